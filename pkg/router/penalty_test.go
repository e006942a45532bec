package router

import (
	"math/rand/v2"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/selector"
)

// The adaptive penalty prices a request of load at the uncached prefill
// work of the service's typical hit, so overlap and load are compared in
// tokens of prefill.
func TestAdaptivePenaltyDecisions(t *testing.T) {
	chat := chain(1, 104)   // 512-token system prompt + 1152 tokens of new context
	shared := chain(2, 136) // 2048-token system prompt + 128-token question
	for _, c := range []struct {
		name     string
		penalty  int
		warmup   int // hits with this many uncached blocks before the decision
		keys     []uint64
		match    int // blocks cached on endpoint 0
		load0    int // in-flight on endpoint 0; the others are idle
		wantEP   int
		wantWhy  string
		wantPen  float64 // LoadPenalty after the decision
		wantFrom int
	}{
		// First turn of a new conversation, cold router: the 32-block system
		// prompt saves 512 tokens, each queued request costs about 1152.
		{name: "short shared prefix does not pin a new conversation", penalty: LoadPenaltyAdaptive,
			keys: chat, match: 32, load0: 1, wantEP: 1, wantWhy: ReasonLoadBlend, wantPen: 1152, wantFrom: 0},
		// The same request with the former fixed default: 512 tokens
		// outweigh 16 requests, so it queues behind endpoint 0's load.
		{name: "fixed 32 pins it", penalty: 32,
			keys: chat, match: 32, load0: 3, wantEP: 0, wantWhy: ReasonLongestPrefix, wantPen: 32, wantFrom: -1},
		// A group prompt whose hits cost 128 uncached tokens stays on its
		// 2048-token prefix until the warm endpoint is 16 requests busier.
		{name: "long prefix stays under load", penalty: LoadPenaltyAdaptive,
			keys: shared, match: 128, load0: 15, wantEP: 0, wantWhy: ReasonLongestPrefix, wantPen: 128, wantFrom: -1},
		{name: "long prefix moves when the queue outweighs it", penalty: LoadPenaltyAdaptive,
			keys: shared, match: 128, load0: 17, wantEP: 1, wantWhy: ReasonLoadBlend, wantPen: 128, wantFrom: 0},
		// After a run of cheap hits (12 uncached blocks each) a queued
		// request is worth 192 tokens: the 512-token match now outweighs
		// two requests but not three.
		{name: "typical hit sets the price (two requests)", penalty: LoadPenaltyAdaptive, warmup: 12,
			keys: chat, match: 32, load0: 2, wantEP: 0, wantWhy: ReasonLongestPrefix, wantFrom: -1},
		{name: "typical hit sets the price (three requests)", penalty: LoadPenaltyAdaptive, warmup: 12,
			keys: chat, match: 32, load0: 3, wantEP: 1, wantWhy: ReasonLoadBlend, wantFrom: 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			inv := newFakeInv()
			cfg := DefaultConfig()
			cfg.ColdSeedN = 0
			cfg.SpillRelief = boolp(false)
			cfg.LoadPenalty = c.penalty
			r, _ := newRouter(t, cfg, inv)
			if c.warmup > 0 {
				hot := chain(9, 64)
				inv.add(7, 3, hot[:64-c.warmup]...)
				for i := 0; i < 64; i++ {
					r.Decide(mode3, hot, 16, cands(4), rr(t), selector.Request{})
				}
				if got, want := r.LoadPenalty(mode3.ID), float64(c.warmup*16); got != want {
					t.Fatalf("penalty after warm-up %v, want %v", got, want)
				}
			}
			inv.add(7, 0, c.keys[:c.match]...)
			cs := cands(4)
			cs[0].InFlight = c.load0
			d := r.Decide(mode3, c.keys, 16, cs, rr(t), selector.Request{})
			if d.EP != c.wantEP || d.Reason != c.wantWhy || d.From != c.wantFrom {
				t.Fatalf("got %+v, want ep %d reason %s from %d", d, c.wantEP, c.wantWhy, c.wantFrom)
			}
			if c.wantPen != 0 && r.LoadPenalty(mode3.ID) != c.wantPen {
				t.Fatalf("penalty %v, want %v", r.LoadPenalty(mode3.ID), c.wantPen)
			}
		})
	}
}

// The estimate is a median of the hits' uncached work at their warmest
// endpoint: a minority of expensive hits does not drag it up (a mean would
// sit near 700 here), misses routed by the fallback selector and moves away
// from the cache do not feed it.
func TestAdaptivePenaltyEstimate(t *testing.T) {
	q := chain(1, 136)
	inv := newFakeInv()
	inv.add(7, 0, q[:128]...) // a hit costs 8 blocks = 128 tokens at endpoint 0
	inv.add(7, 1, q[:4]...)   // and 132 blocks = 2112 tokens at endpoint 1
	cfg := DefaultConfig()
	cfg.ColdSeedN = 0
	r, _ := newRouter(t, cfg, inv)
	if got := r.LoadPenalty(mode3.ID); got != 0 {
		t.Fatalf("penalty before any request %v, want 0", got)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	for i := 0; i < 400; i++ {
		cs := cands(4)
		keys := q
		if rng.IntN(10) < 3 {
			keys = chain(5, 136) // cached nowhere: the fallback routes it
			inv.add(7, 2, chain(6, 1)...)
		}
		if rng.IntN(4) == 0 {
			cs[0].InFlight = 40 // moved off endpoint 0 by the blend
		}
		r.Decide(mode3, keys, 16, cs, rr(t), selector.Request{})
	}
	if got := r.LoadPenalty(mode3.ID); got != 128 {
		t.Fatalf("penalty %v, want the hits' median 128", got)
	}
	// A workload change is followed within a few dozen requests.
	inv.add(7, 0, chain(7, 96)...)
	long := append(chain(7, 96), chain(8, 40)...) // 40 uncached blocks = 640 tokens
	for i := 0; i < 40; i++ {
		r.Decide(mode3, long, 16, cands(4), rr(t), selector.Request{})
	}
	if got := r.LoadPenalty(mode3.ID); got != 640 {
		t.Fatalf("penalty after the workload changed %v, want 640", got)
	}
	// Fully cached prompts still price load at one block, never zero.
	for i := 0; i < 200; i++ {
		r.Decide(mode3, q[:128], 16, cands(4), rr(t), selector.Request{})
	}
	if got := r.LoadPenalty(mode3.ID); got != 16 {
		t.Fatalf("penalty after full hits %v, want one block (16)", got)
	}
}

// With the gateway admitting shortest prefill first, queued load delays a
// request by at most its own uncached work per queued request: a chat turn
// that would recompute a 1,664-token history elsewhere stays on its warm
// endpoint under load that moves it when the engine serves first come,
// first served.
func TestShortestFirstPricesLoadAtOwnWork(t *testing.T) {
	turn := chain(3, 116) // 104 blocks of history cached, 12 new
	for _, c := range []struct {
		name     string
		sf       bool
		load0    int
		wantEP   int
		wantWhy  string
		wantFrom int
	}{
		// Penalty 1152 (a first turn's uncached work): two requests of
		// load outweigh the 1,664 cached tokens.
		{"fcfs moves it", false, 2, 1, ReasonLoadBlend, 0},
		// Its own 192 uncached tokens per queued request: 1,664 cached
		// tokens outweigh eight requests of load, not nine.
		{"shortest first keeps it", true, 8, 0, ReasonLongestPrefix, -1},
		{"shortest first moves it under more load", true, 9, 1, ReasonLoadBlend, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			inv := newFakeInv()
			cfg := DefaultConfig()
			cfg.ColdSeedN = 0
			cfg.SpillRelief = boolp(false)
			cfg.LoadPenalty = 1152
			r, _ := newRouter(t, cfg, inv)
			inv.add(7, 0, turn[:104]...)
			cs := cands(4)
			cs[0].InFlight = c.load0
			view := mode3
			view.ShortestFirst = c.sf
			d := r.Decide(view, turn, 16, cs, rr(t), selector.Request{})
			if d.EP != c.wantEP || d.Reason != c.wantWhy || d.From != c.wantFrom {
				t.Fatalf("got %+v, want ep %d reason %s from %d", d, c.wantEP, c.wantWhy, c.wantFrom)
			}
		})
	}
}

// Shortest first lets a request overtake queued work, not the requests
// the engine's sequences already run: with the budget known, load up to
// it keeps the full penalty and only the rest is capped at the request's
// own work. A document question with 64 new tokens on a 2-sequence
// engine stays beside one long prefill but leaves two, where the cap on
// all load kept it behind any number of them.
func TestShortestFirstPricesRunningSequencesInFull(t *testing.T) {
	q := chain(5, 104) // 100 blocks cached, 4 new
	for _, c := range []struct {
		name    string
		slots   int
		load0   int
		wantEP  int
		wantWhy string
	}{
		{"budget unknown: capped", 0, 2, 0, ReasonLongestPrefix},
		{"one running beside a free sequence", 2, 1, 0, ReasonLongestPrefix},
		{"both sequences running", 2, 2, 1, ReasonLoadBlend},
		{"a larger budget: running requests keep the full price", 4, 2, 1, ReasonLoadBlend},
	} {
		t.Run(c.name, func(t *testing.T) {
			inv := newFakeInv()
			cfg := DefaultConfig()
			cfg.ColdSeedN = 0
			cfg.SpillRelief = boolp(false)
			cfg.LoadPenalty = 1152
			r, _ := newRouter(t, cfg, inv)
			inv.add(7, 0, q[:100]...)
			cs := cands(4)
			for i := range cs {
				cs[i].Slots = c.slots
			}
			cs[0].InFlight = c.load0
			view := mode3
			view.ShortestFirst = true
			d := r.Decide(view, q, 16, cs, rr(t), selector.Request{})
			if d.EP != c.wantEP || d.Reason != c.wantWhy {
				t.Fatalf("got %+v, want ep %d reason %s", d, c.wantEP, c.wantWhy)
			}
		})
	}
}

// SeedLoss is the median prefix a hit's warmest endpoint holds: nothing
// before the first hit (no seed may throw anything away on a guess), then
// the typical history, which a minority of long ones does not drag up.
func TestSeedLossIsTheMedianCachedPrefix(t *testing.T) {
	inv := newFakeInv()
	cfg := DefaultConfig()
	cfg.ColdSeedN = 0
	r, _ := newRouter(t, cfg, inv)
	if got := r.SeedLoss(mode3.ID); got != 0 {
		t.Fatalf("seed loss %v before any hit", got)
	}
	short, long := chain(3, 40), chain(4, 200)
	inv.add(7, 0, short[:32]...)
	inv.add(7, 1, long[:190]...)
	for i := 0; i < 64; i++ {
		keys := short
		if i%4 == 3 {
			keys = long
		}
		r.Decide(mode3, keys, 16, cands(4), rr(t), selector.Request{})
	}
	if got := r.SeedLoss(mode3.ID); got < 32*16 || got > 32*16*(1+workStep) {
		t.Fatalf("seed loss %v after hits of 32 cached blocks and a quarter of 190, want ~%d", got, 32*16)
	}
	if got := r.SeedLoss(99); got != 0 {
		t.Fatalf("seed loss %v for a service with no hits", got)
	}
}
