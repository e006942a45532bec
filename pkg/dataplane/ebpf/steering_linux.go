//go:build linux

// Mode-4 steering: the proxy's listeners registered for sk_lookup and the
// local routes that make a VIP deliverable on this host.

package ebpf

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"syscall"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

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
