package router

import (
	"math"

	"github.com/loxilb-llm/loxilb/pkg/selector"
)

// Rendezvous (highest-random-weight) placement of cold prefixes.
//
// Several gateway nodes behind ECMP see the same inventories (each
// subscribes to every engine) but different local state: in-flight
// requests, outstanding prefill work, the speculative entries of what each
// routed itself, the fallback selector's round-robin position. A prefix no
// endpoint holds yet is placed by that local state alone, so siblings of a
// new prefix arriving at different nodes at the same moment land on
// different endpoints, and each one computes the prefix again. Rendezvous
// hashing gives every node the same answer without talking: each eligible
// endpoint gets the weight mix(key, endpoint) and the heaviest wins. Taking
// an endpoint out moves only the keys it won; adding one moves to it only
// the keys it now wins.

// coldKeyTokens is how many tokens past the prefix every candidate holds
// alike key a cold placement: enough to separate prompts that share only
// their first words, short enough that siblings which differ in their last
// question still meet (the gateway keys its hashing selectors the same
// way, routingKeyTokens).
const coldKeyTokens = 64

// coldKey is the rendezvous key of a request whose first common blocks
// every candidate holds alike (0 for a miss): the hash of its block
// ceil(coldKeyTokens/blockSize) past them, or of its last block when it is
// shorter. Block hashes are chained, so this one hash names the whole
// prefix up to it. ok is false when the request has no block to key on.
func coldKey(keys []uint64, common, blockSize int) (uint64, bool) {
	if len(keys) == 0 || blockSize <= 0 {
		return 0, false
	}
	n := (coldKeyTokens + blockSize - 1) / blockSize
	i := min(max(common, 0)+n, len(keys)) - 1
	return keys[i], true
}

// rendezvousWeight is endpoint ep's weight for key: a 64-bit mix of both,
// so that weights of different endpoints for one key, and of one endpoint
// for different keys, are independent.
func rendezvousWeight(key uint64, ep int) uint64 {
	return mix64(key ^ mix64(uint64(ep)+0x9e3779b97f4a7c15))
}

// mix64 is splitmix64's finaliser: a bijection of uint64 whose output bits
// each depend on every input bit.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// Rendezvous returns the position in eps of the endpoint with the highest
// rendezvous weight for key (ties, which need a 64-bit collision, go to
// the lower endpoint index), or -1 when eps is empty. Every caller with the
// same key and the same endpoint set gets the same endpoint, whatever the
// order of eps; removing an endpoint changes the answer only for the keys
// it had.
func Rendezvous(key uint64, eps []int) int {
	best := -1
	var bw uint64
	for i, ep := range eps {
		w := rendezvousWeight(key, ep)
		if best < 0 || w > bw || (w == bw && ep < eps[best]) {
			best, bw = i, w
		}
	}
	return best
}

// rendezvousPlace chooses, for a cold prefix keyed by key, among the
// healthy candidates that are eligible: their outstanding prefill work is
// within slack tokens of the least (slack is the request's own uncached
// prompt, so it never waits behind more than one more of itself), and
// their load is within the bounded-load limits of spill relief (below
// SpillMinLoad, or load+1 at most ceil(MeanLoadFactor/100·(L+1)/n)). The heaviest rendezvous weight among
// them wins. ok is false when no candidate is eligible (the caller then
// places by least work).
func (r *Router) rendezvousPlace(s *scratch, cands []selector.Candidate, key uint64, slack int64) (int, float64, bool) {
	var minWork int64 = -1
	sum, n := 0.0, 0
	for i := range cands {
		if !cands[i].Healthy {
			continue
		}
		if w := max(cands[i].PrefillTokens, 0); minWork < 0 || w < minWork {
			minWork = w
		}
		sum += selector.Load(cands[i], r.cfg.LoadWeights)
		n++
	}
	if n == 0 {
		return -1, 0, false
	}
	capLoad := math.Ceil(float64(r.cfg.MeanLoadFactor) * (sum + 1) / (100 * float64(n)))
	s.tied = s.tied[:0]
	s.rv = s.rv[:0]
	for i := range cands {
		c := &cands[i]
		if !c.Healthy || max(c.PrefillTokens, 0) > minWork+max(slack, 0) {
			continue
		}
		if l := selector.Load(*c, r.cfg.LoadWeights); l >= float64(r.cfg.SpillMinLoad) && l+1 > capLoad {
			continue
		}
		s.tied = append(s.tied, *c)
		s.rv = append(s.rv, c.Idx)
	}
	best := Rendezvous(key, s.rv)
	if best < 0 {
		return -1, 0, false
	}
	return s.tied[best].Idx, selector.Load(s.tied[best], r.cfg.LoadWeights), true
}
