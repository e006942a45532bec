package router_test

import (
	"fmt"

	"github.com/loxilb-llm/loxilb/pkg/kvindex"
	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/pkg/selector"
)

// A request whose first 12 of 16 blocks are cached on endpoint 2 goes there,
// and the receipt says why.
func ExampleRouter_Decide() {
	ix, _ := kvindex.New(kvindex.Config{}, nil)
	r, _ := router.New(router.DefaultConfig(), ix, nil, nil)
	fallback, _ := selector.New(selector.SelRR, selector.Options{})

	prompt := []uint64{11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26}
	ix.Store(7, 2, 0, prompt[:12]) // from endpoint 2's KV events

	cands := []selector.Candidate{
		{Idx: 0, Weight: 1, Healthy: true},
		{Idx: 1, Weight: 1, Healthy: true},
		{Idx: 2, Weight: 1, Healthy: true, InFlight: 1},
	}
	d := r.Decide(router.ServiceView{ID: 7, KVExactMode: 3}, prompt, 16, cands, fallback, selector.Request{})
	fmt.Println(router.HeaderName+":", d.Receipt())
	fmt.Println("predicted cached tokens:", d.PredictedCachedTokens())
	// Output:
	// X-Loxilb-Route: tier=tier1.5 ep=2 matched=12/16 reason=longest_prefix
	// predicted cached tokens: 192
}
