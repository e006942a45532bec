package gateway

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/peerprefill"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
)

// recordingPeers is another node's announcement channel as this node's
// gateway sees it: the announcements it sent, and its instance.
type recordingPeers struct {
	instance uint64
	mu       sync.Mutex
	sent     []peerprefill.Prefill
}

func (r *recordingPeers) Announce(p peerprefill.Prefill) func() {
	r.mu.Lock()
	defer r.mu.Unlock()
	p.Keys = slices.Clone(p.Keys)
	r.sent = append(r.sent, p)
	return func() {}
}

func (r *recordingPeers) Instance() uint64 { return r.instance }
func (r *recordingPeers) Outranked() bool  { return true }

// announced returns the announcements sent so far.
func (r *recordingPeers) announced() []peerprefill.Prefill {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.sent)
}

// tieFixture is a gateway of instance 100 with the tie-break window w.
func tieFixture(t *testing.T, w time.Duration) (fixture, *recordingPeers) {
	t.Helper()
	rp := &recordingPeers{instance: 100}
	f := newFixtureConfig(t, Config{Seed: "1", CoalesceWait: time.Minute, ClusterTieBreak: w, Peers: rp}, rule(3, ""))
	if _, err := f.g.tok.Get("Qwen/Qwen3-0.6B"); err != nil {
		t.Fatal(err)
	}
	return f, rp
}

// crossing is another node's announcement of the blocks this node's
// first announcement named, from instance.
func crossing(mine peerprefill.Prefill, instance uint64) peerprefill.Prefill {
	p := mine
	p.ID = peerprefill.ID{Instance: instance, Seq: 1}
	return p
}

func tieBreaks(f fixture, outcome string) float64 {
	return testutil.ToFloat64(f.g.m.tieBreak.WithLabelValues("1", outcome))
}

// A new leader defers; another node's announcement of the same blocks
// from a node that ranks first makes it wait for that node's prefill,
// and it is forwarded when that node's "done" arrives.
func TestTieBreakYieldsToBetterRankedNode(t *testing.T) {
	f, rp := tieFixture(t, time.Minute)
	res := pickAsync(context.Background(), f.g, req(prompt))
	waitUntil(t, "the leader announced", func() bool { return len(rp.announced()) == 1 })
	mine := rp.announced()[0]
	other := crossing(mine, 50)
	if why := f.g.RemoteBegin(netip.Addr{}, other); why != "" {
		t.Fatalf("refused: %s", why)
	}
	waitUntil(t, "the leader yielded", func() bool { return f.g.leaders.heldFor(1, mine.EP) == 1 })
	select {
	case r := <-res:
		t.Fatalf("forwarded before the better-ranked node's prefill was done: %+v", r)
	default:
	}
	f.g.RemoteDone(other.ID)
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	if rc, _ := router.ParseReceipt(r.plan.Receipt); rc.EP != mine.EP {
		t.Fatalf("forwarded to %d, announced %d", rc.EP, mine.EP)
	}
	if y, k := tieBreaks(f, tieYielded), tieBreaks(f, tieKept); y != 1 || k != 0 {
		t.Fatalf("tiebreak yielded %v kept %v", y, k)
	}
	if v := coalesced(f, mine.EP, waitReleased); v != 1 {
		t.Fatalf("coalesced{released} = %v", v)
	}
	if v := testutil.ToFloat64(f.g.m.duplicateLeaders.WithLabelValues("1")); v != 0 {
		t.Fatalf("duplicate leaders %v: the crossing was resolved", v)
	}
	r.plan.Done(proxy.Result{Endpoint: mine.EP, Status: 200})
}

// A crossing announcement from a node this one outranks leaves the
// leader deferring for the window only (the other node yields); one that
// arrives after the leader was forwarded is a duplicate prefill, counted.
func TestTieBreakKeepsAgainstLowerRankAndCountsLateDuplicates(t *testing.T) {
	f, rp := tieFixture(t, 20*time.Millisecond)
	res := pickAsync(context.Background(), f.g, req(prompt))
	waitUntil(t, "the leader announced", func() bool { return len(rp.announced()) == 1 })
	mine := rp.announced()[0]
	if why := f.g.RemoteBegin(netip.Addr{}, crossing(mine, 200)); why != "" {
		t.Fatalf("refused: %s", why)
	}
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	if y, k := tieBreaks(f, tieYielded), tieBreaks(f, tieKept); y != 0 || k != 1 {
		t.Fatalf("tiebreak yielded %v kept %v", y, k)
	}
	if v := coalesced(f, mine.EP, waitReleased) + coalesced(f, mine.EP, waitTimeout); v != 0 {
		t.Fatalf("the leader waited for a node it outranks (%v)", v)
	}
	// Forwarded now: a better-ranked node's announcement of the same
	// blocks comes too late to change anything and is a duplicate.
	late := crossing(mine, 10)
	late.ID.Seq = 2
	if why := f.g.RemoteBegin(netip.Addr{}, late); why != "" {
		t.Fatalf("refused: %s", why)
	}
	if v := testutil.ToFloat64(f.g.m.duplicateLeaders.WithLabelValues("1")); v != 1 {
		t.Fatalf("duplicate leaders %v, want 1", v)
	}
	r.plan.Done(proxy.Result{Endpoint: mine.EP, Status: 200})
}

// Without the window (or with no other node) a leader is forwarded at
// once and nothing is counted as a tie-break.
func TestTieBreakOff(t *testing.T) {
	f, rp := tieFixture(t, 0)
	p, err := f.g.Pick(context.Background(), req(prompt))
	if err != nil {
		t.Fatal(err)
	}
	if len(rp.announced()) != 1 {
		t.Fatalf("%d announcements", len(rp.announced()))
	}
	if v := tieBreaks(f, tieKept) + tieBreaks(f, tieYielded); v != 0 {
		t.Fatalf("%v tie-breaks with the window off", v)
	}
	p.Done(proxy.Result{Endpoint: 0, Status: 200})
}

// A client that goes away while its leader defers is answered at once.
func TestTieBreakCancelled(t *testing.T) {
	f, rp := tieFixture(t, time.Minute)
	ctx, cancel := context.WithCancel(context.Background())
	res := pickAsync(ctx, f.g, req(prompt))
	waitUntil(t, "the leader announced", func() bool { return len(rp.announced()) == 1 })
	cancel()
	if r := <-res; !errors.Is(r.err, proxy.ErrClientCanceled) {
		t.Fatalf("pick of a client gone while deferring: %+v", r)
	}
	waitUntil(t, "its leadership ended", func() bool { return f.g.leaders.size() == 0 })
	if v := tieBreaks(f, tieCancelled); v != 1 {
		t.Fatalf("tiebreak cancelled %v", v)
	}
}
