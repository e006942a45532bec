package gateway

import (
	"sync"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/engine"
)

// rankPlacedCap bounds the placement entries remembered per endpoint (two
// per request): at the speculative TTL (5s) it covers ~50 requests a
// second on one endpoint, far more than one engine prefills.
const rankPlacedCap = 512

// rankLoad is the gateway's per-(endpoint, data-parallel rank) load: the
// requests it has sent to each rank and not yet seen end, and the
// requests it has placed on each rank recently, remembered by two block
// keys of the part of their prompt no rank held (the middle one and the
// last one). The rank choice reads both: a request goes to the rank with
// the fewest requests in flight (then the fewest recent placements),
// unless it shares most of its uncached part with a request placed a
// moment ago, which it then follows to its rank even before the engine's
// events say the rank holds it (siblings of one new prompt, a session's
// next turn whose previous turn's events lag). Sharing only a prefix that
// is short against the request's own text (a system prompt before a
// long conversation or document) does not make it follow.
type rankLoad struct {
	mu sync.Mutex
	m  map[heldKey]*rankCounts
}

// rankCounts is one endpoint's bookkeeping. A release subtracts from the
// counts it added to, so the releases of a removed rule's requests cannot
// touch the counts of a later rule with the same number.
type rankCounts struct {
	inflight [engine.MaxDPRanks]int32
	// placed is a ring of recent placements; byKey indexes it by key
	// (the slot of the key's newest placement).
	placed [rankPlacedCap]placement
	next   int
	byKey  map[uint64]int
}

type placement struct {
	key  uint64
	rank int8
	last bool  // the request's last block: one per request, counted as a placement
	at   int64 // unix nanoseconds; 0: empty slot
}

// RankLoad is one data-parallel rank's load as the gateway sees it.
type RankLoad struct {
	Rank int `json:"rank"`
	// InFlight is the requests the gateway sent to the rank and has not
	// seen end.
	InFlight int `json:"in_flight"`
	// Placed is the requests sent to the rank within the speculative
	// TTL.
	Placed int `json:"placed_recently"`
	// Running and Waiting are the engine's own per-rank gauges as last
	// scraped; -1 when the engine publishes none per rank.
	Running int `json:"running"`
	Waiting int `json:"waiting"`
}

// rankSnapshot is what chooseRank reads of one endpoint: per rank, the
// load that orders new prefixes, and the rank a recently placed key went
// to.
type rankSnapshot struct {
	load   [engine.MaxDPRanks]int
	placed [engine.MaxDPRanks]int
	rl     *rankLoad
	c      *rankCounts // nil: nothing placed on the endpoint yet
	cutoff int64       // placements at or before this are too old
	// seedLoss is the most cached blocks a rank seed may throw away
	// (rankseed.go); 0: no seeding.
	seedLoss int
	seeded   bool // chooseRank seeded a cold rank
}

// follow returns the rank a block of keys was placed on within the TTL
// and that block's index p; ok is false when none.
//
// It looks for keys[p], deepest first, for p from len(keys)-1 down to
// from: a placement remembered by one of them had the same prompt up to
// that block, so its rank holds keys[:p+1] once that request is computed.
func (s *rankSnapshot) follow(keys []uint64, from int) (rank, p int, ok bool) {
	if s == nil || s.c == nil {
		return 0, 0, false
	}
	s.rl.mu.Lock()
	defer s.rl.mu.Unlock()
	for p := len(keys) - 1; p >= max(from, 0); p-- {
		if i, ok := s.c.byKey[keys[p]]; ok && s.c.placed[i].at > s.cutoff {
			return int(s.c.placed[i].rank), p, true
		}
	}
	return 0, 0, false
}

// remember writes one placement entry over the ring's oldest.
func (c *rankCounts) remember(key uint64, rank int, last bool, now time.Time) {
	old := c.placed[c.next]
	if old.at != 0 && c.byKey[old.key] == c.next {
		delete(c.byKey, old.key)
	}
	c.placed[c.next] = placement{key: key, rank: int8(rank), last: last, at: now.UnixNano()}
	c.byKey[key] = c.next
	c.next = (c.next + 1) % rankPlacedCap
}

func (rl *rankLoad) counts(service uint32, ep int) *rankCounts {
	k := heldKey{service, ep}
	if rl.m == nil {
		rl.m = make(map[heldKey]*rankCounts)
	}
	c := rl.m[k]
	if c == nil {
		c = &rankCounts{byKey: make(map[uint64]int)}
		rl.m[k] = c
	}
	return c
}

// begin counts a request on rank of ep, remembers that keys (whose first
// best blocks the deepest rank held) were placed there, and returns the
// function that uncounts the request; calling it more than once is
// harmless.
func (rl *rankLoad) begin(service uint32, ep, rank int, keys []uint64, best int, now time.Time) func() {
	if rank < 0 || rank >= engine.MaxDPRanks {
		return func() {}
	}
	rl.mu.Lock()
	c := rl.counts(service, ep)
	c.inflight[rank]++
	if n := len(keys); n > 0 {
		mid := min(max(best, 0)+(n-max(best, 0))/2, n-1)
		if mid < n-1 {
			c.remember(keys[mid], rank, false, now)
		}
		c.remember(keys[n-1], rank, true, now)
	}
	rl.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			rl.mu.Lock()
			c.inflight[rank]--
			rl.mu.Unlock()
		})
	}
}

// snapshot fills s for ranks ranks of ep: per rank, the requests in
// flight (or the engine's scraped running + waiting, when fresh and
// larger: requests other gateways sent) and the placements younger than
// ttl.
func (rl *rankLoad) snapshot(service uint32, ep, ranks int, ttl time.Duration, now time.Time, scraped RankMetrics, s *rankSnapshot) {
	var run, wait [engine.MaxDPRanks]int
	haveEng := scraped != nil && scraped.RankMetrics(service, ep, run[:ranks], wait[:ranks])
	s.rl, s.cutoff = rl, now.Add(-ttl).UnixNano()
	rl.mu.Lock()
	defer rl.mu.Unlock()
	c := rl.m[heldKey{service, ep}]
	s.c = c
	for r := 0; r < ranks; r++ {
		if c != nil {
			s.load[r] = int(max(c.inflight[r], 0))
		}
		if haveEng {
			s.load[r] = max(s.load[r], run[r]+wait[r])
		}
	}
	if c == nil {
		return
	}
	for _, p := range c.placed {
		if p.last && p.at > s.cutoff && int(p.rank) < ranks {
			s.placed[p.rank]++
		}
	}
}

// ranks returns the load of every rank of ep, for the inventory API.
func (rl *rankLoad) ranks(service uint32, ep, ranks int, ttl time.Duration, now time.Time, scraped RankMetrics) []RankLoad {
	var run, wait [engine.MaxDPRanks]int
	haveEng := scraped != nil && scraped.RankMetrics(service, ep, run[:ranks], wait[:ranks])
	var s rankSnapshot
	rl.snapshot(service, ep, ranks, ttl, now, nil, &s)
	out := make([]RankLoad, ranks)
	for r := range out {
		out[r] = RankLoad{Rank: r, InFlight: s.load[r], Placed: s.placed[r], Running: -1, Waiting: -1}
		if haveEng {
			out[r].Running, out[r].Waiting = run[r], wait[r]
		}
	}
	return out
}

// RankLoad returns the load of every data-parallel rank of endpoint ep of
// the rule with id service, nil unless the rule's requests name a rank.
func (g *Gateway) RankLoad(service uint32, ep int) []RankLoad {
	st := g.lookup(service)
	if st == nil || st.rank == nil || ep < 0 || ep >= len(st.addrs) {
		return nil
	}
	return g.ranks.ranks(service, ep, st.rank.ranks, g.cfg.SpeculativeTTL, time.Now(), g.rankEngine)
}

// forget drops a removed service's counts; releases of its requests still
// in flight then touch counts no one reads.
func (rl *rankLoad) forget(service uint32) {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	for k := range rl.m {
		if k.service == service {
			delete(rl.m, k)
		}
	}
}

// RankMetrics supplies an engine's scraped per-rank load
// (*enginemetrics.Scraper).
// RankMetrics sets running[r] and waiting[r] to rank r's requests and
// reports whether a fresh per-rank sample exists (false leaves both
// untouched); it must be safe for concurrent use, cheap, and not retain
// its arguments.
type RankMetrics interface {
	RankMetrics(service uint32, ep int, running, waiting []int) bool
}
