package dispatch

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// TestSGLangPrefillRank: a named prefill rank goes to the prefill server
// as routed_dp_rank (and data_parallel_rank) and to the decode server as
// disagg_prefill_dp_rank, with a bootstrap room congruent to it; without
// one, or for a batch, both legs get the same body as before.
func TestSGLangPrefillRank(t *testing.T) {
	m, _ := parseBody([]byte(`{"model":"m","prompt":"hello","routed_dp_rank":7}`))
	x := &exchange{req: &Request{PrefillRank: func(ep int) (int, int, bool) { return 2, 3, ep == 4 }}, body: m}
	type legBody struct {
		Room        uint64 `json:"bootstrap_room"`
		Routed      *int   `json:"routed_dp_rank"`
		Legacy      *int   `json:"data_parallel_rank"`
		PrefillRank *int   `json:"disagg_prefill_dp_rank"`
	}
	decode := func(b []byte) legBody {
		var l legBody
		if err := json.Unmarshal(b, &l); err != nil {
			t.Fatalf("%s: %v", b, err)
		}
		return l
	}
	for _, room := range []uint64{0, 41, 1<<63 - 1} {
		pre, dec := x.sglangBodies(Endpoint{Idx: 4, Host: "h"}, 8998, room)
		p, d := decode(pre), decode(dec)
		if p.Routed == nil || *p.Routed != 2 || p.Legacy == nil || *p.Legacy != 2 || p.PrefillRank != nil {
			t.Errorf("prefill leg %s", pre)
		}
		if d.PrefillRank == nil || *d.PrefillRank != 2 || (d.Routed != nil && *d.Routed != 7) || d.Legacy != nil {
			t.Errorf("decode leg %s", dec)
		}
		if p.Room != d.Room || p.Room%3 != 2 || p.Room > 1<<63-1 {
			t.Errorf("room %d -> %d, %d: want equal, = 2 mod 3, below 2^63", room, p.Room, d.Room)
		}
	}
	pre, dec := x.sglangBodies(Endpoint{Idx: 5, Host: "h"}, 8998, 41)
	if string(pre) != string(dec) || decode(pre).Room != 41 {
		t.Errorf("no rank named, yet the legs differ: %s / %s", pre, dec)
	}
	mb, _ := parseBody([]byte(`{"model":"m","prompt":["a","b"]}`))
	x.body = mb
	pre, dec = x.sglangBodies(Endpoint{Idx: 4, Host: "h"}, 8998, 41)
	if string(pre) != string(dec) || strings.Contains(string(pre), "dp_rank") {
		t.Errorf("a batch was given one rank: %s / %s", pre, dec)
	}
}

// TestSGLangPrefillRankServed: through the flow, the prefill engine serves
// the leg on the named rank and the request completes.
func TestSGLangPrefillRankServed(t *testing.T) {
	f := newFleet(t, fleetOpts{engine: enginesim.EngineSGLang, nPrefill: 1, nDec: 1, prefillRanks: 2})
	f.prefillRank = func(int) (int, int, bool) { return 1, 2, true }
	for range 3 {
		if r := f.post(t, "/v1/completions", map[string]any{"model": "sim-model", "prompt": "hello there", "max_tokens": 2}); r.status != 200 {
			t.Fatalf("status %d %s", r.status, r.body)
		}
	}
	rs := f.prefill[0].Stats().Ranks
	if rs[1].Targeted != 3 || rs[0].Served != 0 {
		t.Fatalf("prefill ranks %+v, want all 3 legs on rank 1", rs)
	}
}
