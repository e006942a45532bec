package dispatch

import (
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
