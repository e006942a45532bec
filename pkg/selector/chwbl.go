package selector

import (
	"slices"
	"sort"
	"sync"
	"sync/atomic"
)

// chwbl (sel 8) and its weighted form wrr-hash (sel 10): consistent hashing
// with bounded loads.
//
// The ring holds VirtualNodes points per endpoint (wrr-hash: proportional to
// Weight, VirtualNodes per endpoint of mean weight). It is built over every
// candidate, healthy or not, so a health flap or a load cap only moves the
// keys that would have gone to that endpoint, to the next point clockwise.
//
// Bound: with L requests in flight over n healthy endpoints, an endpoint is
// eligible only while InFlight < cap, where
//
//	chwbl:    cap = ceil(MeanLoadFactor/100 * (L+1) / n)
//	wrr-hash: cap = ceil(MeanLoadFactor/100 * (L+1) * w / Σw)
//
// Some endpoint always satisfies InFlight <= L/n < cap, so the walk ends,
// and no pick ever raises an endpoint above cap.
type chwbl struct {
	factor   int
	vnodes   int
	weighted bool

	ring    atomic.Pointer[ring]
	buildMu sync.Mutex
	rr      roundRobin
}

type ring struct {
	sig    uint64
	n      int
	points []uint64
	owner  []int32 // position in the candidate slice the ring was built for
}

func newCHWBL(o Options, weighted bool) *chwbl {
	return &chwbl{factor: o.MeanLoadFactor, vnodes: o.VirtualNodes, weighted: weighted}
}

// signature identifies the candidate layout a ring was built for: the order
// of endpoint indices and, for wrr-hash, their weights.
func (s *chwbl) signature(cands []Candidate) uint64 {
	h := uint64(len(cands))
	for i := range cands {
		v := uint64(cands[i].Idx)
		if s.weighted {
			v ^= uint64(max(cands[i].Weight, 0)) << 32
		}
		h = mix64(h ^ mix64(v+uint64(i)*0x9e3779b97f4a7c15))
	}
	return h
}

func (s *chwbl) ringFor(cands []Candidate) *ring {
	sig := s.signature(cands)
	if r := s.ring.Load(); r != nil && r.sig == sig && r.n == len(cands) {
		return r
	}
	s.buildMu.Lock()
	defer s.buildMu.Unlock()
	if r := s.ring.Load(); r != nil && r.sig == sig && r.n == len(cands) {
		return r
	}
	r := s.build(cands, sig)
	s.ring.Store(r)
	return r
}

func (s *chwbl) build(cands []Candidate, sig uint64) *ring {
	counts := make([]int, len(cands))
	sumW := 0
	if s.weighted {
		for i := range cands {
			sumW += max(cands[i].Weight, 0)
		}
	}
	total := 0
	for i := range cands {
		switch {
		case !s.weighted || sumW == 0:
			counts[i] = s.vnodes
		case cands[i].Weight > 0:
			// Round to nearest, at least one point per positive weight.
			counts[i] = max(1, (s.vnodes*len(cands)*cands[i].Weight+sumW/2)/sumW)
		}
		total += counts[i]
	}
	type pt struct {
		h   uint64
		pos int32
	}
	pts := make([]pt, 0, total)
	for i := range cands {
		base := mix64(uint64(cands[i].Idx) + 0x51ed27)
		for j := 0; j < counts[i]; j++ {
			pts = append(pts, pt{h: mix64(base ^ mix64(uint64(j)+1)), pos: int32(i)})
		}
	}
	slices.SortFunc(pts, func(a, b pt) int {
		switch {
		case a.h < b.h:
			return -1
		case a.h > b.h:
			return 1
		}
		return int(a.pos - b.pos)
	})
	r := &ring{sig: sig, n: len(cands), points: make([]uint64, len(pts)), owner: make([]int32, len(pts))}
	for i, p := range pts {
		r.points[i], r.owner[i] = p.h, p.pos
	}
	return r
}

// capFor is the in-flight ceiling of one candidate.
func (s *chwbl) capFor(c *Candidate, load, n, sumW int) int {
	if s.weighted && sumW > 0 {
		num := s.factor * (load + 1) * max(c.Weight, 0)
		return (num + 100*sumW - 1) / (100 * sumW)
	}
	return (s.factor*(load+1) + 100*n - 1) / (100 * n)
}

func (s *chwbl) Pick(req Request, cands []Candidate) (int, bool) {
	load, n, sumW := 0, 0, 0
	for i := range cands {
		if cands[i].Healthy {
			load += max(cands[i].InFlight, 0)
			n++
			sumW += max(cands[i].Weight, 0)
		}
	}
	if n == 0 {
		return -1, false
	}
	h, ok := keyHash(req)
	if !ok {
		return s.rr.Pick(req, cands)
	}
	r := s.ringFor(cands)
	if len(r.points) > 0 {
		start := sort.Search(len(r.points), func(i int) bool { return r.points[i] >= h })
		for j := 0; j < len(r.points); j++ {
			c := &cands[r.owner[(start+j)%len(r.points)]]
			if c.Healthy && c.InFlight < s.capFor(c, load, n, sumW) {
				return c.Idx, true
			}
		}
	}
	// Only reachable when no healthy endpoint owns ring points (wrr-hash
	// with all positive weights down): least loaded healthy endpoint.
	best := -1
	for i := range cands {
		if cands[i].Healthy && (best < 0 || cands[i].InFlight < cands[best].InFlight) {
			best = i
		}
	}
	return cands[best].Idx, true
}
