//go:build linux

// Attaching and detaching: bpffs pins, the TC programs on each configured
// interface, the sk_lookup program that steers mode-4 VIPs, and purging what
// the daemon leaves in the kernel.

package ebpf

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

const bpffsRoot = "/sys/fs/bpf"

// ensureBPFFS checks that path lives on bpffs. Pins under /sys/fs/bpf get
// bpffs mounted there if it is missing (as systemd would); elsewhere the
// operator has to mount it.
func ensureBPFFS(path string) error {
	onBPFFS := func() bool {
		dir := filepath.Clean(path)
		for {
			var st unix.Statfs_t
			if err := unix.Statfs(dir, &st); err == nil {
				return st.Type == unix.BPF_FS_MAGIC
			}
			parent := filepath.Dir(dir)
			if parent == dir {
				return false
			}
			dir = parent
		}
	}
	if onBPFFS() {
		return nil
	}
	if path == bpffsRoot || strings.HasPrefix(filepath.Clean(path), bpffsRoot+"/") {
		if err := unix.Mount("bpf", bpffsRoot, "bpf", 0, "mode=0700"); err != nil {
			return fmt.Errorf("mount bpffs at %s for pin path %s: %w", bpffsRoot, path, err)
		}
		if onBPFFS() {
			return nil
		}
	}
	return fmt.Errorf("%w: %w: pin path %s is not on a bpffs mount (mount -t bpf bpf <dir>)", dataplane.ErrConfig, dataplane.ErrInvalid, path)
}

func (d *Dataplane) pin(name string) string {
	if d.cfg.PinPath == "" {
		return ""
	}
	return filepath.Join(d.cfg.PinPath, name)
}

func (d *Dataplane) attachTC(ifname string) error {
	iface, err := net.InterfaceByName(ifname)
	if err != nil {
		return fmt.Errorf("attach tc_lb to %s: %w", ifname, err)
	}
	pin := d.pin("tcx_" + ifname)
	if pin != "" {
		if l, err := link.LoadPinnedLink(pin, nil); err == nil {
			if err := l.Update(d.objs.TcLb); err == nil {
				d.links = append(d.links, tcxLink{Link: l, ifname: ifname, fromPin: true})
				return nil
			}
			l.Unpin()
			l.Close()
		}
	}
	l, err := link.AttachTCX(link.TCXOptions{Interface: iface.Index, Program: d.objs.TcLb, Attach: ebpf.AttachTCXIngress})
	if err == nil {
		if pin != "" {
			if err := l.Pin(pin); err != nil {
				l.Close()
				return fmt.Errorf("pin tcx link of %s: %w", ifname, err)
			}
		}
		d.links = append(d.links, tcxLink{Link: l, ifname: ifname})
		return nil
	}
	if !errors.Is(err, ebpf.ErrNotSupported) {
		return fmt.Errorf("attach tcx to %s: %w", ifname, err)
	}
	d.log.Info("TCX not supported, using cls_bpf", "interface", ifname)
	q := &netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: iface.Index, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT}, QdiscType: "clsact"}
	if err := netlink.QdiscReplace(q); err != nil {
		return fmt.Errorf("add clsact qdisc to %s: %w", ifname, err)
	}
	if err := netlink.FilterReplace(clsFilter(iface.Index, d.objs.TcLb.FD())); err != nil {
		return fmt.Errorf("attach cls_bpf to %s: %w", ifname, err)
	}
	d.clsIfaces = append(d.clsIfaces, iface.Index)
	return nil
}

func clsFilter(ifindex, fd int) *netlink.BpfFilter {
	return &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{LinkIndex: ifindex, Parent: netlink.HANDLE_MIN_INGRESS, Handle: 1, Protocol: unix.ETH_P_ALL, Priority: 1},
		Fd:          fd, Name: "tc_lb", DirectAction: true,
	}
}

func (d *Dataplane) attachSkLookup() error {
	pin := d.pin("sk_lookup")
	if pin != "" {
		if l, err := link.LoadPinnedLink(pin, nil); err == nil {
			if err := l.Update(d.objs.SkLookupProxy); err == nil {
				d.skLink, d.skFromPin = l, true
				return nil
			}
			l.Unpin()
			l.Close()
		}
	}
	ns, err := os.Open("/proc/self/ns/net")
	if err != nil {
		return fmt.Errorf("open network namespace: %w", err)
	}
	defer ns.Close()
	l, err := link.AttachNetNs(int(ns.Fd()), d.objs.SkLookupProxy)
	if err != nil {
		return fmt.Errorf("%w: attach sk_lookup to the network namespace: %w", dataplane.ErrUnsupported, err)
	}
	if pin != "" {
		if err := l.Pin(pin); err != nil {
			l.Close()
			return fmt.Errorf("pin sk_lookup link: %w", err)
		}
	}
	d.skLink = l
	return nil
}

// pinProgs pins lb_progs, tc_lb's tail-call table, at the pin path in place
// of the previous run's, once this run's tc_lb is attached: the kernel
// empties a program array when no file descriptor or pin refers to it any
// more, and the attached tc_lb must keep reaching tc_lb_nat while no daemon
// runs. It is not pinned by name at load, which would hand this run the
// previous run's table, holding the previous run's tc_lb_nat.
func (d *Dataplane) pinProgs() error {
	if d.cfg.PinPath == "" {
		return nil
	}
	pin := filepath.Join(d.cfg.PinPath, "lb_progs")
	if err := os.Remove(pin); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("replace the pinned tail-call table: %w", err)
	}
	if err := d.objs.LbProgs.Pin(pin); err != nil {
		return fmt.Errorf("pin the tail-call table: %w", err)
	}
	return nil
}

// detach removes the programs from interfaces and the namespace.
func (d *Dataplane) detach() {
	for _, l := range d.links {
		l.Unpin()
		l.Close()
	}
	d.links = nil
	for _, idx := range d.clsIfaces {
		if err := netlink.FilterDel(clsFilter(idx, d.objs.TcLb.FD())); err != nil {
			d.log.Warn("remove cls_bpf filter", "ifindex", idx, "err", err)
		}
	}
	d.clsIfaces = nil
	if d.skLink != nil {
		d.skLink.Unpin()
		d.skLink.Close()
		d.skLink = nil
	}
}

// abandon undoes a start that failed after loading: what this run attached
// is detached, but links re-used from their pins are only closed, so the
// previous run's data path keeps serving on the pinned maps.
func (d *Dataplane) abandon() {
	for _, l := range d.links {
		if l.fromPin {
			// It now runs this run's tc_lb, which needs its tail-call
			// table once this process is gone.
			if err := d.pinProgs(); err != nil {
				d.log.Error("a re-used link runs this build's tc_lb without its pinned tail-call table", "err", err)
			}
			break
		}
	}
	for _, l := range d.links {
		if !l.fromPin {
			l.Unpin()
		}
		l.Close()
	}
	d.links = nil
	for _, idx := range d.clsIfaces {
		if err := netlink.FilterDel(clsFilter(idx, d.objs.TcLb.FD())); err != nil {
			d.log.Warn("remove cls_bpf filter", "ifindex", idx, "err", err)
		}
	}
	d.clsIfaces = nil
	if d.skLink != nil {
		if !d.skFromPin {
			d.skLink.Unpin()
		}
		d.skLink.Close()
		d.skLink = nil
	}
	d.objs.Close()
	d.unlockPinPath()
}

// unlockPinPath releases the pin path's lock, if held.
func (d *Dataplane) unlockPinPath() {
	if d.pinLock != nil {
		d.pinLock.Close()
		d.pinLock = nil
	}
}

// detachUnconfigured detaches tc_lb from interfaces a previous run attached
// it to (their links are pinned) that are no longer configured: an
// interface dropped from the configuration must stop being balanced.
func (d *Dataplane) detachUnconfigured() {
	if d.cfg.PinPath == "" {
		return
	}
	entries, err := os.ReadDir(d.cfg.PinPath)
	if err != nil {
		d.log.Warn("list pinned links", "pin_path", d.cfg.PinPath, "err", err)
		return
	}
	for _, e := range entries {
		ifname, ok := strings.CutPrefix(e.Name(), "tcx_")
		if !ok || slices.Contains(d.cfg.Interfaces, ifname) {
			continue
		}
		pin := filepath.Join(d.cfg.PinPath, e.Name())
		l, err := link.LoadPinnedLink(pin, nil)
		if err != nil {
			// The interface is gone, or the pin is not a link: drop the pin.
			if err := os.Remove(pin); err != nil {
				d.log.Warn("remove stale link pin", "pin", pin, "err", err)
			}
			continue
		}
		if err := l.Unpin(); err != nil {
			d.log.Warn("unpin link of an interface no longer configured", "interface", ifname, "err", err)
		}
		l.Close() // the last reference: the program leaves the interface
		d.log.Info("detached tc_lb from an interface no longer configured", "interface", ifname)
	}
}

// Purge detaches everything, removes the local VIP routes it added and
// deletes the pinned maps and links. For uninstall and tests.
func (d *Dataplane) Purge() error {
	d.mu.Lock()
	pins := d.cfg.PinPath
	d.cfg.PinPath = "" // Close now detaches
	d.mu.Unlock()
	var errs []error
	if pins != "" {
		for _, m := range []*ebpf.Map{
			d.objs.LbServices, d.objs.LbSlots, d.objs.LbBackends, d.objs.LbRrCursor, d.objs.LbActiveConns,
			d.objs.LbConntrack, d.objs.LbAffinity, d.objs.LbCounters, d.objs.LbSvcStats, d.objs.LbProxyVips,
			d.objs.LbEpEpoch, d.objs.LbFilter, d.objs.LbFibGen, d.objs.LbProgs,
		} {
			if err := m.Unpin(); err != nil {
				errs = append(errs, err)
			}
		}
	}
	errs = append(errs, d.Close())
	if pins != "" {
		if err := os.RemoveAll(pins); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
