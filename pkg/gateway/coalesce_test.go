package gateway

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
)

type pickResult struct {
	plan proxy.Plan
	err  error
}

func pickAsync(ctx context.Context, g *Gateway, r *proxy.Request) <-chan pickResult {
	out := make(chan pickResult, 1)
	go func() {
		p, err := g.Pick(ctx, r)
		out <- pickResult{p, err}
	}()
	return out
}

func coalesced(f fixture, ep int, outcome waitOutcome) float64 {
	return testutil.ToFloat64(f.g.m.coalesced.WithLabelValues("1", string(rune('0'+ep)), string(outcome)))
}

// waitUntil polls cond; the deadline is a hang guard, not a performance
// limit.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// expectOneWaiting checks that the one request waiting in the gateway for
// endpoint ep is that endpoint's load, and nothing else is in flight.
func expectOneWaiting(t *testing.T, f fixture, ep int) {
	t.Helper()
	for _, c := range f.g.candidates(f.g.lookup(1)) {
		if want := map[bool]int{true: 1, false: 0}[c.Idx == ep]; c.InFlight != want {
			t.Fatalf("endpoint %d in-flight %d while one request waits for endpoint %d, want %d", c.Idx, c.InFlight, ep, want)
		}
	}
}

// A sibling routed to blocks its endpoint is still computing for an
// earlier request waits for that request's first byte, then goes to the
// same endpoint.
func TestCoalesceFollowerWaitsForLeaderFirstByte(t *testing.T) {
	f := newFixture(t, rule(3, ""))
	p1, err := f.g.Pick(context.Background(), req(prompt))
	if err != nil {
		t.Fatal(err)
	}
	leader, _ := router.ParseReceipt(p1.Receipt)
	follower := pickAsync(context.Background(), f.g, req(prompt))
	select {
	case r := <-follower:
		t.Fatalf("follower was not held while the leader prefilled: %+v", r)
	case <-time.After(50 * time.Millisecond):
	}
	// The held follower is load on the endpoint it waits for.
	waitUntil(t, "the follower counted as held", func() bool { return f.g.leaders.heldFor(1, leader.EP) == 1 })
	expectOneWaiting(t, f, leader.EP)
	p1.FirstByte()
	r := <-follower
	if r.err != nil {
		t.Fatal(r.err)
	}
	rc, _ := router.ParseReceipt(r.plan.Receipt)
	if rc.EP != leader.EP || rc.Matched != rc.Total {
		t.Fatalf("follower %+v, leader %+v", rc, leader)
	}
	if v := coalesced(f, leader.EP, waitReleased); v != 1 {
		t.Fatalf("coalesced{released} = %v", v)
	}
	// The leader's blocks left the table at its first byte (the follower
	// computes no new full block of its own).
	p1.Done(proxy.Result{Endpoint: leader.EP, Status: 200}) // harmless after FirstByte
	r.plan.Done(proxy.Result{Endpoint: rc.EP, Status: 200})
	if n := f.g.leaders.size(); n != 0 {
		t.Fatalf("%d blocks still registered after both requests ended", n)
	}
}

// A leader that never answers holds its followers only for CoalesceWait.
func TestCoalesceWaitIsBounded(t *testing.T) {
	f := newFixtureConfig(t, Config{Seed: "1", CoalesceWait: 30 * time.Millisecond}, rule(3, ""))
	p1, err := f.g.Pick(context.Background(), req(prompt))
	if err != nil {
		t.Fatal(err)
	}
	leader, _ := router.ParseReceipt(p1.Receipt)
	r := <-pickAsync(context.Background(), f.g, req(prompt))
	if r.err != nil {
		t.Fatal(r.err)
	}
	if v := coalesced(f, leader.EP, waitTimeout); v != 1 {
		t.Fatalf("coalesced{timeout} = %v", v)
	}
}

// A client that goes away while held gets the cancel error, and its own
// registration is released.
func TestCoalesceCancelledFollowerReleasesItsBooking(t *testing.T) {
	f := newFixture(t, rule(3, ""))
	p1, err := f.g.Pick(context.Background(), req(prompt))
	if err != nil {
		t.Fatal(err)
	}
	leader, _ := router.ParseReceipt(p1.Receipt)
	ctx, cancel := context.WithCancel(context.Background())
	follower := pickAsync(ctx, f.g, req(prompt))
	// Cancel only once the follower is held: a client that leaves before
	// (while waiting to be tokenized) never reaches the coalescing wait.
	waitUntil(t, "the follower to be held", func() bool { return f.g.leaders.heldFor(1, leader.EP) == 1 })
	cancel()
	r := <-follower
	if !errors.Is(r.err, proxy.ErrClientCanceled) {
		t.Fatalf("err = %v, want ErrClientCanceled", r.err)
	}
	p1.FirstByte()
	if n := f.g.leaders.size(); n != 0 {
		t.Fatalf("%d blocks still registered after the cancelled follower and the leader ended", n)
	}
	if v := coalesced(f, leader.EP, waitCancelled); v != 1 {
		t.Fatalf("coalesced{cancelled} = %v", v)
	}
}

// With coalescing off (LOXILB_KV_COALESCE_WAIT_MS=0) nothing waits.
func TestCoalesceOff(t *testing.T) {
	f := newFixtureConfig(t, Config{Seed: "1", CoalesceWait: -1}, rule(3, ""))
	if _, err := f.g.Pick(context.Background(), req(prompt)); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-pickAsync(context.Background(), f.g, req(prompt)):
		if r.err != nil {
			t.Fatal(r.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("follower held with coalescing off")
	}
}

// size is the number of registered leader blocks.
func (ls *leaders) size() int {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return len(ls.m)
}
