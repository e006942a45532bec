//go:build linux

package netns

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/dataplanetest"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/ebpf"
)

// inNetNS runs fn on a thread switched into the named network namespace, so
// the sockets fn opens live there (they stay there afterwards).
func inNetNS(ns string, fn func() error) error {
	runtime.LockOSThread()
	self, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer self.Close()
	target, err := os.Open("/run/netns/" + ns)
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer target.Close()
	if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter %s: %w", ns, err)
	}
	ferr := fn()
	if err := unix.Setns(int(self.Fd()), unix.CLONE_NEWNET); err != nil {
		// The thread stays locked and dies with the goroutine.
		return fmt.Errorf("leave %s: %w", ns, err)
	}
	runtime.UnlockOSThread()
	return ferr
}

// udpEcho answers every datagram on addr (in namespace ns) with name.
func udpEcho(t *testing.T, ns string, addr netip.AddrPort, name string) {
	t.Helper()
	var c *net.UDPConn
	if err := inNetNS(ns, func() (err error) {
		c, err = net.ListenUDP("udp4", net.UDPAddrFromAddrPort(addr))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	go func() {
		buf := make([]byte, 1500)
		for {
			_, from, err := c.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			c.WriteToUDPAddrPort([]byte(name), from)
		}
	}()
}

func ipRun(t *testing.T, args string) {
	t.Helper()
	if err := dataplanetest.Run("ip", strings.Fields(args)...); err != nil {
		t.Fatal(err)
	}
}

// TestFlowFollowsRouteAndNeighbourChanges: one UDP flow through a mode-0
// VIP keeps its conntrack entries (and their cached FIB results) while the
// LB's route to the endpoint moves to another next hop and interface, and
// then while that next hop's MAC changes; the first datagram after each
// change already takes the new path. The endpoint address lives on both
// backends, so the answering backend shows which path a datagram took.
func TestFlowFollowsRouteAndNeighbourChanges(t *testing.T) {
	lab := withLab(t, 2)
	if lab == nil {
		return
	}
	epAddr := netip.MustParseAddr("172.30.50.2")
	for _, be := range lab.Backends {
		ipRun(t, "-n "+be+" addr add "+epAddr.String()+"/32 dev lo")
	}
	udpEcho(t, lab.Backends[0], netip.AddrPortFrom(epAddr, 5000), "be1")
	udpEcho(t, lab.Backends[1], netip.AddrPortFrom(epAddr, 5000), "be2")
	ipRun(t, "route add "+epAddr.String()+"/32 via "+BackendAddr(0).String()+" dev "+lab.LBIfaces[1])

	ctx := context.Background()
	d, err := ebpf.New(ebpf.Config{Interfaces: lab.LBIfaces}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	vip := VIP(5)
	if err := d.UpsertService(ctx, dataplane.Service{ID: 5, VIP: vip, Port: 5000, Proto: "udp", Mode: dataplane.ModeDNAT},
		[]dataplane.Endpoint{{Addr: epAddr, Port: 5000, Weight: 1, Healthy: true}}); err != nil {
		t.Fatal(err)
	}

	var client *net.UDPConn
	if err := inNetNS(lab.Client, func() (err error) {
		client, err = net.DialUDP("udp4", nil, net.UDPAddrFromAddrPort(netip.AddrPortFrom(vip, 5000)))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	ask := func(what string) string {
		t.Helper()
		if _, err := client.Write([]byte("ping")); err != nil {
			t.Fatalf("%s: send: %v", what, err)
		}
		client.SetReadDeadline(time.Now().Add(3 * time.Second))
		buf := make([]byte, 64)
		n, err := client.Read(buf)
		if err != nil {
			t.Fatalf("%s: no answer through the VIP: %v", what, err)
		}
		return string(buf[:n])
	}
	counter := func(name string) uint64 {
		st, err := d.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return st.Counters[name]
	}
	changed := func(cmd string) {
		t.Helper()
		gen := d.FIBGeneration()
		ipRun(t, cmd)
		deadline := time.Now().Add(10 * time.Second)
		for d.FIBGeneration() == gen {
			if time.Now().After(deadline) {
				t.Fatalf("%q: the data plane did not notice the change", cmd)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}

	for i := range 4 {
		if got := ask("before"); got != "be1" {
			t.Fatalf("datagram %d answered by %q, want be1 (route via %s)", i, got, lab.LBIfaces[1])
		}
	}
	if counter("fib_cached") == 0 {
		t.Fatal("no packet was forwarded with a cached FIB result: the test would prove nothing")
	}
	flows := counter("new_flow")

	changed("route replace " + epAddr.String() + "/32 via " + BackendAddr(1).String() + " dev " + lab.LBIfaces[2])
	for i := range 4 {
		if got := ask("after the route change"); got != "be2" {
			t.Fatalf("datagram %d after the route change answered by %q, want be2", i, got)
		}
	}

	// be2's interface gets another MAC; the LB learns it. A datagram sent
	// to the old MAC would be dropped by be2.
	mac := "02:00:00:00:12:34"
	ipRun(t, "-n "+lab.Backends[1]+" link set dev e0 address "+mac)
	cached := counter("fib_cached")
	changed("neigh replace " + BackendAddr(1).String() + " lladdr " + mac + " dev " + lab.LBIfaces[2] + " nud reachable")
	for i := range 4 {
		if got := ask("after the neighbour change"); got != "be2" {
			t.Fatalf("datagram %d after the neighbour change answered by %q, want be2", i, got)
		}
	}
	if counter("fib_cached") == cached {
		t.Fatal("the new neighbour was not cached")
	}
	if n := counter("new_flow"); n != flows {
		t.Fatalf("new_flow moved by %d: the datagrams were not one flow", n-flows)
	}
}
