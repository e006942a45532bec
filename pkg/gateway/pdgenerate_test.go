package gateway

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/dispatch"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

func (b *pdBench) generate(t *testing.T, body any) (status int, receipt string, out []byte) {
	t.Helper()
	raw, _ := json.Marshal(body)
	resp, err := http.Post(b.srv.URL+"/generate", "application/json", bytes.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ = io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get(proxy.HeaderRoute), out
}

// TestPDGenerate: SGLang's /generate on a P/D rule runs the concurrent
// bootstrap flow (the decode engine answers only after finding its room's
// prefill), single and batched; text is keyed as the engine hashes it, so
// Tier 1.5 follows the prefill inventory; a malformed batch gets a 400.
func TestPDGenerate(t *testing.T) {
	b := newPDBench(t, "sglang", lbrule.KVExactPD, 85)
	doc := longDoc(30)
	before := transfers(b.prefill)
	st, rc, out := b.generate(t, map[string]any{"text": doc + " Question one?", "sampling_params": map[string]any{"max_new_tokens": 4}})
	if st != 200 || !strings.HasPrefix(rc, "pd tier=") || !bytes.Contains(out, []byte(`"meta_info"`)) {
		t.Fatalf("single: %d %q %s", st, rc, out)
	}
	after := transfers(b.prefill)
	holder := 0
	if after[1] != before[1] {
		holder = 1
	}
	var keys []uint64
	for _, r := range b.prefill[holder].Cache().Ranks {
		for _, bl := range r.Blocks {
			keys = append(keys, bl.Hash)
		}
	}
	b.index.Store(1, holder, 0, keys)
	b.newPD(t, dispatch.Config{TrieMinPercent: 100})
	for round := 0; round < 3; round++ {
		q := fmt.Sprintf(" Question %d: %s", round+2, strings.Repeat(fmt.Sprintf("detail-%d ", round), 30))
		st, rc, out := b.generate(t, map[string]any{"text": doc + q, "sampling_params": map[string]any{"max_new_tokens": 2}, "stream": round == 1})
		if st != 200 || !strings.Contains(rc, "tier=tier1.5") || !strings.Contains(rc, fmt.Sprintf("prefill=%d", holder)) {
			t.Fatalf("round %d: %d receipt %q: want Tier 1.5 to prefill %d (%s)", round, st, rc, holder, out)
		}
	}

	// A batch of token-id prompts: one room per prompt, both legs.
	before = transfers(b.prefill)
	st, _, out = b.generate(t, map[string]any{"input_ids": [][]int{{1, 2, 3, 4, 5}, {6, 7, 8}, {9, 10}}, "sampling_params": map[string]any{"max_new_tokens": 2}})
	var many []map[string]any
	if st != 200 || json.Unmarshal(out, &many) != nil || len(many) != 3 {
		t.Fatalf("batch: %d %s", st, out)
	}
	after = transfers(b.prefill)
	if n := after[0] + after[1] - before[0] - before[1]; n != 3 {
		t.Fatalf("batch of 3 made %d prefill transfers", n)
	}

	b.g.cfg.MaxPromptTokens = 4
	st, _, out = b.generate(t, map[string]any{"input_ids": [][]int{{1, 2, 3, 4, 5}}})
	if st != 400 || !strings.Contains(string(out), "input_ids has 5 tokens") {
		t.Fatalf("over-long input_ids: %d %s", st, out)
	}
	b.g.cfg.MaxPromptTokens = 0
	st, _, out = b.generate(t, map[string]any{"text": []string{}})
	if st != 400 || !strings.Contains(string(out), "text is an empty list") {
		t.Fatalf("empty batch: %d %s", st, out)
	}
}

// TestPDGenerateOtherEngines: /generate is SGLang's; on a vLLM P/D rule it
// is passed to a decode endpoint as before.
func TestPDGenerateOtherEngines(t *testing.T) {
	b := newPDBench(t, "vllm", lbrule.KVExactOff, 86)
	plan, fn, err := b.g.Prepare(&proxy.Request{Service: 1, Method: "POST", Path: "/generate", Header: http.Header{}, Body: []byte(`{"text":"hi"}`)})
	if err != nil || fn != nil || len(plan.Candidates) == 0 || plan.Candidates[0].Idx < 2 {
		t.Fatalf("plan %+v fn %v err %v", plan, fn != nil, err)
	}
}
