package kvindex

import (
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
)

// gtableOps drives a gtable and a Go map with the operations the index
// performs (insert after find, set bits, delete after find, move steps)
// plus table moves installed at arbitrary moments and sizes, grown or
// shrunk, and checks every key's visibility after every step: a lookup
// during a move must see exactly what a map sees.
func gtableOps(t *testing.T, r *rand.Rand, steps int, keySpace func() uint64) {
	t.Helper()
	var g gtable
	ref := map[uint64]uint64{}
	for step := 0; step < steps; step++ {
		k := keySpace()
		switch op := r.IntN(100); {
		case op < 45:
			v := r.Uint64() | 1
			if i := g.find(k); i >= 0 {
				g.vals[i] |= v
				ref[k] |= v
			} else {
				g.put(k, v)
				ref[k] = v
			}
		case op < 80:
			if i := g.find(k); i >= 0 {
				g.delAt(i)
				delete(ref, k)
			} else if _, ok := ref[k]; ok {
				t.Fatalf("step %d: find(%#x) missed a present key", step, k)
			}
			g.maybeShrink()
		case op < 95:
			if g.moving() {
				m := 1 + r.IntN(8)
				g.migrate(m, 16*m)
			}
		default:
			if !g.moving() && g.len() > 0 {
				// Any size that holds what is there with room: the move
				// must be correct however it was triggered.
				n := slotsFor(g.len()+1) << r.IntN(3)
				g.install(make([]uint64, n), make([]uint64, n))
			}
		}
		if got := g.get(k); got != ref[k] {
			t.Fatalf("step %d: get(%#x) = %#x, want %#x (moving %v)", step, k, got, ref[k], g.moving())
		}
		if g.len() != len(ref) {
			t.Fatalf("step %d: len = %d, want %d", step, g.len(), len(ref))
		}
		for i := 0; step%64 == 0 && i < g.cursor && g.moving(); i++ {
			if g.old.vals[i] != 0 {
				t.Fatalf("step %d: old slot %d below cursor %d is occupied", step, i, g.cursor)
			}
		}
	}
	seen := 0
	g.each(func(k, v uint64) bool {
		if ref[k] != v {
			t.Fatalf("each yielded %#x=%#x, want %#x", k, v, ref[k])
		}
		if g.table.get(k) != 0 && g.old.get(k) != 0 {
			t.Fatalf("key %#x in both tables", k)
		}
		seen++
		return true
	})
	if seen != len(ref) {
		t.Fatalf("each saw %d, want %d", seen, len(ref))
	}
}

func TestGTableMovesAgainstMap(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 7))
	// Small key space: probe runs collide, wrap around the end of both
	// tables and shift back across the move cursor.
	gtableOps(t, r, 200000, func() uint64 {
		switch r.IntN(3) {
		case 0:
			return uint64(r.IntN(200))
		case 1:
			return uint64(r.IntN(64)) << 58 // same low bits, different homes
		default:
			return r.Uint64() % 4096
		}
	})
}

// FuzzGTable runs the same model check from fuzzed seeds.
func FuzzGTable(f *testing.F) {
	f.Add(uint64(1), uint64(2), uint16(64))
	f.Add(uint64(9), uint64(0), uint16(5))
	f.Fuzz(func(t *testing.T, a, b uint64, space uint16) {
		r := rand.New(rand.NewPCG(a, b))
		n := int(space)%4096 + 1
		gtableOps(t, r, 5000, func() uint64 { return uint64(r.IntN(n)) * 0x10001 })
	})
}

// TestIndexGrowsIncrementally fills a service well past the size where its
// table moves incrementally, with a reader checking a resident prefix the
// whole time, then removes most keys so it shrinks the same way; every
// observable is compared with the reference after each phase.
func TestIndexGrowsIncrementally(t *testing.T) {
	ix, _ := newIndex(t, Config{})
	req := seq(1<<40, 1<<40+32)
	ix.Store(1, 0, 0, req)
	var stop atomic.Bool
	var wg sync.WaitGroup
	var lost atomic.Int64
	wg.Add(1)
	go func() {
		defer wg.Done()
		out := make([]int, 1)
		for !stop.Load() {
			ix.PrefixMatch(1, req, []int{0}, out)
			if out[0] != len(req) {
				lost.Add(1)
			}
		}
	}()
	const total = 120_000 // table of 2^18 slots: two incremental moves
	batch := make([]uint64, 0, 64)
	for k := uint64(0); k < total; k++ {
		batch = append(batch, k)
		if len(batch) == cap(batch) {
			ix.Store(1, int(k%3), int(k/64%2), batch)
			batch = batch[:0]
		}
	}
	s := ix.lookup(1)
	s.mu.RLock()
	slots, moved := len(s.tab.keys), s.tab.moving()
	s.mu.RUnlock()
	if slots < 1<<18 {
		t.Fatalf("table has %d slots after %d keys", slots, total)
	}
	checkInvariants(t, ix)
	for ep := 0; ep < 3; ep++ {
		var want []uint64
		for k := uint64(0); k < total/64*64; k++ {
			if int((k/64*64+63)%3) == ep {
				want = append(want, k)
			}
		}
		if got := match(ix, 1, want, ep); got[0] != len(want) {
			t.Fatalf("ep %d: PrefixMatch of its %d keys = %d (moving %v)", ep, len(want), got[0], moved)
		}
	}
	// Shrink: remove all but a few thousand keys of ep 0.
	for k := uint64(0); k < total; k += 64 {
		end := min(k+64, total)
		for ep := 0; ep < 3; ep++ {
			for rank := 0; rank < 2; rank++ {
				if ep == 0 && k < 4096 {
					continue
				}
				ix.Remove(1, ep, rank, seq(k, end))
			}
		}
	}
	ix.Sweep() // finishes a move left half done
	stop.Store(true)
	wg.Wait()
	if lost.Load() != 0 {
		t.Fatalf("a reader saw the resident prefix incomplete %d times", lost.Load())
	}
	s.mu.RLock()
	slots, moved = len(s.tab.keys), s.tab.moving()
	s.mu.RUnlock()
	if moved || slots > 1<<15 {
		t.Fatalf("after removals: %d slots, moving %v", slots, moved)
	}
	checkInvariants(t, ix)
	want := len(req)
	for k := uint64(0); k < 4096; k += 64 {
		if (k+63)%3 == 0 {
			want += 64
		}
	}
	if n := ix.Len(1, 0); n != want {
		t.Fatalf("ep 0 holds %d, want %d", n, want)
	}
}
