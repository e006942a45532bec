package router

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/selector"
)

// TestDecideInvariants checks, over many random fleets (fixed seed), the
// properties every decision must have whatever the inputs.
func TestDecideInvariants(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for iter := 0; iter < 3000; iter++ {
		n := 1 + rng.IntN(12)
		total := rng.IntN(40)
		bs := []int{1, 4, 16, 64}[rng.IntN(4)]
		q := chain(uint64(iter), total)
		inv := newFakeInv()
		cs := cands(n)
		for i := range cs {
			cs[i].Healthy = rng.IntN(5) != 0
			cs[i].InFlight = rng.IntN(20)
			if rng.IntN(2) == 0 {
				cs[i].Metrics = selector.EngineMetrics{Running: rng.IntN(10), Waiting: rng.IntN(5), KVUsage: rng.Float64(), Valid: true}
			}
			if total > 0 && rng.IntN(2) == 0 {
				inv.add(7, i, q[:rng.IntN(total+1)]...)
			}
			inv.add(7, i, chain(uint64(1000+i), rng.IntN(30))...)
		}
		cfg := DefaultConfig()
		cfg.MinMatchTokens = rng.IntN(100)
		cfg.ColdSeedN = rng.IntN(4)
		cfg.ColdMinBlocks = rng.IntN(40)
		cfg.LoadPenalty = rng.IntN(201) - 1 // -1 is LoadPenaltyAdaptive
		cfg.SpillMinLoad = rng.IntN(4)
		relief := rng.IntN(2) == 0
		cfg.SpillRelief = &relief
		r, _ := newRouter(t, cfg, inv)
		d := r.Decide(mode3, q, bs, cs, rr(t), selector.Request{})

		anyHealthy := false
		for _, c := range cs {
			anyHealthy = anyHealthy || c.Healthy
		}
		if !anyHealthy {
			if d.EP != -1 || d.Reason != ReasonNoHealthy {
				t.Fatalf("iter %d: no healthy candidate but %+v", iter, d)
			}
			continue
		}
		if d.EP < 0 || d.EP >= n || !cs[d.EP].Healthy {
			t.Fatalf("iter %d: chose unhealthy or unknown endpoint: %+v", iter, d)
		}
		if d.TotalBlocks != total || d.MatchedBlocks < 0 || d.MatchedBlocks > total {
			t.Fatalf("iter %d: block counts %+v", iter, d)
		}
		if d.Tier == TierFallback {
			continue
		}
		// A hit needs a healthy endpoint holding at least the minimum prefix.
		minBlocks := 1
		if cfg.MinMatchTokens > 0 {
			minBlocks = min((cfg.MinMatchTokens+bs-1)/bs, total)
		}
		best := 0
		out := make([]int, 1)
		for _, c := range cs {
			if c.Healthy {
				inv.PrefixMatch(7, q, []int{c.Idx}, out)
				best = max(best, out[0])
			}
		}
		if best < minBlocks {
			t.Fatalf("iter %d: hit %+v although best match %d < min %d", iter, d, best, minBlocks)
		}
		inv.PrefixMatch(7, q, []int{d.EP}, out)
		if out[0] != d.MatchedBlocks {
			t.Fatalf("iter %d: receipt says %d matched, inventory %d", iter, d.MatchedBlocks, out[0])
		}
		okReason := map[string][]string{
			TierKV:       {ReasonLongestPrefix, ReasonLoadBlend, ReasonLeastPrefill},
			TierSpill:    {ReasonLoadBlend, ReasonOverCap},
			TierColdSeed: {ReasonColdSeed},
		}[d.Tier]
		if !slices.Contains(okReason, d.Reason) {
			t.Fatalf("iter %d: tier/reason mismatch %+v", iter, d)
		}
		if (d.From >= 0) != (d.Reason != ReasonLongestPrefix && d.Reason != ReasonLeastPrefill) {
			t.Fatalf("iter %d: from/reason mismatch %+v", iter, d)
		}
		// Spill relief never moves a request onto an endpoint above the cap.
		if d.Reason == ReasonOverCap {
			sum, h := 0.0, 0
			for _, c := range cs {
				if c.Healthy {
					sum += selector.Load(c, cfg.LoadWeights)
					h++
				}
			}
			capLoad := math.Ceil(float64(cfg.MeanLoadFactor) * (sum + 1) / (100 * float64(h)))
			if d.Load+1 > capLoad {
				t.Fatalf("iter %d: spilled onto ep %d with load %v over cap %v", iter, d.EP, d.Load, capLoad)
			}
		}
	}
}
