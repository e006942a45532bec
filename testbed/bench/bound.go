package bench

import "container/list"

// Bound is the offline ceiling on the fleet's cache hit ratio for a trace.
type Bound struct {
	// FleetLRU is the hit ratio of ONE LRU prefix cache holding the whole
	// fleet's capacity (engines x blocks), replaying the trace in nominal
	// order with the engines' rules: full blocks only, longest cached
	// prefix, the last prompt token always recomputed, every full block
	// inserted after the request. No placement of requests on separate
	// engines of the same total size can share more, except through LRU
	// artefacts, so a router is judged against it.
	FleetLRU float64 `json:"fleet_lru"`
	// Unbounded is the same replay with an infinite cache: only first-time
	// (compulsory) misses remain.
	Unbounded float64 `json:"unbounded"`
	// CapacityBlocks is the fleet capacity the LRU bound used.
	CapacityBlocks int `json:"capacity_blocks"`
}

// UpperBound computes the Bound of a trace.
func UpperBound(trace []Req, blockSize, capacityBlocks int) Bound {
	return Bound{
		FleetLRU:       replayLRU(trace, blockSize, capacityBlocks),
		Unbounded:      replayLRU(trace, blockSize, 0),
		CapacityBlocks: capacityBlocks,
	}
}

// blockKeys chains a 64-bit FNV-1a over each full block and its parent, so
// equal keys mean equal prefixes (as the engines' chained block hashes).
func blockKeys(tokens []uint32, bs int) []uint64 {
	n := len(tokens) / bs
	out := make([]uint64, n)
	var parent uint64 = 14695981039346656037
	for b := 0; b < n; b++ {
		h := parent
		for _, t := range tokens[b*bs : (b+1)*bs] {
			for s := 0; s < 32; s += 8 {
				h ^= uint64(byte(t >> s))
				h *= 1099511628211
			}
		}
		out[b] = h
		parent = h
	}
	return out
}

// replayLRU returns hit tokens / prompt tokens; capacity 0 is unbounded.
func replayLRU(trace []Req, bs, capacity int) float64 {
	lru := list.New()
	idx := map[uint64]*list.Element{}
	var hit, total int
	for _, r := range trace {
		keys := blockKeys(r.Tokens, bs)
		limit := (len(r.Tokens) - 1) / bs
		n := 0
		for n < limit && n < len(keys) {
			if _, ok := idx[keys[n]]; !ok {
				break
			}
			n++
		}
		hit += n * bs
		total += len(r.Tokens)
		for _, k := range keys {
			if e, ok := idx[k]; ok {
				lru.MoveToFront(e)
				continue
			}
			idx[k] = lru.PushFront(k)
			if capacity > 0 && lru.Len() > capacity {
				old := lru.Back()
				lru.Remove(old)
				delete(idx, old.Value.(uint64))
			}
		}
	}
	if total == 0 {
		return 0
	}
	return float64(hit) / float64(total)
}
