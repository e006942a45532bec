package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/testbed/daemontest"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// outlierPool starts a plain round-robin mode-4 rule (no probes, so only
// passive health checking can take an endpoint out) over n endpoints on
// 127.77.net.11.. . faults[i] configures engine i; refuse[i] leaves
// address i without a listener (connections are refused).
func outlierPool(t *testing.T, net int, faults []enginesim.Faults, refuse []bool, env []string, args ...string) (*daemontest.Daemon, string, []*enginesim.Engine) {
	t.Helper()
	var eps []string
	engines := make([]*enginesim.Engine, len(faults))
	for i, f := range faults {
		host := fmt.Sprintf("127.77.%d.%d", net, 11+i)
		if !refuse[i] {
			engines[i] = startEngine(t, enginesim.Config{Engine: "vllm", Listen: host + ":28000", ZMQPort: -1,
				TimeScale: 0, TimeScaleSet: true, Faults: f})
		}
		eps = append(eps, fmt.Sprintf(`{"endpointIP":%q,"targetPort":28000,"weight":1}`, host))
	}
	a := append([]string{"--tokenizer-dir", tokenizerDir(), "--metrics", "--proxy-receipts", "always"}, args...)
	d := daemontest.Start(t, bins, t.TempDir(), env, a...)
	vip := fmt.Sprintf("127.77.%d.1:28080", net)
	rule := fmt.Sprintf(`{"serviceArguments":{"externalIP":"127.77.%d.1","port":28080,"protocol":"tcp","mode":4,"sel":0,
		"probetype":"none"},"endpoints":[%s]}`, net, strings.Join(eps, ","))
	resp, body := post(t, d.URL("/config/loadbalancer"), json.RawMessage(rule))
	if resp.StatusCode != 200 {
		t.Fatalf("create rule: %d %s", resp.StatusCode, body)
	}
	return d, vip, engines
}

// drive sends n sequential completions and returns the status counts and
// the receipts seen.
func drive(t *testing.T, vip string, n int) (map[int]int, []string) {
	t.Helper()
	codes := map[int]int{}
	var receipts []string
	for i := 0; i < n; i++ {
		resp, _ := post(t, "http://"+vip+"/v1/completions", map[string]any{"model": model, "prompt": fmt.Sprintf("hello %d", i), "max_tokens": 2})
		codes[resp.StatusCode]++
		receipts = append(receipts, resp.Header.Get("X-Loxilb-Route"))
	}
	return codes, receipts
}

func countWith(l []string, sub string) int {
	n := 0
	for _, s := range l {
		if strings.Contains(s, sub) {
			n++
		}
	}
	return n
}

// TestOutlierEjects5xx: one engine of three answers 503 to everything.
// Round robin sends it every third request until 5 consecutive 5xx eject
// it; from then on no client sees an error.
func TestOutlierEjects5xx(t *testing.T) {
	faults := []enginesim.Faults{{}, {FailRequests: -1, FailStatus: 503}, {}}
	d, vip, engines := outlierPool(t, 1, faults, make([]bool, 3), nil)
	codes, receipts := drive(t, vip, 60)
	t.Logf("client statuses over 60 requests: %v; the failing engine served %d", codes, engines[1].Stats().Requests)
	if codes[503] != 5 || codes[200] != 55 {
		t.Fatalf("statuses %v, want exactly 5 503s (the ejection threshold) and 55 200s", codes)
	}
	if n := countWith(receipts, "ejected=1"); n < 40 {
		t.Errorf("%d receipts name ejected=1, want the requests after the ejection", n)
	}
	m := metrics(t, d)
	if v := metricValue(m, "loxilb_outlier_ejections_total", `reason="consecutive_5xx"`, `ep_idx="1"`); v != 1 {
		t.Errorf("loxilb_outlier_ejections_total{consecutive_5xx,ep 1} = %v, want 1", v)
	}
	if v := metricValue(m, "loxilb_outlier_ejected{", `ep_idx="1"`); v != 1 {
		t.Errorf("loxilb_outlier_ejected{ep 1} = %v, want 1", v)
	}
	if v := metricValue(m, "loxilb_gateway_ejected_skipped_total", `ep_idx="1"`); v < 40 {
		t.Errorf("loxilb_gateway_ejected_skipped_total = %v, want the requests after the ejection", v)
	}
	checkMetricLabels(t, m)
}

// TestOutlierRetriesRefused: an endpoint refuses connections. Every
// request routed to it is sent to the next endpoint, so no client sees
// an error, and three refusals eject it.
func TestOutlierRetriesRefused(t *testing.T) {
	d, vip, _ := outlierPool(t, 2, make([]enginesim.Faults, 3), []bool{false, true, false}, nil)
	codes, _ := drive(t, vip, 45)
	t.Logf("client statuses over 45 requests with a refusing endpoint: %v", codes)
	if codes[200] != 45 {
		t.Fatalf("statuses %v, want 45 200s: refused connections are retried", codes)
	}
	m := metrics(t, d)
	if v := metricValue(m, "loxilb_outlier_ejections_total", `reason="gateway_failure"`, `ep_idx="1"`); v != 1 {
		t.Errorf("loxilb_outlier_ejections_total{gateway_failure,ep 1} = %v, want 1", v)
	}
	if v := metricValue(m, "loxilb_ai_upstream_errors_total", `class="connect"`); v != 3 {
		t.Errorf("connect errors %v, want 3 (ejected after the third)", v)
	}
}

// TestOutlierResetNotRetried: an engine reads each request whole and then
// resets the connection. It may have started the request, so the proxy
// never sends it elsewhere: exactly the three requests before the
// ejection get 502, and the engine is ejected.
func TestOutlierResetNotRetried(t *testing.T) {
	faults := []enginesim.Faults{{}, {ResetRequests: -1}, {}}
	d, vip, engines := outlierPool(t, 3, faults, make([]bool, 3), nil)
	codes, _ := drive(t, vip, 45)
	t.Logf("client statuses over 45 requests with a resetting engine: %v; it received %d", codes, engines[1].Stats().Requests)
	if codes[http.StatusBadGateway] != 3 || codes[200] != 42 {
		t.Fatalf("statuses %v, want exactly 3 502s (not retried) and 42 200s", codes)
	}
	if got := engines[1].Stats().Requests; got != 3 {
		t.Errorf("the resetting engine received %d requests, want 3", got)
	}
	m := metrics(t, d)
	if v := metricValue(m, "loxilb_outlier_ejections_total", `reason="gateway_failure"`, `ep_idx="1"`); v != 1 {
		t.Errorf("loxilb_outlier_ejections_total{gateway_failure,ep 1} = %v, want 1", v)
	}
}

// TestPDBreakerOpensOnPrefill: one of two vLLM prefill endpoints answers
// 503. With LLB_PD_ORIGIN_ERR_THRESHOLD=2 its breaker opens after two
// origin errors and every later request prefills on the other one.
func TestPDBreakerOpensOnPrefill(t *testing.T) {
	const net = 78
	var eps []string
	var engines []*enginesim.Engine
	for i := 0; i < 3; i++ {
		host := fmt.Sprintf("127.%d.0.%d", net, 11+i)
		role, epRole := enginesim.RolePrefill, 1
		if i == 2 {
			role, epRole = enginesim.RoleDecode, 2
		}
		c := enginesim.Config{Engine: "vllm", Role: role, Listen: host + ":28000", ZMQPort: -1, Seed: seed, TimeScale: 0, TimeScaleSet: true}
		if i == 0 {
			c.Faults = enginesim.Faults{FailRequests: -1, FailStatus: 503}
		}
		engines = append(engines, startEngine(t, c))
		eps = append(eps, fmt.Sprintf(`{"endpointIP":%q,"targetPort":28000,"weight":1,"ep_role":%d}`, host, epRole))
	}
	d := daemontest.Start(t, bins, t.TempDir(), []string{"LLB_KV_NONE_HASH_SEED=" + seed, "LLB_PD_ORIGIN_ERR_THRESHOLD=2"},
		"--tokenizer-dir", tokenizerDir(), "--metrics", "--proxy-receipts", "always")
	rule := fmt.Sprintf(`{"serviceArguments":{"externalIP":"127.%d.0.1","port":28080,"protocol":"tcp","mode":4,"sel":0,
		"probetype":"none","kvEngineType":"vllm","pd_disagg_mode":true},"endpoints":[%s]}`, net, strings.Join(eps, ","))
	resp, body := post(t, d.URL("/config/loadbalancer"), json.RawMessage(rule))
	if resp.StatusCode != 200 {
		t.Fatalf("create rule: %d %s", resp.StatusCode, body)
	}
	vip := fmt.Sprintf("127.%d.0.1:28080", net)
	codes, receipts := drive(t, vip, 30)
	t.Logf("client statuses over 30 P/D requests with a failing prefill endpoint: %v; it received %d", codes, engines[0].Stats().Requests)
	if codes[502] > 2 || codes[200] < 28 {
		t.Fatalf("statuses %v, want at most 2 errors before the breaker opens", codes)
	}
	if got := engines[0].Stats().Requests; got != uint64(codes[502]) || got > 2 {
		t.Errorf("the failing prefill endpoint received %d requests, want the %d that failed (at most 2)", got, codes[502])
	}
	if n := countWith(receipts, "ejected=0"); n < 26 {
		t.Errorf("%d receipts name ejected=0", n)
	}
	m := metrics(t, d)
	if v := metricValue(m, "loxilb_outlier_ejections_total", `reason="pd_origin_error"`, `role="prefill"`, `ep_idx="0"`); v != 1 {
		t.Errorf("loxilb_outlier_ejections_total{pd_origin_error,prefill,ep 0} = %v, want 1", v)
	}
	checkMetricLabels(t, m)
}
