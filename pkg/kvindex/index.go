package kvindex

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/engine"
)

const (
	// MaxEndpoints bounds endpoint indices (0..MaxEndpoints-1) per service.
	// Rules hold at most 32 endpoints; one 64-bit membership mask per block
	// is what lets a prefix query test every candidate with one probe.
	MaxEndpoints = 64
	// MaxRanks bounds data-parallel ranks (0..MaxRanks-1) per endpoint:
	// the rule limit on kvDpRankCount.
	MaxRanks = engine.MaxDPRanks

	// DefaultMaxBlocksPerEndpoint is the default inventory cap.
	DefaultMaxBlocksPerEndpoint = 1_000_000
	// DefaultMaxSpeculativePerEndpoint is the default cap on live
	// speculative entries per endpoint.
	DefaultMaxSpeculativePerEndpoint = 65536
	// DefaultSweepInterval is how often Run removes expired speculative
	// entries.
	DefaultSweepInterval = time.Second
)

// A rank set is a uint8 bitmask; this fails to compile if the rank limit
// outgrows it.
const _ = uint8(1 << (MaxRanks - 1))

// ErrBadConfig is returned by New for an invalid Config.
var ErrBadConfig = errors.New("invalid kv index config")

// Config sizes an Index.
type Config struct {
	// MaxBlocksPerEndpoint caps each endpoint's inventory; 0 means
	// DefaultMaxBlocksPerEndpoint. Beyond it, the oldest-inserted blocks
	// are evicted and counted.
	MaxBlocksPerEndpoint int
	// MaxSpeculativePerEndpoint caps live speculative entries per endpoint;
	// 0 means DefaultMaxSpeculativePerEndpoint. Beyond it new speculative
	// entries are dropped and counted.
	MaxSpeculativePerEndpoint int
	// SweepInterval is the period of Run's expiry sweep; 0 means
	// DefaultSweepInterval.
	SweepInterval time.Duration
	// Now is the clock for speculative expiry; nil means time.Now. Tests
	// inject a fake clock.
	Now func() time.Time
}

// Index holds the block inventories of every (service, endpoint).
// All methods are safe for concurrent use. Writers to one service are
// serialised by that service's lock; readers (PrefixMatch, Len, Snapshot)
// share it, so queries never wait on another service's writers.
type Index struct {
	maxBlocks int
	maxSpec   int
	sweep     time.Duration
	now       func() time.Time
	m         *metrics

	mu       sync.RWMutex
	services map[uint32]*service
}

// service is one rule's inventories. tab maps each block key held anywhere
// in the service to the bitmask of endpoints holding it, so PrefixMatch
// costs one probe per request block for all candidates together.
type service struct {
	id    uint32
	label string

	// wmu serialises the service's writers and guards what only writers
	// read (endpoint insertion orders); mu, taken after it, guards what
	// queries read (the block table, counts, rank tables, speculative
	// entries). A writer does its allocations, copies and compactions
	// holding wmu alone and takes mu only to change what queries read,
	// so a query never waits for more than a bounded step of work.
	wmu     sync.Mutex
	mu      sync.RWMutex // write side through lockQ/unlockQ
	ls      lockStat     // hold times of mu, only in kvindex_lockstat builds
	dropped bool         // set holding both
	tab     gtable
	eps     [MaxEndpoints]*endpoint

	// Speculative entries: specMask[k] = endpoints with a speculative k
	// (live or not yet swept); specExp[{k,ep}] = expiry in UnixNano.
	specMask map[uint64]uint64
	specExp  map[specKey]int64

	// tier records CPU copies; empty until the first CPU store.
	tier tiers
}

type specKey struct {
	key uint64
	ep  uint8
}

// endpoint is the per-endpoint bookkeeping: real block count, insertion
// order for eviction, and rank masks when more than rank 0 publishes.
type endpoint struct {
	label string
	n     int

	// order lists keys in insertion order from order[head:]. It may hold
	// stale elements (keys removed since, or older copies of keys stored
	// again); every present key has at least one element. The number of
	// stale elements is len(order)-head-n, and compaction keeps it below
	// about n/2.
	order []uint64
	head  int

	// ranks maps a key to its rank bitmask when that mask is not exactly
	// {rank 0}. Single-rank engines never allocate it: a present key with
	// no entry is held by rank 0 only. Queries read it under mu, so it is
	// grown and shrunk by building a copy and swapping the pointer.
	ranks *table[uint8]

	specN int

	blocks    prometheus.Gauge
	evictions prometheus.Counter
	specDrops prometheus.Counter
}

// New returns an empty Index, registering its metrics on reg (nil: no
// registration).
func New(cfg Config, reg prometheus.Registerer) (*Index, error) {
	if cfg.MaxBlocksPerEndpoint < 0 {
		return nil, fmt.Errorf("%w: MaxBlocksPerEndpoint %d is negative", ErrBadConfig, cfg.MaxBlocksPerEndpoint)
	}
	if cfg.MaxSpeculativePerEndpoint < 0 {
		return nil, fmt.Errorf("%w: MaxSpeculativePerEndpoint %d is negative", ErrBadConfig, cfg.MaxSpeculativePerEndpoint)
	}
	if cfg.SweepInterval < 0 {
		return nil, fmt.Errorf("%w: SweepInterval %s is negative", ErrBadConfig, cfg.SweepInterval)
	}
	ix := &Index{
		maxBlocks: cfg.MaxBlocksPerEndpoint,
		maxSpec:   cfg.MaxSpeculativePerEndpoint,
		sweep:     cfg.SweepInterval,
		now:       cfg.Now,
		services:  make(map[uint32]*service),
	}
	if ix.maxBlocks == 0 {
		ix.maxBlocks = DefaultMaxBlocksPerEndpoint
	}
	if ix.maxSpec == 0 {
		ix.maxSpec = DefaultMaxSpeculativePerEndpoint
	}
	if ix.sweep == 0 {
		ix.sweep = DefaultSweepInterval
	}
	if ix.now == nil {
		ix.now = time.Now
	}
	m, err := newMetrics(reg)
	if err != nil {
		return nil, err
	}
	ix.m = m
	return ix, nil
}

// MaxBlocksPerEndpoint is the effective per-endpoint cap.
func (ix *Index) MaxBlocksPerEndpoint() int { return ix.maxBlocks }

func (ix *Index) lookup(id uint32) *service {
	ix.mu.RLock()
	s := ix.services[id]
	ix.mu.RUnlock()
	return s
}

// writerLocked returns the service with its writer lock (wmu) held,
// creating it if needed. A service dropped between lookup and lock is
// looked up again, so a write racing DropService lands in the new
// incarnation or nowhere.
func (ix *Index) writerLocked(id uint32) *service {
	for {
		s := ix.lookup(id)
		if s == nil {
			ix.mu.Lock()
			s = ix.services[id]
			if s == nil {
				s = &service{id: id, label: strconv.FormatUint(uint64(id), 10)}
				ix.services[id] = s
			}
			ix.mu.Unlock()
		}
		s.wmu.Lock()
		if !s.dropped {
			return s
		}
		s.wmu.Unlock()
	}
}

// writeLocked is writerLocked that also takes the query lock; release
// with unlock.
func (ix *Index) writeLocked(id uint32) *service {
	s := ix.writerLocked(id)
	s.lockQ()
	return s
}

// lockExisting takes both locks of an existing, not dropped service, or
// returns nil.
func (ix *Index) lockExisting(id uint32) *service {
	s := ix.lookup(id)
	if s == nil {
		return nil
	}
	s.wmu.Lock()
	if s.dropped {
		s.wmu.Unlock()
		return nil
	}
	s.lockQ()
	return s
}

func (s *service) unlock() {
	s.unlockQ()
	s.wmu.Unlock()
}

// resizeTable moves a large table to the size it wants: the new arrays are
// allocated (and zeroed) holding wmu only, then installed under mu. The
// entries follow in bounded steps with later writes (migrateStep) and the
// periodic sweep. s.wmu must be held and s.mu not.
func (s *service) resizeTable(nkeys int) {
	n := s.tab.wantSlots(nkeys)
	if n == 0 {
		return
	}
	keys, vals := make([]uint64, n), make([]uint64, n)
	// Memory fresh from the OS is mapped on first touch, which would
	// otherwise happen under the lock as entries move.
	prefault(keys)
	prefault(vals)
	s.lockQ()
	s.tab.install(keys, vals)
	s.unlockQ()
}

// migrateStep moves part of the previous table along with a write of
// nkeys keys: two entries per key (so a table replaced at 4/5 load has
// moved everything before the new one is 3/5 full) and at least 64. s.mu
// must be held.
func (s *service) migrateStep(nkeys int) {
	if s.tab.moving() {
		m := max(2*nkeys, 64)
		s.tab.migrate(m, 16*m)
	}
}

// reserve makes room, holding wmu only, for nkeys more keys in e's
// insertion order and (for ranks other than 0, or once it exists) its
// rank table, so the write under mu never copies or rehashes them. Queries
// read rank tables (RankPrefixMatch), so a rank table is never grown in
// place: reserve returns the larger copy (nil when e.ranks has room) for
// the caller to install as e.ranks under mu.
func (e *endpoint) reserve(nkeys, rank int) *table[uint8] {
	if free := cap(e.order) - len(e.order); free < nkeys {
		live := e.order[e.head:]
		grown := make([]uint64, max(2*len(live), len(live)+nkeys, 1024))
		// Touching the spare capacity faults its pages in here rather
		// than under the query lock as keys are appended.
		prefault(grown[len(live):])
		copy(grown, live)
		e.order, e.head = grown[:len(live)], 0
	}
	switch r := e.ranks; {
	case r == nil && rank != 0:
		return (&table[uint8]{}).resized(slotsFor(nkeys))
	case r != nil && (r.n+nkeys)*5 > len(r.keys)*4:
		return r.resized(slotsFor(2 * (r.n + nkeys)))
	}
	return nil
}

// validEP reports whether ep and rank are in range, counting a rejection
// otherwise: an out-of-range index is a caller bug or a misconfigured rule,
// and must be visible rather than silently ignored.
func (ix *Index) validEP(service uint32, ep, rank int) bool {
	if ep < 0 || ep >= MaxEndpoints {
		ix.m.rejected.WithLabelValues(strconv.FormatUint(uint64(service), 10), "ep_out_of_range").Inc()
		return false
	}
	if rank < 0 || rank >= MaxRanks {
		ix.m.rejected.WithLabelValues(strconv.FormatUint(uint64(service), 10), "rank_out_of_range").Inc()
		return false
	}
	return true
}

// ep returns endpoint i of s, creating it (and its metric series) if needed.
// s.mu must be held for writing.
func (ix *Index) ep(s *service, i int) *endpoint {
	e := s.eps[i]
	if e == nil {
		e = &endpoint{label: strconv.Itoa(i)}
		e.blocks = ix.m.blocks.WithLabelValues(s.label, e.label)
		e.evictions = ix.m.evictions.WithLabelValues(s.label, e.label)
		e.specDrops = ix.m.specDrops.WithLabelValues(s.label, e.label)
		s.eps[i] = e
	}
	return e
}

// rankMask is the rank set holding k at e; k must be present at e.
func (e *endpoint) rankMask(k uint64) uint8 {
	if e.ranks != nil {
		if m := e.ranks.get(k); m != 0 {
			return m
		}
	}
	return 1
}

func (e *endpoint) setRankMask(k uint64, m uint8) {
	if m == 1 {
		if e.ranks != nil {
			e.ranks.del(k)
		}
		return
	}
	if e.ranks == nil {
		t := newTable[uint8](0)
		e.ranks = &t
	}
	e.ranks.put(k, m)
}

// Store records that rank of endpoint ep in service holds keys (a
// BlockStored event). Keys already present gain the rank; new keys are
// appended to the eviction order; a real entry replaces a speculative one.
// When the endpoint exceeds its cap, its oldest-inserted blocks are evicted
// and counted.
func (ix *Index) Store(service uint32, ep int, rank int, keys []uint64) {
	ix.StoreTier(service, ep, rank, TierGPU, keys)
}

// StoreTier is Store for copies on tier. A CPU copy of a key the endpoint
// holds on GPU only adds the CPU record (the block stays GPU-resident for
// routing); a GPU copy of a CPU-only key makes it GPU-resident.
func (ix *Index) StoreTier(service uint32, ep int, rank int, tier Tier, keys []uint64) {
	if !ix.validEP(service, ep, rank) {
		return
	}
	for len(keys) > 0 {
		n := min(len(keys), writeChunk)
		ix.store(service, ep, rank, tier, keys[:n])
		keys = keys[n:]
	}
}

// writeChunk bounds how many keys one write applies under the query lock,
// so a huge event does not stall prefix queries for long: 128 keys and the
// 256 table entries moved with them are some 400 random memory accesses,
// about 0.1 ms on a virtual machine (1024-key chunks held the lock for
// 0.4 ms at the median and over 1 ms at p99.9). Readers may see a prefix
// of a large batch, which is as valid as any moment between events.
const writeChunk = 128

func (ix *Index) store(service uint32, ep int, rank int, tier Tier, keys []uint64) {
	s := ix.writerLocked(service)
	defer s.wmu.Unlock()
	e := s.eps[ep]
	if e == nil {
		s.lockQ()
		e = ix.ep(s, ep)
		s.unlockQ()
	}
	s.resizeTable(len(keys))
	ranks := e.reserve(len(keys), rank)
	cpuT, cpuOnlyT := s.reserveTiers(len(keys), tier == TierCPU)
	s.lockQ()
	if ranks != nil {
		e.ranks = ranks
	}
	s.installTiers(cpuT, cpuOnlyT)
	s.migrateStep(len(keys))
	bit := uint64(1) << ep
	rbit := uint8(1) << rank
	for _, k := range keys {
		if tier == TierCPU {
			present := s.tab.get(k)&bit != 0
			if !present || s.cpuOnlyAt(k, bit) {
				s.tier.cpuOnly.put(k, s.tier.cpuOnly.get(k)|bit)
			}
			s.tier.cpu.put(k, s.tier.cpu.get(k)|bit)
			if present {
				continue
			}
		} else if s.cpuOnlyAt(k, bit) {
			setMask(s.tier.cpuOnly, k, s.tier.cpuOnly.get(k)&^bit)
		}
		if i := s.tab.find(k); i >= 0 {
			if s.tab.vals[i]&bit != 0 {
				if rank != 0 || e.ranks != nil {
					e.setRankMask(k, e.rankMask(k)|rbit)
				}
				if s.specMask != nil {
					s.dropSpec(e, k, ep)
				}
				continue
			}
			s.tab.vals[i] |= bit
		} else {
			s.tab.put(k, bit)
		}
		if rank != 0 {
			e.setRankMask(k, rbit)
		}
		e.order = append(e.order, k)
		e.n++
		if s.specMask != nil {
			s.dropSpec(e, k, ep)
		}
	}
	for e.n > ix.maxBlocks && ix.evictOldest(s, e, ep) {
	}
	n := e.n
	s.unlockQ()
	s.compact(e, ep)
	e.blocks.Set(float64(n))
}

// evictOldest removes the oldest-inserted block of e from every rank. It
// reports false only if the order is exhausted, which the order invariant
// rules out; the caller stops rather than spin.
func (ix *Index) evictOldest(s *service, e *endpoint, ep int) bool {
	bit := uint64(1) << ep
	for e.head < len(e.order) {
		k := e.order[e.head]
		e.head++
		if i := s.tab.find(k); i >= 0 && s.tab.vals[i]&bit != 0 {
			s.removeAt(e, i, k, bit)
			e.evictions.Inc()
			return true
		}
	}
	return false
}

// removeAt drops key k (at slot i of s.tab) from endpoint e entirely.
func (s *service) removeAt(e *endpoint, i int, k uint64, bit uint64) {
	if v := s.tab.vals[i] &^ bit; v != 0 {
		s.tab.vals[i] = v
	} else {
		s.tab.delAt(i)
	}
	if e.ranks != nil {
		e.ranks.del(k)
	}
	s.dropTiers(k, bit)
	e.n--
}

// compact bounds the stale part of e's insertion order: it drops the
// consumed prefix and, when stale elements exceed about half the live count,
// rebuilds the order keeping the newest element of every present key. It
// touches only writer state: s.wmu must be held, s.mu need not be.
func (s *service) compact(e *endpoint, ep int) {
	if e.n == 0 {
		e.order, e.head = e.order[:0], 0
		if cap(e.order) > 1024 {
			e.order = nil
		}
		return
	}
	// Drop stale keys from the head here, holding wmu only, so the next
	// eviction (under mu) does not have to skip them: after a mass
	// removal of old blocks they could be a third of the order.
	bit := uint64(1) << ep
	for e.head < len(e.order) && s.tab.get(e.order[e.head])&bit == 0 {
		e.head++
	}
	live := len(e.order) - e.head
	stale := live - e.n
	if stale > e.n/2+64 {
		seen := newTable[uint8](e.n)
		out := make([]uint64, e.n, e.n+e.n/4)
		w := e.n
		for i := len(e.order) - 1; i >= e.head && w > 0; i-- {
			k := e.order[i]
			if s.tab.get(k)&bit == 0 || seen.get(k) != 0 {
				continue
			}
			seen.put(k, 1)
			w--
			out[w] = k
		}
		e.order, e.head = out[w:], 0
		return
	}
	if e.head > 1024 && e.head > len(e.order)/2 {
		n := copy(e.order, e.order[e.head:])
		e.order, e.head = e.order[:n], 0
	}
}

// Remove records that rank of endpoint ep no longer holds keys (a
// BlockRemoved event). A key leaves the endpoint when its last rank drops
// it; keys the rank does not hold are ignored.
func (ix *Index) Remove(service uint32, ep int, rank int, keys []uint64) {
	ix.RemoveTier(service, ep, rank, TierGPU, keys)
}

// RemoveTier is Remove for the copies on tier: removing the GPU copy of a
// block that also has a CPU copy leaves it CPU-only (vLLM publishes the
// eviction of each medium separately); removing a copy the endpoint does
// not hold on that tier changes nothing.
func (ix *Index) RemoveTier(service uint32, ep int, rank int, tier Tier, keys []uint64) {
	if !ix.validEP(service, ep, rank) {
		return
	}
	for len(keys) > 0 {
		n := min(len(keys), writeChunk)
		ix.remove(service, ep, rank, tier, keys[:n])
		keys = keys[n:]
	}
}

func (ix *Index) remove(service uint32, ep int, rank int, tier Tier, keys []uint64) {
	s := ix.lookup(service)
	if s == nil {
		return
	}
	s.wmu.Lock()
	defer s.wmu.Unlock()
	e := s.eps[ep]
	if s.dropped || e == nil || e.n == 0 {
		return
	}
	// A GPU removal can turn keys CPU-only: make room first, holding wmu.
	cpuT, cpuOnlyT := s.reserveTiers(len(keys), tier == TierGPU && s.tier.cpu != nil && s.tier.cpu.n > 0)
	s.lockQ()
	s.installTiers(cpuT, cpuOnlyT)
	s.migrateStep(len(keys))
	bit := uint64(1) << ep
	rbit := uint8(1) << rank
	for _, k := range keys {
		i := s.tab.find(k)
		if i < 0 || s.tab.vals[i]&bit == 0 {
			continue
		}
		if tier == TierCPU {
			if !s.hasCPUAt(k, bit) {
				continue
			}
			if s.cpuOnlyAt(k, bit) {
				s.removeAt(e, i, k, bit)
			} else {
				setMask(s.tier.cpu, k, s.tier.cpu.get(k)&^bit)
			}
			continue
		}
		if s.cpuOnlyAt(k, bit) {
			continue // no GPU copy to remove
		}
		m := e.rankMask(k)
		if m&rbit == 0 {
			continue
		}
		if m &^= rbit; m != 0 {
			e.setRankMask(k, m)
			continue
		}
		if s.hasCPUAt(k, bit) {
			// The last GPU copy went; the CPU copy stays.
			e.setRankMask(k, 1)
			s.tier.cpuOnly.put(k, s.tier.cpuOnly.get(k)|bit)
			continue
		}
		s.removeAt(e, i, k, bit)
	}
	s.tab.maybeShrink()
	n := e.n
	s.unlockQ()
	if r := e.ranks; r != nil {
		if slots := r.shrinkSlots(); slots > 0 {
			// Queries read the rank table: shrink a copy, then swap.
			small := r.resized(slots)
			s.lockQ()
			e.ranks = small
			s.unlockQ()
		}
	}
	s.compact(e, ep)
	s.resizeTable(0)
	e.blocks.Set(float64(n))
}

// ClearRank removes every block held only by rank of endpoint ep (an
// AllBlocksCleared event from that rank's publisher). Blocks other ranks
// also hold stay, minus this rank. Speculative entries are kept: they
// describe requests routed to the endpoint, not one rank's cache.
func (ix *Index) ClearRank(service uint32, ep int, rank int) {
	if !ix.validEP(service, ep, rank) {
		return
	}
	s := ix.lockExisting(service)
	if s == nil {
		return
	}
	defer s.wmu.Unlock()
	e := s.eps[ep]
	if e == nil || e.n == 0 {
		s.unlockQ()
		return
	}
	bit := uint64(1) << ep
	rbit := uint8(1) << rank
	if rank != 0 {
		if e.ranks == nil {
			s.unlockQ()
			return // only rank 0 holds anything
		}
		e.ranks.update(func(k uint64, m uint8) uint8 {
			if m&rbit == 0 {
				return m
			}
			m &^= rbit
			if m == 0 {
				// Drop k from the endpoint; s.tab is not being iterated.
				i := s.tab.find(k)
				if i < 0 {
					return 0
				}
				if v := s.tab.vals[i] &^ bit; v != 0 {
					s.tab.vals[i] = v
				} else {
					s.tab.delAt(i)
				}
				s.dropTiers(k, bit)
				e.n--
				return 0
			}
			if m == 1 {
				return 0 // back to the implicit rank-0-only state
			}
			return m
		})
	} else {
		// Walk the endpoint's own insertion order rather than the whole
		// service table: it lists every key the endpoint holds (some twice,
		// which the presence check makes harmless).
		for _, k := range e.order[e.head:] {
			i := s.tab.find(k)
			if i < 0 || s.tab.vals[i]&bit == 0 {
				continue
			}
			m := e.rankMask(k)
			if m&rbit == 0 {
				continue
			}
			if m &^= rbit; m != 0 {
				e.setRankMask(k, m)
				continue
			}
			s.removeAt(e, i, k, bit)
		}
	}
	s.tab.maybeShrink()
	n := e.n
	s.unlockQ()
	s.compact(e, ep)
	s.resizeTable(0)
	e.blocks.Set(float64(n))
}

// ClearEndpoint forgets everything endpoint ep holds, real and speculative
// (a publisher reset: the engine restarted or its sequence went backwards).
func (ix *Index) ClearEndpoint(service uint32, ep int) {
	if !ix.validEP(service, ep, 0) {
		return
	}
	s := ix.lockExisting(service)
	if s == nil {
		return
	}
	defer s.wmu.Unlock()
	e := s.eps[ep]
	if e == nil {
		s.unlockQ()
		return
	}
	bit := uint64(1) << ep
	// As in ClearRank, the endpoint's order lists every key it holds, so
	// the cost is proportional to this endpoint, not to the service.
	for _, k := range e.order[e.head:] {
		if i := s.tab.find(k); i >= 0 && s.tab.vals[i]&bit != 0 {
			if v := s.tab.vals[i] &^ bit; v != 0 {
				s.tab.vals[i] = v
			} else {
				s.tab.delAt(i)
			}
			s.dropTiers(k, bit)
		}
	}
	s.tab.maybeShrink()
	e.n, e.order, e.head, e.ranks = 0, nil, 0, nil
	if e.specN > 0 {
		for k, m := range s.specMask {
			if m&bit != 0 {
				s.dropSpec(e, k, ep)
			}
		}
	}
	s.unlockQ()
	s.resizeTable(0)
	e.blocks.Set(0)
}

// DropService forgets a service (its rule was deleted) and removes its
// metric series.
func (ix *Index) DropService(service uint32) {
	ix.mu.Lock()
	s := ix.services[service]
	delete(ix.services, service)
	ix.mu.Unlock()
	if s == nil {
		return
	}
	s.wmu.Lock()
	s.lockQ()
	defer s.unlock()
	s.dropped = true
	for _, e := range s.eps {
		if e == nil {
			continue
		}
		ix.m.blocks.DeleteLabelValues(s.label, e.label)
		ix.m.evictions.DeleteLabelValues(s.label, e.label)
		ix.m.specDrops.DeleteLabelValues(s.label, e.label)
	}
	for _, reason := range []string{"ep_out_of_range", "rank_out_of_range"} {
		ix.m.rejected.DeleteLabelValues(s.label, reason)
	}
	s.tab, s.eps, s.specMask, s.specExp, s.tier = gtable{}, [MaxEndpoints]*endpoint{}, nil, nil, tiers{}
}

// Len is the number of real blocks endpoint ep holds (speculative entries
// are not counted).
func (ix *Index) Len(service uint32, ep int) int {
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
		return e.n
	}
	return 0
}

// PrefixMatch sets out[i] to the length of the longest prefix keys[0:j] all
// present at endpoint eps[i] (real, or speculative and unexpired). It walks
// keys once for all candidates and stops at the first key no candidate
// holds. Out-of-range endpoints get 0; if out is shorter than eps, only
// the first len(out) candidates are evaluated.
func (ix *Index) PrefixMatch(service uint32, keys []uint64, eps []int, out []int) {
	ix.prefixMatch(service, keys, eps, out, true, nil)
}

// PrefixMatchConfirmed is PrefixMatch over real (event-fed) entries only,
// ignoring speculative ones. The zero-hit watchdog uses it: a match on the
// gateway's own guesses says nothing about hash parity with the engine.
func (ix *Index) PrefixMatchConfirmed(service uint32, keys []uint64, eps []int, out []int) {
	ix.prefixMatch(service, keys, eps, out, false, nil)
}

// prefixMatch is the shared query; cpu, when non-nil, receives the
// CPU-only counts of PrefixMatchTiered and is zeroed by the caller.
func (ix *Index) prefixMatch(service uint32, keys []uint64, eps []int, out []int, withSpec bool, cpu []int) {
	if len(out) < len(eps) {
		eps = eps[:len(out)]
	}
	out = out[:len(eps)]
	for i := range out {
		out[i] = 0
	}
	var alive uint64
	for _, ep := range eps {
		if ep >= 0 && ep < MaxEndpoints {
			alive |= 1 << ep
		}
	}
	if alive == 0 || len(keys) == 0 {
		return
	}
	s := ix.lookup(service)
	if s == nil {
		return
	}
	var depth [MaxEndpoints]int32
	s.mu.RLock()
	hasSpec := withSpec && len(s.specMask) > 0
	var now int64
	if hasSpec {
		now = ix.now().UnixNano()
	}
	cands := alive
	var n int
	if s.tab.moving() {
		n, alive = s.walkMoving(keys, alive, &depth, hasSpec, now)
	} else {
		n, alive = s.walk(keys, alive, &depth, hasSpec, now)
	}
	for alive != 0 {
		b := bits.TrailingZeros64(alive)
		depth[b] = int32(n)
		alive &= alive - 1
	}
	var cpuN [MaxEndpoints]int32
	if cpu != nil {
		s.countCPU(keys, cands, &depth, &cpuN)
	}
	s.mu.RUnlock()
	for i, ep := range eps {
		if ep >= 0 && ep < MaxEndpoints {
			out[i] = int(depth[ep])
			if cpu != nil {
				cpu[i] = int(cpuN[ep])
			}
		}
	}
}

// RankPrefixMatch sets out[r] to the length of the longest prefix
// keys[0:j] that data-parallel rank r of endpoint ep holds, for r below
// len(out) and MaxRanks (the rest of out is set to 0). Only real entries
// count: a speculative entry records where a request was routed, not
// which rank computed it.
func (ix *Index) RankPrefixMatch(service uint32, ep int, keys []uint64, out []int) {
	for i := range out {
		out[i] = 0
	}
	n := min(len(out), MaxRanks)
	if ep < 0 || ep >= MaxEndpoints || n == 0 || len(keys) == 0 {
		return
	}
	s := ix.lookup(service)
	if s == nil {
		return
	}
	alive := uint8(1<<n - 1)
	bit := uint64(1) << ep
	depth := len(keys)
	// Like PrefixMatch this shares only the query lock: writers replace a
	// rank table under it rather than growing it in place, so a
	// rank-targeted request waits for at most one bounded write step,
	// never for a writer's allocations.
	s.mu.RLock()
	e := s.eps[ep]
	if e == nil {
		s.mu.RUnlock()
		return
	}
	for i, k := range keys {
		var m uint8
		if s.tab.get(k)&bit != 0 {
			m = e.rankMask(k)
		}
		if lost := alive &^ m; lost != 0 {
			for r := 0; r < n; r++ {
				if lost&(1<<r) != 0 {
					out[r] = i
				}
			}
			alive &= m
			if alive == 0 {
				break
			}
		}
	}
	s.mu.RUnlock()
	for r := 0; r < n; r++ {
		if alive&(1<<r) != 0 {
			out[r] = depth
		}
	}
}

// walk is prefixMatch's walk over keys: one inlined probe per block. It
// returns the prefix length reached (-1 when every candidate dropped out)
// and the candidates still alive, and records in depth where each
// dropped-out candidate stopped. s.mu must be held for reading.
func (s *service) walk(keys []uint64, alive uint64, depth *[MaxEndpoints]int32, hasSpec bool, now int64) (int, uint64) {
	for i, k := range keys {
		m := s.tab.table.get(k)
		if hasSpec {
			m |= s.liveSpec(k, alive&^m, now)
		}
		if lost := alive &^ m; lost != 0 {
			for lost != 0 {
				b := bits.TrailingZeros64(lost)
				depth[b] = int32(i)
				lost &= lost - 1
			}
			alive &= m
			if alive == 0 {
				return -1, 0
			}
		}
	}
	return len(keys), alive
}

// walkMoving is walk while a table move is under way: a key the current
// table misses may still be in the previous one. It is kept apart so the
// steady-state walk stays as short as it was.
func (s *service) walkMoving(keys []uint64, alive uint64, depth *[MaxEndpoints]int32, hasSpec bool, now int64) (int, uint64) {
	for i, k := range keys {
		m := s.tab.table.get(k)
		if m == 0 {
			m = s.tab.old.get(k)
		}
		if hasSpec {
			m |= s.liveSpec(k, alive&^m, now)
		}
		if lost := alive &^ m; lost != 0 {
			for lost != 0 {
				b := bits.TrailingZeros64(lost)
				depth[b] = int32(i)
				lost &= lost - 1
			}
			alive &= m
			if alive == 0 {
				return -1, 0
			}
		}
	}
	return len(keys), alive
}

// Snapshot returns up to limit of endpoint ep's real block keys (limit <= 0
// means all), oldest inserted first, and the total count.
func (ix *Index) Snapshot(service uint32, ep int, limit int) (blocks []uint64, total int) {
	if ep < 0 || ep >= MaxEndpoints {
		return nil, 0
	}
	s := ix.lookup(service)
	if s == nil {
		return nil, 0
	}
	// The insertion order is writer state: hold the writer lock, which
	// blocks writers of this service but never its queries.
	s.wmu.Lock()
	defer s.wmu.Unlock()
	e := s.eps[ep]
	if e == nil || e.n == 0 {
		return nil, 0
	}
	total = e.n
	if limit <= 0 || limit > total {
		limit = total
	}
	blocks = make([]uint64, 0, limit)
	bit := uint64(1) << ep
	// The order holds every present key at least once; duplicates (keys
	// stored again after a removal) exist only while it has stale elements.
	var seen table[uint8]
	dups := len(e.order)-e.head > e.n
	for _, k := range e.order[e.head:] {
		if s.tab.get(k)&bit == 0 {
			continue
		}
		if dups {
			if seen.get(k) != 0 {
				continue
			}
			seen.put(k, 1)
		}
		blocks = append(blocks, k)
		if len(blocks) == limit {
			break
		}
	}
	return blocks, total
}

// Services lists the service ids with any state, for diagnostics.
func (ix *Index) Services() []uint32 {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	out := make([]uint32, 0, len(ix.services))
	for id := range ix.services {
		out = append(out, id)
	}
	return out
}

// Run sweeps expired speculative entries every SweepInterval until ctx is
// done. Expired entries are already ignored by PrefixMatch; the sweep only
// reclaims their memory and their share of the speculative cap.
func (ix *Index) Run(ctx context.Context) error {
	t := time.NewTicker(ix.sweep)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			ix.Sweep()
		}
	}
}

// sweepMigrateSteps bounds the table-move steps one Sweep makes per
// service (sweepMigrateMoves entries each, the size of a write chunk's
// move step): 256k entries a second at the default interval.
const (
	sweepMigrateSteps = 1024
	sweepMigrateMoves = 256
)

// Sweep removes expired speculative entries now and advances table moves.
func (ix *Index) Sweep() {
	ix.mu.RLock()
	svcs := make([]*service, 0, len(ix.services))
	for _, s := range ix.services {
		svcs = append(svcs, s)
	}
	ix.mu.RUnlock()
	now := ix.now().UnixNano()
	for _, s := range svcs {
		s.wmu.Lock()
		if !s.dropped {
			s.lockQ()
			s.sweepSpec(now)
			s.unlockQ()
			// Finish a table move that writes left half done, in steps
			// as short as a write's, so it does not keep two tables and
			// a slower miss path alive while the service is idle.
			for i := 0; i < sweepMigrateSteps && s.tab.moving(); i++ {
				s.lockQ()
				s.tab.migrate(sweepMigrateMoves, 16*sweepMigrateMoves)
				s.unlockQ()
			}
		}
		s.wmu.Unlock()
	}
}
