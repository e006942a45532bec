package gateway

import (
	"context"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Prefill admission: shortest prefill first.
//
// An engine runs a bounded number of sequences and queues the rest first
// come, first served. When a burst of long cold prompts fills an endpoint,
// a request that hits the cache (a chat's next turn, a question on a cached
// system prompt) waits behind all of them although its own prefill takes a
// few milliseconds: one recomputation sets the TTFT of every cached request
// that arrives behind it. With a budget per endpoint (by default the
// engine's concurrent-sequence budget learned by the scraper, budget.go;
// or a fixed PrefillSlots), the gateway forwards at most that many
// requests per endpoint that have not yet returned their first byte, and
// queues the
// rest in the gateway ordered by predicted uncached prompt tokens (known
// from the KV inventory at routing time), shortest first, so cached
// requests overtake cold ones (weighted shortest-processing-time order,
// the policy that minimises mean waiting time). Shortest first alone
// starves the long prompts of a busy endpoint, though: every cached
// request that arrives overtakes them, for up to PrefillQueueWait, and
// round robin, which queues nothing, then has the shorter tail. So a waiting
// request yields at most its own predicted work: once requests admitted
// ahead of it since it arrived add up to its own uncached tokens, or
// number as many as the endpoint's budget (one engine's worth of
// sequences, each held for decode steps its tokens do not show), it goes
// next, oldest such first. Its extra wait is then bounded by about its own
// prefill time or one round of the engine's sequences, while a cold
// prompt still lets a burst of cached turns (each a few blocks) through
// ahead of it, since one cached turn overtakes every cold prompt queued. A request is never queued
// longer than PrefillQueueWait either: then it is forwarded anyway and the
// engine's own queue takes it.
//
// The routing decision is made before queueing, so a queued request keeps
// its cache affinity; queued requests count as their endpoint's load, so
// the router moves new work away from an endpoint whose queue grows.
// Requests released by a coalescing leader (coalesce.go) inherit its slot
// and are not queued again: they compute only their own suffix.

// admitOutcome is how a request passed the prefill gate, the "outcome"
// label of loxilb_kv_prefill_admitted_total.
type admitOutcome string

const (
	admitImmediate admitOutcome = "immediate" // a slot was free
	admitQueued    admitOutcome = "queued"    // waited, then got a slot
	admitTimeout   admitOutcome = "timeout"   // waited PrefillQueueWait, forwarded over the budget
	admitInherited admitOutcome = "inherited" // released by its coalescing leader
	admitCancelled admitOutcome = "cancelled" // the client went away while queued
)

// prefillAuto is prefillGate.slots for budgets learned per endpoint.
const prefillAuto = -1

// prefillGate holds the per-endpoint slot counts and queues.
type prefillGate struct {
	// slots per endpoint: N > 0 fixed, prefillAuto learned from learner
	// (nothing learned: admit at once), 0 off (no state at all).
	slots   int
	learner SlotLearner // nil: nothing is ever learned
	mu      sync.Mutex
	eps     map[heldKey]*slotQueue
	seq     uint64
}

// slotQueue is one endpoint's admission state.
type slotQueue struct {
	busy    int // admitted requests without a first byte yet
	waiting []*waiter
}

type waiter struct {
	uncached   int64
	overtaken  int64 // uncached tokens admitted ahead of it since it queued
	overtakers int   // requests admitted ahead of it since it queued
	seq        uint64
	lead       *leader       // this request's coalescing leadership, if any
	ready      chan struct{} // closed when a slot is handed over
	granted    bool
}

// before orders waiters by weighted shortest prefill first: predicted
// uncached tokens divided by the requests the prefill unblocks (itself and
// the followers coalesced onto it), then arrival. Without the weight a
// long prompt that others wait for would be overtaken by every short one,
// and its followers with it.
func (w *waiter) before(o *waiter) bool {
	a := w.uncached * int64(1+o.lead.followerCount())
	b := o.uncached * int64(1+w.lead.followerCount())
	if a != b {
		return a < b
	}
	return w.seq < o.seq
}

// yielded tells whether w has let its own predicted work, or a whole
// engine's worth of requests (lim, the endpoint's sequence budget), be
// admitted ahead of it: it may be overtaken no more. Tokens alone
// undercount what a request ahead costs: each also holds one of the
// engine's sequences for its decode steps, which its few uncached tokens
// do not show, so a long prompt yielding only by tokens let dozens of
// cached requests by and waited several of its own prefills.
func (w *waiter) yielded(lim int) bool {
	return w.overtaken >= w.uncached || lim > 0 && w.overtakers >= lim
}

// next removes and returns the waiter to admit first: the oldest that has
// yielded (lim: the endpoint's budget), else the first in weighted
// shortest-prefill order. Every earlier arrival it overtakes is charged
// its uncached tokens and one request.
func (q *slotQueue) next(lim int) *waiter {
	best, aged := 0, -1
	for i, w := range q.waiting {
		if i > 0 && w.before(q.waiting[best]) {
			best = i
		}
		if w.yielded(lim) && (aged < 0 || w.seq < q.waiting[aged].seq) {
			aged = i
		}
	}
	if aged >= 0 {
		best = aged
	}
	w := q.waiting[best]
	q.waiting = append(q.waiting[:best], q.waiting[best+1:]...)
	for _, o := range q.waiting {
		if o.seq < w.seq {
			o.overtaken += w.uncached
			o.overtakers++
		}
	}
	return w
}

// remove drops w (it stopped waiting).
func (q *slotQueue) remove(w *waiter) {
	for i, x := range q.waiting {
		if x == w {
			q.waiting = append(q.waiting[:i], q.waiting[i+1:]...)
			return
		}
	}
}

// on tells whether requests go through the gate.
func (pg *prefillGate) on() bool { return pg.slots != 0 }

// budget returns ep's slot budget and its source; 0 slots admit at once.
func (pg *prefillGate) budget(service uint32, ep int) (int, string) {
	switch {
	case pg.slots > 0:
		return pg.slots, BudgetConfigured
	case pg.slots == 0:
		return 0, BudgetOff
	case pg.learner == nil:
		return 0, BudgetNone
	}
	n, src, ok := pg.learner.LearnedSlots(service, ep)
	if !ok || n <= 0 {
		return 0, BudgetNone
	}
	return n, src
}

// queues tells whether requests to the service's endpoints (0..n-1) may
// wait in the gateway: a fixed budget, or a learned one for at least one
// endpoint. The router then prices load shortest-first (a request waits
// only behind shorter work), first come, first served otherwise.
func (pg *prefillGate) queues(service uint32, n int) bool {
	if pg.slots >= 0 {
		return pg.slots > 0
	}
	for ep := range n {
		if lim, _ := pg.budget(service, ep); lim > 0 {
			return true
		}
	}
	return false
}

// free tells whether one more request fits a budget of lim slots.
func (q *slotQueue) free(lim int) bool { return lim <= 0 || q.busy < lim }

func (pg *prefillGate) queue(k heldKey) *slotQueue {
	if pg.eps == nil {
		pg.eps = make(map[heldKey]*slotQueue)
	}
	q := pg.eps[k]
	if q == nil {
		q = &slotQueue{}
		pg.eps[k] = q
	}
	return q
}

// admit takes a prefill slot on (service, ep) for a request that will
// compute uncached prompt tokens, waiting at most maxWait for one. inherit
// admits at once (a coalesced follower). The returned release gives the
// slot back (call it at the first byte or at the end; more calls do
// nothing); it is a no-op when the gate is off or the client left. While
// an endpoint has no budget (auto, nothing learned yet) every request is
// admitted at once but still counted, so the count is right when a budget
// arrives.
func (pg *prefillGate) admit(ctx context.Context, service uint32, ep int, uncached int64, lead *leader, maxWait time.Duration, inherit bool) (func(), admitOutcome) {
	if !pg.on() {
		return func() {}, admitImmediate
	}
	lim, _ := pg.budget(service, ep)
	k := heldKey{service, ep}
	pg.mu.Lock()
	q := pg.queue(k)
	if inherit || q.free(lim) {
		q.busy++
		pg.mu.Unlock()
		if inherit {
			return pg.releaser(k), admitInherited
		}
		return pg.releaser(k), admitImmediate
	}
	pg.seq++
	w := &waiter{uncached: uncached, seq: pg.seq, lead: lead, ready: make(chan struct{})}
	q.waiting = append(q.waiting, w)
	pg.mu.Unlock()

	t := time.NewTimer(maxWait)
	defer t.Stop()
	select {
	case <-w.ready:
		return pg.releaser(k), admitQueued
	case <-t.C:
		pg.mu.Lock()
		if !w.granted {
			q.remove(w)
			q.busy++ // forwarded over the budget; its release still counts
		}
		pg.mu.Unlock()
		return pg.releaser(k), admitTimeout
	case <-ctx.Done():
		pg.mu.Lock()
		granted := w.granted
		if !granted {
			q.remove(w)
		}
		pg.mu.Unlock()
		if granted {
			pg.releaser(k)() // hand the slot on
		}
		return func() {}, admitCancelled
	}
}

// releaser returns the once-only function that frees one slot of k and
// hands free slots to the shortest waiting requests.
func (pg *prefillGate) releaser(k heldKey) func() {
	var once sync.Once
	return func() {
		once.Do(func() {
			lim, _ := pg.budget(k.service, k.ep)
			pg.mu.Lock()
			defer pg.mu.Unlock()
			q := pg.eps[k]
			if q == nil {
				return
			}
			q.busy--
			for q.free(lim) && len(q.waiting) > 0 {
				w := q.next(lim)
				w.granted = true
				q.busy++
				close(w.ready)
			}
			if q.busy <= 0 && len(q.waiting) == 0 {
				delete(pg.eps, k)
			}
		})
	}
}

// queuedFor returns how many requests wait for a slot on ep.
func (pg *prefillGate) queuedFor(service uint32, ep int) int {
	if !pg.on() {
		return 0
	}
	pg.mu.Lock()
	defer pg.mu.Unlock()
	if q := pg.eps[heldKey{service, ep}]; q != nil {
		return len(q.waiting)
	}
	return 0
}

// The gate's live state, read at scrape time.
var (
	prefillDepthDesc = prometheus.NewDesc("loxilb_kv_prefill_queue_depth",
		"Requests waiting in the gateway for a prefill slot on the endpoint (budget: loxilb_kv_prefill_slots).", []string{"service", "ep_idx"}, nil)
	prefillBusyDesc = prometheus.NewDesc("loxilb_kv_prefill_slots_busy",
		"Requests forwarded to the endpoint that have not returned their first byte (may exceed the slots after a queue timeout).", []string{"service", "ep_idx"}, nil)
)

// Describe implements prometheus.Collector.
func (pg *prefillGate) Describe(ch chan<- *prometheus.Desc) {
	ch <- prefillDepthDesc
	ch <- prefillBusyDesc
}

// Collect implements prometheus.Collector: one sample per endpoint with
// requests admitted or waiting.
func (pg *prefillGate) Collect(ch chan<- prometheus.Metric) {
	pg.mu.Lock()
	defer pg.mu.Unlock()
	for k, q := range pg.eps {
		svc, ep := strconv.FormatUint(uint64(k.service), 10), strconv.Itoa(k.ep)
		ch <- prometheus.MustNewConstMetric(prefillDepthDesc, prometheus.GaugeValue, float64(len(q.waiting)), svc, ep)
		ch <- prometheus.MustNewConstMetric(prefillBusyDesc, prometheus.GaugeValue, float64(q.busy), svc, ep)
	}
}
