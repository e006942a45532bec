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

	// A long stream on the warm endpoint, then the drain.
	sr, br := stream(t, m.vip, prompt, 40)
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
	if err != nil || !done || events < 39 {
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

	// Back in service it is warm at once.
	m.drain(t, w, "off")
	checkVisible("back in service", false)
	if r := complete(t, m.vip, prompt); r.ep != w || r.tier != router.TierKV {
		t.Errorf("back in service: %+v, want a Tier-1.5 hit on %d", r, w)
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
