package gateway

import (
	"context"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/peerprefill"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
)

// linkedGateways are two gateways, as two nodes sharing a rule, that
// announce their prefills to each other over real UDP sockets.
func linkedGateways(t *testing.T) (a, b fixture, na, nb *peerprefill.Node) {
	t.Helper()
	return linkedGatewaysLoad(t, 0)
}

// linkedGatewaysLoad links two gateways that, with loadInterval > 0, also
// share their load every loadInterval and add each other's to their own
// (ClusterLoad, with no scraped engine metrics).
func linkedGatewaysLoad(t *testing.T, loadInterval time.Duration) (a, b fixture, na, nb *peerprefill.Node) {
	t.Helper()
	var addrA, addrB atomic.Pointer[string]
	// Each node's socket is built first and given to its gateway; the
	// gateway is then the handler the node's Run serves, as in the daemon.
	node := func(peer *atomic.Pointer[string]) *peerprefill.Node {
		n, err := peerprefill.New(peerprefill.Config{Listen: "127.0.0.1:0", Refresh: 5 * time.Millisecond, LoadInterval: loadInterval,
			Peers: func() []string {
				if p := peer.Load(); p != nil {
					return []string{*p}
				}
				return nil
			}}, nil, prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	na, nb = node(&addrB), node(&addrA)
	// The wait outlasts any pause of a loaded test machine.
	cfg := func(n *peerprefill.Node) Config {
		c := Config{Seed: "1", CoalesceWait: time.Minute, Peers: n}
		if loadInterval > 0 {
			c.ClusterLoad, c.PeerLoad, c.Engine.Others = true, n, &fakeOthers{}
		}
		return c
	}
	a = newFixtureConfig(t, cfg(na), rule(3, ""))
	b = newFixtureConfig(t, cfg(nb), rule(3, ""))
	for _, f := range []fixture{a, b} {
		// Loaded before the test's requests, which then only tokenize.
		if _, err := f.g.tok.Get("Qwen/Qwen3-0.6B"); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range []struct {
		n *peerprefill.Node
		g *Gateway
	}{{na, a.g}, {nb, b.g}} {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { _ = p.n.Run(ctx, p.g); close(done) }()
		t.Cleanup(func() { cancel(); <-done })
	}
	sa, sb := na.Addr().String(), nb.Addr().String()
	addrA.Store(&sa)
	addrB.Store(&sb)
	waitUntil(t, "both nodes knowing the other", func() bool { return na.Peers() == 1 && nb.Peers() == 1 })
	return a, b, na, nb
}

// A sibling reaching the other node while this node's request computes
// the prefix is routed to the same endpoint and waits for that request's
// first byte there, as a sibling on the same node does.
func TestRemotePrefillHoldsSiblingOnOtherNode(t *testing.T) {
	a, b, _, _ := linkedGateways(t)
	p1, err := a.g.Pick(context.Background(), req(prompt))
	if err != nil {
		t.Fatal(err)
	}
	leader, _ := router.ParseReceipt(p1.Receipt)
	waitUntil(t, "b holding a's announcement", func() bool { return b.g.remote.count() == 1 })
	follower := pickAsync(context.Background(), b.g, req(prompt))
	waitUntil(t, "the sibling held at b", func() bool { return b.g.leaders.heldFor(1, leader.EP) == 1 })
	select {
	case r := <-follower:
		t.Fatalf("the sibling at b was not held while a's request prefilled: %+v", r)
	default:
	}
	p1.FirstByte()
	r := <-follower
	if r.err != nil {
		t.Fatal(r.err)
	}
	rc, _ := router.ParseReceipt(r.plan.Receipt)
	if rc.EP != leader.EP || rc.Matched != rc.Total {
		t.Fatalf("sibling at b %+v, leader at a %+v", rc, leader)
	}
	if v := coalesced(b, leader.EP, waitReleased); v != 1 {
		t.Fatalf("b coalesced{released} = %v", v)
	}
	r.plan.Done(proxy.Result{Endpoint: rc.EP, Status: 200})
	p1.Done(proxy.Result{Endpoint: leader.EP, Status: 200})
	waitUntil(t, "a's announcement ended at b", func() bool { return b.g.remote.count() == 0 && b.g.leaders.size() == 0 })
}

// An announcement whose "done" never comes is held only until its expiry.
func TestRemotePrefillExpires(t *testing.T) {
	f := newFixture(t, rule(3, ""))
	st := f.g.lookup(1)
	p := peerprefill.Prefill{ID: peerprefill.ID{Instance: 1, Seq: 1}, Service: 1, EP: 1,
		EPHash: peerprefill.EndpointHash(st.addrs[1]), Uncached: 100, TTL: 20 * time.Millisecond, Keys: []uint64{5, 6}}
	if why := f.g.RemoteBegin(netip.Addr{}, p); why != "" {
		t.Fatalf("refused: %s", why)
	}
	if l := f.g.leaders.find(1, 1, 6); l == nil {
		t.Fatal("no leader for the announced keys")
	}
	waitUntil(t, "the announcement expired", func() bool { return f.g.remote.count() == 0 && f.g.leaders.find(1, 1, 6) == nil })
	f.g.RemoteDone(p.ID) // late: harmless
}

// Announcements naming a rule or endpoint this node does not hold alike
// are refused; past maxRemoteLeaders they are refused as full; a local
// leader of the same blocks is never displaced.
func TestRemotePrefillRefusals(t *testing.T) {
	f := newFixture(t, rule(3, ""))
	st := f.g.lookup(1)
	good := peerprefill.Prefill{Service: 1, EP: 0, EPHash: peerprefill.EndpointHash(st.addrs[0]), Uncached: 10, TTL: time.Minute, Keys: []uint64{1}}
	bad := map[string]peerprefill.Prefill{}
	p := good
	p.Service = 2
	bad["unknown rule"] = p
	p = good
	p.EP = 2
	bad["endpoint index past the rule's"] = p
	p = good
	p.EPHash++
	bad["another address at the index"] = p
	for name, p := range bad {
		if why := f.g.RemoteBegin(netip.Addr{}, p); why != peerprefill.DropRule {
			t.Errorf("%s: %q, want %q", name, why, peerprefill.DropRule)
		}
	}

	end, local := f.g.leaders.register(1, 0, []uint64{1}, 10)
	defer end()
	for i := range maxRemoteLeaders {
		p := good
		p.ID.Seq = uint64(i)
		if why := f.g.RemoteBegin(netip.Addr{}, p); why != "" {
			t.Fatalf("announcement %d refused: %s", i, why)
		}
	}
	p = good
	p.ID.Seq = maxRemoteLeaders
	if why := f.g.RemoteBegin(netip.Addr{}, p); why != peerprefill.DropFull {
		t.Fatalf("announcement past the cap: %q", why)
	}
	if f.g.leaders.find(1, 0, 1) != local {
		t.Fatal("an announcement displaced this node's own leader")
	}
	for i := range maxRemoteLeaders {
		f.g.RemoteDone(peerprefill.ID{Seq: uint64(i)})
	}
	if n := f.g.remote.count(); n != 0 {
		t.Fatalf("%d announcements held after their ends", n)
	}
}
