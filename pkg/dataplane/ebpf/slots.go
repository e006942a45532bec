package ebpf

import (
	"encoding/binary"
	"hash/fnv"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

// Slot table geometry; twins of SLOTS_PER_GEN in bpf/consts.h.
const (
	slotsPerGen = 4096
	// maglevSize is the Maglev lookup-table size: prime, below slotsPerGen,
	// and large compared to MaxEndpoints so each endpoint's share is even
	// (Maglev needs M >> N; 4093/64 ≈ 64 entries per endpoint).
	maglevSize = 4093
)

// buildSlots returns the slot table the kernel selects from: endpoint
// indices, only healthy endpoints, never more than slotsPerGen entries. An
// empty table means "no endpoint": new connections are dropped and counted.
//
//   - rr, hash, persist, lc: every healthy endpoint once (lc only needs a
//     non-empty table; it scans counters).
//   - priority: weights expanded by smooth weighted round robin so rr over
//     the table interleaves endpoints instead of sending bursts.
//   - consistent hash: a Maglev table (see maglevTable).
func buildSlots(sel int, eps []dataplane.Endpoint) []uint32 {
	var healthy []int
	for i, ep := range eps {
		if ep.Healthy {
			healthy = append(healthy, i)
		}
	}
	if len(healthy) == 0 {
		return nil
	}
	switch sel {
	case dataplane.SelPriority:
		return weightedSlots(eps, healthy)
	case dataplane.SelConsistentHash:
		return maglevTable(eps, healthy, maglevSize)
	}
	out := make([]uint32, len(healthy))
	for i, h := range healthy {
		out[i] = uint32(h)
	}
	return out
}

func gcd(a, b int) int {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

// weightedSlots expands weights into a table whose length is the sum of the
// weights reduced by their gcd (scaled down to fit slotsPerGen), ordered by
// smooth weighted round robin (the nginx algorithm).
func weightedSlots(eps []dataplane.Endpoint, healthy []int) []uint32 {
	w := make([]int, len(healthy))
	g, total := 0, 0
	for i, h := range healthy {
		w[i] = max(eps[h].Weight, 1)
		g = gcd(g, w[i])
	}
	for i := range w {
		w[i] /= g
		total += w[i]
	}
	if total > slotsPerGen {
		scaled := 0
		for i := range w {
			w[i] = max(w[i]*slotsPerGen/total, 1)
			scaled += w[i]
		}
		total = scaled
		for total > slotsPerGen { // rounding up to 1 can overshoot
			for i := range w {
				if w[i] > 1 && total > slotsPerGen {
					w[i]--
					total--
				}
			}
		}
	}
	cur := make([]int, len(w))
	out := make([]uint32, 0, total)
	for range total {
		best := 0
		for i := range w {
			cur[i] += w[i]
			if cur[i] > cur[best] {
				best = i
			}
		}
		cur[best] -= total
		out = append(out, uint32(healthy[best]))
	}
	return out
}

// endpointHashes derives Maglev's offset and skip for an endpoint from its
// address and port, so the permutation of an endpoint does not depend on its
// position or on the health of others: that is what limits disruption.
func endpointHashes(ep dataplane.Endpoint, m uint64) (offset, skip uint64) {
	var b [7]byte
	a := ep.Addr.As4()
	copy(b[:4], a[:])
	binary.BigEndian.PutUint16(b[4:6], ep.Port)
	h1 := fnv.New64a()
	b[6] = 0xa5
	h1.Write(b[:])
	h2 := fnv.New64a()
	b[6] = 0x5a
	h2.Write(b[:])
	return mix64(h1.Sum64()) % m, mix64(h2.Sum64())%(m-1) + 1
}

// mix64 is the splitmix64 finaliser; FNV alone has weak high/low bit mixing.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// maglevTable fills an m-entry lookup table (m prime) by Maglev's
// population: endpoints take turns claiming their next preferred free entry.
func maglevTable(eps []dataplane.Endpoint, healthy []int, m int) []uint32 {
	n := len(healthy)
	offset := make([]uint64, n)
	skip := make([]uint64, n)
	next := make([]uint64, n)
	for i, h := range healthy {
		offset[i], skip[i] = endpointHashes(eps[h], uint64(m))
	}
	table := make([]int32, m)
	for i := range table {
		table[i] = -1
	}
	filled := 0
	for {
		for i := range n {
			c := (offset[i] + next[i]*skip[i]) % uint64(m)
			for table[c] >= 0 {
				next[i]++
				c = (offset[i] + next[i]*skip[i]) % uint64(m)
			}
			table[c] = int32(healthy[i])
			next[i]++
			filled++
			if filled == m {
				out := make([]uint32, m)
				for j, v := range table {
					out[j] = uint32(v)
				}
				return out
			}
		}
	}
}
