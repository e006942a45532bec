package ebpf

import (
	"net/netip"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

func eps(n int) []dataplane.Endpoint {
	out := make([]dataplane.Endpoint, n)
	for i := range out {
		out[i] = dataplane.Endpoint{Addr: netip.AddrFrom4([4]byte{172, 16, byte(i / 250), byte(1 + i%250)}), Port: 8080, Weight: 1, Healthy: true}
	}
	return out
}

func TestBuildSlotsSkipsUnhealthy(t *testing.T) {
	e := eps(3)
	e[1].Healthy = false
	for _, sel := range []int{dataplane.SelRoundRobin, dataplane.SelHash, dataplane.SelPriority, dataplane.SelPersist, dataplane.SelLeastConn, dataplane.SelConsistentHash} {
		s := buildSlots(sel, e)
		if len(s) == 0 {
			t.Fatalf("sel %d: empty table", sel)
		}
		for _, v := range s {
			if v == 1 {
				t.Fatalf("sel %d: unhealthy endpoint 1 in table", sel)
			}
		}
	}
	e[0].Healthy, e[2].Healthy = false, false
	if s := buildSlots(dataplane.SelRoundRobin, e); len(s) != 0 {
		t.Fatalf("all down: got %v, want empty", s)
	}
}

func TestWeightedSlotsInterleave(t *testing.T) {
	e := eps(2)
	e[0].Weight, e[1].Weight = 80, 20
	s := buildSlots(dataplane.SelPriority, e)
	if len(s) != 5 {
		t.Fatalf("len %d, want 5 (80:20 reduced)", len(s))
	}
	n0 := 0
	for _, v := range s {
		if v == 0 {
			n0++
		}
	}
	if n0 != 4 {
		t.Fatalf("endpoint 0 has %d of 5 slots, want 4: %v", n0, s)
	}
	if s[0] == s[1] && s[1] == s[2] && s[2] == s[3] && s[3] != 0 {
		t.Fatalf("not interleaved: %v", s)
	}
}

func TestWeightedSlotsFit(t *testing.T) {
	e := eps(3)
	e[0].Weight, e[1].Weight, e[2].Weight = 100000, 3, 7
	s := buildSlots(dataplane.SelPriority, e)
	if len(s) > slotsPerGen || len(s) == 0 {
		t.Fatalf("len %d", len(s))
	}
	seen := map[uint32]bool{}
	for _, v := range s {
		seen[v] = true
	}
	if len(seen) != 3 {
		t.Fatalf("every weighted endpoint keeps a slot: %v", seen)
	}
}

func TestMaglevBalancedAndStable(t *testing.T) {
	e := eps(10)
	full := buildSlots(dataplane.SelConsistentHash, e)
	if len(full) != maglevSize {
		t.Fatalf("len %d", len(full))
	}
	count := map[uint32]int{}
	for _, v := range full {
		count[v]++
	}
	for ep, c := range count {
		// Maglev guarantees near-equal shares: within a few percent of M/N.
		if c < maglevSize/10*9/10 || c > maglevSize/10*11/10 {
			t.Fatalf("endpoint %d holds %d entries of %d", ep, c, maglevSize)
		}
	}
	e[3].Healthy = false
	less := buildSlots(dataplane.SelConsistentHash, e)
	moved := 0
	for i := range full {
		if full[i] != 3 && full[i] != less[i] {
			moved++
		}
	}
	// Only entries of the removed endpoint must move; Maglev moves a few more.
	if frac := float64(moved) / float64(maglevSize); frac > 0.05 {
		t.Fatalf("%.1f%% of surviving entries moved", frac*100)
	}
}

func BenchmarkMaglevTable(b *testing.B) {
	e := eps(64)
	for b.Loop() {
		buildSlots(dataplane.SelConsistentHash, e)
	}
}
