package gateway

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
)

type admitResult struct {
	release func()
	out     admitOutcome
	id      string
}

func admitAsync(ctx context.Context, pg *prefillGate, id string, uncached int64, lead *leader, wait time.Duration, got chan<- admitResult) {
	go func() {
		rel, out := pg.admit(ctx, 1, 0, uncached, lead, wait, false)
		got <- admitResult{rel, out, id}
	}()
}

// waitQueued blocks until n requests wait on endpoint 0.
func waitQueued(t *testing.T, pg *prefillGate, n int) {
	t.Helper()
	waitUntil(t, fmt.Sprintf("%d requests queued", n), func() bool { return pg.queuedFor(1, 0) == n })
}

func expectNone(t *testing.T, got <-chan admitResult) {
	t.Helper()
	select {
	case r := <-got:
		t.Fatalf("%s was admitted (%s) with no free slot", r.id, r.out)
	case <-time.After(20 * time.Millisecond):
	}
}

// admitFirst takes a free slot of the gate on endpoint 0 (the only one of
// a one-slot gate) and returns its release.
func admitFirst(t *testing.T, pg *prefillGate) func() {
	t.Helper()
	release, out := pg.admit(context.Background(), 1, 0, 100, nil, time.Minute, false)
	if out != admitImmediate {
		t.Fatalf("first request: %s, want immediate", out)
	}
	return release
}

// A long prompt lets shorter ones overtake it only up to its own
// predicted work, or as many requests as the endpoint's budget, whichever
// comes first: a stream of cached requests queued behind a cold one used
// to go first however long it had waited, and the cold ones set the TTFT
// tail. With three slots a 1000-token prompt yields to three 300-token
// ones (the budget, before their 900 tokens reach its own), then goes
// before the fourth; a 500-token one yields to two (600 tokens).
func TestPrefillGateBoundsOvertaking(t *testing.T) {
	for _, c := range []struct {
		cold int64
		want string
	}{
		{1000, "hit hit hit cold hit hit"},
		{500, "hit hit cold hit hit hit"},
	} {
		pg := &prefillGate{slots: 3}
		var held []func()
		for range 3 {
			held = append(held, admitFirst(t, pg))
		}
		got := make(chan admitResult, 6)
		admitAsync(context.Background(), pg, "cold", c.cold, nil, time.Minute, got)
		waitQueued(t, pg, 1)
		for i := range 5 {
			admitAsync(context.Background(), pg, fmt.Sprintf("hit%d", i+1), 300, nil, time.Minute, got)
			waitQueued(t, pg, i+2)
		}
		// One slot at a time: the other two stay taken throughout.
		release := held[0]
		var order []string
		for range 6 {
			release()
			r := <-got
			if r.out != admitQueued {
				t.Fatalf("%s: %s, want queued", r.id, r.out)
			}
			order = append(order, strings.TrimRight(r.id, "0123456789"))
			release = r.release
		}
		release()
		held[1]()
		held[2]()
		if strings.Join(order, " ") != c.want {
			t.Fatalf("cold %d: admitted %v, want %s", c.cold, order, c.want)
		}
	}
}

// Free slots go to the waiting request with the shortest predicted
// prefill, whatever the arrival order; a leader is weighed by the requests
// coalesced onto it.
func TestPrefillGateShortestFirst(t *testing.T) {
	// Three slots, two held throughout, so no waiter is overtaken by as
	// many requests as the budget (which would make it go next).
	pg := &prefillGate{slots: 3}
	first := admitFirst(t, pg)
	held := []func(){admitFirst(t, pg), admitFirst(t, pg)}
	got := make(chan admitResult, 4)
	lead := &leader{done: make(chan struct{})}
	admitAsync(context.Background(), pg, "cold-2000", 2000, nil, time.Minute, got)
	waitQueued(t, pg, 1)
	admitAsync(context.Background(), pg, "leader-1200", 1200, lead, time.Minute, got)
	waitQueued(t, pg, 2)
	admitAsync(context.Background(), pg, "hit-300", 300, nil, time.Minute, got)
	waitQueued(t, pg, 3)
	lead.followers.Add(3) // 1200 tokens unblock four requests: 300 per request
	expectNone(t, got)

	var order []string
	release := first
	for range 3 {
		release()
		r := <-got
		if r.out != admitQueued {
			t.Fatalf("%s: %s, want queued", r.id, r.out)
		}
		order = append(order, r.id)
		expectNone(t, got)
		release = r.release
	}
	// hit-300 and leader-1200 weigh the same; hit-300 arrived later.
	if want := "leader-1200 hit-300 cold-2000"; strings.Join(order, " ") != want {
		t.Fatalf("admitted %v, want %s", order, want)
	}
	release()
	release() // once only: the slot count must not go negative
	for _, h := range held {
		h()
	}
	if n := len(pg.eps); n != 0 {
		t.Fatalf("%d endpoint queues left after every request released", n)
	}
}

// A request waits at most the bound, then goes over the budget; the slot
// count stays right, so a later request still finds the endpoint full.
func TestPrefillGateWaitIsBounded(t *testing.T) {
	pg := &prefillGate{slots: 1}
	first, _ := pg.admit(context.Background(), 1, 0, 100, nil, time.Minute, false)
	second, out := pg.admit(context.Background(), 1, 0, 100, nil, 10*time.Millisecond, false)
	if out != admitTimeout {
		t.Fatalf("second request: %s, want timeout", out)
	}
	first()
	got := make(chan admitResult, 1)
	admitAsync(context.Background(), pg, "third", 50, nil, time.Minute, got)
	waitQueued(t, pg, 1) // the over-budget second request still holds the slot
	second()
	if r := <-got; r.out != admitQueued {
		t.Fatalf("third: %s, want queued", r.out)
	} else {
		r.release()
	}
}

// A client that leaves while queued stops counting as load, and a slot
// granted in the same instant is passed on, not lost.
func TestPrefillGateCancelledWaiter(t *testing.T) {
	pg := &prefillGate{slots: 1}
	first, _ := pg.admit(context.Background(), 1, 0, 100, nil, time.Minute, false)
	ctx, cancel := context.WithCancel(context.Background())
	got := make(chan admitResult, 2)
	admitAsync(ctx, pg, "leaves", 10, nil, time.Minute, got)
	waitQueued(t, pg, 1)
	admitAsync(context.Background(), pg, "stays", 500, nil, time.Minute, got)
	waitQueued(t, pg, 2)
	cancel()
	if r := <-got; r.id != "leaves" || r.out != admitCancelled {
		t.Fatalf("%s: %s, want leaves cancelled", r.id, r.out)
	}
	waitQueued(t, pg, 1)
	first()
	if r := <-got; r.id != "stays" || r.out != admitQueued {
		t.Fatalf("%s: %s, want stays queued", r.id, r.out)
	}
}

// Followers released by their coalescing leader take its place at once,
// and with the gate off nothing waits.
func TestPrefillGateInheritAndOff(t *testing.T) {
	pg := &prefillGate{slots: 1}
	first, _ := pg.admit(context.Background(), 1, 0, 100, nil, time.Minute, false)
	if _, out := pg.admit(context.Background(), 1, 0, 100, nil, time.Minute, true); out != admitInherited {
		t.Fatalf("follower: %s, want inherited", out)
	}
	first()
	off := &prefillGate{}
	for range 3 {
		if _, out := off.admit(context.Background(), 1, 0, 100, nil, time.Minute, false); out != admitImmediate {
			t.Fatalf("gate off: %s", out)
		}
	}
	if off.queuedFor(1, 0) != 0 || len(off.eps) != 0 {
		t.Fatal("the gate kept state while off")
	}
}

// Through Pick: with one slot per endpoint, a request routed to an endpoint
// whose slot is taken waits in the gateway, counts as that endpoint's
// load, and is forwarded at the first byte of the request ahead of it.
func TestPickQueuesForPrefillSlot(t *testing.T) {
	f := newFixtureConfig(t, Config{Seed: "1", PrefillSlots: 1, CoalesceWait: -1}, rule(3, ""))
	p1, err := f.g.Pick(context.Background(), req(prompt))
	if err != nil {
		t.Fatal(err)
	}
	first, _ := router.ParseReceipt(p1.Receipt)
	second := pickAsync(context.Background(), f.g, req(prompt))
	waitUntil(t, "the second request to queue", func() bool { return f.g.prefill.queuedFor(1, first.EP) == 1 })
	expectOneWaiting(t, f, first.EP)
	p1.FirstByte()
	r := <-second
	if r.err != nil {
		t.Fatal(r.err)
	}
	if rc, _ := router.ParseReceipt(r.plan.Receipt); rc.EP != first.EP {
		t.Fatalf("queued request went to %d, want %d (its routing decision)", rc.EP, first.EP)
	}
	ep := string(rune('0' + first.EP))
	if v := testutil.ToFloat64(f.g.m.admitted.WithLabelValues("1", ep, string(admitQueued))); v != 1 {
		t.Fatalf("admitted{queued} = %v", v)
	}
	p1.Done(proxy.Result{Endpoint: first.EP, Status: 200})
	r.plan.Done(proxy.Result{Endpoint: first.EP, Status: 200})
	if n := len(f.g.prefill.eps); n != 0 {
		t.Fatalf("%d endpoint queues left after both requests ended", n)
	}

	// A client that leaves while queued gets the client-cancel class.
	p3, _ := f.g.Pick(context.Background(), req(prompt))
	ctx, cancel := context.WithCancel(context.Background())
	fourth := pickAsync(ctx, f.g, req(prompt))
	waitUntil(t, "the fourth request to queue", func() bool { return f.g.prefill.queuedFor(1, first.EP) == 1 })
	cancel()
	if r := <-fourth; !errors.Is(r.err, proxy.ErrClientCanceled) {
		t.Fatalf("err = %v, want ErrClientCanceled", r.err)
	}
	p3.Done(proxy.Result{Endpoint: first.EP, Status: 200})
}
