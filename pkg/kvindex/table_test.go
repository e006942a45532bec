package kvindex

import (
	"math/rand/v2"
	"testing"
)

// TestTableAgainstMap drives the open-addressing table and a Go map with the
// same random operations, on a small key space so probe runs collide, wrap
// around and shift back on delete.
func TestTableAgainstMap(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 1))
	tab := newTable[uint64](0)
	ref := map[uint64]uint64{}
	keyOf := func() uint64 {
		switch r.IntN(3) {
		case 0:
			return uint64(r.IntN(64)) // includes key 0
		case 1:
			return uint64(r.IntN(64)) << 58 // same low bits, different homes
		default:
			return r.Uint64()
		}
	}
	for step := 0; step < 200000; step++ {
		k := keyOf()
		switch op := r.IntN(10); {
		case op < 5:
			v := r.Uint64() | 1
			tab.put(k, v)
			ref[k] = v
		case op < 9:
			tab.del(k)
			delete(ref, k)
		default:
			if r.IntN(30) == 0 {
				tab.update(func(k uint64, v uint64) uint64 {
					if k%2 == 0 {
						return 0
					}
					return v | 2 // idempotent, as update requires
				})
				for k, v := range ref {
					if k%2 == 0 {
						delete(ref, k)
					} else {
						ref[k] = v | 2
					}
				}
			}
		}
		if got := tab.get(k); got != ref[k] {
			t.Fatalf("step %d: get(%#x) = %d, want %d", step, k, got, ref[k])
		}
		if tab.n != len(ref) {
			t.Fatalf("step %d: n = %d, want %d", step, tab.n, len(ref))
		}
	}
	for k, v := range ref {
		if tab.get(k) != v {
			t.Fatalf("final get(%#x) = %d, want %d", k, tab.get(k), v)
		}
	}
	seen := 0
	tab.each(func(k uint64, v uint64) bool {
		if ref[k] != v {
			t.Fatalf("each yielded %#x=%d, want %d", k, v, ref[k])
		}
		seen++
		return true
	})
	if seen != len(ref) {
		t.Fatalf("each saw %d, want %d", seen, len(ref))
	}
	if tab.n*5 > len(tab.keys)*4 {
		t.Fatalf("load factor exceeded: %d/%d", tab.n, len(tab.keys))
	}
}

func TestTableUpdateShrinks(t *testing.T) {
	tab := newTable[uint8](0)
	for k := uint64(0); k < 10000; k++ {
		tab.put(k, 1)
	}
	tab.update(func(k uint64, v uint8) uint8 {
		if k < 10 {
			return 2
		}
		return 0
	})
	if tab.n != 10 || len(tab.keys) > 16 {
		t.Fatalf("n=%d slots=%d after update", tab.n, len(tab.keys))
	}
	for k := uint64(0); k < 20; k++ {
		want := uint8(0)
		if k < 10 {
			want = 2
		}
		if tab.get(k) != want {
			t.Fatalf("get(%d) = %d", k, tab.get(k))
		}
	}
}
