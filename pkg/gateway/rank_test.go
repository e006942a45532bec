package gateway

import (
	"encoding/json"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/engine"
	"github.com/loxilb-llm/loxilb/pkg/kvindex"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

func TestAppendFields(t *testing.T) {
	fields := []string{engine.SGLangRankField, engine.SGLangLegacyRankField}
	cases := []struct {
		in, want string
		ok       bool
	}{
		{`{"model":"m","prompt":"hi"}`, `{"model":"m","prompt":"hi","routed_dp_rank":1,"data_parallel_rank":1}`, true},
		{"  {\"prompt\":[1,2]}\n", `  {"prompt":[1,2],"routed_dp_rank":1,"data_parallel_rank":1}`, true},
		{`{ }`, `{ "routed_dp_rank":1,"data_parallel_rank":1}`, true},
		// A client's own rank is overridden: decoders keep the last duplicate.
		{`{"prompt":"x","routed_dp_rank":0}`, `{"prompt":"x","routed_dp_rank":0,"routed_dp_rank":1,"data_parallel_rank":1}`, true},
		{`[1,2]`, ``, false},
		{`{"prompt":"x"`, ``, false},
		{``, ``, false},
		{`}`, ``, false},
	}
	for _, c := range cases {
		got, ok := appendFields([]byte(c.in), fields, 1)
		if ok != c.ok || string(got) != c.want {
			t.Errorf("appendFields(%q) = %q, %v; want %q, %v", c.in, got, ok, c.want, c.ok)
		}
		if ok {
			var m map[string]any
			if err := json.Unmarshal(got, &m); err != nil || m["routed_dp_rank"] != 1.0 {
				t.Errorf("appendFields(%q) = %q: %v %v", c.in, got, m, err)
			}
		}
	}
}

func TestChooseRank(t *testing.T) {
	ix, err := kvindex.New(kvindex.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	keys := []uint64{10, 11, 12, 13}
	// Nothing cached: a stable rank for the prefix, whatever is asked.
	r0 := chooseRank(ix, 1, 0, 2, keys)
	for range 5 {
		if r := chooseRank(ix, 1, 0, 2, keys); r != r0 {
			t.Fatalf("cold rank changed: %d then %d", r0, r)
		}
	}
	// The rank holding the longer prefix wins when the other would
	// recompute more than the request's own uncached block.
	ix.Store(1, 0, 1, keys[:3])
	ix.Store(1, 0, 0, keys[:1])
	if r := chooseRank(ix, 1, 0, 2, keys); r != 1 {
		t.Fatalf("rank %d, want 1 (3 blocks against 1)", r)
	}
	ix.Store(1, 0, 0, keys)
	if r := chooseRank(ix, 1, 0, 2, keys); r != 0 {
		t.Fatalf("rank %d, want 0 (4 blocks against 3)", r)
	}
	// Continuations of one shared prefix spread over the ranks.
	ix2, _ := kvindex.New(kvindex.Config{}, nil)
	shared := []uint64{1, 2}
	ix2.Store(1, 0, 0, shared)
	ix2.Store(1, 0, 1, shared)
	seen := map[int]bool{}
	for i := range 64 {
		seen[chooseRank(ix2, 1, 0, 2, []uint64{1, 2, uint64(1000 + i*7919)})] = true
	}
	if len(seen) != 2 {
		t.Fatalf("64 continuations of one cached prefix all went to rank(s) %v", seen)
	}
}

// A system prompt cached on one rank only does not pin every new document
// after it to that rank (the sibling rank's cache would stay empty), while
// a session whose history is long against its new turn stays on its rank.
func TestChooseRankSpreadsPastSharedPrompt(t *testing.T) {
	ix, err := kvindex.New(kvindex.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	sys := []uint64{1, 2, 3, 4, 5, 6, 7, 8}
	ix.Store(1, 0, 0, sys) // only rank 0 has seen the system prompt
	doc := func(d int) []uint64 {
		k := append([]uint64(nil), sys...)
		for b := range 90 {
			k = append(k, uint64(1_000_000*(d+1)+b))
		}
		return k
	}
	per := [2]int{}
	for d := range 64 {
		r := chooseRank(ix, 1, 0, 2, doc(d))
		per[r]++
		if again := chooseRank(ix, 1, 0, 2, doc(d)); again != r {
			t.Fatalf("document %d went to rank %d, then %d", d, r, again)
		}
	}
	if per[0] == 0 || per[1] == 0 {
		t.Fatalf("64 new documents after a system prompt cached on rank 0 only: per rank %v", per)
	}
	// A session on rank 1: 98 cached blocks, 4 new ones.
	session := doc(99)[:98] // 98 blocks
	session = append(session, 7, 7, 7, 7)
	ix.Store(1, 0, 1, session[:98])
	for range 8 {
		if r := chooseRank(ix, 1, 0, 2, session); r != 1 {
			t.Fatalf("session left its 98-block history for rank %d", r)
		}
	}
}

func TestRankTargetingPerEngine(t *testing.T) {
	if newRankTargeting("sglang", 1) != nil || newRankTargeting("trtllm", 4) != nil || newRankTargeting("llamacpp", 2) != nil {
		t.Fatal("targeting for a single rank or an engine that cannot be told one")
	}
	body := []byte(`{"prompt":"x"}`)
	sg := newRankTargeting("sglang", 2)
	ep, ok := sg.targetEndpoint(proxy.Endpoint{Idx: 3, Addr: "a"}, 1, body)
	if !ok || string(ep.Body) != `{"prompt":"x","routed_dp_rank":1,"data_parallel_rank":1}` || ep.Header != nil || ep.Idx != 3 {
		t.Fatalf("sglang endpoint %+v", ep)
	}
	vl := newRankTargeting("", 2) // the default engine is vLLM
	ep, ok = vl.targetEndpoint(proxy.Endpoint{Idx: 0, Addr: "a"}, 1, body)
	if !ok || ep.Body != nil || ep.Header.Get("X-data-parallel-rank") != "1" {
		t.Fatalf("vllm endpoint %+v", ep)
	}
	if _, ok := sg.targetEndpoint(proxy.Endpoint{}, 0, []byte(`[]`)); ok {
		t.Fatal("a non-object body was rewritten")
	}
}
