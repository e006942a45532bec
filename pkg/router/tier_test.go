package router_test

import (
	"log/slog"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/kvindex"
	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/pkg/selector"
)

func tierRouter(t *testing.T, wCPU float64) (*kvindex.Index, *router.Router) {
	t.Helper()
	ix, err := kvindex.New(kvindex.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg := router.DefaultConfig()
	cfg.ColdSeedN = 0
	cfg.TierWeightCPU = wCPU
	r, err := router.New(cfg, ix, slog.New(slog.DiscardHandler), nil)
	if err != nil {
		t.Fatal(err)
	}
	return ix, r
}

// TestTierWeights: a prefix on GPU at one endpoint and on CPU at another
// goes to the GPU copy (without tiers the lower index would win the tie);
// a CPU-only copy is still a hit; a long CPU prefix beats a short GPU one
// once weighted; weight 1 makes the tiers equal again.
func TestTierWeights(t *testing.T) {
	sel, _ := selector.New(selector.SelRR, selector.Options{})
	svc := router.ServiceView{ID: 1, KVExactMode: 3}
	q := keys(1, 32)

	ix, r := tierRouter(t, router.DefaultTierWeightCPU)
	ix.StoreTier(1, 0, 0, kvindex.TierCPU, q)
	ix.Store(1, 1, 0, q)
	d := r.Decide(svc, q, 16, healthy(3), sel, selector.Request{})
	if d.EP != 1 || d.Tier != router.TierKV || d.MatchedBlocks != 32 || d.CPUBlocks != 0 {
		t.Fatalf("GPU copy at 1, CPU copy at 0: %+v", d)
	}

	ix, r = tierRouter(t, router.DefaultTierWeightCPU)
	ix.StoreTier(1, 2, 0, kvindex.TierCPU, q)
	ix.Store(1, 0, 0, keys(9, 8)) // some unrelated GPU inventory
	d = r.Decide(svc, q, 16, healthy(3), sel, selector.Request{})
	if d.EP != 2 || d.Tier != router.TierKV || d.MatchedBlocks != 32 || d.CPUBlocks != 32 {
		t.Fatalf("CPU-only copy: %+v", d)
	}

	// 32 CPU blocks (25.6 weighted) beat 20 GPU blocks; 24 GPU blocks
	// beat them.
	ix.Store(1, 1, 0, q[:20])
	if d = r.Decide(svc, q, 16, healthy(3), sel, selector.Request{}); d.EP != 2 {
		t.Fatalf("32 CPU vs 20 GPU: %+v", d)
	}
	ix.Store(1, 1, 0, q[20:26])
	if d = r.Decide(svc, q, 16, healthy(3), sel, selector.Request{}); d.EP != 1 || d.MatchedBlocks != 26 {
		t.Fatalf("32 CPU vs 26 GPU: %+v", d)
	}

	// Weight 1: tiers are equal, the tie goes to the lower index.
	ix, r = tierRouter(t, 1)
	ix.Store(1, 1, 0, q)
	ix.StoreTier(1, 0, 0, kvindex.TierCPU, q)
	ix.Store(1, 2, 0, keys(9, 8))
	if d = r.Decide(svc, q, 16, healthy(3), sel, selector.Request{}); d.EP != 0 || d.CPUBlocks != 32 {
		t.Fatalf("weight 1: %+v", d)
	}
}
