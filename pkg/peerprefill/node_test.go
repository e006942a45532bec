package peerprefill

import (
	"context"
	"net"
	"net/netip"
	"slices"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/testbed/wait"
)

// recorder is a Handler keeping what it was handed.
type recorder struct {
	mu     sync.Mutex
	begins []Prefill
	dones  []ID
	refuse string
}

func (r *recorder) RemoteBegin(_ netip.Addr, p Prefill) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.refuse != "" {
		return r.refuse
	}
	p.Keys = slices.Clone(p.Keys)
	r.begins = append(r.begins, p)
	return ""
}

func (r *recorder) RemoteDone(id ID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.dones = append(r.dones, id)
}

func (r *recorder) counts() (int, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.begins), len(r.dones)
}

// peerAddrs is a mutable peer list.
type peerAddrs struct {
	mu sync.Mutex
	s  []string
}

func (p *peerAddrs) get() []string { p.mu.Lock(); defer p.mu.Unlock(); return slices.Clone(p.s) }
func (p *peerAddrs) set(s ...string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.s = s
}

type testNode struct {
	n     *Node
	h     *recorder
	peers *peerAddrs
}

func startNode(t *testing.T) testNode {
	t.Helper()
	tn, _ := startNodeWith(t, Config{}, nil)
	return tn
}

// startNodeWith runs a node with cfg (Listen and Peers filled in) serving
// h (tn.h when nil); stop ends its Run and waits for it.
func startNodeWith(t *testing.T, cfg Config, h Handler) (tn testNode, stop func()) {
	t.Helper()
	tn = testNode{h: &recorder{}, peers: &peerAddrs{}}
	if h == nil {
		h = tn.h
	}
	cfg.Listen, cfg.Peers = "127.0.0.1:0", tn.peers.get
	n, err := New(cfg, nil, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	tn.n = n
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = n.Run(ctx, h); close(done) }()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return tn, stop
}

// Run without a handler is refused (and frees the socket) instead of
// receiving announcements nobody takes.
func TestRunNeedsHandler(t *testing.T) {
	n, err := New(Config{Listen: "127.0.0.1:0", Peers: func() []string { return nil }}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	addr := n.Addr().String()
	if err := n.Run(context.Background(), nil); err == nil {
		t.Fatal("Run(nil) served")
	}
	// The socket was closed: its port can be bound again.
	again, err := New(Config{Listen: addr, Peers: func() []string { return nil }}, nil, nil)
	if err != nil {
		t.Fatalf("the socket of a refused Run is still held: %v", err)
	}
	_ = again.conn.Close()
}

// link makes the nodes each other's peers.
func link(t *testing.T, a, b testNode) {
	a.peers.set(b.n.Addr().String())
	b.peers.set(a.n.Addr().String())
	a.n.refresh()
	b.n.refresh()
}

// An announcement and its end reach the other node over a real socket.
func TestAnnounceReachesPeer(t *testing.T) {
	a, b := startNode(t), startNode(t)
	link(t, a, b)
	p := samplePrefill()
	done := a.n.Announce(p)
	wait.Eventually(t, "the begin at b", func() bool { n, _ := b.h.counts(); return n == 1 })
	done()
	done() // once only
	wait.Eventually(t, "the done at b", func() bool { _, n := b.h.counts(); return n == 1 })
	b.h.mu.Lock()
	got, id := b.h.begins[0], b.h.dones[0]
	b.h.mu.Unlock()
	if got.ID != id || got.ID.Instance != a.n.instance || got.Service != p.Service || !slices.Equal(got.Keys, p.Keys) {
		t.Fatalf("b got %+v then done %+v", got, id)
	}
	if v := testutil.ToFloat64(a.n.sent.WithLabelValues("begin")); v != 1 {
		t.Fatalf("sent{begin} = %v", v)
	}
	if v := testutil.ToFloat64(b.n.received.WithLabelValues("done")); v != 1 {
		t.Fatalf("received{done} = %v", v)
	}
	if n, _ := a.h.counts(); n != 0 {
		t.Fatalf("a handed its own announcement")
	}
}

// Alone (no peer) a node sends nothing.
func TestAnnounceAloneSendsNothing(t *testing.T) {
	a := startNode(t)
	a.n.Announce(samplePrefill())()
	if v := testutil.ToFloat64(a.n.sent.WithLabelValues("begin")) + testutil.ToFloat64(a.n.sent.WithLabelValues("done")); v != 0 {
		t.Fatalf("sent %v datagrams with no peer", v)
	}
}

// Datagrams from a socket that is no member's peer address, malformed
// ones and ones the handler refuses are counted and dropped; the node
// goes on taking good ones.
func TestHostileDatagramsAreCountedAndDropped(t *testing.T) {
	a, b := startNode(t), startNode(t)
	link(t, a, b)
	dropped := func(reason string) float64 { return testutil.ToFloat64(b.n.dropped.WithLabelValues(reason)) }

	stranger, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer stranger.Close()
	if _, err := stranger.WriteToUDPAddrPort(appendBegin(nil, samplePrefill()), b.n.Addr()); err != nil {
		t.Fatal(err)
	}
	wait.Eventually(t, "the stranger's datagram dropped", func() bool { return dropped(DropUnknownPeer) == 1 })

	// From a's own socket: garbage, an oversized datagram, a truncated one.
	for _, bad := range [][]byte{[]byte("GET / HTTP/1.1\r\n\r\n"), make([]byte, MaxDatagram+100), appendBegin(nil, samplePrefill())[:40]} {
		if _, err := a.n.conn.WriteToUDPAddrPort(bad, b.n.Addr()); err != nil {
			t.Fatal(err)
		}
	}
	wait.Eventually(t, "the malformed datagrams dropped", func() bool { return dropped(DropMalformed) == 3 })

	b.h.mu.Lock()
	b.h.refuse = DropRule
	b.h.mu.Unlock()
	a.n.Announce(samplePrefill())
	wait.Eventually(t, "the refused announcement counted", func() bool { return dropped(DropRule) == 1 })
	b.h.mu.Lock()
	b.h.refuse = ""
	b.h.mu.Unlock()
	a.n.Announce(samplePrefill())
	wait.Eventually(t, "a good announcement taken after the hostile ones", func() bool { n, _ := b.h.counts(); return n == 1 })
}

// A peer that leaves the membership gets nothing more.
func TestPeerRemovedGetsNothing(t *testing.T) {
	a, b := startNode(t), startNode(t)
	link(t, a, b)
	a.peers.set()
	a.n.refresh()
	a.n.Announce(samplePrefill())()
	if v := testutil.ToFloat64(a.n.sent.WithLabelValues("begin")); v != 0 {
		t.Fatalf("sent %v begins to a removed peer", v)
	}
}

// A node is outranked while a peer has not been heard from or has a lower
// instance, and not with no peer or once every peer is heard from with a
// higher one.
func TestOutranked(t *testing.T) {
	a, b := startNode(t), startNode(t)
	if a.n.Outranked() {
		t.Fatal("outranked with no peer")
	}
	link(t, a, b)
	if !a.n.Outranked() || !b.n.Outranked() {
		t.Fatal("not outranked by a peer never heard from")
	}
	a.n.Announce(samplePrefill())()
	b.n.Announce(samplePrefill())()
	lower, higher := a, b
	if b.n.instance < a.n.instance {
		lower, higher = b, a
	}
	wait.Eventually(t, "each node ranked against the other", func() bool {
		return !lower.n.Outranked() && higher.n.Outranked()
	})
	lower.peers.set()
	lower.n.refresh()
	higher.peers.set()
	higher.n.refresh()
	if lower.n.Outranked() || higher.n.Outranked() {
		t.Fatal("outranked by a peer that left")
	}
}
