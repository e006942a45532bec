package kvindex

import (
	"math/rand/v2"
	"testing"
	"time"
)

// moving reports whether service svc's block table is between two sizes.
func moving(ix *Index, svc uint32) bool {
	s := ix.lookup(svc)
	if s == nil {
		return false
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.tab.moving()
}

// TestMovesAgainstModel drives one service through many table moves, up
// and down, with every kind of write (batches spanning several chunks,
// removals, rank and endpoint clears, sweeps) and checks every query
// against a map model after every step: a key that a move lost, or left
// behind where lookups do not find it, fails the test.
func TestMovesAgainstModel(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 8))
	ix, _ := newIndex(t, Config{})
	ref := model{}
	const universe = 1 << 14
	// Mostly event-sized batches (a move advances with every write, so
	// small writes leave it in progress for many steps), sometimes one
	// spanning several chunks.
	batch := func() int {
		if r.IntN(20) == 0 {
			return 1 + r.IntN(400)
		}
		return 1 + r.IntN(40)
	}
	keys := func(n int) []uint64 {
		out := make([]uint64, n)
		for i := range out {
			out[i] = uint64(r.IntN(universe))
		}
		return out
	}
	eps := []int{0, 1, 2, 3}
	out := make([]int, len(eps))
	var movingSteps, moves int
	wasMoving := false
	const steps = 8000
	for step := 0; step < steps; step++ {
		ep, rank := r.IntN(len(eps)), r.IntN(3)
		m := ref.ep(1, ep)
		// Phases of mostly stores and mostly removals, so the table both
		// grows and shrinks through incremental moves.
		storeBias := 80
		if step/1000%2 == 1 {
			storeBias = 3
		}
		switch op := r.IntN(100); {
		case op < storeBias:
			ks := keys(batch())
			ix.Store(1, ep, rank, ks)
			for _, k := range ks {
				m[k] |= 1 << rank
			}
		case op < 97:
			ks := keys(batch())
			if storeBias < 50 {
				// Removal phase: remove keys the rank holds.
				ks = ks[:0]
				for k, ranks := range m {
					if len(ks) == cap(ks) {
						break
					}
					if ranks&(1<<rank) != 0 {
						ks = append(ks, k)
					}
				}
			}
			ix.Remove(1, ep, rank, ks)
			for _, k := range ks {
				if m[k]&(1<<rank) != 0 {
					if m[k] &^= 1 << rank; m[k] == 0 {
						delete(m, k)
					}
				}
			}
		case op < 98:
			ix.ClearRank(1, ep, rank)
			for k := range m {
				if m[k] &^= 1 << rank; m[k] == 0 {
					delete(m, k)
				}
			}
		case op < 99:
			if step%7 == 0 {
				ix.ClearEndpoint(1, ep)
				clear(m)
			}
		default:
			ix.Sweep()
		}
		mv := moving(ix, 1)
		if mv {
			movingSteps++
			if !wasMoving {
				moves++
			}
		}
		wasMoving = mv
		// Query a prefix of keys the model holds for ep, then one more.
		var q []uint64
		for k := range m {
			if len(q) == 64 {
				break
			}
			q = append(q, k)
		}
		q = append(q, keys(1)...)
		ix.PrefixMatch(1, q, eps, out)
		for i, e := range eps {
			want := 0
			for _, k := range q {
				if _, ok := ref.ep(1, e)[k]; !ok {
					break
				}
				want++
			}
			if out[i] != want {
				t.Fatalf("step %d (moving %v): PrefixMatch ep %d = %d, want %d", step, mv, e, out[i], want)
			}
		}
		var byRank [3]int
		ix.RankPrefixMatch(1, ep, q, byRank[:])
		for rk := range byRank {
			want := 0
			for _, k := range q {
				if m[k]&(1<<rk) == 0 {
					break
				}
				want++
			}
			if byRank[rk] != want {
				t.Fatalf("step %d (moving %v): RankPrefixMatch ep %d rank %d = %d, want %d", step, mv, ep, rk, byRank[rk], want)
			}
		}
		if got := ix.Len(1, ep); got != len(m) {
			t.Fatalf("step %d (moving %v): Len(ep %d) = %d, want %d", step, mv, ep, got, len(m))
		}
		if step%100 == 0 {
			// Every key of every endpoint, not just a sample.
			for _, e := range eps {
				all := make([]uint64, 0, len(ref.ep(1, e)))
				for k := range ref.ep(1, e) {
					all = append(all, k)
				}
				if got := match(ix, 1, all, e); got[0] != len(all) {
					t.Fatalf("step %d (moving %v): ep %d finds %d of its %d keys", step, mv, e, got[0], len(all))
				}
			}
			checkInvariants(t, ix)
		}
	}
	// The test is only worth something if it saw many moves in progress.
	if moves < 12 || movingSteps < 500 {
		t.Fatalf("only %d moves and %d steps during a move: the test does not exercise moves", moves, movingSteps)
	}
	t.Logf("%d moves, %d of %d steps observed mid-move", moves, movingSteps, steps)
	checkInvariants(t, ix)
}

// TestEvictionDuringMoves fills endpoint 0 past its cap with distinct keys
// while twenty other endpoints fill up to theirs, growing the service
// table, so evictions (which remove entries from whichever table holds
// them) happen mid-move.
// With distinct keys eviction is exactly first-in first-out: after every
// batch the newest cap keys must all be found and the one before them not.
func TestEvictionDuringMoves(t *testing.T) {
	const limit = 3000
	ix, _ := newIndex(t, Config{MaxBlocksPerEndpoint: limit})
	var stored []uint64
	midMove := 0
	next := uint64(1 << 32)
	for batch := 0; batch < 400; batch++ {
		n := 1 + batch%300
		ks := seq(next, next+uint64(n))
		next += uint64(n)
		ix.Store(1, 0, batch%2, ks)
		stored = append(stored, ks...)
		// Endpoints 1..20 receive 150 keys each 20th batch: 3000 by the end.
		ix.Store(1, 1+batch%20, 0, seq(uint64(batch)*150, uint64(batch+1)*150))
		if moving(ix, 1) {
			midMove++
		}
		want := stored[max(0, len(stored)-limit):]
		if got := ix.Len(1, 0); got != len(want) {
			t.Fatalf("batch %d: Len = %d, want %d", batch, got, len(want))
		}
		if got := match(ix, 1, want, 0); got[0] != len(want) {
			t.Fatalf("batch %d (moving %v): newest %d keys found up to %d", batch, moving(ix, 1), len(want), got[0])
		}
		if len(stored) > limit {
			evicted := stored[len(stored)-limit-1]
			if got := match(ix, 1, []uint64{evicted}, 0); got[0] != 0 {
				t.Fatalf("batch %d: evicted key %d still found", batch, evicted)
			}
		}
	}
	for ep := 1; ep <= 20; ep++ {
		var want []uint64
		for b := ep - 1; b < 400; b += 20 {
			want = append(want, seq(uint64(b)*150, uint64(b+1)*150)...)
		}
		if got := match(ix, 1, want, ep); got[0] != len(want) {
			t.Fatalf("endpoint %d finds %d of %d keys", ep, got[0], len(want))
		}
	}
	if midMove < 20 {
		t.Fatalf("only %d batches ended mid-move: the test does not exercise moves", midMove)
	}
	checkInvariants(t, ix)
}

// TestRankPrefixMatchSkipsWriterLock: a rank lookup is part of a routing
// decision, so like PrefixMatch it must not wait for the writer lock,
// which a writer holds while it allocates a table of the next size (over
// a second for a 10M-block service).
func TestRankPrefixMatchSkipsWriterLock(t *testing.T) {
	ix, _ := newIndex(t, Config{})
	req := seq(0, 16)
	ix.Store(1, 0, 1, req)
	s := ix.lookup(1)
	s.wmu.Lock() // a writer mid-way through its off-lock work
	done := make(chan [2]int, 1)
	go func() {
		var out [2]int
		ix.RankPrefixMatch(1, 0, req, out[:])
		done <- out
	}()
	select {
	case out := <-done:
		s.wmu.Unlock()
		if out != [2]int{0, len(req)} {
			t.Fatalf("RankPrefixMatch = %v, want [0 %d]", out, len(req))
		}
	case <-time.After(30 * time.Second): // a liveness bound, not a timing claim
		s.wmu.Unlock()
		t.Fatal("RankPrefixMatch waited for the writer lock")
	}
}

// TestRankTablesGrowUnderReaders stores and removes many rank-1 blocks
// (growing and shrinking the endpoint's rank table) while readers check
// that a resident prefix is always found at both ranks. Run with -race it
// also proves rank tables are never changed under a reader.
func TestRankTablesGrowUnderReaders(t *testing.T) {
	ix, _ := newIndex(t, Config{})
	req := seq(1<<40, 1<<40+32)
	ix.Store(1, 0, 0, req)
	ix.Store(1, 0, 1, req)
	stop := make(chan struct{})
	errs := make(chan string, 1)
	go func() {
		defer close(errs)
		var out [2]int
		for {
			select {
			case <-stop:
				return
			default:
			}
			ix.RankPrefixMatch(1, 0, req, out[:])
			if out != [2]int{len(req), len(req)} {
				errs <- "rank prefix lost"
				return
			}
		}
	}()
	const total = 60_000
	for round := 0; round < 2; round++ {
		for k := uint64(0); k < total; k += 100 {
			ix.Store(1, 0, 1, seq(k, k+100))
		}
		for k := uint64(0); k < total; k += 100 {
			ix.Remove(1, 0, 1, seq(k, k+100))
		}
	}
	close(stop)
	if msg, ok := <-errs; ok {
		t.Fatal(msg)
	}
	if n := ix.Len(1, 0); n != len(req) {
		t.Fatalf("Len = %d, want %d", n, len(req))
	}
	s := ix.lookup(1)
	if r := s.eps[0].ranks; r == nil || len(r.keys) > 1024 {
		t.Fatalf("rank table not shrunk after removals: %v slots", slotsOf(r))
	}
	checkInvariants(t, ix)
}

func slotsOf(r *table[uint8]) int {
	if r == nil {
		return 0
	}
	return len(r.keys)
}

// TestPrefixMatchZeroAllocs: the routing lookups allocate nothing, in
// steady state and during a table move.
func TestPrefixMatchZeroAllocs(t *testing.T) {
	ix, _ := newIndex(t, Config{})
	req := seq(1<<40, 1<<40+64)
	ix.Store(1, 0, 0, req)
	ix.Store(1, 0, 1, req[:32])
	eps := []int{0, 1, 2}
	out := make([]int, len(eps))
	var byRank [2]int
	check := func(state string) {
		t.Helper()
		if a := testing.AllocsPerRun(200, func() {
			ix.PrefixMatch(1, req, eps, out)
			ix.RankPrefixMatch(1, 0, req, byRank[:])
		}); a != 0 {
			t.Fatalf("%s: %v allocations per lookup", state, a)
		}
		if out[0] != len(req) || byRank != [2]int{len(req), 32} {
			t.Fatalf("%s: PrefixMatch %v, RankPrefixMatch %v", state, out, byRank)
		}
	}
	check("steady")
	for k := uint64(0); !moving(ix, 1); k += 64 {
		ix.Store(1, 1, 0, seq(k, k+64))
	}
	check("moving")
}
