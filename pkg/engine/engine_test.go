package engine

import (
	"slices"
	"testing"
)

func TestMatrixDefaults(t *testing.T) {
	cases := map[string]string{"": AlgoSHA256CBOR, "vllm": AlgoSHA256CBOR, "sglang": AlgoSHA256SGLang, "trtllm": AlgoBlockHashTRTLLM}
	for name, want := range cases {
		s, ok := Lookup(name)
		if !ok || s.DefaultAlgo != want {
			t.Errorf("Lookup(%q) = %+v, %v; want default %s", name, s, ok, want)
		}
		if !s.AllowsAlgo(want) {
			t.Errorf("%s does not allow its own default %s", name, want)
		}
	}
	if s, _ := Lookup("llamacpp"); s.KVExact || s.PD {
		t.Errorf("llamacpp must not offer KV-exact or P/D: %+v", s)
	}
	if _, ok := Lookup("tgi"); ok {
		t.Error("unknown engine accepted")
	}
	if s, _ := Lookup("sglang"); s.AllowsAlgo(AlgoSHA256CBOR) {
		t.Error("sglang must not accept a vLLM algorithm")
	}
	for _, a := range AllAlgos {
		if !KnownAlgo(a) {
			t.Errorf("KnownAlgo(%s) false", a)
		}
	}
	if len(Names()) != 4 || len(All()) != 4 {
		t.Errorf("Names=%v", Names())
	}
	if s, _ := Lookup("sglang"); !s.Rank.Targets() || s.Rank.BodyFields[0] != "routed_dp_rank" || s.Rank.PDPrefillField != "disagg_prefill_dp_rank" {
		t.Errorf("sglang rank target: %+v", s.Rank)
	}
	if s, _ := Lookup("vllm"); s.Rank.Header != "X-data-parallel-rank" || len(s.Rank.BodyFields) != 0 {
		t.Errorf("vllm rank target: %+v", s.Rank)
	}
	for _, n := range []string{"trtllm", "llamacpp"} {
		if s, _ := Lookup(n); s.Rank.Targets() {
			t.Errorf("%s cannot be told a rank: %+v", n, s.Rank)
		}
	}
}

func TestPDPaths(t *testing.T) {
	for name, want := range map[string]bool{"sglang": true, "vllm": false, "trtllm": false} {
		s, _ := Lookup(name)
		if got := slices.Contains(s.PDPaths, PathGenerate); got != want || !slices.Contains(s.PDPaths, PathChatCompletions) {
			t.Errorf("%s P/D paths %v", name, s.PDPaths)
		}
	}
}
