package kvindex

import (
	"slices"
	"testing"
)

func tiered(ix *Index, svc uint32, keys []uint64, eps ...int) (depth, cpu []int) {
	depth, cpu = make([]int, len(eps)), make([]int, len(eps))
	ix.PrefixMatchTiered(svc, keys, eps, depth, cpu)
	return depth, cpu
}

// TestTierGPUAndCPU: endpoint 0 holds the prefix on GPU, endpoint 1 on CPU
// only; both match the whole prefix, and only endpoint 1's blocks count as
// CPU. A block on both tiers counts as GPU.
func TestTierGPUAndCPU(t *testing.T) {
	ix, _ := newIndex(t, Config{})
	req := seq(100, 108)
	ix.Store(1, 0, 0, req)
	ix.StoreTier(1, 1, 0, TierCPU, req)
	ix.StoreTier(1, 0, 0, TierCPU, req[:4]) // GPU+CPU stays GPU
	d, c := tiered(ix, 1, req, 0, 1, 2)
	if !slices.Equal(d, []int{8, 8, 0}) || !slices.Equal(c, []int{0, 8, 0}) {
		t.Fatalf("depth %v cpu %v, want [8 8 0] [0 8 0]", d, c)
	}
	if got := match(ix, 1, req, 0, 1); !slices.Equal(got, []int{8, 8}) {
		t.Fatalf("PrefixMatch %v", got)
	}
	if ix.Len(1, 1) != 8 {
		t.Fatalf("Len(ep1) %d, want 8", ix.Len(1, 1))
	}
	// Promote half of endpoint 1's copies to GPU.
	ix.Store(1, 1, 0, req[:4])
	if _, c := tiered(ix, 1, req, 1); c[0] != 4 {
		t.Fatalf("after GPU store: cpu %d, want 4", c[0])
	}
	checkInvariants(t, ix)
}

// TestTierRemoveSemantics follows vLLM's per-medium events: removing the
// GPU copy of a block that has a CPU copy leaves it CPU-only; removing the
// CPU copy of a GPU block leaves it GPU; removing the last copy drops it;
// removals on a tier the endpoint does not hold change nothing.
func TestTierRemoveSemantics(t *testing.T) {
	ix, _ := newIndex(t, Config{})
	req := seq(1, 5) // 4 blocks
	ix.Store(1, 0, 0, req)
	ix.StoreTier(1, 0, 0, TierCPU, req[:2])

	ix.Remove(1, 0, 0, req[:1]) // GPU copy of block 0 goes, CPU stays
	d, c := tiered(ix, 1, req, 0)
	if d[0] != 4 || c[0] != 1 {
		t.Fatalf("after GPU removal: depth %d cpu %d, want 4 1", d[0], c[0])
	}
	ix.Remove(1, 0, 0, req[:1])               // no GPU copy left: ignored
	ix.RemoveTier(1, 0, 0, TierCPU, req[2:3]) // no CPU copy: ignored
	if d, c = tiered(ix, 1, req, 0); d[0] != 4 || c[0] != 1 {
		t.Fatalf("after no-op removals: depth %d cpu %d, want 4 1", d[0], c[0])
	}
	ix.RemoveTier(1, 0, 0, TierCPU, req[1:2]) // block 1 keeps its GPU copy
	if d, c = tiered(ix, 1, req, 0); d[0] != 4 || c[0] != 1 {
		t.Fatalf("after CPU removal of a GPU block: depth %d cpu %d, want 4 1", d[0], c[0])
	}
	ix.RemoveTier(1, 0, 0, TierCPU, req[:1]) // last copy of block 0
	if d, _ = tiered(ix, 1, req, 0); d[0] != 0 || ix.Len(1, 0) != 3 {
		t.Fatalf("after last copy removed: depth %d len %d, want 0 3", d[0], ix.Len(1, 0))
	}
	checkInvariants(t, ix)
}

// TestTierClearsForget: eviction, a rank clear and an endpoint clear drop
// the CPU records with the blocks, so a block stored again later is GPU.
func TestTierClearsForget(t *testing.T) {
	ix, _ := newIndex(t, Config{MaxBlocksPerEndpoint: 4})
	req := seq(10, 14)
	ix.StoreTier(1, 0, 0, TierCPU, req)
	ix.Store(1, 0, 0, seq(20, 24)) // evicts all four CPU blocks
	ix.Store(1, 0, 0, req)
	if _, c := tiered(ix, 1, req, 0); c[0] != 0 {
		t.Fatalf("evicted CPU records survived: cpu %d", c[0])
	}
	ix.StoreTier(1, 1, 0, TierCPU, req)
	ix.ClearRank(1, 1, 0)
	ix.Store(1, 1, 0, req)
	ix.StoreTier(1, 2, 0, TierCPU, req)
	ix.ClearEndpoint(1, 2)
	ix.Store(1, 2, 0, req)
	if d, c := tiered(ix, 1, req, 1, 2); !slices.Equal(d, []int{4, 4}) || !slices.Equal(c, []int{0, 0}) {
		t.Fatalf("after clears: depth %v cpu %v", d, c)
	}
	checkInvariants(t, ix)
}

// TestTierMixedPrefix counts CPU blocks only within each endpoint's own
// matched prefix.
func TestTierMixedPrefix(t *testing.T) {
	ix, _ := newIndex(t, Config{})
	req := seq(0, 10)
	ix.Store(1, 0, 0, req[:3])
	ix.StoreTier(1, 0, 0, TierCPU, req[3:6]) // ep0: 3 GPU + 3 CPU
	ix.StoreTier(1, 1, 0, TierCPU, req[:2])  // ep1: 2 CPU
	ix.StoreTier(1, 1, 0, TierCPU, req[7:])  // beyond ep1's prefix
	d, c := tiered(ix, 1, req, 0, 1)
	if !slices.Equal(d, []int{6, 2}) || !slices.Equal(c, []int{3, 2}) {
		t.Fatalf("depth %v cpu %v, want [6 2] [3 2]", d, c)
	}
}

// TestPrefixMatchTieredZeroAllocs: the tiered lookup allocates nothing.
func TestPrefixMatchTieredZeroAllocs(t *testing.T) {
	ix, _ := newIndex(t, Config{})
	req := seq(1<<40, 1<<40+64)
	ix.Store(1, 0, 0, req)
	ix.StoreTier(1, 1, 0, TierCPU, req)
	eps := []int{0, 1, 2}
	out, cpu := make([]int, 3), make([]int, 3)
	if a := testing.AllocsPerRun(200, func() { ix.PrefixMatchTiered(1, req, eps, out, cpu) }); a != 0 {
		t.Fatalf("%v allocations per lookup", a)
	}
	if !slices.Equal(out, []int{64, 64, 0}) || !slices.Equal(cpu, []int{0, 64, 0}) {
		t.Fatalf("depth %v cpu %v", out, cpu)
	}
}

// BenchmarkPrefixMatchTier compares, on one fixture (32 endpoints of 20k
// blocks, every one holding the whole 256-block request), PrefixMatch with
// PrefixMatchTiered on a GPU-only service and after half the endpoints
// also report CPU-only copies of another 20k blocks and the request's
// second half moves to CPU at them.
func BenchmarkPrefixMatchTier(b *testing.B) {
	ix, req, cands := prefixFixture(b, 32, 20_000, 256, func(int) int { return 256 })
	out, cpu := make([]int, len(cands)), make([]int, len(cands))
	b.Run("PrefixMatch/gpu-only", func(b *testing.B) {
		for b.Loop() {
			ix.PrefixMatch(1, req, cands, out)
		}
	})
	b.Run("Tiered/gpu-only", func(b *testing.B) {
		for b.Loop() {
			ix.PrefixMatchTiered(1, req, cands, out, cpu)
		}
	})
	for ep := 0; ep < 32; ep += 2 {
		ix.StoreTier(1, ep, 0, TierCPU, seq(uint64(ep)<<40, uint64(ep)<<40+20_000))
		ix.StoreTier(1, ep, 0, TierCPU, req[128:])
		ix.Remove(1, ep, 0, req[128:])
	}
	b.Run("PrefixMatch/with-cpu", func(b *testing.B) {
		for b.Loop() {
			ix.PrefixMatch(1, req, cands, out)
		}
	})
	b.Run("Tiered/with-cpu", func(b *testing.B) {
		for b.Loop() {
			ix.PrefixMatchTiered(1, req, cands, out, cpu)
		}
		if out[0] != 256 || cpu[0] != 128 || cpu[1] != 0 {
			b.Fatalf("depth %d cpu %d/%d", out[0], cpu[0], cpu[1])
		}
	})
}

// TestTierModel drives random tiered stores, removals and clears (no
// evictions: the cap is above the key space; TestTierClearsForget covers
// them) against a plain map model of (endpoint, key) -> {gpu, cpu} and
// compares every endpoint's depth and CPU count for random requests.
func TestTierModel(t *testing.T) {
	const eps, keyspace = 4, 48
	ix, _ := newIndex(t, Config{})
	type copies struct{ gpu, cpu bool }
	model := make([]map[uint64]copies, eps)
	for i := range model {
		model[i] = map[uint64]copies{}
	}
	r := uint64(88172645463325252)
	rnd := func(n int) int { r ^= r << 13; r ^= r >> 7; r ^= r << 17; return int(r % uint64(n)) }
	for step := 0; step < 20000; step++ {
		ep := rnd(eps)
		keys := make([]uint64, 1+rnd(6))
		for i := range keys {
			keys[i] = uint64(rnd(keyspace))
		}
		tier := Tier(rnd(2))
		switch op := rnd(20); {
		case op < 10:
			ix.StoreTier(1, ep, 0, tier, keys)
			for _, k := range keys {
				c := model[ep][k]
				if tier == TierCPU {
					c.cpu = true
				} else {
					c.gpu = true
				}
				model[ep][k] = c
			}
		case op < 19:
			ix.RemoveTier(1, ep, 0, tier, keys)
			for _, k := range keys {
				c, ok := model[ep][k]
				if !ok {
					continue
				}
				if tier == TierCPU {
					c.cpu = false
				} else {
					c.gpu = false
				}
				if !c.cpu && !c.gpu {
					delete(model[ep], k)
				} else {
					model[ep][k] = c
				}
			}
		default:
			ix.ClearEndpoint(1, ep)
			model[ep] = map[uint64]copies{}
		}
		req := make([]uint64, 8)
		for i := range req {
			req[i] = uint64(rnd(keyspace))
		}
		d, c := tiered(ix, 1, req, 0, 1, 2, 3)
		for e := 0; e < eps; e++ {
			wd, wc := 0, 0
			for _, k := range req {
				cp, ok := model[e][k]
				if !ok {
					break
				}
				wd++
				if !cp.gpu {
					wc++
				}
			}
			if d[e] != wd || c[e] != wc {
				t.Fatalf("step %d ep %d: depth %d cpu %d, model %d %d", step, e, d[e], c[e], wd, wc)
			}
		}
	}
	checkInvariants(t, ix)
}
