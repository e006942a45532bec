package router

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/selector"
)

// Strict attestation: an endpoint marked untrusted gets no Tier-1.5
// traffic, however much of the prompt it holds; the miss is counted as
// parity_untrusted when only it held the prefix.
func TestUntrustedEndpointGetsNoTier15(t *testing.T) {
	inv := newFakeInv()
	cfg := DefaultConfig()
	cfg.MinMatchTokens, cfg.ColdSeedN = 0, 0
	r, _ := newRouter(t, cfg, inv)
	keys := chain(7, 8)
	inv.add(1, 1, keys...)     // endpoint 1 holds the whole prompt
	inv.add(1, 0, keys[:2]...) // endpoint 0 a little of it
	view := ServiceView{ID: 1, KVExactMode: 3}

	d := r.Decide(view, keys, 16, cands(3), rr(t), selector.Request{})
	if d.Tier != TierKV || d.EP != 1 {
		t.Fatalf("trusted: %+v, want a Tier-1.5 hit on endpoint 1", d)
	}
	view.Untrusted = 1 << 1
	for i := 0; i < 20; i++ {
		d = r.Decide(view, keys, 16, cands(3), rr(t), selector.Request{})
		if d.EP == 1 {
			t.Fatalf("untrusted endpoint chosen: %+v", d)
		}
		if d.Tier != TierKV || d.EP != 0 || d.MatchedBlocks != 2 {
			t.Fatalf("untrusted: %+v, want the trusted partial match on endpoint 0", d)
		}
	}
	// Only the untrusted endpoint holds this prompt: a miss, said why.
	other := chain(9, 4)
	inv.add(1, 1, other...)
	d = r.Decide(view, other, 16, cands(3), rr(t), selector.Request{})
	if d.Tier != TierFallback || d.Reason != ReasonParityUntrusted {
		t.Fatalf("only the untrusted endpoint matches: %+v", d)
	}
	if v := testutil.ToFloat64(r.m.miss.WithLabelValues("1", ReasonParityUntrusted)); v != 1 {
		t.Errorf("parity_untrusted misses counted %v, want 1", v)
	}
	// Every healthy endpoint untrusted: a miss, said why.
	view.Untrusted = 0b111
	if d = r.Decide(view, keys, 16, cands(3), rr(t), selector.Request{}); d.Tier != TierFallback || d.Reason != ReasonParityUntrusted || d.EP < 0 {
		t.Fatalf("all untrusted: %+v", d)
	}
}
