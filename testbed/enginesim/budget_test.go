package enginesim

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/enginemetrics"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/testbed/wait"
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

// A vLLM engine queueing behind its sequence budget shows it in nothing
// but its running and waiting gauges, and only while the burst lasts. The
// gateway's scraper, sampling while this node has more requests open than
// the engine was seen running, learns the budget within the burst, with
// its regular scrape an hour away.
func TestScraperLearnsVLLMBudgetFromAQueue(t *testing.T) {
	// Two sequences; each 48-token prefill takes about a second.
	e := startEngine(t, Config{Engine: EngineVLLM, MaxRunning: 2, PrefillUsPerToken: 20000, TimeScale: 1, TimeScaleSet: true}, Deps{})
	var wg sync.WaitGroup
	defer wg.Wait()
	for i := range 3 {
		wg.Go(func() {
			body, _ := json.Marshal(map[string]any{"model": "sim-model", "prompt": seqTokens(100*i+1, 48), "max_tokens": 1})
			resp, err := http.Post(e.URL()+"/v1/completions", "application/json", bytes.NewReader(body))
			if err != nil {
				t.Errorf("request %d: %v", i, err)
				return
			}
			resp.Body.Close()
		})
	}
	s, err := enginemetrics.New(enginemetrics.Config{Interval: time.Hour, SelfInFlight: func(uint32, int) int { return 3 }}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ap := netip.MustParseAddrPort(e.Addr())
	rule := &lbrule.Rule{Service: lbrule.ServiceArgs{Mode: lbrule.ModeFullProxy, KVEngine: "vllm"},
		Endpoints: []lbrule.Endpoint{{IP: ap.Addr().String(), Port: int(ap.Port())}}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := s.Reconcile(ctx, []control.Service{{ID: 1, Rule: rule}}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	wait.Eventually(t, "the budget learned from the engine's queue", func() bool {
		n, src, _ := s.LearnedSlots(1, 0)
		return n == 2 && src == enginemetrics.BudgetObserved
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
