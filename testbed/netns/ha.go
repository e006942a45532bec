package netns

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"strings"
)

// HALab is the several-nodes topology: a client, a router that spreads a
// VIP over the gateway nodes with an ECMP multipath route (as BGP ECMP
// does in production), the nodes, and a services namespace holding etcd
// and the engines.
//
//	cli   c0 172.28.1.2/24 ── r0 172.28.1.1 ┐
//	node1 n0 172.28.11.2/24 ── r1 172.28.11.1 ├─ rtr (ip_forward=1, fib_multipath_hash_policy=1,
//	node2 n0 172.28.12.2/24 ── r2 172.28.12.1 │       VIP/32 nexthop via each node)
//	node3 n0 172.28.13.2/24 ── r3 172.28.13.1 │
//	svc   s0 172.28.2.2/24 ── rs 172.28.2.1 ┘   (etcd on .2, engines on .11, .12, ...)
//
// Every namespace routes everything else via the router. Names are unique
// per lab, so labs of concurrent runs do not collide.
type HALab struct {
	Client, Router, Services string
	Nodes                    []string
}

// HAClientAddr is the client's address.
func HAClientAddr() netip.Addr { return netip.AddrFrom4([4]byte{172, 28, 1, 2}) }

// HANodeAddr is node i's address (0-based), the router's next hop to it.
func HANodeAddr(i int) netip.Addr { return netip.AddrFrom4([4]byte{172, 28, byte(11 + i), 2}) }

// HAStoreAddr is the services namespace's address etcd listens on.
func HAStoreAddr() netip.Addr { return netip.AddrFrom4([4]byte{172, 28, 2, 2}) }

// HAEngineAddr is engine i's address (0-based) in the services namespace.
func HAEngineAddr(i int) netip.Addr { return netip.AddrFrom4([4]byte{172, 28, 2, byte(11 + i)}) }

// HAVIP is the VIP the router spreads over the nodes. It is assigned
// nowhere by the lab: each node's data plane makes it local.
func HAVIP() netip.Addr { return netip.AddrFrom4([4]byte{172, 28, 100, 1}) }

// BuildHA creates the lab with the given numbers of nodes and engines and
// the VIP's multipath route over every node. On error it removes what it
// made.
func BuildHA(nodes, engines int) (*HALab, error) {
	var b [3]byte
	rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	l := &HALab{Client: "hacli" + id, Router: "hartr" + id, Services: "hasvc" + id}
	for i := range nodes {
		l.Nodes = append(l.Nodes, fmt.Sprintf("han%d%s", i+1, id))
	}
	if err := l.build(engines); err != nil {
		return nil, errors.Join(err, l.Destroy())
	}
	return l, nil
}

func (l *HALab) namespaces() []string {
	return append([]string{l.Client, l.Router, l.Services}, l.Nodes...)
}

func (l *HALab) build(engines int) error {
	var cmds [][]string
	add := func(args ...string) { cmds = append(cmds, args) }
	sysctl := func(ns, kv string) { add("ip", "netns", "exec", ns, "sysctl", "-qw", kv) }
	for _, ns := range l.namespaces() {
		add("ip", "netns", "add", ns)
		add("ip", "-n", ns, "link", "set", "lo", "up")
		sysctl(ns, "net.ipv4.conf.all.rp_filter=0")
		sysctl(ns, "net.ipv4.conf.default.rp_filter=0")
	}
	sysctl(l.Router, "net.ipv4.ip_forward=1")
	// Hash flows on the 5-tuple, so connections of one client spread.
	sysctl(l.Router, "net.ipv4.fib_multipath_hash_policy=1")

	link := func(rIf, peerNS, peerIf string, rIP, peerIP netip.Addr) {
		cmds = append(cmds, vethCmds(l.Router, rIf, peerNS, peerIf, rIP, peerIP)...)
	}
	link("r0", l.Client, "c0", netip.AddrFrom4([4]byte{172, 28, 1, 1}), HAClientAddr())
	link("rs", l.Services, "s0", netip.AddrFrom4([4]byte{172, 28, 2, 1}), HAStoreAddr())
	for i := range engines {
		add("ip", "-n", l.Services, "addr", "add", HAEngineAddr(i).String()+"/24", "dev", "s0")
	}
	for i, n := range l.Nodes {
		link(fmt.Sprintf("r%d", i+1), n, "n0", netip.AddrFrom4([4]byte{172, 28, byte(11 + i), 1}), HANodeAddr(i))
	}
	for _, c := range cmds {
		if err := run(c...); err != nil {
			return err
		}
	}
	all := make([]int, len(l.Nodes))
	for i := range all {
		all[i] = i
	}
	return l.RouteVIP(all...)
}

// RouteVIP points the router's VIP route at the given nodes (0-based), one
// next hop each, replacing the route: what a BGP router does when a node
// announces or withdraws the VIP. No node leaves the VIP unrouted.
func (l *HALab) RouteVIP(nodes ...int) error {
	args := []string{"ip", "-n", l.Router, "route", "replace", HAVIP().String() + "/32"}
	for _, i := range nodes {
		args = append(args, "nexthop", "via", HANodeAddr(i).String(), "dev", fmt.Sprintf("r%d", i+1))
	}
	if len(nodes) == 0 {
		return l.unrouteVIP()
	}
	return run(args...)
}

func (l *HALab) unrouteVIP() error {
	err := run("ip", "-n", l.Router, "route", "del", HAVIP().String()+"/32")
	if err != nil && strings.Contains(err.Error(), "No such process") {
		return nil
	}
	return err
}

// Destroy deletes the lab's namespaces (veths go with them).
func (l *HALab) Destroy() error {
	var errs []error
	for _, ns := range l.namespaces() {
		if err := run("ip", "netns", "del", ns); err != nil {
			if run("ip", "netns", "pids", ns) == nil { // still there
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}
