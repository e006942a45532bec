package kvindex

import (
	"context"
	"errors"
	"math/bits"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func newIndex(t testing.TB, cfg Config) (*Index, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	ix, err := New(cfg, reg)
	if err != nil {
		t.Fatal(err)
	}
	return ix, reg
}

func match(ix *Index, svc uint32, keys []uint64, eps ...int) []int {
	out := make([]int, len(eps))
	ix.PrefixMatch(svc, keys, eps, out)
	return out
}

func seq(from, to uint64) []uint64 {
	var out []uint64
	for k := from; k < to; k++ {
		out = append(out, k)
	}
	return out
}

func TestNewValidation(t *testing.T) {
	for _, cfg := range []Config{
		{MaxBlocksPerEndpoint: -1},
		{MaxSpeculativePerEndpoint: -1},
		{SweepInterval: -time.Second},
	} {
		if _, err := New(cfg, nil); !errors.Is(err, ErrBadConfig) {
			t.Errorf("New(%+v) err = %v", cfg, err)
		}
	}
	ix, err := New(Config{}, nil)
	if err != nil || ix.MaxBlocksPerEndpoint() != DefaultMaxBlocksPerEndpoint {
		t.Fatalf("defaults: %v %d", err, ix.MaxBlocksPerEndpoint())
	}
	reg := prometheus.NewRegistry()
	if _, err := New(Config{}, reg); err != nil {
		t.Fatal(err)
	}
	if _, err := New(Config{}, reg); err == nil {
		t.Fatal("second Index on one registerer must fail to register")
	}
}

// op is one step of a conformance scenario.
type op struct {
	do    func(ix *Index)
	check func(t *testing.T, ix *Index)
}

func store(svc uint32, ep, rank int, keys ...uint64) op {
	return op{do: func(ix *Index) { ix.Store(svc, ep, rank, keys) }}
}
func remove(svc uint32, ep, rank int, keys ...uint64) op {
	return op{do: func(ix *Index) { ix.Remove(svc, ep, rank, keys) }}
}
func clearRank(svc uint32, ep, rank int) op {
	return op{do: func(ix *Index) { ix.ClearRank(svc, ep, rank) }}
}
func clearEP(svc uint32, ep int) op {
	return op{do: func(ix *Index) { ix.ClearEndpoint(svc, ep) }}
}
func expectLen(svc uint32, ep, n int) op {
	return op{check: func(t *testing.T, ix *Index) {
		t.Helper()
		if got := ix.Len(svc, ep); got != n {
			t.Fatalf("Len(%d,%d) = %d, want %d", svc, ep, got, n)
		}
	}}
}
func expectMatch(svc uint32, keys []uint64, eps []int, want ...int) op {
	return op{check: func(t *testing.T, ix *Index) {
		t.Helper()
		if got := match(ix, svc, keys, eps...); !slices.Equal(got, want) {
			t.Fatalf("PrefixMatch(%d, %v, %v) = %v, want %v", svc, keys, eps, got, want)
		}
	}}
}
func expectBlocks(svc uint32, ep int, keys ...uint64) op {
	return op{check: func(t *testing.T, ix *Index) {
		t.Helper()
		got, total := ix.Snapshot(svc, ep, 0)
		slices.Sort(got)
		want := slices.Clone(keys)
		slices.Sort(want)
		if total != len(want) || !slices.Equal(got, want) {
			t.Fatalf("Snapshot(%d,%d) = %v (%d), want %v", svc, ep, got, total, want)
		}
	}}
}

func TestConformance(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		ops  []op
	}{
		{"store and remove", Config{}, []op{
			store(1, 0, 0, 1, 2, 3),
			store(1, 0, 0, 2, 3, 4), // duplicates do not double count
			expectLen(1, 0, 4),
			remove(1, 0, 0, 2, 99), // unknown keys are ignored
			expectLen(1, 0, 3),
			expectBlocks(1, 0, 1, 3, 4),
			expectLen(1, 1, 0),
			expectLen(2, 0, 0),
		}},
		{"key zero is a key", Config{}, []op{
			store(1, 0, 0, 0),
			expectLen(1, 0, 1),
			expectMatch(1, []uint64{0, 1}, []int{0}, 1),
			remove(1, 0, 0, 0),
			expectLen(1, 0, 0),
		}},
		{"consecutive prefix only", Config{}, []op{
			store(1, 0, 0, 10, 11, 13, 14),
			store(1, 1, 0, 10, 11, 12, 13),
			store(1, 2, 0, 11, 12),
			expectMatch(1, []uint64{10, 11, 12, 13, 14}, []int{0, 1, 2, 3}, 2, 4, 0, 0),
			expectMatch(1, []uint64{10, 11, 12, 13}, []int{1, 1, 0}, 4, 4, 2),
			expectMatch(1, nil, []int{0, 1}, 0, 0),
			expectMatch(1, []uint64{10}, nil),
			expectMatch(9, []uint64{10}, []int{0}, 0),
			expectMatch(1, []uint64{10, 11}, []int{-1, 64, 0}, 0, 0, 2),
		}},
		{"endpoints are independent", Config{}, []op{
			store(1, 0, 0, 1, 2),
			store(1, 1, 0, 1, 2),
			store(2, 0, 0, 1, 2),
			remove(1, 0, 0, 1),
			expectMatch(1, []uint64{1, 2}, []int{0, 1}, 0, 2),
			expectMatch(2, []uint64{1, 2}, []int{0, 1}, 2, 0),
			clearEP(1, 1),
			expectLen(1, 1, 0),
			expectLen(1, 0, 1),
			expectLen(2, 0, 2),
			store(1, 1, 0, 5),
			expectBlocks(1, 1, 5),
		}},
		{"clear rank keeps other ranks", Config{}, []op{
			store(1, 0, 0, 1, 2),
			store(1, 0, 1, 2, 3),
			store(1, 0, 2, 4),
			expectLen(1, 0, 4),
			clearRank(1, 0, 1),
			expectBlocks(1, 0, 1, 2, 4), // 2 stays: rank 0 holds it too
			clearRank(1, 0, 0),
			expectBlocks(1, 0, 4),
			clearRank(1, 0, 2),
			expectLen(1, 0, 0),
		}},
		{"clear rank 0 keeps rank 1", Config{}, []op{
			store(1, 0, 1, 7, 8),
			store(1, 0, 0, 8, 9),
			clearRank(1, 0, 0),
			expectBlocks(1, 0, 7, 8),
			clearRank(1, 0, 3), // a rank that holds nothing
			expectBlocks(1, 0, 7, 8),
		}},
		{"remove is per rank", Config{}, []op{
			store(1, 0, 0, 5),
			store(1, 0, 3, 5),
			remove(1, 0, 1, 5), // rank 1 never held it
			expectLen(1, 0, 1),
			remove(1, 0, 0, 5),
			expectLen(1, 0, 1),
			remove(1, 0, 3, 5),
			expectLen(1, 0, 0),
		}},
		{"cap evicts oldest inserted", Config{MaxBlocksPerEndpoint: 3}, []op{
			store(1, 0, 0, 1, 2, 3),
			store(1, 0, 0, 4),
			expectBlocks(1, 0, 2, 3, 4),
			store(1, 0, 0, 2), // already present: no eviction, no reordering
			store(1, 0, 0, 5, 6),
			expectBlocks(1, 0, 4, 5, 6),
			store(1, 1, 0, 1, 2, 3, 4, 5, 6, 7), // per-endpoint cap
			expectBlocks(1, 1, 5, 6, 7),
			expectBlocks(1, 0, 4, 5, 6),
		}},
		{"cap evicts all ranks of a block", Config{MaxBlocksPerEndpoint: 2}, []op{
			store(1, 0, 0, 1),
			store(1, 0, 1, 1, 2),
			store(1, 0, 1, 3),
			expectBlocks(1, 0, 2, 3),
			clearRank(1, 0, 0),
			expectBlocks(1, 0, 2, 3),
		}},
		{"out of range is rejected", Config{}, []op{
			store(1, MaxEndpoints, 0, 1),
			store(1, -1, 0, 1),
			store(1, 0, MaxRanks, 1),
			remove(1, 0, -1, 1),
			clearRank(1, 0, 9),
			clearEP(1, 99),
			expectLen(1, 0, 0),
			expectLen(1, MaxEndpoints, 0),
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ix, _ := newIndex(t, tt.cfg)
			for _, o := range tt.ops {
				if o.do != nil {
					o.do(ix)
				}
				if o.check != nil {
					o.check(t, ix)
				}
			}
			checkInvariants(t, ix)
		})
	}
}

func TestMetrics(t *testing.T) {
	ix, reg := newIndex(t, Config{MaxBlocksPerEndpoint: 2})
	ix.Store(7, 3, 0, []uint64{1, 2, 3, 4})
	ix.Store(8, 0, 0, []uint64{1})
	ix.Store(7, MaxEndpoints, 0, []uint64{1})
	if got := testutil.ToFloat64(ix.m.blocks.WithLabelValues("7", "3")); got != 2 {
		t.Errorf("blocks gauge = %v", got)
	}
	if got := testutil.ToFloat64(ix.m.evictions.WithLabelValues("7", "3")); got != 2 {
		t.Errorf("evictions = %v", got)
	}
	if got := testutil.ToFloat64(ix.m.rejected.WithLabelValues("7", "ep_out_of_range")); got != 1 {
		t.Errorf("rejected = %v", got)
	}
	ix.Remove(7, 3, 0, []uint64{4})
	if got := testutil.ToFloat64(ix.m.blocks.WithLabelValues("7", "3")); got != 1 {
		t.Errorf("blocks gauge after remove = %v", got)
	}
	ix.DropService(7)
	n, err := testutil.GatherAndCount(reg, "loxilb_pd_kv_blocks", "loxilb_kv_inv_cap_evictions_total", "loxilb_kv_inv_rejected_total")
	if err != nil {
		t.Fatal(err)
	}
	if n != 2 { // only service 8's gauge and eviction counter remain
		t.Errorf("series after DropService = %d, want 2", n)
	}
	if err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP loxilb_pd_kv_blocks Blocks in the KV inventory of an endpoint, from engine KV events (speculative entries excluded).
# TYPE loxilb_pd_kv_blocks gauge
loxilb_pd_kv_blocks{ep_idx="0",service="8"} 1
`), "loxilb_pd_kv_blocks"); err != nil {
		t.Error(err)
	}
	if ix.Len(7, 3) != 0 || len(ix.Services()) != 1 {
		t.Error("dropped service still visible")
	}
	// A dropped service can come back (rule re-created).
	ix.Store(7, 3, 0, []uint64{9})
	if ix.Len(7, 3) != 1 {
		t.Error("re-created service not stored")
	}
}

func TestSnapshotLimit(t *testing.T) {
	ix, _ := newIndex(t, Config{})
	ix.Store(1, 0, 0, seq(0, 1000))
	blocks, total := ix.Snapshot(1, 0, 10)
	if len(blocks) != 10 || total != 1000 {
		t.Fatalf("Snapshot limit 10 = %d blocks, total %d", len(blocks), total)
	}
	blocks, total = ix.Snapshot(1, 0, 5000)
	if len(blocks) != 1000 || total != 1000 {
		t.Fatalf("Snapshot limit 5000 = %d blocks, total %d", len(blocks), total)
	}
	if b, n := ix.Snapshot(1, 1, 10); b != nil || n != 0 {
		t.Fatalf("empty endpoint snapshot = %v, %d", b, n)
	}
	if b, n := ix.Snapshot(2, 0, 10); b != nil || n != 0 {
		t.Fatalf("unknown service snapshot = %v, %d", b, n)
	}
}

// model is a straightforward reference inventory.
type model map[uint32]map[int]map[uint64]uint8

func (m model) ep(svc uint32, ep int) map[uint64]uint8 {
	if m[svc] == nil {
		m[svc] = map[int]map[uint64]uint8{}
	}
	if m[svc][ep] == nil {
		m[svc][ep] = map[uint64]uint8{}
	}
	return m[svc][ep]
}

// TestRandomAgainstModel runs random operations (no cap pressure) against
// the reference model and compares every observable after each step.
func TestRandomAgainstModel(t *testing.T) {
	r := rand.New(rand.NewPCG(2, 3))
	ix, _ := newIndex(t, Config{})
	ref := model{}
	keys := func() []uint64 {
		n := 1 + r.IntN(8)
		out := make([]uint64, n)
		for i := range out {
			out[i] = uint64(r.IntN(200))
		}
		return out
	}
	for step := 0; step < 20000; step++ {
		svc := uint32(r.IntN(2))
		ep := r.IntN(4)
		rank := r.IntN(3)
		switch op := r.IntN(100); {
		case op < 50:
			ks := keys()
			ix.Store(svc, ep, rank, ks)
			m := ref.ep(svc, ep)
			for _, k := range ks {
				m[k] |= 1 << rank
			}
		case op < 90:
			ks := keys()
			ix.Remove(svc, ep, rank, ks)
			m := ref.ep(svc, ep)
			for _, k := range ks {
				if m[k]&(1<<rank) != 0 {
					if m[k] &^= 1 << rank; m[k] == 0 {
						delete(m, k)
					}
				}
			}
		case op < 96:
			ix.ClearRank(svc, ep, rank)
			m := ref.ep(svc, ep)
			for k := range m {
				if m[k] &^= 1 << rank; m[k] == 0 {
					delete(m, k)
				}
			}
		case op < 99:
			ix.ClearEndpoint(svc, ep)
			clear(ref.ep(svc, ep))
		default:
			ix.DropService(svc)
			delete(ref, svc)
		}
		// Observe.
		if got, want := ix.Len(svc, ep), len(ref.ep(svc, ep)); got != want {
			t.Fatalf("step %d: Len = %d, want %d", step, got, want)
		}
		q := keys()
		eps := []int{0, 1, 2, 3}
		got := match(ix, svc, q, eps...)
		for i, e := range eps {
			want := 0
			for _, k := range q {
				if _, ok := ref.ep(svc, e)[k]; !ok {
					break
				}
				want++
			}
			if got[i] != want {
				t.Fatalf("step %d: PrefixMatch ep %d = %d, want %d", step, e, got[i], want)
			}
		}
		var byRank [4]int // one more than the ranks stored
		ix.RankPrefixMatch(svc, ep, q, byRank[:])
		for rk := range byRank {
			want := 0
			for _, k := range q {
				if ref.ep(svc, ep)[k]&(1<<rk) == 0 {
					break
				}
				want++
			}
			if byRank[rk] != want {
				t.Fatalf("step %d: RankPrefixMatch ep %d rank %d = %d, want %d", step, ep, rk, byRank[rk], want)
			}
		}
		if step%500 == 0 {
			checkInvariants(t, ix)
		}
	}
	// Rank masks must match the model exactly.
	for svc, eps := range ref {
		s := ix.lookup(svc)
		for ep, m := range eps {
			if len(m) == 0 {
				continue
			}
			e := s.eps[ep]
			for k, want := range m {
				if got := e.rankMask(k); got != want {
					t.Fatalf("svc %d ep %d key %d ranks = %b, want %b", svc, ep, k, got, want)
				}
			}
		}
	}
	checkInvariants(t, ix)
}

// checkInvariants verifies the internal bookkeeping of every service.
func checkInvariants(t *testing.T, ix *Index) {
	t.Helper()
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	for id, s := range ix.services {
		s.mu.RLock()
		var count [MaxEndpoints]int
		s.tab.each(func(k uint64, v uint64) bool {
			for r := v; r != 0; r &= r - 1 {
				count[bits.TrailingZeros64(r)]++
			}
			return true
		})
		if s.tier.cpu != nil {
			// Tier records name only endpoints holding the key, and a
			// CPU-only endpoint has a CPU copy.
			s.tier.cpu.each(func(k uint64, m uint64) bool {
				if m&^s.tab.get(k) != 0 {
					t.Fatalf("svc %d: cpu record %d=%b beyond holders %b", id, k, m, s.tab.get(k))
				}
				return true
			})
			s.tier.cpuOnly.each(func(k uint64, m uint64) bool {
				if m&^s.tier.cpu.get(k) != 0 {
					t.Fatalf("svc %d: cpu-only record %d=%b without cpu copy %b", id, k, m, s.tier.cpu.get(k))
				}
				return true
			})
		}
		for i, e := range s.eps {
			if e == nil {
				if count[i] != 0 {
					t.Fatalf("svc %d ep %d: %d keys without endpoint", id, i, count[i])
				}
				continue
			}
			if count[i] != e.n {
				t.Fatalf("svc %d ep %d: n = %d, table holds %d", id, i, e.n, count[i])
			}
			inOrder := map[uint64]bool{}
			for _, k := range e.order[e.head:] {
				inOrder[k] = true
			}
			bit := uint64(1) << i
			s.tab.each(func(k uint64, v uint64) bool {
				if v&bit != 0 && !inOrder[k] {
					t.Fatalf("svc %d ep %d: key %d missing from insertion order", id, i, k)
				}
				return true
			})
			if e.ranks != nil {
				e.ranks.each(func(k uint64, m uint8) bool {
					if s.tab.get(k)&bit == 0 || m == 0 || m == 1 {
						t.Fatalf("svc %d ep %d: stray rank entry %d=%b", id, i, k, m)
					}
					return true
				})
			}
			if stale := len(e.order) - e.head - e.n; stale > e.n/2+64 {
				t.Fatalf("svc %d ep %d: %d stale order elements for %d blocks", id, i, stale, e.n)
			}
		}
		s.mu.RUnlock()
	}
}

// TestOrderStaysBounded churns store/remove without reaching the cap; the
// insertion order must not grow without bound.
func TestOrderStaysBounded(t *testing.T) {
	ix, _ := newIndex(t, Config{})
	ix.Store(1, 0, 0, seq(0, 100))
	for i := uint64(0); i < 100000; i++ {
		k := 1000 + i
		ix.Store(1, 0, 0, []uint64{k})
		ix.Remove(1, 0, 0, []uint64{k})
		ix.Store(1, 0, 0, []uint64{i % 100}) // re-store of a present key
	}
	s := ix.lookup(1)
	if l := len(s.eps[0].order); l > 1000 {
		t.Fatalf("order grew to %d for 100 blocks", l)
	}
	checkInvariants(t, ix)
}

func TestEvictionUnderChurnKeepsCap(t *testing.T) {
	ix, _ := newIndex(t, Config{MaxBlocksPerEndpoint: 500})
	r := rand.New(rand.NewPCG(4, 5))
	for i := 0; i < 50000; i++ {
		k := uint64(r.IntN(2000))
		if r.IntN(3) == 0 {
			ix.Remove(1, 0, r.IntN(2), []uint64{k})
		} else {
			ix.Store(1, 0, r.IntN(2), []uint64{k})
		}
		if ix.Len(1, 0) > 500 {
			t.Fatalf("cap exceeded: %d", ix.Len(1, 0))
		}
	}
	checkInvariants(t, ix)
}

// TestConcurrent runs one ordered writer per endpoint (as the event ingester
// does) next to readers and resets; run it with -race. Each writer's final
// state is deterministic, so it is checked at the end.
func TestConcurrent(t *testing.T) {
	ix, _ := newIndex(t, Config{MaxBlocksPerEndpoint: 5000})
	ctx, cancel := context.WithCancel(context.Background())
	var readers sync.WaitGroup
	for g := 0; g < 3; g++ {
		readers.Add(1)
		go func() {
			defer readers.Done()
			q := seq(0, 64)
			eps := []int{0, 1, 2, 3, 4, 5, 6, 7}
			out := make([]int, len(eps))
			for ctx.Err() == nil {
				ix.PrefixMatch(1, q, eps, out)
				for _, d := range out {
					if d < 0 || d > len(q) {
						panic("bad depth")
					}
				}
				ix.Snapshot(1, 2, 10)
				ix.Len(1, 3)
				ix.StoreSpeculative(2, 1, q[:8], time.Second)
				ix.PrefixMatch(2, q, eps, out)
			}
		}()
	}
	readers.Add(1)
	go func() {
		defer readers.Done()
		for ctx.Err() == nil {
			ix.DropService(2)
			ix.Sweep()
			time.Sleep(time.Millisecond)
		}
	}()
	var writers sync.WaitGroup
	for ep := 0; ep < 8; ep++ {
		writers.Add(1)
		go func() {
			defer writers.Done()
			r := rand.New(rand.NewPCG(uint64(ep), 9))
			for i := 0; i < 3000; i++ {
				k := uint64(r.IntN(400))
				switch r.IntN(10) {
				case 0:
					ix.Remove(1, ep, 0, []uint64{k})
				case 1:
					if i%500 == 0 {
						ix.ClearRank(1, ep, 1)
					}
				default:
					ix.Store(1, ep, r.IntN(2), []uint64{k, k + 1, k + 2})
				}
				ix.Store(2, ep, 0, []uint64{k})
			}
			ix.ClearRank(1, ep, 1)
			ix.Store(1, ep, 0, seq(0, uint64(ep*10)))
		}()
	}
	writers.Wait()
	cancel()
	readers.Wait()
	eps := []int{0, 1, 2, 3, 4, 5, 6, 7}
	got := match(ix, 1, seq(0, 100), eps...)
	for i, ep := range eps {
		if got[i] < ep*10 {
			t.Errorf("ep %d: prefix %d, want at least %d", ep, got[i], ep*10)
		}
	}
	checkInvariants(t, ix)
}

func TestSnapshotOldestFirst(t *testing.T) {
	ix, _ := newIndex(t, Config{})
	ix.Store(1, 0, 0, []uint64{30, 10, 20})
	ix.Store(1, 0, 1, []uint64{10, 40})
	got, total := ix.Snapshot(1, 0, 0)
	if want := []uint64{30, 10, 20, 40}; !slices.Equal(got, want) || total != 4 {
		t.Fatalf("Snapshot = %v (%d), want %v", got, total, want)
	}
	got, _ = ix.Snapshot(1, 0, 2)
	if want := []uint64{30, 10}; !slices.Equal(got, want) {
		t.Fatalf("Snapshot limit 2 = %v, want %v", got, want)
	}
	// A re-stored key appears once.
	ix.Remove(1, 0, 0, []uint64{30})
	ix.Store(1, 0, 0, []uint64{30})
	got, total = ix.Snapshot(1, 0, 0)
	slices.Sort(got)
	if want := []uint64{10, 20, 30, 40}; !slices.Equal(got, want) || total != 4 {
		t.Fatalf("Snapshot after re-store = %v (%d)", got, total)
	}
}

// TestBulkClears exercises the in-place bulk update on large, shared tables
// (probe runs wrap around and the table shrinks) against the model.
func TestBulkClears(t *testing.T) {
	ix, _ := newIndex(t, Config{})
	ref := model{}
	r := rand.New(rand.NewPCG(6, 7))
	for ep := 0; ep < 3; ep++ {
		for rank := 0; rank < 3; rank++ {
			ks := make([]uint64, 6000) // > writeChunk: several chunks
			for i := range ks {
				ks[i] = uint64(r.IntN(30000))
			}
			ix.Store(1, ep, rank, ks)
			m := ref.ep(1, ep)
			for _, k := range ks {
				m[k] |= 1 << rank
			}
		}
	}
	check := func(what string) {
		t.Helper()
		checkInvariants(t, ix)
		for ep := 0; ep < 3; ep++ {
			m := ref.ep(1, ep)
			if ix.Len(1, ep) != len(m) {
				t.Fatalf("%s: ep %d Len = %d, want %d", what, ep, ix.Len(1, ep), len(m))
			}
			got, _ := ix.Snapshot(1, ep, 0)
			if len(got) != len(m) {
				t.Fatalf("%s: ep %d snapshot has %d", what, ep, len(got))
			}
			for _, k := range got {
				if _, ok := m[k]; !ok {
					t.Fatalf("%s: ep %d holds %d", what, ep, k)
				}
			}
		}
	}
	check("filled")
	clearModelRank := func(ep, rank int) {
		m := ref.ep(1, ep)
		for k := range m {
			if m[k] &^= 1 << rank; m[k] == 0 {
				delete(m, k)
			}
		}
	}
	ix.ClearRank(1, 1, 0)
	clearModelRank(1, 0)
	check("rank 0 of ep 1")
	ix.ClearRank(1, 1, 2)
	clearModelRank(1, 2)
	check("rank 2 of ep 1")
	ix.ClearEndpoint(1, 0)
	clear(ref.ep(1, 0))
	check("ep 0")
	ix.ClearRank(1, 1, 1)
	clearModelRank(1, 1)
	ix.ClearEndpoint(1, 2)
	clear(ref.ep(1, 2))
	check("all")
	if s := ix.lookup(1); s.tab.n != 0 || len(s.tab.keys) > 1024 {
		t.Fatalf("table not shrunk: n=%d slots=%d", s.tab.n, len(s.tab.keys))
	}
}

func TestLargeBatchesAreChunked(t *testing.T) {
	ix, _ := newIndex(t, Config{MaxBlocksPerEndpoint: 3000})
	ix.Store(1, 0, 0, seq(0, 5000))
	if ix.Len(1, 0) != 3000 {
		t.Fatalf("Len = %d", ix.Len(1, 0))
	}
	if got := match(ix, 1, seq(2000, 5000), 0); got[0] != 3000 {
		t.Fatalf("newest 3000 not kept: %v", got)
	}
	ix.Remove(1, 0, 0, seq(0, 5000))
	if ix.Len(1, 0) != 0 {
		t.Fatalf("Len after remove = %d", ix.Len(1, 0))
	}
	checkInvariants(t, ix)
}

func TestPrefixMatchShortOut(t *testing.T) {
	ix, _ := newIndex(t, Config{})
	ix.Store(1, 0, 0, seq(0, 4))
	out := make([]int, 1)
	ix.PrefixMatch(1, seq(0, 4), []int{0, 1, 2}, out)
	if out[0] != 4 {
		t.Fatalf("out = %v", out)
	}
	ix.PrefixMatch(1, seq(0, 4), []int{0}, nil)
}
