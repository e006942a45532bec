package router

import (
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/selector"
)

func TestColdKey(t *testing.T) {
	keys := chain(1, 10)
	for _, c := range []struct {
		keys              []uint64
		common, bs, wantI int
		ok                bool
	}{
		{keys, 0, 16, 3, true},  // 64 tokens = 4 blocks
		{keys, 0, 64, 0, true},  // one block
		{keys, 0, 100, 0, true}, // rounded up to one block
		{keys, 8, 16, 9, true},  // capped at the last block
		{keys, 2, 16, 5, true},  // four blocks past the common prefix
		{keys[:2], 0, 16, 1, true},
		{nil, 0, 16, 0, false},
		{keys, 0, 0, 0, false},
	} {
		k, ok := coldKey(c.keys, c.common, c.bs)
		if ok != c.ok || (ok && k != c.keys[c.wantI]) {
			t.Fatalf("coldKey(%d keys, common %d, bs %d) = %x %v, want block %d", len(c.keys), c.common, c.bs, k, ok, c.wantI)
		}
	}
}

// Two gateway nodes whose local state differs (outstanding prefill work,
// round-robin position) place siblings of a new prefix on one endpoint
// with ColdRendezvous, and different prefixes still spread.
func TestColdRendezvousAgreesAcrossNodes(t *testing.T) {
	inv := newFakeInv()
	inv.add(7, 0, chain(99, 64)...) // a non-empty inventory: misses are no_match
	cfg := DefaultConfig()
	cfg.ColdSeedN = 0
	cfg.ColdRendezvous = true
	a, _ := newRouter(t, cfg, inv)
	b, _ := newRouter(t, cfg, inv)
	ca, cb := cands(4), cands(4)
	ca[1].PrefillTokens, ca[1].InFlight = 200, 1 // node a sent a prefill to 1
	cb[3].PrefillTokens, cb[3].InFlight = 250, 1 // node b one to 3
	selA, selB := rr(t), rr(t)
	used := map[int]int{}
	for p := uint64(1); p <= 64; p++ {
		sib1 := append(chain(p, 16), 1001)
		sib2 := append(chain(p, 16), 2002)
		da := a.Decide(mode3, sib1, 16, ca, selA, selector.Request{})
		db := b.Decide(mode3, sib2, 16, cb, selB, selector.Request{})
		if da.EP != db.EP || da.Reason != ReasonNoMatch || db.Reason != ReasonNoMatch {
			t.Fatalf("prefix %d: node a placed %+v, node b %+v", p, da, db)
		}
		used[da.EP]++
	}
	if len(used) != 4 {
		t.Fatalf("64 prefixes used endpoints %v, want all four", used)
	}

	// Without rendezvous the same local state splits siblings.
	cfg.ColdRendezvous = false
	a, _ = newRouter(t, cfg, inv)
	b, _ = newRouter(t, cfg, inv)
	split := 0
	for p := uint64(1); p <= 64; p++ {
		if a.Decide(mode3, chain(p, 16), 16, ca, selA, selector.Request{}).EP != b.Decide(mode3, chain(p, 16), 16, cb, selB, selector.Request{}).EP {
			split++
		}
	}
	if split == 0 {
		t.Fatal("least-work placement should split some siblings between the two nodes")
	}
}

// Rendezvous stays within the limits of a miss: never behind more prefill
// work than the request's own past the least, never above the spill cap.
func TestColdRendezvousBounds(t *testing.T) {
	inv := newFakeInv()
	cfg := DefaultConfig()
	cfg.ColdSeedN = 0
	cfg.ColdRendezvous = true
	r, _ := newRouter(t, cfg, inv)
	cs := cands(4)
	// A 256-token miss: endpoints 1 (no work) and 3 (200 tokens) are
	// eligible, 0 and 2 are far behind.
	cs[0].PrefillTokens, cs[2].PrefillTokens, cs[3].PrefillTokens = 6000, 3000, 200
	seen := map[int]int{}
	for p := uint64(1); p <= 64; p++ {
		d := r.Decide(mode3, chain(p, 16), 16, cs, rr(t), selector.Request{})
		if d.Tier != TierFallback || d.Reason != ReasonEmptyInventory {
			t.Fatalf("prefix %d: %+v", p, d)
		}
		seen[d.EP]++
	}
	if seen[0] != 0 || seen[2] != 0 || seen[1] == 0 || seen[3] == 0 {
		t.Fatalf("misses went to %v, want only endpoints 1 and 3", seen)
	}
	// Endpoint 3 loaded above the cap: ceil(2·(6+1)/4) = 4 < 6+1.
	cs[3].InFlight = 6
	for p := uint64(1); p <= 64; p++ {
		if d := r.Decide(mode3, chain(p, 16), 16, cs, rr(t), selector.Request{}); d.EP != 1 {
			t.Fatalf("prefix %d went to %d, want 1 (3 is over the cap, 0 and 2 behind long prefills)", p, d.EP)
		}
	}
	// A hit every endpoint holds alike is placed past the common blocks.
	sys := chain(50, 8)
	for ep := 0; ep < 4; ep++ {
		inv.add(7, ep, sys...)
	}
	cs[3].InFlight, cs[3].PrefillTokens = 0, 100 // within the 128 uncached tokens
	q := append(append([]uint64(nil), sys...), chain(51, 8)...)
	d := r.Decide(mode3, q, 16, cs, rr(t), selector.Request{})
	want, _ := selector.Rendezvous(q[11], []selector.Candidate{{Idx: 1, Healthy: true}, {Idx: 3, Healthy: true}}, nil)
	if d.EP != want || d.Reason != ReasonLeastPrefill || d.MatchedBlocks != 8 {
		t.Fatalf("shared system prompt: %+v, want endpoint %d by rendezvous", d, want)
	}
}
