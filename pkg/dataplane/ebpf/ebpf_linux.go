//go:build linux

package ebpf

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

// Config configures the eBPF data plane.
type Config struct {
	// Interfaces are the devices tc_lb is attached to (TC ingress). Empty
	// means none: the daemon never attaches to every interface by itself.
	Interfaces []string
	// PinPath is a directory on bpffs (e.g. /sys/fs/bpf/loxilb). When set,
	// maps and links are pinned there and survive Close and a daemon
	// restart. Empty means nothing is pinned and Close detaches everything.
	PinPath string
	// GCInterval is how often expired conntrack entries are removed.
	// Default 2s.
	GCInterval time.Duration
	// StackForwarding hands NATed packets to the kernel's forwarding path
	// instead of bpf_fib_lookup + bpf_redirect_neigh. DSR always uses the FIB.
	StackForwarding bool
	// HashSeed seeds the flow hash of the hash/persist/consistent-hash
	// selectors. Zero means the built-in seed (stable across restarts).
	HashSeed uint32
}

// Dataplane is the eBPF implementation of dataplane.Dataplane.
type Dataplane struct {
	cfg Config
	log *slog.Logger
	// pinLock holds the pin path's lock (see lockPinPath) from load until
	// Close, Purge or an abandoned start.
	pinLock *os.File

	mu         sync.Mutex
	gcMu       sync.Mutex // serialises GC passes, which run without mu
	closed     bool
	objs       lbObjects
	links      []tcxLink
	clsIfaces  []int // interfaces using the cls_bpf fallback
	skLink     link.Link
	skFromPin  bool // skLink was re-used from its pin, so it serves the previous run's state
	services   map[uint32]*svcState
	frontends  map[lbSvcKey]uint32 // installed frontend -> service ID
	idxUsed    [dataplane.MaxServices]bool
	proxySlots map[uint16]uint32        // proxy listener port -> lb_proxy_socks key
	routes     map[netip.Addr]*vipRoute // mode-4 VIPs made local, by VIP
	nCPU       int

	fib          *fibWatch // bumps lb_fib_gen on routing changes
	ctEntries    int       // conntrack entries seen by the last GC pass
	staleRemoved uint64    // recovered services removed because the control plane does not hold them
	gcStop       chan struct{}
	gcDone       chan struct{}
}

// vipRoute tracks the services using a mode-4 VIP and whether the local
// route is ours to remove.
type vipRoute struct {
	users map[uint32]bool
	ours  bool
}

type svcState struct {
	svc  dataplane.Service
	eps  []dataplane.Endpoint
	idx  uint16
	gen  uint8
	keys []lbSvcKey
	// cells holds each endpoint's counter/epoch cell (see lb_ep_epoch):
	// an endpoint keeps its cell across updates while it stays.
	cells map[epID]uint8
	// recovered is true from recover until the first upsert of the ID: the
	// service comes from the pinned maps, not from this process's control
	// plane, and PruneRecovered removes it if nobody claims it.
	recovered bool
}

// tcxLink is tc_lb's TCX attachment to one interface.
type tcxLink struct {
	link.Link
	ifname string
	// fromPin is true when the link was re-used from its pin: it carried
	// traffic before this process started, so a failed start must leave it
	// attached and pinned.
	fromPin bool
}

var (
	_ dataplane.Dataplane    = (*Dataplane)(nil)
	_ dataplane.ProxySteerer = (*Dataplane)(nil)
	_ dataplane.Recoverer    = (*Dataplane)(nil)
	_ dataplane.Checker      = (*Dataplane)(nil)
)

// Open loads and attaches the data plane. On failure (not root, no BPF or
// TCX support, a bad interface name) it returns the error and a not-ready
// capability whose Reason says why, so the daemon can run proxy-only.
func Open(cfg Config, logger *slog.Logger, reg prometheus.Registerer) (dataplane.Dataplane, dataplane.Capability, error) {
	capab := dataplane.Capability{Name: CapabilityName}
	d, err := New(cfg, logger)
	if err != nil {
		capab.Reason = err.Error()
		return nil, capab, err
	}
	if reg != nil {
		if err := reg.Register(newCollector(d)); err != nil {
			d.Close()
			capab.Reason = err.Error()
			return nil, capab, fmt.Errorf("register data plane metrics: %w", err)
		}
	}
	if len(cfg.Interfaces) == 0 {
		// Loaded and steering mode 4, but no packet reaches tc_lb: a rule
		// of modes 0-3 or 5 would be accepted and never served.
		capab.Reason = "tc_lb is attached to no interface (none configured): modes 0-3 and 5 are not served; sk_lookup steering of mode 4 is on"
		return d, capab, nil
	}
	capab.Ready = true
	capab.Reason = fmt.Sprintf("tc_lb attached to %s, sk_lookup steering on", strings.Join(cfg.Interfaces, ", "))
	return d, capab, nil
}

// checkInterfaces makes sure every configured interface exists, before
// anything is loaded or a pinned link touched: a mistyped name must stop the
// start, not take down what the previous run left attached.
func checkInterfaces(names []string) error {
	seen := map[string]bool{}
	for _, name := range names {
		if seen[name] {
			return fmt.Errorf("%w: interface %q is listed twice", dataplane.ErrConfig, name)
		}
		seen[name] = true
		if _, err := net.InterfaceByName(name); err != nil {
			var have []string
			if ifs, err := net.Interfaces(); err == nil {
				for _, i := range ifs {
					have = append(have, i.Name)
				}
			}
			return fmt.Errorf("%w: interface %q does not exist (present: %s): %w", dataplane.ErrConfig, name, strings.Join(have, ", "), err)
		}
	}
	return nil
}

// New is Open without metrics registration, returning the concrete type.
func New(cfg Config, logger *slog.Logger) (*Dataplane, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if err := checkInterfaces(cfg.Interfaces); err != nil {
		return nil, err
	}
	if cfg.GCInterval <= 0 {
		cfg.GCInterval = 2 * time.Second
	}
	d := &Dataplane{
		cfg:        cfg,
		log:        logger,
		services:   map[uint32]*svcState{},
		frontends:  map[lbSvcKey]uint32{},
		proxySlots: map[uint16]uint32{},
		routes:     map[netip.Addr]*vipRoute{},
	}
	if os.Geteuid() != 0 {
		return nil, fmt.Errorf("%w: loading BPF programs needs root (CAP_BPF, CAP_NET_ADMIN); running proxy-only", dataplane.ErrUnsupported)
	}
	n, err := ebpf.PossibleCPU()
	if err != nil {
		return nil, fmt.Errorf("count CPUs: %w", err)
	}
	d.nCPU = n
	d.reserveSNATPorts()
	if err := d.load(); err != nil {
		return nil, err
	}
	if err := d.recover(); err != nil {
		d.objs.Close()
		d.unlockPinPath()
		return nil, err
	}
	if err := d.startFIBWatch(); err != nil {
		d.objs.Close()
		d.unlockPinPath()
		return nil, err
	}
	for _, ifname := range cfg.Interfaces {
		if err := d.attachTC(ifname); err != nil {
			d.fib.stop()
			d.abandon()
			return nil, err
		}
	}
	if err := d.pinProgs(); err != nil {
		d.fib.stop()
		d.abandon()
		return nil, err
	}
	if err := d.attachSkLookup(); err != nil {
		d.fib.stop()
		d.abandon()
		return nil, err
	}
	d.detachUnconfigured()
	d.gcStop = make(chan struct{})
	d.gcDone = make(chan struct{})
	go d.gcLoop()
	return d, nil
}

func (d *Dataplane) load() error {
	spec, err := loadLb()
	if err != nil {
		return fmt.Errorf("parse embedded BPF object: %w", err)
	}
	fib := uint8(1)
	if d.cfg.StackForwarding {
		fib = 0
	}
	if err := spec.Variables[lbVarCfgFibForward].Set(fib); err != nil {
		return fmt.Errorf("set cfg_fib_forward: %w", err)
	}
	if d.cfg.HashSeed != 0 {
		if err := spec.Variables[lbVarCfgHashSeed].Set(d.cfg.HashSeed); err != nil {
			return fmt.Errorf("set cfg_hash_seed: %w", err)
		}
	}
	opts := &ebpf.CollectionOptions{}
	if d.cfg.PinPath != "" {
		if err := ensureBPFFS(d.cfg.PinPath); err != nil {
			return err
		}
		if err := os.MkdirAll(d.cfg.PinPath, 0o700); err != nil {
			return fmt.Errorf("create pin directory: %w", err)
		}
		lock, err := lockPinPath(d.cfg.PinPath)
		if err != nil {
			return err
		}
		d.pinLock = lock
		opts.Maps.PinPath = d.cfg.PinPath
		d.dropIncompatiblePins(spec)
	} else {
		for _, m := range spec.Maps {
			m.Pinning = ebpf.PinNone
		}
	}
	if err := spec.LoadAndAssign(&d.objs, opts); err != nil {
		d.unlockPinPath()
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			d.log.Error("BPF verifier rejected the program", "log", fmt.Sprintf("%+v", ve))
		}
		if errors.Is(err, ebpf.ErrMapIncompatible) {
			return fmt.Errorf("load BPF objects: pinned maps under %s come from an incompatible version (run with a fresh --bpf-pin-path, or remove the old state with loxilb cleanup): %w", d.cfg.PinPath, err)
		}
		return fmt.Errorf("%w: load BPF objects: %w", dataplane.ErrUnsupported, err)
	}
	return nil
}

// Sysctls of the host stack's ephemeral ports (per network namespace).
const (
	sysctlPortRange     = "/proc/sys/net/ipv4/ip_local_port_range"
	sysctlReservedPorts = "/proc/sys/net/ipv4/ip_local_reserved_ports"
)

// reserveSNATPorts keeps the one-arm SNAT ports (snatLocalPortMin-Max) out
// of the host stack's ephemeral range: when ip_local_port_range overlaps
// them, they are added to ip_local_reserved_ports (logged), so a socket of
// the LB never gets a port a translated flow may use. A failure is logged,
// not fatal: one-arm then risks clashing with local sockets.
func (d *Dataplane) reserveSNATPorts() {
	raw, err := os.ReadFile(sysctlPortRange)
	if err != nil {
		d.log.Warn("read the ephemeral port range", "err", err)
		return
	}
	var lo, hi int
	if _, err := fmt.Sscanf(string(raw), "%d %d", &lo, &hi); err != nil {
		d.log.Warn("parse the ephemeral port range", "value", strings.TrimSpace(string(raw)), "err", err)
		return
	}
	if hi < snatLocalPortMin || lo > snatLocalPortMax {
		return
	}
	want := fmt.Sprintf("%d-%d", snatLocalPortMin, snatLocalPortMax)
	cur, err := os.ReadFile(sysctlReservedPorts)
	if err != nil {
		d.log.Warn("read the reserved ports", "err", err)
		return
	}
	list := strings.TrimSpace(string(cur))
	if slices.Contains(strings.Split(list, ","), want) {
		return
	}
	next := want
	if list != "" {
		next = list + "," + want
	}
	if err := os.WriteFile(sysctlReservedPorts, []byte(next), 0o644); err != nil {
		d.log.Warn("reserve the one-arm SNAT ports: local sockets may clash with one-arm flows", "ports", want, "err", err)
		return
	}
	d.log.Info("ip_local_port_range overlaps the one-arm SNAT ports: reserved them for the data plane",
		"ip_local_port_range", fmt.Sprintf("%d-%d", lo, hi), "ip_local_reserved_ports", next)
}

// dropIncompatiblePins removes pinned maps whose layout differs from this
// build's (left by an older version), so they are created afresh instead of
// failing the start. Their state is lost: for conntrack that ends the flows
// they held; services are re-installed by the control plane.
func (d *Dataplane) dropIncompatiblePins(spec *ebpf.CollectionSpec) {
	for name, ms := range spec.Maps {
		if ms.Pinning != ebpf.PinByName {
			continue
		}
		path := filepath.Join(d.cfg.PinPath, name)
		m, err := ebpf.LoadPinnedMap(path, nil)
		if err != nil {
			continue // not pinned yet
		}
		err = ms.Compatible(m)
		m.Close()
		if err == nil {
			continue
		}
		if rmErr := os.Remove(path); rmErr != nil {
			d.log.Error("remove an incompatible pinned map", "map", name, "pin", path, "err", rmErr)
			continue
		}
		d.log.Warn("pinned map has the layout of another version: recreated empty", "map", name, "pin", path, "diff", err.Error())
	}
}

// recover rebuilds the Go view of services from pinned maps after a restart,
// so IDs keep their table index (conntrack entries refer to it).
func (d *Dataplane) recover() error {
	var k lbSvcKey
	var v lbSvcVal
	it := d.objs.LbServices.Iterate()
	for it.Next(&k, &v) {
		st := d.services[v.Id]
		if st == nil {
			st = &svcState{idx: v.Idx, gen: v.Gen, recovered: true, svc: dataplane.Service{
				ID: v.Id, VIP: addrFrom(k.Vip), Port: hostPort(k.Port), Proto: protoName(k.Proto),
				Mode: int(v.Mode), Sel: int(v.Sel), InactiveTimeout: time.Duration(v.TimeoutS) * time.Second,
				PersistTimeout: time.Duration(v.PersistS) * time.Second,
			}}
			for i := range int(v.EpCount) {
				var be lbBackend
				if err := d.objs.LbBackends.Lookup(beKey(v.Idx, v.Gen, i), &be); err != nil {
					return fmt.Errorf("recover endpoints of service %d: %w", v.Id, err)
				}
				e := dataplane.Endpoint{Addr: addrFrom(be.Addr), Port: hostPort(be.Port), Weight: 1, Healthy: be.Flags&beActive != 0}
				st.eps = append(st.eps, e)
				if st.cells == nil {
					st.cells = map[epID]uint8{}
				}
				st.cells[epID{e.Addr, e.Port}] = be.Cell
			}
			if !distinctCells(st.cells) {
				// Written by a version without cells: the next update
				// assigns them afresh.
				st.cells = nil
			}
			if int(v.Idx) >= dataplane.MaxServices {
				return fmt.Errorf("recover service %d: index %d out of range", v.Id, v.Idx)
			}
			d.idxUsed[v.Idx] = true
			d.services[v.Id] = st
		}
		if st.svc.Mode == dataplane.ModeHostOneArm {
			st.svc.VIP = netip.IPv4Unspecified()
		}
		st.keys = append(st.keys, k)
		d.frontends[k] = v.Id
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("recover services: %w", err)
	}
	var pv lbProxyVal
	pit := d.objs.LbProxyVips.Iterate()
	for pit.Next(&k, &pv) {
		if _, ok := d.services[pv.SvcId]; ok {
			continue
		}
		idx, ok := d.allocIdx()
		if !ok {
			return fmt.Errorf("recover proxy service %d: %w", pv.SvcId, dataplane.ErrCapacity)
		}
		d.services[pv.SvcId] = &svcState{idx: idx, keys: []lbSvcKey{k}, recovered: true, svc: dataplane.Service{
			ID: pv.SvcId, VIP: addrFrom(k.Vip), Port: hostPort(k.Port), Proto: "tcp", Mode: dataplane.ModeFullProxy,
		}}
		d.frontends[k] = pv.SvcId
	}
	if err := pit.Err(); err != nil {
		return fmt.Errorf("recover proxy services: %w", err)
	}
	if d.cfg.PinPath != "" {
		if err := d.recoverRoutes(); err != nil {
			return err
		}
	}
	if err := d.writeFilter(nil); err != nil {
		return err
	}
	if len(d.services) > 0 {
		d.log.Info("recovered services from pinned maps", "count", len(d.services), "pin_path", d.cfg.PinPath)
	}
	return nil
}

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

// Close stops conntrack GC and releases file descriptors. With a PinPath the
// programs stay attached and the maps stay pinned, so forwarding continues;
// without one everything is detached.
func (d *Dataplane) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	d.mu.Unlock()
	close(d.gcStop)
	<-d.gcDone
	d.fib.stop()

	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cfg.PinPath == "" {
		d.detach()
		for vip := range d.routes {
			d.delLocalRoute(vip)
		}
	} else {
		for _, l := range d.links {
			l.Close()
		}
		if d.skLink != nil {
			d.skLink.Close()
		}
	}
	defer d.unlockPinPath()
	return d.objs.Close()
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

func (d *Dataplane) allocIdx() (uint16, bool) {
	for i, used := range d.idxUsed {
		if !used {
			d.idxUsed[i] = true
			return uint16(i), true
		}
	}
	return 0, false
}

// UpsertService implements dataplane.Dataplane.
func (d *Dataplane) UpsertService(ctx context.Context, svc dataplane.Service, eps []dataplane.Endpoint) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := dataplane.Validate(svc, eps); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return dataplane.ErrClosed
	}
	proto, _ := dataplane.ProtoNumber(svc.Proto)
	keys, err := frontendKeys(svc, proto)
	if err != nil {
		return err
	}
	for _, k := range keys {
		id, ok := d.frontends[k]
		if !ok || id == svc.ID {
			continue
		}
		if other := d.services[id]; other != nil && other.recovered {
			// Left by a previous run and not held by this control plane,
			// which now gives the frontend to another service.
			d.removeStale(other, fmt.Sprintf("service %d takes its frontend %s:%d/%s", svc.ID, addrFrom(k.Vip), svc.Port, svc.Proto))
			continue
		}
		return fmt.Errorf("%w: service %d has %s:%d/%s", dataplane.ErrConflict, id, addrFrom(k.Vip), svc.Port, svc.Proto)
	}
	st := d.services[svc.ID]
	if st != nil && st.recovered && (st.svc.VIP != svc.VIP || st.svc.Port != svc.Port || st.svc.Proto != svc.Proto) {
		// The ID now names another service: the recovered one's slot,
		// flows and affinities must not pass to it.
		d.removeStale(st, fmt.Sprintf("its ID now names %s:%d/%s", svc.VIP, svc.Port, svc.Proto))
		st = nil
	}
	fresh := st == nil
	if !fresh && (st.svc.Mode == dataplane.ModeFullProxy) != (svc.Mode == dataplane.ModeFullProxy) {
		// The frontends move between the kernel path and proxy steering;
		// the same key may be in the other map.
		for _, k := range st.keys {
			d.removeFrontend(st, k)
		}
		st.keys = nil
	}
	if fresh {
		idx, ok := d.allocIdx()
		if !ok {
			return fmt.Errorf("%w: %d services", dataplane.ErrCapacity, dataplane.MaxServices)
		}
		st = &svcState{idx: idx, gen: 1}
		d.resetIndex(idx)
	}
	if err := d.install(st, svc, eps, keys, proto); err != nil {
		if fresh {
			d.idxUsed[st.idx] = false
		}
		return fmt.Errorf("install service %d: %w", svc.ID, err)
	}
	// Frontends the service no longer has (VIP, port or mode changed).
	for _, k := range st.keys {
		if !slices.Contains(keys, k) {
			d.removeFrontend(st, k)
		}
	}
	st.svc, st.eps, st.keys, st.recovered = svc, slices.Clone(eps), keys, false
	d.services[svc.ID] = st
	for _, k := range keys {
		d.frontends[k] = svc.ID
	}
	d.syncFilter()
	return nil
}

// CheckService implements dataplane.Checker: what UpsertService would
// refuse, found without changing anything.
func (d *Dataplane) CheckService(ctx context.Context, svc dataplane.Service, eps []dataplane.Endpoint) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := dataplane.Validate(svc, eps); err != nil {
		return err
	}
	proto, _ := dataplane.ProtoNumber(svc.Proto)
	keys, err := frontendKeys(svc, proto)
	if err != nil {
		return err
	}
	if svc.Mode != dataplane.ModeFullProxy {
		for _, ep := range eps {
			if _, err := snatAddr(svc, ep); err != nil {
				return err
			}
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return dataplane.ErrClosed
	}
	for _, k := range keys {
		id, ok := d.frontends[k]
		if !ok || (id == svc.ID && svc.ID != 0) {
			continue
		}
		if other := d.services[id]; other != nil && other.recovered {
			continue // a leftover of a previous run: the upsert removes it
		}
		return fmt.Errorf("%w: service %d has %s:%d/%s", dataplane.ErrConflict, id, addrFrom(k.Vip), svc.Port, svc.Proto)
	}
	if st := d.services[svc.ID]; st != nil && svc.ID != 0 {
		return nil // an update keeps its table index
	}
	for _, used := range d.idxUsed {
		if !used {
			return nil
		}
	}
	for _, st := range d.services {
		if st.recovered {
			return nil // PruneRecovered or an upsert frees it
		}
	}
	return fmt.Errorf("%w: %d services", dataplane.ErrCapacity, dataplane.MaxServices)
}

// frontendKeys lists the {vip, port, proto} keys of a service: one, or one
// per local IPv4 address for host one-arm (as loxilb replicates such rules).
func frontendKeys(svc dataplane.Service, proto uint8) ([]lbSvcKey, error) {
	if svc.Mode != dataplane.ModeHostOneArm {
		return []lbSvcKey{{Vip: nbo32(svc.VIP), Port: nbo16(svc.Port), Proto: proto}}, nil
	}
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		return nil, fmt.Errorf("list local addresses for host one-arm: %w", err)
	}
	var keys []lbSvcKey
	for _, a := range addrs {
		ip, ok := netip.AddrFromSlice(a.IP.To4())
		if !ok || ip.IsLoopback() {
			continue
		}
		keys = append(keys, lbSvcKey{Vip: nbo32(ip), Port: nbo16(svc.Port), Proto: proto})
	}
	return keys, nil
}

func (d *Dataplane) install(st *svcState, svc dataplane.Service, eps []dataplane.Endpoint, keys []lbSvcKey, proto uint8) error {
	if svc.Mode == dataplane.ModeFullProxy {
		slot, ok := d.proxySlots[svc.ProxyPort]
		if !ok {
			if len(d.proxySlots) >= 64 {
				return fmt.Errorf("%w: proxy listener ports", dataplane.ErrCapacity)
			}
			slot = uint32(len(d.proxySlots))
			d.proxySlots[svc.ProxyPort] = slot
		}
		if err := d.addLocalRoute(svc.VIP, svc.ID); err != nil {
			return err
		}
		for _, k := range keys {
			if err := d.objs.LbProxyVips.Put(k, lbProxyVal{SockIdx: slot, SvcId: svc.ID}); err != nil {
				return fmt.Errorf("write proxy VIP: %w", err)
			}
		}
		return nil
	}
	gen := st.gen ^ 1
	prev := st.cells
	if st.svc.Mode != svc.Mode {
		prev = nil // every flow of the old mode is stale: all cells afresh
	}
	cells, fresh, gone := assignCells(st.cells, prev, eps)
	bes := make([]lbBackend, len(eps))
	for i, ep := range eps {
		snat, err := snatAddr(svc, ep)
		if err != nil {
			return err
		}
		bes[i] = lbBackend{Addr: nbo32(ep.Addr), SnatAddr: snat, Port: nbo16(ep.Port), Cell: cells[epID{ep.Addr, ep.Port}]}
		if ep.Healthy {
			bes[i].Flags = beActive
		}
	}
	// New endpoints start on a clean cell before any flow can reach them.
	d.resetCells(st.idx, fresh)
	nslots, err := d.writeGeneration(st.idx, gen, svc.Sel, eps, bes)
	if err != nil {
		return err
	}
	persist := svc.PersistTimeout
	if persist == 0 {
		persist = dataplane.DefaultPersistTime
	}
	v := lbSvcVal{
		Id: svc.ID, Idx: st.idx, Mode: uint8(svc.Mode), Sel: uint8(svc.Sel), Gen: gen,
		SlotCount: uint16(nslots), EpCount: uint16(len(eps)),
		TimeoutS: uint32(dataplane.InactivityFor(svc) / time.Second), PersistS: uint32(persist / time.Second),
	}
	// Its frontends and endpoints pass the prefilter before the switch.
	var pending filterBitmap
	pending.addService(svc, eps, keys)
	if err := d.writeFilter(&pending); err != nil {
		return err
	}
	for _, k := range keys {
		if err := d.objs.LbServices.Put(k, v); err != nil {
			return fmt.Errorf("switch service entry: %w", err)
		}
	}
	st.gen = gen
	// Endpoints that left: their flows are stale from now on.
	d.resetCells(st.idx, gone)
	st.cells = cells
	return nil
}

// epID identifies an endpoint across updates of its service.
type epID struct {
	addr netip.Addr
	port uint16
}

// assignCells gives every endpoint of eps a counter/epoch cell: the one it
// has in keep, else a cell no endpoint of all (the previous assignment)
// used, else any cell the new set leaves free. fresh lists the newly
// assigned cells (to reset before the new endpoint set goes live), gone the
// cells of all that the new set no longer uses (to reset after).
func assignCells(all, keep map[epID]uint8, eps []dataplane.Endpoint) (cells map[epID]uint8, fresh, gone []uint8) {
	cells = make(map[epID]uint8, len(eps))
	var used, old [maxEPs]bool
	for _, c := range all {
		old[c] = true
	}
	for _, ep := range eps {
		id := epID{ep.Addr, ep.Port}
		if c, ok := keep[id]; ok {
			cells[id] = c
			used[c] = true
		}
	}
	for _, ep := range eps {
		id := epID{ep.Addr, ep.Port}
		if _, ok := cells[id]; ok {
			continue
		}
		c := -1
		for i := range maxEPs {
			if !used[i] && !old[i] {
				c = i
				break
			}
		}
		if c < 0 {
			for i := range maxEPs {
				if !used[i] {
					c = i
					break
				}
			}
		}
		if c < 0 {
			// More distinct endpoints than cells: Validate caps them.
			c = 0
		}
		cells[id] = uint8(c)
		used[c] = true
		fresh = append(fresh, uint8(c))
	}
	for c := range maxEPs {
		if old[c] && !used[c] {
			gone = append(gone, uint8(c))
		}
	}
	return cells, fresh, gone
}

// distinctCells reports whether no two endpoints share a cell.
func distinctCells(cells map[epID]uint8) bool {
	var seen [maxEPs]bool
	for _, c := range cells {
		if int(c) >= maxEPs || seen[c] {
			return false
		}
		seen[c] = true
	}
	return true
}

// writeGeneration fills the idle half of the endpoint and slot tables.
func (d *Dataplane) writeGeneration(idx uint16, gen uint8, sel int, eps []dataplane.Endpoint, bes []lbBackend) (int, error) {
	if len(bes) > 0 {
		keys := make([]uint32, len(bes))
		for i := range bes {
			keys[i] = beKey(idx, gen, i)
		}
		if _, err := d.objs.LbBackends.BatchUpdate(keys, bes, nil); err != nil {
			return 0, fmt.Errorf("write endpoints: %w", err)
		}
	}
	slots := buildSlots(sel, eps)
	if len(slots) > 0 {
		keys := make([]uint32, len(slots))
		base := (uint32(idx)*2 + uint32(gen)) * slotsPerGen
		for i := range slots {
			keys[i] = base + uint32(i)
		}
		if _, err := d.objs.LbSlots.BatchUpdate(keys, slots, nil); err != nil {
			return 0, fmt.Errorf("write slot table: %w", err)
		}
	}
	return len(slots), nil
}

func snatAddr(svc dataplane.Service, ep dataplane.Endpoint) (uint32, error) {
	switch svc.Mode {
	case dataplane.ModeFullNAT:
		if svc.SNATAddr.IsValid() {
			return nbo32(svc.SNATAddr), nil
		}
		return nbo32(svc.VIP), nil
	case dataplane.ModeOneArm, dataplane.ModeHostOneArm:
		if svc.SNATAddr.IsValid() {
			return nbo32(svc.SNATAddr), nil
		}
		routes, err := netlink.RouteGet(ep.Addr.AsSlice())
		if err != nil || len(routes) == 0 || routes[0].Src == nil {
			return 0, fmt.Errorf("%w: derive the one-arm source address toward endpoint %v: no route with a source address (%v)",
				dataplane.ErrUnroutable, ep.Addr, err)
		}
		src, _ := netip.AddrFromSlice(routes[0].Src.To4())
		return nbo32(src), nil
	}
	return 0, nil
}

func (d *Dataplane) removeFrontend(st *svcState, k lbSvcKey) {
	if err := d.objs.LbServices.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		d.log.Warn("delete service entry", "id", st.svc.ID, "err", err)
	}
	if err := d.objs.LbProxyVips.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		d.log.Warn("delete proxy VIP entry", "id", st.svc.ID, "err", err)
	}
	if st.svc.Mode == dataplane.ModeFullProxy {
		d.releaseLocalRoute(addrFrom(k.Vip), st.svc.ID)
	}
	delete(d.frontends, k)
}

// resetIndex zeroes the per-index state a previous service may have left
// and makes every flow of that service stale (bumps all its cells).
func (d *Dataplane) resetIndex(idx uint16) {
	zero := make([]lbSvcStats, d.nCPU)
	if err := d.objs.LbSvcStats.Put(uint32(idx), zero); err != nil {
		d.log.Warn("reset service counters", "idx", idx, "err", err)
	}
	d.objs.LbRrCursor.Put(uint32(idx), uint32(0))
	all := make([]uint8, maxEPs)
	for i := range all {
		all[i] = uint8(i)
	}
	d.resetCells(idx, all)
}

// resetCells gives cells of service idx a new epoch and a zero count: the
// flows recorded with the old epoch are stale (dropped on their next packet
// or by the GC) and never decrement the count again.
func (d *Dataplane) resetCells(idx uint16, cells []uint8) {
	for _, c := range cells {
		key := uint32(idx)*maxEPs + uint32(c)
		var e uint32
		if err := d.objs.LbEpEpoch.Lookup(key, &e); err != nil {
			d.log.Warn("read endpoint epoch", "idx", idx, "cell", c, "err", err)
		}
		if err := d.objs.LbEpEpoch.Put(key, e+1); err != nil {
			d.log.Warn("bump endpoint epoch", "idx", idx, "cell", c, "err", err)
		}
		if err := d.objs.LbActiveConns.Put(key, int64(0)); err != nil {
			d.log.Warn("reset connection count", "idx", idx, "cell", c, "err", err)
		}
	}
}

// DeleteService implements dataplane.Dataplane.
func (d *Dataplane) DeleteService(ctx context.Context, id uint32) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return dataplane.ErrClosed
	}
	st, ok := d.services[id]
	if !ok {
		return nil
	}
	d.removeService(st)
	return nil
}

// removeService removes an installed service with its frontends, flows and
// affinities, and frees its index.
func (d *Dataplane) removeService(st *svcState) {
	for _, k := range st.keys {
		d.removeFrontend(st, k)
	}
	// Its flows go lazily: resetIndex makes them stale, and the program
	// (next packet) or the GC drops their entries.
	var ak lbAffinityKey
	var av lbAffinityVal
	var del []lbAffinityKey
	it := d.objs.LbAffinity.Iterate()
	for it.Next(&ak, &av) {
		if ak.SvcIdx == st.idx {
			del = append(del, ak)
		}
	}
	for _, k := range del {
		d.objs.LbAffinity.Delete(k)
	}
	d.resetIndex(st.idx)
	d.idxUsed[st.idx] = false
	delete(d.services, st.svc.ID)
	d.syncFilter()
}

// removeStale removes a recovered service the control plane does not hold,
// says so and counts it.
func (d *Dataplane) removeStale(st *svcState, why string) {
	d.log.Warn("removing a service left in the pinned maps by a previous run: the rule store does not hold it",
		"id", st.svc.ID, "vip", st.svc.VIP, "port", st.svc.Port, "proto", st.svc.Proto, "mode", st.svc.Mode, "why", why)
	d.removeService(st)
	d.staleRemoved++
}

// PruneRecovered implements dataplane.Recoverer.
func (d *Dataplane) PruneRecovered(ctx context.Context) ([]uint32, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, dataplane.ErrClosed
	}
	var ids []uint32
	for id, st := range d.services {
		if st.recovered {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	for _, id := range ids {
		d.removeStale(d.services[id], "not installed by the control plane after the restart")
	}
	return ids, nil
}

// StaleServicesRemoved is how many services recovered from the pinned maps
// were removed because the control plane does not hold them.
func (d *Dataplane) StaleServicesRemoved() uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.staleRemoved
}

// SetEndpointHealth implements dataplane.Dataplane. It rebuilds the slot
// table without (or with) the endpoint in the idle generation and flips.
// Established connections to an endpoint marked down keep their entries and
// drain.
func (d *Dataplane) SetEndpointHealth(ctx context.Context, id uint32, epIdx int, healthy bool) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return dataplane.ErrClosed
	}
	st, ok := d.services[id]
	if !ok {
		return fmt.Errorf("%w: %d", dataplane.ErrNotFound, id)
	}
	if epIdx < 0 || epIdx >= len(st.eps) {
		return fmt.Errorf("%w: service %d has no endpoint %d", dataplane.ErrInvalid, id, epIdx)
	}
	if st.eps[epIdx].Healthy == healthy {
		return nil
	}
	eps := slices.Clone(st.eps)
	eps[epIdx].Healthy = healthy
	proto, _ := dataplane.ProtoNumber(st.svc.Proto)
	if err := d.install(st, st.svc, eps, st.keys, proto); err != nil {
		return fmt.Errorf("service %d: set endpoint %d health: %w", id, epIdx, err)
	}
	st.eps = eps
	return nil
}

// RegisterProxyListener implements dataplane.ProxySteerer: l's socket goes
// into lb_proxy_socks so sk_lookup_proxy hands it the SYNs of every mode-4
// service with ProxyPort == port. The listener must not be MPTCP (Go's
// default since 1.24): use net.ListenConfig with SetMultipathTCP(false).
func (d *Dataplane) RegisterProxyListener(port uint16, l syscall.Conn) error {
	if port == 0 || l == nil {
		return fmt.Errorf("%w: proxy listener needs a port and a socket", dataplane.ErrInvalid)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return dataplane.ErrClosed
	}
	slot, ok := d.proxySlots[port]
	if !ok {
		if len(d.proxySlots) >= 64 {
			return fmt.Errorf("%w: proxy listener ports", dataplane.ErrCapacity)
		}
		slot = uint32(len(d.proxySlots))
		d.proxySlots[port] = slot
	}
	rc, err := l.SyscallConn()
	if err != nil {
		return fmt.Errorf("proxy listener on port %d: %w", port, err)
	}
	var putErr error
	if err := rc.Control(func(fd uintptr) {
		putErr = d.objs.LbProxySocks.Put(slot, uint64(fd))
	}); err != nil {
		return fmt.Errorf("proxy listener on port %d: %w", port, err)
	}
	if errors.Is(putErr, unix.EOPNOTSUPP) {
		return fmt.Errorf("%w: proxy listener on port %d is not a plain TCP socket (MPTCP? use net.ListenConfig.SetMultipathTCP(false)): %w",
			dataplane.ErrUnsupported, port, putErr)
	}
	if putErr != nil {
		return fmt.Errorf("insert proxy listener on port %d: %w", port, putErr)
	}
	return nil
}

// addLocalRoute makes a mode-4 VIP local (table local, dev lo) unless it
// already is, so the stack delivers its packets to a socket.
func (d *Dataplane) addLocalRoute(vip netip.Addr, id uint32) error {
	if r, ok := d.routes[vip]; ok {
		r.users[id] = true
		return nil
	}
	r := &vipRoute{users: map[uint32]bool{id: true}}
	if rs, err := netlink.RouteGet(vip.AsSlice()); err != nil || len(rs) == 0 || rs[0].Type != unix.RTN_LOCAL {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return fmt.Errorf("make VIP %v local: %w", vip, err)
		}
		if err := netlink.RouteReplace(localRoute(lo.Attrs().Index, vip)); err != nil {
			return fmt.Errorf("make VIP %v local: %w", vip, err)
		}
		r.ours = true
	} // else already local (loopback range or an assigned address): not ours
	d.routes[vip] = r
	return nil
}

// routeProto marks the local VIP routes this data plane adds (the route's
// "proto", unassigned in iproute2's rt_protos), so a restarted daemon tells
// them from an operator's and removes them when their service goes.
const routeProto = netlink.RouteProtocol(76)

func localRoute(lo int, vip netip.Addr) *netlink.Route {
	return &netlink.Route{
		LinkIndex: lo, Dst: &net.IPNet{IP: vip.AsSlice(), Mask: net.CIDRMask(32, 32)},
		Type: unix.RTN_LOCAL, Table: unix.RT_TABLE_LOCAL, Scope: unix.RT_SCOPE_HOST, Protocol: routeProto,
	}
}

// recoverRoutes adopts the local VIP routes a previous run added (marked
// with routeProto) for the recovered mode-4 services, so deleting such a
// service removes its route; marked routes no service uses are removed.
func (d *Dataplane) recoverRoutes() error {
	users := map[netip.Addr]map[uint32]bool{}
	for id, st := range d.services {
		if st.svc.Mode != dataplane.ModeFullProxy {
			continue
		}
		if users[st.svc.VIP] == nil {
			users[st.svc.VIP] = map[uint32]bool{}
		}
		users[st.svc.VIP][id] = true
	}
	rs, err := netlink.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{Table: unix.RT_TABLE_LOCAL, Protocol: routeProto},
		netlink.RT_FILTER_TABLE|netlink.RT_FILTER_PROTOCOL)
	if err != nil {
		return fmt.Errorf("list local VIP routes: %w", err)
	}
	for _, r := range rs {
		if r.Dst == nil {
			continue
		}
		vip, ok := netip.AddrFromSlice(r.Dst.IP.To4())
		if ones, bits := r.Dst.Mask.Size(); !ok || ones != 32 || bits != 32 {
			continue
		}
		if u := users[vip]; len(u) > 0 {
			d.routes[vip] = &vipRoute{users: u, ours: true}
			continue
		}
		if err := netlink.RouteDel(&r); err != nil {
			d.log.Warn("remove a local VIP route no service uses", "vip", vip, "err", err)
		} else {
			d.log.Info("removed a local VIP route no service uses", "vip", vip)
		}
	}
	return nil
}

func (d *Dataplane) releaseLocalRoute(vip netip.Addr, id uint32) {
	r, ok := d.routes[vip]
	if !ok {
		return
	}
	delete(r.users, id)
	if len(r.users) == 0 {
		d.delLocalRoute(vip)
	}
}

func (d *Dataplane) delLocalRoute(vip netip.Addr) {
	r := d.routes[vip]
	delete(d.routes, vip)
	if r == nil || !r.ours {
		return
	}
	lo, err := netlink.LinkByName("lo")
	if err == nil {
		err = netlink.RouteDel(localRoute(lo.Attrs().Index, vip))
	}
	if err != nil {
		d.log.Warn("remove local VIP route", "vip", vip, "err", err)
	}
}

// Stats implements dataplane.Dataplane.
func (d *Dataplane) Stats(ctx context.Context) (dataplane.Stats, error) {
	if err := ctx.Err(); err != nil {
		return dataplane.Stats{}, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return dataplane.Stats{}, dataplane.ErrClosed
	}
	st := dataplane.Stats{
		Counters:         make(map[string]uint64, len(counterNames)),
		Services:         make(map[uint32]dataplane.ServiceStats, len(d.services)),
		ConntrackEntries: d.ctEntries,
	}
	per := make([]uint64, d.nCPU)
	for i, name := range counterNames {
		if err := d.objs.LbCounters.Lookup(uint32(i), &per); err != nil {
			return dataplane.Stats{}, fmt.Errorf("read counter %s: %w", name, err)
		}
		var sum uint64
		for _, v := range per {
			sum += v
		}
		st.Counters[name] = sum
	}
	ss := make([]lbSvcStats, d.nCPU)
	for id, s := range d.services {
		if err := d.objs.LbSvcStats.Lookup(uint32(s.idx), &ss); err != nil {
			return dataplane.Stats{}, fmt.Errorf("read counters of service %d: %w", id, err)
		}
		var out dataplane.ServiceStats
		for _, v := range ss {
			out.Packets += v.Pkts
			out.Bytes += v.Bytes
			out.Flows += v.Flows
		}
		st.Services[id] = out
	}
	return st, nil
}

func (d *Dataplane) gcLoop() {
	defer close(d.gcDone)
	t := time.NewTicker(d.cfg.GCInterval)
	defer t.Stop()
	for {
		select {
		case <-d.gcStop:
			return
		case <-t.C:
			d.GC()
		}
	}
}

func monotonicNow() uint64 {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts) // the clock of bpf_ktime_get_coarse_ns
	return uint64(ts.Nano())
}

// ctTimeout is how long an entry may stay idle in its state.
func ctTimeout(v *lbCtVal) time.Duration {
	est := time.Duration(v.TimeoutS) * time.Second
	switch v.State {
	case ctEst:
		return est
	case ctNew:
		return min(ctSYNSecs*time.Second, est)
	default:
		return min(ctFINSecs*time.Second, est)
	}
}

// peerKey is the key of the other direction's entry (see ct_forget in lb.c).
func peerKey(k *lbCtKey, v *lbCtVal) lbCtKey {
	p := lbCtKey{Proto: k.Proto, Saddr: k.Daddr, Sport: k.Dport, Daddr: k.Saddr, Dport: k.Sport}
	if v.Flags&ctXlateDst != 0 {
		p.Saddr, p.Sport = v.NewDaddr, v.NewDport
	}
	if v.Flags&ctXlateSrc != 0 {
		p.Daddr, p.Dport = v.NewSaddr, v.NewSport
	}
	return p
}

// GC removes expired and stale conntrack entries: an entry goes when it and
// its peer are both idle past their state's timeout (one quiet direction
// must not break a flow), or at once when its endpoint cell has a new epoch
// (endpoint or service removed). It returns the number removed. It runs
// every GCInterval without holding the data plane's lock, so rule changes
// never wait for a walk of the table; tests call it directly.
func (d *Dataplane) GC() int {
	d.gcMu.Lock()
	defer d.gcMu.Unlock()
	d.mu.Lock()
	ct, epochs, conns := d.objs.LbConntrack, d.objs.LbEpEpoch, d.objs.LbActiveConns
	closed := d.closed
	d.mu.Unlock()
	if ct == nil || epochs == nil || closed {
		return 0
	}
	now := monotonicNow()
	epochOf := map[uint32]uint32{}
	stale := func(v *lbCtVal) bool {
		key := uint32(v.SvcIdx)*maxEPs + uint32(v.Cell)
		e, ok := epochOf[key]
		if !ok {
			if err := epochs.Lookup(key, &e); err != nil {
				return false
			}
			epochOf[key] = e
		}
		return e != v.Epoch
	}
	var k lbCtKey
	var v lbCtVal
	total := 0
	expired := map[lbCtKey]lbCtVal{}
	var dead []lbCtKey
	live := map[lbCtKey]bool{}
	it := ct.Iterate()
	for it.Next(&k, &v) {
		total++
		switch {
		case stale(&v):
			dead = append(dead, k)
		case now > v.LastSeenNs && time.Duration(now-v.LastSeenNs) > ctTimeout(&v):
			expired[k] = v
		default:
			live[k] = true
		}
	}
	if err := it.Err(); err != nil {
		d.log.Warn("conntrack GC", "err", err)
	}
	removed := 0
	for _, k := range dead {
		if ct.Delete(k) == nil {
			removed++
		}
	}
	for k, v := range expired {
		if v.Flags&ctDSR == 0 && live[peerKey(&k, &v)] {
			continue
		}
		if err := ct.Delete(k); err != nil {
			continue
		}
		removed++
		if v.Flags&ctLCHeld != 0 && !stale(&v) {
			// Read-modify-write races with the program's atomic adds; the
			// window is tiny and the count only steers least-connection.
			key := uint32(v.SvcIdx)*maxEPs + uint32(v.Cell)
			var n int64
			if conns.Lookup(key, &n) == nil && n > 0 {
				conns.Put(key, n-1)
			}
		}
	}
	d.mu.Lock()
	d.ctEntries = total - removed
	d.mu.Unlock()
	return removed
}

// Byte-order helpers: map fields hold network-order bytes in host-order
// integers, because the program compares raw packet bytes.
func nbo32(a netip.Addr) uint32 {
	b := a.As4()
	return binary.NativeEndian.Uint32(b[:])
}

func addrFrom(v uint32) netip.Addr {
	var b [4]byte
	binary.NativeEndian.PutUint32(b[:], v)
	return netip.AddrFrom4(b)
}

func nbo16(p uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], p)
	return binary.NativeEndian.Uint16(b[:])
}

func hostPort(v uint16) uint16 {
	var b [2]byte
	binary.NativeEndian.PutUint16(b[:], v)
	return binary.BigEndian.Uint16(b[:])
}

func beKey(idx uint16, gen uint8, ep int) uint32 {
	return (uint32(idx)*2+uint32(gen&1))*maxEPs + uint32(ep)
}

func protoName(p uint8) string {
	switch p {
	case 6:
		return "tcp"
	case 17:
		return "udp"
	case 132:
		return "sctp"
	}
	return fmt.Sprintf("proto-%d", p)
}

// ProgramRuntime returns how often tc_lb ran and its total run time, as
// counted by the kernel while BPF run-time statistics are enabled
// (kernel.bpf_stats_enabled or ebpf.EnableStats); otherwise both stay 0.
func (d *Dataplane) ProgramRuntime() (runs uint64, total time.Duration, err error) {
	st, err := d.objs.TcLb.Stats()
	if err != nil {
		return 0, 0, fmt.Errorf("tc_lb stats: %w", err)
	}
	return st.RunCount, st.Runtime, nil
}
