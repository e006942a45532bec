package dispatch

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

func prompt(topic string, n int) string {
	var sb strings.Builder
	for i := 0; i < n; i++ {
		fmt.Fprintf(&sb, "%s sentence number %d about prefix caching and disaggregated serving. ", topic, i)
	}
	return sb.String()
}

type flowCase struct {
	name   string
	path   string
	stream bool
}

var flowCases = []flowCase{
	{"completions", "/v1/completions", false},
	{"completions-stream", "/v1/completions", true},
	{"chat", "/v1/chat/completions", false},
	{"chat-stream", "/v1/chat/completions", true},
}

func bodyFor(c flowCase, p string, maxTokens int) map[string]any {
	b := map[string]any{"model": "sim-model", "max_tokens": maxTokens, "stream": c.stream}
	if strings.Contains(c.path, "chat") {
		b["messages"] = []map[string]string{{"role": "user", "content": p}}
	} else {
		b["prompt"] = p
	}
	if c.stream {
		b["stream_options"] = map[string]bool{"include_usage": true}
	}
	return b
}

// TestFlows runs every engine's P/D flow against emulators in P/D roles, in
// streaming and non-streaming form, and checks (1) the answer equals what a
// role-less engine produces for the same prompt, (2) every decode leg
// claimed the transfer record of a prefill leg for the same prompt (the
// emulator refuses a decode otherwise), from the prefill engine the
// dispatcher chose.
func TestFlows(t *testing.T) {
	for _, engine := range []string{enginesim.EngineVLLM, enginesim.EngineSGLang, enginesim.EngineTRTLLM} {
		t.Run(engine, func(t *testing.T) {
			f := newFleet(t, fleetOpts{engine: engine, nPrefill: 2, nDec: 2})
			for i, c := range flowCases {
				t.Run(c.name, func(t *testing.T) {
					body := bodyFor(c, prompt(fmt.Sprintf("%s-%d", engine, i), 8), 12)
					want := reference(t, engine, c.path, body)
					if len(strings.Fields(want)) != 12 {
						t.Fatalf("reference answer %q: want 12 words", want)
					}
					before := claims(f)
					r := f.post(t, c.path, body)
					if r.status != http.StatusOK || r.err != nil {
						t.Fatalf("status %d err %v: %s", r.status, r.err, r.body)
					}
					if got := text(t, r); got != want {
						t.Fatalf("P/D answer differs from a role-less engine:\n got %q\nwant %q", got, want)
					}
					if c.stream && !strings.HasPrefix(r.header.Get("Content-Type"), "text/event-stream") {
						t.Fatalf("streaming request answered with %q", r.header.Get("Content-Type"))
					}
					after := claims(f)
					// The claim is served by the prefill engine the decode leg
					// reached with the parameters it was given.
					if after.prefillClaimed != before.prefillClaimed+1 {
						t.Fatalf("transfer claims %d -> %d, want one more", before.prefillClaimed, after.prefillClaimed)
					}
					if after.prefillTransfers != before.prefillTransfers+1 {
						t.Fatalf("prefill transfers %d -> %d, want one more", before.prefillTransfers, after.prefillTransfers)
					}
				})
			}
			if got := metricSum(t, f.reg, "loxilb_ai_pd_requests_total", "outcome", "ok"); got != float64(len(flowCases)) {
				t.Fatalf("ok requests = %v, want %d", got, len(flowCases))
			}
			if got := metricSum(t, f.reg, "loxilb_ai_pd_decode_ttft_seconds"); got != float64(len(flowCases)) {
				t.Fatalf("decode TTFT samples = %v", got)
			}
			if got := metricSum(t, f.reg, "loxilb_ai_pd_prefill_duration_seconds"); got != float64(len(flowCases)) {
				t.Fatalf("prefill duration samples = %v", got)
			}
			if engine != enginesim.EngineSGLang {
				if got := metricSum(t, f.reg, "loxilb_ai_pd_kv_params_found_total"); got != float64(len(flowCases)) {
					t.Fatalf("params found = %v", got)
				}
			}
		})
	}
}

type claimCounts struct{ prefillTransfers, prefillClaimed uint64 }

func claims(f *fleet) claimCounts {
	var c claimCounts
	for _, e := range f.prefill {
		s := e.Stats()
		c.prefillTransfers += s.PDTransfers
		c.prefillClaimed += s.PDClaimed
	}
	return c
}

// TestRightPrefill pins each request to one prefill engine (the other is
// unhealthy) and checks that engine's record was the one claimed: the
// decode leg was pointed at the right prefill.
func TestRightPrefill(t *testing.T) {
	for _, engine := range []string{enginesim.EngineVLLM, enginesim.EngineSGLang, enginesim.EngineTRTLLM} {
		t.Run(engine, func(t *testing.T) {
			f := newFleet(t, fleetOpts{engine: engine, nPrefill: 2, nDec: 1})
			for target := 0; target < 2; target++ {
				for i := range f.pool.Prefill {
					f.pool.Prefill[i].Healthy = i == target
				}
				before := f.prefill[target].Stats()
				r := f.post(t, "/v1/completions", bodyFor(flowCases[0], prompt(fmt.Sprintf("right-%d", target), 4), 4))
				if r.status != 200 {
					t.Fatalf("status %d: %s", r.status, r.body)
				}
				after := f.prefill[target].Stats()
				if after.PDTransfers != before.PDTransfers+1 {
					t.Fatalf("prefill %d did not run the prefill leg", target)
				}
				if after.PDClaimed != before.PDClaimed+1 {
					t.Fatalf("prefill %d's transfer was not claimed by the decode leg", target)
				}
			}
		})
	}
}

// TestSGLangGenerate: SGLang's native /generate runs the concurrent flow;
// the decode engine answers only when it finds its room's prefill, so a
// 200 means both legs carried the same room (one per prompt for a batch).
func TestSGLangGenerate(t *testing.T) {
	f := newFleet(t, fleetOpts{engine: enginesim.EngineSGLang, nPrefill: 1, nDec: 1})
	r := f.post(t, "/generate", map[string]any{"input_ids": []int{5, 6, 7, 8, 9, 10, 11, 12}, "sampling_params": map[string]any{"max_new_tokens": 4}})
	var one struct {
		Text     string `json:"text"`
		MetaInfo struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"meta_info"`
	}
	if r.status != 200 || json.Unmarshal(r.body, &one) != nil || one.Text == "" || one.MetaInfo.CompletionTokens != 4 {
		t.Fatalf("single /generate: %d %s", r.status, r.body)
	}
	r = f.post(t, "/generate", map[string]any{"text": []string{"alpha beta", "gamma delta epsilon", "zeta"}, "sampling_params": map[string]any{"max_new_tokens": 2}})
	var many []struct {
		Text string `json:"text"`
	}
	if r.status != 200 || json.Unmarshal(r.body, &many) != nil || len(many) != 3 {
		t.Fatalf("batched /generate: %d %s", r.status, r.body)
	}
	if got := f.prefill[0].Stats().PDTransfers; got != 4 {
		t.Fatalf("prefill served %d prompts, want 4", got)
	}
	if got := f.decode[0].Stats().Completed; got != 2 {
		t.Fatalf("decode completed %d requests, want 2", got)
	}
	for _, body := range []map[string]any{
		{"text": []string{}},
		{"text": "a", "input_ids": []int{1}},
		{"text": []any{"a", 5}},
		{"input_ids": []any{[]int{1, 2}, 3}},
		{"input_ids": [][]int{{1, 2}, {}}},
		{"sampling_params": map[string]any{}},
	} {
		r := f.post(t, "/generate", body)
		if r.status != 400 || !strings.Contains(string(r.body), "/generate") {
			t.Errorf("%v: %d %s", body, r.status, r.body)
		}
	}
	if got := f.prefill[0].Stats().Requests; got != 2 {
		t.Errorf("malformed batches reached the prefill engine: %d requests", got)
	}
}

func TestGenerateNeedsSGLang(t *testing.T) {
	f := newFleet(t, fleetOpts{engine: enginesim.EngineVLLM, nPrefill: 1, nDec: 1})
	if r := f.post(t, "/generate", map[string]any{"text": "hi"}); r.status != 400 || !strings.Contains(string(r.body), "SGLang") {
		t.Fatalf("/generate on a vLLM pool: %d %s", r.status, r.body)
	}
}
