package router_test

import (
	"log/slog"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/kvindex"
	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/pkg/selector"
)

// The production inventory satisfies the router's interface.
var _ router.Inventory = (*kvindex.Index)(nil)

func keys(p uint64, n int) []uint64 {
	k := make([]uint64, n)
	for i := range k {
		k[i] = p<<32 | uint64(i+1)
	}
	return k
}

func healthy(n int) []selector.Candidate {
	c := make([]selector.Candidate, n)
	for i := range c {
		c[i] = selector.Candidate{Idx: i, Weight: 1, Healthy: true}
	}
	return c
}

// TestWithKVIndex runs the decision against the real inventory: a hit on
// the warm endpoint, and a speculative entry (recorded by the proxy after
// routing) attracting the next sibling before the engine's events arrive.
func TestWithKVIndex(t *testing.T) {
	ix, err := kvindex.New(kvindex.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg := router.DefaultConfig()
	cfg.ColdSeedN = 0
	r, err := router.New(cfg, ix, slog.New(slog.DiscardHandler), nil)
	if err != nil {
		t.Fatal(err)
	}
	sel, _ := selector.New(selector.SelRR, selector.Options{})
	svc := router.ServiceView{ID: 1, KVExactMode: 3}
	q := keys(1, 32)
	ix.Store(1, 2, 0, q[:20])
	ix.Store(1, 0, 0, keys(9, 40))
	d := r.Decide(svc, q, 16, healthy(4), sel, selector.Request{})
	if d.EP != 2 || d.Tier != router.TierKV || d.MatchedBlocks != 20 || d.TotalBlocks != 32 {
		t.Fatalf("warm hit: %+v", d)
	}

	sib := keys(5, 32) // a new prefix nobody holds
	d = r.Decide(svc, sib, 16, healthy(4), sel, selector.Request{})
	if d.Tier != router.TierFallback || d.Reason != router.ReasonNoMatch {
		t.Fatalf("new prefix: %+v", d)
	}
	ix.StoreSpeculative(1, d.EP, sib, time.Minute)
	d2 := r.Decide(svc, sib, 16, healthy(4), sel, selector.Request{})
	if d2.EP != d.EP || d2.Tier != router.TierKV || d2.MatchedBlocks != 32 {
		t.Fatalf("sibling did not follow the speculative entry to %d: %+v", d.EP, d2)
	}
}

// BenchmarkDecideKVIndex is the realistic lookup+score cost: 64 endpoints
// with real inventories, a 128-block (2k tokens at block size 16) request.
func BenchmarkDecideKVIndex(b *testing.B) {
	const eps, blocks = 64, 128
	ix, err := kvindex.New(kvindex.Config{}, nil)
	if err != nil {
		b.Fatal(err)
	}
	q := keys(1, blocks)
	for ep := 0; ep < eps; ep++ {
		ix.Store(1, ep, 0, q[:ep*blocks/eps])
		ix.Store(1, ep, 0, keys(uint64(100+ep), 4096))
	}
	r, err := router.New(router.DefaultConfig(), ix, nil, nil)
	if err != nil {
		b.Fatal(err)
	}
	cs := healthy(eps)
	for i := range cs {
		cs[i].InFlight = i % 5
		cs[i].Metrics = selector.EngineMetrics{Running: i % 4, Waiting: i % 2, KVUsage: 0.4, Valid: true}
	}
	sel, _ := selector.New(selector.SelRR, selector.Options{})
	svc := router.ServiceView{ID: 1, KVExactMode: 3}
	b.ReportAllocs()
	for b.Loop() {
		r.Decide(svc, q, 16, cs, sel, selector.Request{})
	}
}

var _ router.ConfirmedInventory = (*kvindex.Index)(nil)
