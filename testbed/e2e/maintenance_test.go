package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/testbed/daemontest"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// maintenancePool is a vLLM KV-exact round-robin rule over two emulators
// that decode one token every 50 ms, served by a daemon on stateDir.
type maintenancePool struct {
	d       *daemontest.Daemon
	state   string
	vip     string
	hosts   []string
	engines []*enginesim.Engine
}

func (m *maintenancePool) start(t *testing.T) {
	t.Helper()
	m.d = daemontest.Start(t, bins, m.state, []string{"LLB_KV_NONE_HASH_SEED=" + seed},
		"--tokenizer-dir", tokenizerDir(), "--metrics", "--proxy-receipts", "always")
}

func newMaintenancePool(t *testing.T, net int) *maintenancePool {
	t.Helper()
	m := &maintenancePool{state: t.TempDir(), vip: fmt.Sprintf("127.0.%d.1:28080", net)}
	var eps []string
	for i := 0; i < 2; i++ {
		host := fmt.Sprintf("127.0.%d.%d", net, 11+i)
		c := enginesimVLLM(host)
		c.TimeScale, c.DecodeUsPerToken, c.PrefillUsPerToken = 1, 50_000, 1
		m.engines = append(m.engines, startEngine(t, c))
		m.hosts = append(m.hosts, host)
		eps = append(eps, fmt.Sprintf(`{"endpointIP":%q,"targetPort":28000,"weight":1}`, host))
	}
	m.start(t)
	rule := fmt.Sprintf(`{"serviceArguments":{"externalIP":"127.0.%d.1","port":28080,"protocol":"tcp","mode":4,"sel":0,
		"kvExactMode":3,"kvEngineType":"vllm","kvZmqPort":25557,"kvDpRankCount":1,"kvBlockSize":16,"model_name":%q},"endpoints":[%s]}`,
		net, model, strings.Join(eps, ","))
	resp, body := post(t, m.d.URL("/config/loadbalancer"), json.RawMessage(rule))
	if resp.StatusCode != 200 {
		t.Fatalf("create rule: %d %s", resp.StatusCode, body)
	}
	m.waitConnected(t)
	return m
}

func (m *maintenancePool) waitConnected(t *testing.T) {
	t.Helper()
	waitFor(t, "subscribers connected", 15*time.Second, func() bool {
		return metricValue(metrics(t, m.d), "loxilb_kv_subscriber_connected") >= 2
	})
}

// drain runs `loxicmd set drain on|off` and returns its output.
func (m *maintenancePool) drain(t *testing.T, ep int, on string) string {
	t.Helper()
	out, errs, code := daemontest.CLI(t, bins, m.d.Port, "set", "drain", on, strings.Split(m.vip, ":")[0], "--tcp=28080", "--endpoint="+m.hosts[ep]+":28000")
	if code != 0 {
		t.Fatalf("set drain %s: exit %d %s %s", on, code, out, errs)
	}
	return out
}

// stream starts a streamed completion of prompt and returns the route its
// receipt names once the first event arrived.
func stream(t *testing.T, vip, prompt string, tokens int) (route, *bufio.Reader) {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"model": model, "prompt": prompt, "max_tokens": tokens, "stream": true, "ignore_eos": true})
	resp, err := http.Post("http://"+vip+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	if resp.StatusCode != 200 {
		t.Fatalf("stream: %d", resp.StatusCode)
	}
	rc, err := router.ParseReceipt(resp.Header.Get("X-Loxilb-Route"))
	if err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(resp.Body)
	if line, err := br.ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("first event: %q %v", line, err)
	}
	return route{ep: rc.EP, tier: rc.Tier, matched: rc.Matched}, br
}

// TestEndpointDrain: an endpoint put in maintenance through loxicmd gets no
// new request, not even one its KV cache would attract, while a stream
// already on it runs to its end; its KV subscription stays, so put back in
// service it is warm at once; the state shows in the listing, the wide view
// and the metrics, and survives a restart of the daemon.
func TestEndpointDrain(t *testing.T) {
	m := newMaintenancePool(t, 213)
	prompt := longPrompt("maintenance", 1)
	// Warm one endpoint with the prompt; the second request hits it.
	first := complete(t, m.vip, prompt)
	waitFor(t, "the warm endpoint's events", 10*time.Second, func() bool {
		var inv struct{ Total int }
		getJSON(t, m.d.URL(fmt.Sprintf("/config/ai/kv/inventory?service_id=1&ep_idx=%d", first.ep)), &inv)
		return inv.Total > 0
	})
	warm := complete(t, m.vip, prompt)
	if warm.tier != router.TierKV || warm.ep != first.ep {
		t.Fatalf("warm-up: %+v after %+v", warm, first)
	}
	w, other := warm.ep, 1-warm.ep

	invTotal := func(ep int) int {
		var inv struct{ Total int }
		getJSON(t, m.d.URL(fmt.Sprintf("/config/ai/kv/inventory?service_id=1&ep_idx=%d", ep)), &inv)
		return inv.Total
	}
	warmBlocks := invTotal(w)

	// A long stream on the warm endpoint (6 s, so it outlasts the loxicmd
	// calls on a loaded machine), then the drain.
	const streamTokens = 120
	sr, br := stream(t, m.vip, prompt, streamTokens)
	if sr.ep != w {
		t.Fatalf("stream went to %d, want the warm endpoint %d", sr.ep, w)
	}
	out := m.drain(t, w, "on")
	if !strings.Contains(out, "draining, 1 requests in flight") {
		t.Errorf("set drain on: %q, want the stream counted in flight", out)
	}
	before := m.engines[w].Stats().Requests
	for i := 0; i < 6; i++ {
		if r := complete(t, m.vip, prompt); r.ep != other {
			t.Fatalf("request %d during the drain went to endpoint %d (%+v)", i, r.ep, r)
		}
	}
	if got := m.engines[w].Stats().Requests; got != before {
		t.Errorf("the draining engine received %d new requests", got-before)
	}
	events, done, err := readRest(br)
	if err != nil || !done || events < streamTokens-1 {
		t.Fatalf("in-flight stream: %d events, done=%v, err=%v", events, done, err)
	}

	// Visible: listing, wide view, metrics; the subscription is kept.
	checkVisible := func(when string, draining bool) {
		t.Helper()
		var list struct {
			LBAttr []struct {
				Endpoints []struct {
					Draining bool `json:"draining"`
				} `json:"endpoints"`
			} `json:"lbAttr"`
		}
		getJSON(t, m.d.URL("/config/loadbalancer/all"), &list)
		if got := list.LBAttr[0].Endpoints; got[w].Draining != draining || got[other].Draining {
			t.Errorf("%s: listing %+v", when, got)
		}
		wide, _, _ := daemontest.CLI(t, bins, m.d.Port, "get", "lb", "-o", "wide")
		if strings.Contains(wide, "draining") != draining {
			t.Errorf("%s: get lb -o wide:\n%s", when, wide)
		}
		text := metrics(t, m.d)
		want := 0.0
		if draining {
			want = 1
		}
		if v := metricValue(text, "loxilb_endpoint_draining", `service="1"`, fmt.Sprintf(`ep_idx="%d"`, w)); v != want {
			t.Errorf("%s: loxilb_endpoint_draining of endpoint %d = %v", when, w, v)
		}
	}
	checkVisible("while draining", true)
	if v := metricValue(metrics(t, m.d), "loxilb_kv_subscriber_connected", fmt.Sprintf(`ep_idx="%d"`, w)); v != 1 {
		t.Errorf("the draining endpoint's KV subscription: connected=%v", v)
	}

	// Back in service it is warm at once: its inventory was kept (the
	// other endpoint, which served the prompt meanwhile, is as warm, so
	// which of the two a request goes to is the load blend's choice).
	if got := invTotal(w); got < warmBlocks {
		t.Errorf("the draining endpoint's inventory fell from %d to %d blocks", warmBlocks, got)
	}
	m.drain(t, w, "off")
	checkVisible("back in service", false)
	if r := complete(t, m.vip, prompt); r.tier != router.TierKV {
		t.Errorf("back in service: %+v, want a Tier-1.5 hit", r)
	}

	// The state survives a restart.
	m.drain(t, w, "on")
	m.d.Stop()
	m.start(t)
	m.waitConnected(t)
	checkVisible("after a restart", true)
	for i := 0; i < 4; i++ {
		if r := complete(t, m.vip, longPrompt("restart", i)); r.ep != other {
			t.Fatalf("request %d after the restart went to the draining endpoint: %+v", i, r)
		}
	}
	// Draining every endpoint leaves nothing to serve: 503, said so.
	m.drain(t, other, "on")
	resp, body := post(t, "http://"+m.vip+"/v1/completions", map[string]any{"model": model, "prompt": "hello", "max_tokens": 2})
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), "draining") {
		t.Errorf("every endpoint draining: %d %s", resp.StatusCode, body)
	}
}

// TestStrictAttestationThroughDaemon: engine 1 hashes 32-token blocks
// against the rule's 16, so its verdict becomes block_size_mismatch; the
// rule sets kvParityStrict, so from then on it gets no Tier-1.5 request
// (it still serves misses), and the exclusion shows in the listing, the
// wide view, the inventory API and the metrics.
func TestStrictAttestationThroughDaemon(t *testing.T) {
	p := newPool(t, poolOpts{n: 2, net: 214, sel: 0, ruleArgs: `"kvParityStrict":true`,
		engine: func(i int, c *enginesim.Config) {
			if i == 1 {
				c.BlockSize = 32
			}
		}})
	type epList struct {
		LBAttr []struct {
			Endpoints []struct {
				KVParity   string `json:"kvParity"`
				KVExcluded bool   `json:"kvExcluded"`
			} `json:"endpoints"`
		} `json:"lbAttr"`
	}
	n := 0
	waitFor(t, "endpoint 1's verdict", 20*time.Second, func() bool {
		// Unrelated prompts: each is a miss, so round robin reaches
		// endpoint 1 too.
		complete(t, p.vip, longPrompt(fmt.Sprintf("verdict%d", n), n))
		n++
		var l epList
		getJSON(t, p.d.URL("/config/loadbalancer/all"), &l)
		return l.LBAttr[0].Endpoints[1].KVParity == "block_size_mismatch" && l.LBAttr[0].Endpoints[1].KVExcluded
	})
	served := map[string]int{}
	for i := 0; i < 8; i++ {
		prompt := longPrompt(fmt.Sprintf("strict%d", i), i)
		for j := 0; j < 3; j++ {
			r := complete(t, p.vip, prompt)
			served[fmt.Sprintf("%d/%s", r.ep, r.tier)]++
			if r.ep == 1 && r.tier != router.TierFallback {
				t.Fatalf("the mismatched endpoint got a %s request: %+v (served so far %v)", r.tier, r, served)
			}
		}
	}
	if served["0/"+router.TierKV] == 0 || served["1/"+router.TierFallback] == 0 {
		t.Errorf("want Tier-1.5 hits on endpoint 0 and misses still served by endpoint 1: %v", served)
	}
	t.Logf("requests by endpoint/tier: %v", served)
	var inv struct {
		Excluded bool `json:"kv_excluded"`
	}
	getJSON(t, p.d.URL("/config/ai/kv/inventory?service_id=1&ep_idx=1"), &inv)
	if !inv.Excluded {
		t.Error("inventory API: kv_excluded is false")
	}
	wide, _, _ := daemontest.CLI(t, bins, p.d.Port, "get", "lb", "-o", "wide")
	if !strings.Contains(wide, "block_size_mismatch:no-tier1.5") {
		t.Errorf("get lb -o wide:\n%s", wide)
	}
	if v := metricValue(metrics(t, p.d), "loxilb_gateway_kv_untrusted_skipped_total", `ep_idx="1"`, `verdict="block_size_mismatch"`); v < 8 {
		t.Errorf("loxilb_gateway_kv_untrusted_skipped_total = %v", v)
	}
}
