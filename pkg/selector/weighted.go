package selector

import (
	"sync"
	"time"
)

// priority (sel 2) is smooth weighted round robin (the nginx algorithm): over
// any window of Σw picks each endpoint receives exactly its weight, spread
// out rather than in bursts. Weight-0 endpoints are backups: they share the
// traffic round-robin only while no positive-weight endpoint is healthy.
type priority struct {
	mu      sync.Mutex
	current map[int]int // endpoint index -> smooth WRR accumulator
	backup  roundRobin
}

func newPriority() *priority { return &priority{current: make(map[int]int)} }

func (s *priority) Pick(req Request, cands []Candidate) (int, bool) {
	s.mu.Lock()
	total, best, bestCur := 0, -1, 0
	for i := range cands {
		c := &cands[i]
		if !c.Healthy || c.Weight <= 0 {
			continue
		}
		cur := s.current[c.Idx] + c.Weight
		s.current[c.Idx] = cur
		total += c.Weight
		if best < 0 || cur > bestCur {
			best, bestCur = c.Idx, cur
		}
	}
	if best >= 0 {
		s.current[best] -= total
		s.mu.Unlock()
		return best, true
	}
	s.mu.Unlock()
	return s.backup.Pick(req, cands)
}

// persist (sel 3) binds a client address to an endpoint until the client has
// been silent for the timeout. The table is bounded: when full, expired
// entries are swept, and if that frees nothing an eighth of the table is
// dropped (those clients are simply re-placed by hash, usually on the same
// endpoint).
type persist struct {
	mu      sync.Mutex
	timeout time.Duration
	max     int
	now     func() time.Time
	table   map[[16]byte]persistEntry
	hash    hashSel
}

type persistEntry struct {
	idx  int
	last time.Time
}

func newPersist(o Options) *persist {
	return &persist{
		timeout: o.PersistTimeout,
		max:     o.PersistMaxClients,
		now:     o.Now,
		table:   make(map[[16]byte]persistEntry),
		hash:    hashSel{fallback: &roundRobin{}},
	}
}

func (s *persist) Pick(req Request, cands []Candidate) (int, bool) {
	if !req.ClientIP.IsValid() {
		return s.hash.Pick(req, cands)
	}
	key := req.ClientIP.Unmap().As16()
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if e, ok := s.table[key]; ok && now.Sub(e.last) < s.timeout {
		for i := range cands {
			if cands[i].Idx == e.idx && cands[i].Healthy {
				s.table[key] = persistEntry{idx: e.idx, last: now}
				return e.idx, true
			}
		}
	}
	// Placement hashes the address only, so a client re-placed after an
	// eviction or timeout usually lands where it was.
	idx, ok := s.hash.Pick(Request{ClientIP: req.ClientIP}, cands)
	if !ok {
		return -1, false
	}
	if _, exists := s.table[key]; !exists && len(s.table) >= s.max {
		s.makeRoom(now)
	}
	s.table[key] = persistEntry{idx: idx, last: now}
	return idx, true
}

func (s *persist) makeRoom(now time.Time) {
	for k, e := range s.table {
		if now.Sub(e.last) >= s.timeout {
			delete(s.table, k)
		}
	}
	if len(s.table) < s.max {
		return
	}
	drop := max(s.max/8, 1)
	for k := range s.table {
		if drop == 0 {
			break
		}
		delete(s.table, k)
		drop--
	}
}

// clients reports the affinity table size (tests).
func (s *persist) clients() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.table)
}
