package enginesim

import (
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/gateway"
)

// The emulated SGLang server info carries the sequence cap where SGLang
// puts it (per-rank effective caps in internal_states), and the gateway
// reads the engine's whole budget from it.
func TestSGLangServerInfoPublishesBudget(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineSGLang, DPRanks: 3, MaxRunning: 8, TimeScaleSet: true}, Deps{})
	for _, path := range []string{"/get_server_info", "/server_info"} {
		r := do(t, "GET", e.URL()+path, nil)
		n, found, err := gateway.ParseServerInfoBudget(r.body)
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
	if m, err := gateway.ParseEngineMetrics("vllm", r.body); err != nil || m.Running != 0 || m.Waiting != 0 {
		t.Fatalf("%+v %v", m, err)
	}
}
