//go:build linux

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

// Cleanup removes what a data plane pinned at pinPath leaves in the kernel
// once no daemon runs on it: the TCX links of tc_lb (detaching it from its
// interfaces), the sk_lookup link of the calling process's network
// namespace, the pinned maps and the pin directory; cls_bpf filters (the
// TCX fallback) whose tc_lb uses those pinned maps; and the local VIP
// routes the data plane adds (route protocol 76) in the calling network
// namespace, unless another data plane is attached there. It loads no
// program, so it works whatever version pinned the objects. It refuses with ErrPinPathBusy while a daemon holds the pin
// path, and removes nothing in a directory that is not on bpffs. Maps are
// told by name: this build's, or any pinned map named lb_* (another
// version's). Entries of the pin directory that are not the data plane's
// are left and listed.
// Run twice, the second report is empty.
func Cleanup(pinPath string) (CleanupReport, error) {
	var rep CleanupReport
	if os.Geteuid() != 0 {
		return rep, fmt.Errorf("%w: cleanup needs root (CAP_BPF, CAP_NET_ADMIN)", dataplane.ErrUnsupported)
	}
	var errs []error
	if pinPath != "" {
		if err := cleanupPins(pinPath, &rep); err != nil {
			if errors.Is(err, ErrPinPathBusy) || errors.Is(err, dataplane.ErrConfig) {
				return rep, err // nothing touched
			}
			errs = append(errs, err)
		}
	}
	if err := cleanupRoutes(&rep); err != nil {
		errs = append(errs, err)
	}
	return rep, errors.Join(errs...)
}

// pinnedMapNames are the maps the BPF object pins by name.
func pinnedMapNames() ([]string, error) {
	spec, err := loadLb()
	if err != nil {
		return nil, fmt.Errorf("parse embedded BPF object: %w", err)
	}
	var names []string
	for name, m := range spec.Maps {
		if m.Pinning == ebpf.PinByName {
			names = append(names, name)
		}
	}
	return names, nil
}

func cleanupPins(pinPath string, rep *CleanupReport) error {
	var fs unix.Statfs_t
	if err := unix.Statfs(pinPath, &fs); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil // nothing pinned there
		}
		return fmt.Errorf("pin path %s: %w", pinPath, err)
	}
	if fs.Type != unix.BPF_FS_MAGIC {
		return fmt.Errorf("%w: pin path %s is not on a bpffs mount: nothing removed", dataplane.ErrConfig, pinPath)
	}
	lock, err := lockPinPath(pinPath)
	if err != nil {
		return err
	}
	defer lock.Close()
	mapNames, err := pinnedMapNames()
	if err != nil {
		return err
	}
	entries, err := os.ReadDir(pinPath)
	if err != nil {
		return fmt.Errorf("list pin path %s: %w", pinPath, err)
	}
	var errs []error
	// cls_bpf filters are not pinned: they are found by the pinned map
	// their program uses, so this goes before the maps are unpinned.
	// lb_counters: tc_lb of every version uses it (the attached tc_lb hands
	// everything but the prefilter to tc_lb_nat, which holds lb_services).
	if err := cleanupClsFilters(filepath.Join(pinPath, "lb_counters"), rep); err != nil {
		errs = append(errs, err)
	}
	for _, e := range entries {
		name, pin := e.Name(), filepath.Join(pinPath, e.Name())
		switch ifname, tcx := strings.CutPrefix(name, "tcx_"); {
		case tcx || name == "sk_lookup":
			what := "detached sk_lookup from the network namespace"
			if tcx {
				what = "detached tc_lb from " + ifname
			}
			if err := unpinLink(pin); err != nil {
				errs = append(errs, err)
				continue
			}
			rep.Removed = append(rep.Removed, fmt.Sprintf("%s (unpinned %s)", what, pin))
		case slices.Contains(mapNames, name) || strings.HasPrefix(name, "lb_") && isPinnedMap(pin):
			if err := os.Remove(pin); err != nil {
				errs = append(errs, fmt.Errorf("unpin map %s: %w", pin, err))
				continue
			}
			rep.Removed = append(rep.Removed, "unpinned map "+pin)
		default:
			rep.Left = append(rep.Left, pin+" (not an object of the data plane)")
		}
	}
	if len(rep.Left) == 0 && len(errs) == 0 {
		if err := os.Remove(pinPath); err != nil {
			errs = append(errs, fmt.Errorf("remove pin directory: %w", err))
		} else {
			rep.Removed = append(rep.Removed, "removed pin directory "+pinPath)
		}
	}
	return errors.Join(errs...)
}

// unpinLink drops a link's pin; with no other reference left the link is
// released and its program detached. A pin that is not a loadable link (its
// interface is gone) is removed all the same.
func unpinLink(pin string) error {
	l, err := link.LoadPinnedLink(pin, nil)
	if err != nil {
		if err := os.Remove(pin); err != nil {
			return fmt.Errorf("remove link pin %s: %w", pin, err)
		}
		return nil
	}
	defer l.Close()
	if err := l.Unpin(); err != nil {
		return fmt.Errorf("unpin link %s: %w", pin, err)
	}
	return nil
}

// cleanupClsFilters removes the cls_bpf filters the TCX fallback adds (tc_lb
// on ingress, handle 1, priority 1) whose program uses the map pinned at
// mapPin, on every interface of the network namespace.
func cleanupClsFilters(mapPin string, rep *CleanupReport) error {
	m, err := ebpf.LoadPinnedMap(mapPin, nil)
	if err != nil {
		return nil // no pinned map: no filter can be told to be ours
	}
	info, err := m.Info()
	m.Close()
	if err != nil {
		return fmt.Errorf("read pinned map %s: %w", mapPin, err)
	}
	mapID, ok := info.ID()
	if !ok {
		return nil
	}
	links, err := netlink.LinkList()
	if err != nil {
		return fmt.Errorf("list interfaces: %w", err)
	}
	var errs []error
	for _, l := range links {
		filters, err := netlink.FilterList(l, netlink.HANDLE_MIN_INGRESS)
		if err != nil {
			continue // no clsact qdisc
		}
		for _, f := range filters {
			bf, ok := f.(*netlink.BpfFilter)
			if !ok || bf.Handle != 1 || bf.Priority != 1 || !usesMap(bf.Id, mapID) {
				continue
			}
			if err := netlink.FilterDel(bf); err != nil {
				errs = append(errs, fmt.Errorf("remove cls_bpf filter from %s: %w", l.Attrs().Name, err))
				continue
			}
			rep.Removed = append(rep.Removed, "detached tc_lb (cls_bpf) from "+l.Attrs().Name)
		}
	}
	return errors.Join(errs...)
}

func usesMap(progID int, mapID ebpf.MapID) bool {
	p, err := ebpf.NewProgramFromID(ebpf.ProgramID(progID))
	if err != nil {
		return false
	}
	defer p.Close()
	info, err := p.Info()
	if err != nil {
		return false
	}
	ids, _ := info.MapIDs()
	return slices.Contains(ids, mapID)
}

// cleanupRoutes removes the local VIP routes marked with routeProto in the
// calling network namespace, unless a data plane still runs there (its
// sk_lookup program is attached: another daemon, on another pin path, whose
// mode-4 VIPs need those routes); then they are left and listed.
func cleanupRoutes(rep *CleanupReport) error {
	rs, err := netlink.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{Table: unix.RT_TABLE_LOCAL, Protocol: routeProto},
		netlink.RT_FILTER_TABLE|netlink.RT_FILTER_PROTOCOL)
	if err != nil {
		return fmt.Errorf("list local VIP routes: %w", err)
	}
	if len(rs) == 0 {
		return nil
	}
	if n, err := skLookupPrograms(); err != nil {
		return err
	} else if n > 0 {
		for _, r := range rs {
			if r.Dst != nil {
				rep.Left = append(rep.Left, fmt.Sprintf("route local %s proto %d (a data plane still runs in this network namespace:"+
					" %d sk_lookup program(s) attached; run cleanup with its --bpf-pin-path once it is stopped)", r.Dst.IP, routeProto, n))
			}
		}
		return nil
	}
	var errs []error
	for _, r := range rs {
		if r.Dst == nil {
			continue
		}
		dev := "?"
		if l, err := net.InterfaceByIndex(r.LinkIndex); err == nil {
			dev = l.Name
		}
		if err := netlink.RouteDel(&r); err != nil {
			errs = append(errs, fmt.Errorf("remove route local %s dev %s: %w", r.Dst, dev, err))
			continue
		}
		rep.Removed = append(rep.Removed, fmt.Sprintf("removed route local %s dev %s proto %d", r.Dst.IP, dev, routeProto))
	}
	return errors.Join(errs...)
}

// skLookupPrograms counts the sk_lookup programs attached to the calling
// process's network namespace.
func skLookupPrograms() (int, error) {
	ns, err := os.Open("/proc/self/ns/net")
	if err != nil {
		return 0, fmt.Errorf("open network namespace: %w", err)
	}
	defer ns.Close()
	res, err := link.QueryPrograms(link.QueryOptions{Target: int(ns.Fd()), Attach: ebpf.AttachSkLookup})
	if err != nil {
		return 0, fmt.Errorf("query sk_lookup programs of the network namespace: %w", err)
	}
	return len(res.Programs), nil
}

// isPinnedMap reports whether pin is a pinned map: with the data plane's
// "lb_" prefix, a map another version pinned that this build no longer has.
func isPinnedMap(pin string) bool {
	m, err := ebpf.LoadPinnedMap(pin, nil)
	if err != nil {
		return false
	}
	m.Close()
	return true
}
