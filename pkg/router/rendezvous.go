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
// hashing (selector.Rendezvous) gives every node the same answer without
// talking: each eligible endpoint gets the weight mix(key, endpoint) and
// the heaviest wins. Taking an endpoint out moves only the keys it won;
// adding one moves to it only the keys it now wins.

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

// rendezvousPlace chooses, for a cold prefix keyed by key, among the
// healthy candidates that are eligible: their outstanding prefill work is
// within slack tokens of the least (slack is the request's own uncached
// prompt, so it never waits behind more than one more of itself), and
// their load is within the bounded-load limits of spill relief (below
// SpillMinLoad, or load+1 at most ceil(MeanLoadFactor/100·(L+1)/n)). The
// heaviest rendezvous weight among them wins. ok is false when no
// candidate is eligible (the caller then places by least work).
func (r *Router) rendezvousPlace(cands []selector.Candidate, key uint64, slack int64) (int, float64, bool) {
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
	ep, ok := selector.Rendezvous(key, cands, func(c *selector.Candidate) bool {
		if max(c.PrefillTokens, 0) > minWork+max(slack, 0) {
			return false
		}
		l := selector.Load(*c, r.cfg.LoadWeights)
		return l < float64(r.cfg.SpillMinLoad) || l+1 <= capLoad
	})
	if !ok {
		return -1, 0, false
	}
	for i := range cands {
		if cands[i].Idx == ep {
			return ep, selector.Load(cands[i], r.cfg.LoadWeights), true
		}
	}
	return -1, 0, false
}
