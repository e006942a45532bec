package kvindex

import "math/bits"

// Tier is the storage medium of a block copy. Engines that offload KV
// blocks to host memory (vLLM's CPU offloading connector, LMCache, SGLang's
// host cache) publish the offloaded copy with its own medium; such a copy
// still saves prefill, but costs a host-to-device transfer, so routing
// weighs it below a GPU-resident copy.
type Tier uint8

const (
	// TierGPU is a block resident in accelerator memory.
	TierGPU Tier = iota
	// TierCPU is a block offloaded to host memory (or a tier behind it).
	TierCPU
)

// String names the tier as metrics and the API show it.
func (t Tier) String() string {
	if t == TierCPU {
		return "cpu"
	}
	return "gpu"
}

// tiers is a service's per-tier bookkeeping, allocated on the first CPU
// store so GPU-only services pay nothing. cpu maps a key to the endpoints
// holding a CPU copy (writer state); cpuOnly to the endpoints whose only
// copy is on CPU, which is all a query needs: an endpoint holding both
// copies serves the block from GPU. Both are replaced, never grown in
// place, under the query lock (see reserveTiers).
type tiers struct {
	cpu     *table[uint64]
	cpuOnly *table[uint64]
}

// setMask sets k's mask in t, deleting the entry when the mask is 0 (the
// table's empty marker). t must have room (reserveTiers).
func setMask(t *table[uint64], k, m uint64) {
	if m == 0 {
		t.del(k)
		return
	}
	t.put(k, m)
}

// grownFor returns a larger copy of t when nkeys more entries would pass
// the load limit, or nil when t has room.
func grownFor(t *table[uint64], nkeys int) *table[uint64] {
	if t == nil {
		return (&table[uint64]{}).resized(slotsFor(nkeys))
	}
	if (t.n+nkeys)*5 > len(t.keys)*4 {
		return t.resized(slotsFor(2 * (t.n + nkeys)))
	}
	return nil
}

// reserveTiers builds, holding wmu only, tier tables with room for nkeys
// more entries, for the caller to install under mu with installTiers. need
// says whether the write can add tier entries at all (a GPU store never
// does; a GPU removal only when CPU copies exist).
func (s *service) reserveTiers(nkeys int, need bool) (cpu, cpuOnly *table[uint64]) {
	if !need {
		return nil, nil
	}
	return grownFor(s.tier.cpu, nkeys), grownFor(s.tier.cpuOnly, nkeys)
}

// installTiers swaps in tables from reserveTiers; s.mu must be held.
func (s *service) installTiers(cpu, cpuOnly *table[uint64]) {
	if cpu != nil {
		s.tier.cpu = cpu
	}
	if cpuOnly != nil {
		s.tier.cpuOnly = cpuOnly
	}
}

// dropTiers forgets every tier record of (k, ep); s.mu must be held.
func (s *service) dropTiers(k, bit uint64) {
	if s.tier.cpu == nil {
		return
	}
	if m := s.tier.cpu.get(k); m&bit != 0 {
		setMask(s.tier.cpu, k, m&^bit)
	}
	if m := s.tier.cpuOnly.get(k); m&bit != 0 {
		setMask(s.tier.cpuOnly, k, m&^bit)
	}
}

// cpuOnlyAt reports whether endpoint bit holds k on CPU only.
func (s *service) cpuOnlyAt(k, bit uint64) bool {
	return s.tier.cpuOnly != nil && s.tier.cpuOnly.get(k)&bit != 0
}

// hasCPUAt reports whether endpoint bit holds a CPU copy of k.
func (s *service) hasCPUAt(k, bit uint64) bool {
	return s.tier.cpu != nil && s.tier.cpu.get(k)&bit != 0
}

// PrefixMatchTiered is PrefixMatch that also sets cpu[i] to how many of
// the out[i] matched blocks endpoint eps[i] holds on CPU only (a block held
// on GPU and CPU counts as GPU; speculative entries count as GPU). A caller
// weighs the two parts: a CPU hit avoids recomputation but pays a transfer.
// Services without CPU copies cost exactly what PrefixMatch costs; with
// them, one more probe per matched block. It does not allocate. cpu must be
// at least as long as out.
func (ix *Index) PrefixMatchTiered(service uint32, keys []uint64, eps []int, out, cpu []int) {
	if len(cpu) < len(out) {
		out = out[:len(cpu)]
	}
	for i := range cpu {
		cpu[i] = 0
	}
	ix.prefixMatch(service, keys, eps, out, true, cpu)
}

// countCPU sets cpu[b] to the CPU-only blocks among the first depth[b]
// keys of each candidate b in cands. It probes the CPU-only table once per
// key and counts for all candidates at once in bit-sliced counters
// (planes[j] holds bit j of every candidate's count), so the cost per key
// is a probe and a carry chain of amortised two steps, not a loop over
// endpoints. s.mu must be held for reading.
func (s *service) countCPU(keys []uint64, cands uint64, depth *[MaxEndpoints]int32, cpu *[MaxEndpoints]int32) {
	t := s.tier.cpuOnly
	if t == nil || t.n == 0 {
		return
	}
	// live is the candidates whose prefix reaches key i; next is the
	// smallest depth among them, where live must shrink.
	var live uint64
	var maxd int32
	for c := cands; c != 0; c &= c - 1 {
		b := bits.TrailingZeros64(c)
		if depth[b] > 0 {
			live |= 1 << b
			maxd = max(maxd, depth[b])
		}
	}
	next := minDepth(live, depth)
	var planes [32]uint64
	for i, k := range keys[:maxd] {
		if int32(i) == next {
			for c := live; c != 0; c &= c - 1 {
				if b := bits.TrailingZeros64(c); depth[b] <= int32(i) {
					live &^= 1 << b
				}
			}
			next = minDepth(live, depth)
		}
		m := t.get(k) & live
		for j := 0; m != 0; j++ {
			carry := planes[j] & m
			planes[j] ^= m
			m = carry
		}
	}
	for c := cands; c != 0; c &= c - 1 {
		b := bits.TrailingZeros64(c)
		var n int32
		for j := range planes {
			n |= int32((planes[j]>>b)&1) << j
		}
		cpu[b] = n
	}
}

func minDepth(live uint64, depth *[MaxEndpoints]int32) int32 {
	n := int32(-1)
	for c := live; c != 0; c &= c - 1 {
		if d := depth[bits.TrailingZeros64(c)]; n < 0 || d < n {
			n = d
		}
	}
	return n
}
