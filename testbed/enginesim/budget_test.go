package enginesim

import (
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/enginemetrics"
)

// The emulated SGLang server info carries the sequence cap where SGLang
// puts it (per-rank effective caps in internal_states), and the gateway
// reads the engine's whole budget from it.
func TestSGLangServerInfoPublishesBudget(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineSGLang, DPRanks: 3, MaxRunning: 8, TimeScaleSet: true}, Deps{})
	for _, path := range []string{"/get_server_info", "/server_info"} {
		r := do(t, "GET", e.URL()+path, nil)
		n, found, err := enginemetrics.ParseServerInfoBudget(r.body)
		if err != nil || !found || n != 8 {
			t.Fatalf("%s: budget %d %v %v from %s", path, n, found, err, r.body)
		}
		if states, _ := r.json["internal_states"].([]any); len(states) != 3 {
			t.Fatalf("%s: %d internal states, want one per rank", path, len(states))
		}
	}
}

// The emulated vLLM publishes its cache configuration but, as vLLM, no
// sequence budget: the gateway parses its load gauges and nothing else.
func TestVLLMMetricsPublishNoBudget(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineVLLM, MaxRunning: 5, TimeScaleSet: true}, Deps{})
	r := do(t, "GET", e.URL()+"/metrics", nil)
	text := string(r.body)
	if !strings.Contains(text, "vllm:cache_config_info{") || strings.Contains(text, "max_num_seqs") {
		t.Fatalf("metrics:\n%s", text)
	}
	if m, err := enginemetrics.Parse("vllm", r.body); err != nil || m.Running != 0 || m.Waiting != 0 {
		t.Fatalf("%+v %v", m, err)
	}
}

// With data parallelism the emulated SGLang publishes each rank's running
// and queued requests labelled with its dp_rank, as SGLang's schedulers
// do; the endpoint totals the gateway sums stay the engine's.
func TestSGLangMetricsPerRank(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineSGLang, DPRanks: 2, MaxRunning: 4, TimeScaleSet: true}, Deps{})
	text := string(do(t, "GET", e.URL()+"/metrics", nil).body)
	for _, s := range []string{`sglang:num_running_reqs{dp_rank="0",engine_type="unified"`, `sglang:num_running_reqs{dp_rank="1",engine_type="unified"`,
		`sglang:num_queue_reqs{dp_rank="1",engine_type="unified"`} {
		if !strings.Contains(text, s) {
			t.Errorf("metrics lack %s:\n%s", s, text)
		}
	}
	if m, err := enginemetrics.Parse("sglang", []byte(text)); err != nil || m.Running != 0 || m.Waiting != 0 {
		t.Fatalf("%+v %v", m, err)
	}
	one := startEngine(t, Config{Engine: EngineSGLang, TimeScaleSet: true}, Deps{})
	if text := string(do(t, "GET", one.URL()+"/metrics", nil).body); strings.Contains(text, "dp_rank") {
		t.Fatalf("a single-rank engine labels a dp_rank:\n%s", text)
	}
}
