package kvindex

import (
	"math/bits"
	"time"
)

// StoreSpeculative records keys at endpoint ep for ttl, before the engine has
// published them: after the router sends a request to ep, sibling requests
// sharing its new prefix should follow it there instead of prefilling the
// same prefix elsewhere. PrefixMatch counts unexpired speculative entries;
// Len, Snapshot and the block gauge do not. A BlockStored for the same key
// at ep replaces the speculative entry; storing it speculatively again
// refreshes its expiry. Keys the endpoint already holds for real are
// skipped. A non-positive ttl stores nothing.
func (ix *Index) StoreSpeculative(service uint32, ep int, keys []uint64, ttl time.Duration) {
	if !ix.validEP(service, ep, 0) || len(keys) == 0 || ttl <= 0 {
		return
	}
	s := ix.writeLocked(service)
	defer s.unlock()
	e := ix.ep(s, ep)
	now := ix.now().UnixNano()
	exp := now + int64(ttl)
	bit := uint64(1) << ep
	if s.specMask == nil {
		s.specMask = make(map[uint64]uint64)
		s.specExp = make(map[specKey]int64)
	}
	swept := false
	for _, k := range keys {
		if s.tab.get(k)&bit != 0 {
			continue
		}
		sk := specKey{key: k, ep: uint8(ep)}
		if s.specMask[k]&bit != 0 {
			s.specExp[sk] = exp
			continue
		}
		if e.specN >= ix.maxSpec && !swept {
			// Reclaim expired entries before refusing new ones.
			s.sweepSpec(now)
			swept = true
		}
		if e.specN >= ix.maxSpec {
			e.specDrops.Inc()
			continue
		}
		s.specMask[k] |= bit
		s.specExp[sk] = exp
		e.specN++
	}
}

// SpeculativeLen is the number of speculative entries endpoint ep holds,
// including expired ones not yet swept.
func (ix *Index) SpeculativeLen(service uint32, ep int) int {
	if ep < 0 || ep >= MaxEndpoints {
		return 0
	}
	s := ix.lookup(service)
	if s == nil {
		return 0
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	if e := s.eps[ep]; e != nil {
		return e.specN
	}
	return 0
}

// liveSpec returns the subset of want whose speculative entry for k has not
// expired at now. s.mu must be held (read is enough).
func (s *service) liveSpec(k uint64, want uint64, now int64) uint64 {
	m := s.specMask[k] & want
	if m == 0 {
		return 0
	}
	var live uint64
	for r := m; r != 0; r &= r - 1 {
		b := bits.TrailingZeros64(r)
		if s.specExp[specKey{key: k, ep: uint8(b)}] > now {
			live |= 1 << b
		}
	}
	return live
}

// dropSpec removes the speculative entry for k at endpoint ep, if any.
// s.mu must be held for writing.
func (s *service) dropSpec(e *endpoint, k uint64, ep int) {
	bit := uint64(1) << ep
	m, ok := s.specMask[k]
	if !ok || m&bit == 0 {
		return
	}
	if m &^= bit; m == 0 {
		delete(s.specMask, k)
	} else {
		s.specMask[k] = m
	}
	delete(s.specExp, specKey{key: k, ep: uint8(ep)})
	e.specN--
}

// sweepSpec removes every speculative entry expired at now.
// s.mu must be held for writing.
func (s *service) sweepSpec(now int64) {
	for sk, exp := range s.specExp {
		if exp > now {
			continue
		}
		if e := s.eps[sk.ep]; e != nil {
			s.dropSpec(e, sk.key, int(sk.ep))
		}
	}
	if len(s.specMask) == 0 && s.specMask != nil {
		// Let the maps' memory go after a burst.
		s.specMask, s.specExp = nil, nil
	}
}
