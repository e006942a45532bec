package selector

import "testing"

func healthy(idx ...int) []Candidate {
	c := make([]Candidate, len(idx))
	for i, x := range idx {
		c[i] = Candidate{Idx: x, Weight: 1, Healthy: true}
	}
	return c
}

func TestRendezvousDeterministicAndOrderFree(t *testing.T) {
	fwd, rev := healthy(0, 1, 2, 3, 4, 5), healthy(5, 4, 3, 2, 1, 0)
	for k := uint64(0); k < 2000; k++ {
		a, _ := Rendezvous(k, fwd, nil)
		b, _ := Rendezvous(k, rev, nil)
		if a != b {
			t.Fatalf("key %d: endpoint %d in one order, %d in the other", k, a, b)
		}
	}
	if _, ok := Rendezvous(1, nil, nil); ok {
		t.Fatal("no candidate should give ok=false")
	}
	c := healthy(0, 1)
	c[0].Healthy = false
	if ep, ok := Rendezvous(1, c, func(c *Candidate) bool { return c.Idx != 1 }); ok {
		t.Fatalf("unhealthy or filtered candidates chosen: %d", ep)
	}
}

func TestRendezvousSpreadsKeys(t *testing.T) {
	c := healthy(0, 1, 2, 3)
	const keys = 20000
	count := make([]int, len(c))
	for k := uint64(0); k < keys; k++ {
		ep, _ := Rendezvous(mix64(k), c, nil)
		count[ep]++
	}
	for i, n := range count {
		// Each endpoint's share within 10% of a quarter (about 12 standard
		// deviations of a binomial of 20000 draws).
		if n < keys/4*9/10 || n > keys/4*11/10 {
			t.Fatalf("endpoint %d won %d of %d keys: %v", i, n, keys, count)
		}
	}
}

// Taking an endpoint out (removed from the rule, unhealthy, or filtered
// out) moves only the keys it won, and they spread over the others.
func TestRendezvousRemovalMovesOnlyItsKeys(t *testing.T) {
	all := healthy(0, 1, 2, 3, 4)
	without := healthy(0, 1, 3, 4)
	moved := map[int]int{}
	onRemoved := 0
	for k := uint64(0); k < 10000; k++ {
		key := mix64(k ^ 0xabcdef)
		before, _ := Rendezvous(key, all, nil)
		after, _ := Rendezvous(key, without, nil)
		filtered, _ := Rendezvous(key, all, func(c *Candidate) bool { return c.Idx != 2 })
		if filtered != after {
			t.Fatalf("key %x: filtering endpoint 2 out gave %d, removing it %d", key, filtered, after)
		}
		if before != 2 {
			if after != before {
				t.Fatalf("key %x moved from %d to %d although endpoint %d stayed", key, before, after, before)
			}
			continue
		}
		onRemoved++
		moved[after]++
	}
	if onRemoved == 0 || len(moved) != 4 {
		t.Fatalf("the removed endpoint's %d keys went to %v, want all four others", onRemoved, moved)
	}
}
