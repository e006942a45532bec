package router

import (
	"math"
	"sync/atomic"

	"github.com/loxilb-llm/loxilb/pkg/selector"
)

// Recompute gates: what moving a request off its cached prefix costs.
//
// Spill relief and cold seeding both send a request away from the
// endpoint holding its prefix, and the target recomputes every token the
// holder had cached. Without a price on that, a session step with a 2k-token
// history left its holder as soon as the holder ran two more requests than
// the fleet mean, or whenever a seed fell due. With the wrong price the
// opposite fault appears: the blend's penalty (the median uncached tokens
// of a hit) is one block for a hot prefix whose requests add a few words
// each, so a recompute gate priced with it kept 32 concurrent requests of
// one prefix on one engine, and a gate that admitted only seeds shorter
// than that penalty never re-warmed a restarted engine.
//
// The gates therefore weigh the two sides in tokens of work at the engine:
//
//   - staying costs the holder's queue: the larger of its outstanding
//     prefill tokens (Candidate.PrefillTokens) and its load (in-flight and
//     gateway-queued requests, or the engine's scraped running + waiting,
//     see selector.Load) priced at the service's median prompt length. A
//     request ahead of us occupies a sequence slot and a share of every
//     step for as long as a whole request runs, prefill and decode, not
//     only for its uncached rest, so a typical request's whole prompt is
//     the price of one, and a hot prefix whose requests each add a few
//     tokens still counts as the load it is;
//   - moving costs the target's queue, priced alike, plus the tokens the
//     target would compute that the holder would not.
//
// A spill goes ahead only when moving is cheaper (movePays). A cold seed
// also buys something the comparison does not see, a re-warmed engine, so
// it goes ahead when moving pays or when the tokens it throws away are no
// more than the service's median cached prefix (seedCheap): a due seed
// waits for a request of typical or shorter history, never the long tail
// of a session, and a fleet whose requests all share one prefix still
// seeds its restarted engine.

// streamMedian is a running median estimate of a positive quantity,
// stored as math.Float64bits: each sample moves it by a factor of
// 1+workStep towards itself (Frugal-style), so it follows a change of
// workload within a few dozen samples, costs one compare-and-swap, and a
// minority of outliers cannot drag it the way they drag a mean. 0 until
// the first sample.
type streamMedian struct{ bits atomic.Uint64 }

// observe folds sample x (> 0) into the estimate. A compare-and-swap loop
// rather than a lock: Decide stays lock-free, and a retry only happens
// when two decisions of one service race.
func (m *streamMedian) observe(x float64) {
	for {
		old := m.bits.Load()
		w := math.Float64frombits(old)
		switch {
		case w == 0:
			w = x
		case x > w:
			w = min(w*(1+workStep), x)
		case x < w:
			w = max(w/(1+workStep), x)
		}
		if m.bits.CompareAndSwap(old, math.Float64bits(w)) {
			return
		}
	}
}

// value returns the estimate, or def before the first sample.
func (m *streamMedian) value(def float64) float64 {
	if w := math.Float64frombits(m.bits.Load()); w > 0 {
		return w
	}
	return def
}

// moveCost prices one decision's candidates for the recompute gates.
type moveCost struct {
	s         *scratch
	cands     []selector.Candidate
	total     int     // request blocks
	blockSize int     // tokens per block
	perLoad   float64 // tokens one request of load costs: the median prompt
}

// newMoveCost prices load at the service's median prompt length (this
// request's before the first sample).
func newMoveCost(st *serviceState, s *scratch, cands []selector.Candidate, total, blockSize int) moveCost {
	own := float64(total * blockSize)
	return moveCost{s: s, cands: cands, total: total, blockSize: blockSize, perLoad: st.prompt.value(own)}
}

// wait is the queue ahead of a newcomer at scratch position i, in tokens.
func (c moveCost) wait(i int) float64 {
	return max(float64(c.cands[c.s.pos[i]].PrefillTokens), c.perLoad*c.s.load[i])
}

// own is the prefill the request itself needs at position i, in tokens:
// its uncached blocks, at least one (the last token is always computed).
func (c moveCost) own(i int) float64 {
	return max(float64(c.total)-c.s.eff[i], 1) * float64(c.blockSize)
}

// movePays reports whether moving from position from to position to
// costs less than staying.
func (c moveCost) movePays(from, to int) bool {
	return from == to || c.wait(to)+c.own(to) < c.wait(from)+c.own(from)
}

// seedCheap reports whether a cold seed from position from to position to
// throws away no more cached tokens than the service's median cached
// prefix (a hit's; this one's before the first sample).
func (c moveCost) seedCheap(st *serviceState, from, to int) bool {
	lost := (c.s.eff[from] - c.s.eff[to]) * float64(c.blockSize)
	return lost <= st.cached.value(lost)
}

// observe records a Tier-1.5 hit's prompt length and the prefix its
// warmest endpoint holds, in tokens, for the gates' medians.
func (st *serviceState) observeHit(total, warmMatch, blockSize int) {
	st.prompt.observe(float64(max(total*blockSize, 1)))
	st.cached.observe(float64(max(warmMatch*blockSize, 1)))
}

// SeedLoss is the most cached tokens a move that seeds a cold place may
// throw away for service: the median prefix a hit's warmest endpoint
// holds (0 before the first hit, when nothing is known to be typical, and
// for a service the router has not seen, whose state it does not create).
// The gateway prices a data-parallel rank seed with it as seedCheap
// prices an endpoint seed, so the two levels agree on what a long
// history is.
func (r *Router) SeedLoss(service uint32) float64 {
	r.mu.RLock()
	st := r.services[service]
	r.mu.RUnlock()
	if st == nil {
		return 0
	}
	return st.cached.value(0)
}
