package ebpf

import (
	"net/netip"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

// FuzzBuildSlots checks the slot-table invariants the kernel relies on for
// any endpoint set: bounded length, only healthy endpoints, every healthy
// endpoint present (weighted and Maglev tables), empty only when none is up.
func FuzzBuildSlots(f *testing.F) {
	f.Add(uint8(dataplane.SelPriority), []byte{80, 20, 0, 5})
	f.Add(uint8(dataplane.SelConsistentHash), []byte{1, 1, 1})
	f.Add(uint8(dataplane.SelRoundRobin), []byte{0})
	f.Fuzz(func(t *testing.T, sel uint8, spec []byte) {
		if len(spec) > dataplane.MaxEndpoints {
			spec = spec[:dataplane.MaxEndpoints]
		}
		var eps []dataplane.Endpoint
		healthy := map[uint32]bool{}
		for i, b := range spec {
			e := dataplane.Endpoint{Addr: netip.AddrFrom4([4]byte{172, 31, byte(i), b}), Port: 80, Weight: int(b&0x7f) * 997, Healthy: b&0x80 == 0}
			if e.Healthy {
				healthy[uint32(i)] = true
			}
			eps = append(eps, e)
		}
		s := []int{dataplane.SelRoundRobin, dataplane.SelHash, dataplane.SelPriority, dataplane.SelPersist, dataplane.SelLeastConn, dataplane.SelConsistentHash}[int(sel)%6]
		table := buildSlots(s, eps)
		if len(table) > slotsPerGen {
			t.Fatalf("table of %d entries", len(table))
		}
		if (len(table) == 0) != (len(healthy) == 0) {
			t.Fatalf("%d entries with %d healthy endpoints", len(table), len(healthy))
		}
		seen := map[uint32]bool{}
		for _, v := range table {
			if !healthy[v] {
				t.Fatalf("slot holds unhealthy or unknown endpoint %d", v)
			}
			seen[v] = true
		}
		if len(seen) != len(healthy) {
			t.Fatalf("%d of %d healthy endpoints have slots (sel %d)", len(seen), len(healthy), s)
		}
	})
}
