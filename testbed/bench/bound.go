package bench

import (
	"container/list"
	"sort"
	"time"
)

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
	// TTFTFloorMs is the TTFT every request would see with the fleet-LRU
	// hits and no queueing at all: the modelled prefill of its uncached
	// tokens plus one decode step. No router can beat its percentiles
	// except by LRU artefacts; compulsory misses (first requests of a
	// prefix) set its tail.
	TTFTFloorMs Percentiles `json:"ttft_floor_ms"`
	// TTFTFloorLaterTurnsMs is the same floor over the requests that are
	// not a session's first turn, and LaterTurns their number; nil and 0
	// for workloads without sessions.
	TTFTFloorLaterTurnsMs *Percentiles `json:"ttft_floor_later_turns_ms,omitempty"`
	LaterTurns            int          `json:"later_turns,omitempty"`
}

// UpperBound computes the Bound of a trace for a fleet.
func UpperBound(trace []Req, f FleetConfig) Bound {
	ratio, hits := replayLRU(trace, f.BlockSize, f.TotalBlocks())
	unb, _ := replayLRU(trace, f.BlockSize, 0)
	b := Bound{FleetLRU: ratio, Unbounded: unb, CapacityBlocks: f.TotalBlocks()}
	floor := make([]time.Duration, len(trace))
	var later []time.Duration
	for i, r := range trace {
		us := (f.PrefillUsPerToken*float64(len(r.Tokens)-hits[i]) + f.DecodeUsPerToken) * f.TimeScale
		floor[i] = time.Duration(us * float64(time.Microsecond))
		if r.Turn > 0 {
			later = append(later, floor[i])
		}
	}
	b.TTFTFloorMs = percentiles(floor)
	if len(later) > 0 {
		p := percentiles(later)
		b.TTFTFloorLaterTurnsMs, b.LaterTurns = &p, len(later)
	}
	return b
}

// percentiles sorts v in place and returns its mean, p50, p90 and p99.
func percentiles(v []time.Duration) Percentiles {
	sort.Slice(v, func(i, j int) bool { return v[i] < v[j] })
	p := Percentiles{P50: ms(percentile(v, .5)), P90: ms(percentile(v, .9)), P99: ms(percentile(v, .99))}
	if len(v) > 0 {
		var sum time.Duration
		for _, x := range v {
			sum += x
		}
		p.Mean = ms(sum / time.Duration(len(v)))
	}
	return p
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

// replayLRU returns hit tokens / prompt tokens and each request's hit
// tokens; capacity 0 is unbounded.
func replayLRU(trace []Req, bs, capacity int) (float64, []int) {
	hits := make([]int, len(trace))
	lru := list.New()
	idx := map[uint64]*list.Element{}
	var hit, total int
	for ri, r := range trace {
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
		hits[ri] = n * bs
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
		return 0, hits
	}
	return float64(hit) / float64(total), hits
}
