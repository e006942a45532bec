package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/daemontest"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// pdPool is a P/D rule through the real daemon: prefill endpoints first
// (indexes 0..np-1), then decode endpoints.
type pdPool struct {
	prefill, decode []*enginesim.Engine
	d               *daemontest.Daemon
	vip             string
}

const (
	pdPort, pdZMQ, pdBoot = 28000, 25557, 28998
)

// requirePDWiring fails when the daemon's gateway has no P/D dispatcher
// (gateway.Config.PD): then every request on a P/D rule, even a model
// list, is refused with that hint.
func requirePDWiring(t *testing.T, p *pdPool) {
	t.Helper()
	resp, err := http.Get("http://" + p.vip + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode == http.StatusServiceUnavailable && strings.Contains(string(body), "gateway.Config.PD") {
		t.Fatal("the daemon's gateway has no P/D dispatcher (gateway.Config.PD): " + strings.TrimSpace(string(body)))
	}
	if resp.StatusCode != 200 {
		t.Fatalf("model list on the P/D rule: %d %s", resp.StatusCode, body)
	}
}

func newPDPool(t *testing.T, engine string, kvMode, net, np, nd int) *pdPool {
	t.Helper()
	p := &pdPool{vip: fmt.Sprintf("127.0.%d.1:28080", net)}
	var eps []string
	for i := 0; i < np+nd; i++ {
		role := enginesim.RolePrefill
		epRole := 1
		host := fmt.Sprintf("127.0.%d.%d", net, 11+i)
		if i >= np {
			role, epRole = enginesim.RoleDecode, 2
		}
		c := enginesim.Config{Engine: engine, Role: role, Listen: fmt.Sprintf("%s:%d", host, pdPort), ZMQBind: host,
			ZMQPort: -1, Seed: seed, TimeScale: 0, TimeScaleSet: true}
		if role == enginesim.RolePrefill {
			if kvMode == 1 && engine != enginesim.EngineTRTLLM {
				c.ZMQPort = pdZMQ
			}
			if engine == enginesim.EngineSGLang {
				c.BootstrapPort = pdBoot
			}
		}
		e := startEngine(t, c)
		if role == enginesim.RolePrefill {
			p.prefill = append(p.prefill, e)
		} else {
			p.decode = append(p.decode, e)
		}
		eps = append(eps, fmt.Sprintf(`{"endpointIP":%q,"targetPort":%d,"weight":1,"ep_role":%d}`, host, pdPort, epRole))
	}
	p.d = daemontest.Start(t, bins, t.TempDir(), []string{"LLB_KV_NONE_HASH_SEED=" + seed},
		"--tokenizer-dir", tokenizerDir(), "--metrics", "--proxy-receipts", "on-request")
	extra := ""
	switch {
	case kvMode == 1 && engine != enginesim.EngineTRTLLM:
		extra = fmt.Sprintf(`,"kvZmqPort":%d`, pdZMQ)
	}
	if engine == enginesim.EngineSGLang {
		extra += fmt.Sprintf(`,"pdBootstrapPort":%d`, pdBoot)
	}
	if kvMode == 1 {
		bs := 16
		if engine == enginesim.EngineTRTLLM {
			bs = 32
		}
		extra += fmt.Sprintf(`,"kvBlockSize":%d`, bs)
	}
	rule := fmt.Sprintf(`{"serviceArguments":{"externalIP":"127.0.%d.1","port":28080,"protocol":"tcp","mode":4,"sel":0,
		"pd_disagg_mode":true,"kvExactMode":%d,"kvEngineType":%q,"model_name":%q,"session_header_name":"X-Session"%s},"endpoints":[%s]}`,
		net, kvMode, engine, model, extra, strings.Join(eps, ","))
	resp, body := post(t, p.d.URL("/config/loadbalancer"), json.RawMessage(rule))
	if resp.StatusCode != 200 {
		t.Fatalf("create rule: %d %s", resp.StatusCode, body)
	}
	var last error
	for i := 0; i < 100; i++ { // the VIP listener comes up with the rule
		var r *http.Response
		if r, last = http.Get("http://" + p.vip + "/v1/models"); last == nil {
			r.Body.Close()
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if last != nil {
		t.Fatalf("VIP %s never answered: %v", p.vip, last)
	}
	requirePDWiring(t, p)
	return p
}

var pdReceipt = regexp.MustCompile(`pd tier=(\S+) prefill=(\d+) decode=(\d+)`)

type pdRoute struct {
	tier            string
	prefill, decode int
	body            []byte
}

func (p *pdPool) chat(t *testing.T, content string, stream bool, hdr ...string) pdRoute {
	t.Helper()
	req := map[string]any{"model": model, "max_tokens": 8, "stream": stream,
		"messages": []map[string]string{{"role": "user", "content": content}}}
	resp, body := post(t, "http://"+p.vip+"/v1/chat/completions", req, append([]string{"X-Loxilb-Receipt", "1"}, hdr...)...)
	if resp.StatusCode != 200 {
		t.Fatalf("chat: %d %s", resp.StatusCode, body)
	}
	if stream != bytes.Contains(body, []byte("data: [DONE]")) {
		t.Fatalf("stream=%v answered %s", stream, body)
	}
	m := pdReceipt.FindStringSubmatch(resp.Header.Get("X-Loxilb-Route"))
	if m == nil {
		t.Fatalf("receipt %q is not a P/D receipt", resp.Header.Get("X-Loxilb-Route"))
	}
	pi, _ := strconv.Atoi(m[2])
	di, _ := strconv.Atoi(m[3])
	return pdRoute{tier: m[1], prefill: pi, decode: di, body: body}
}

func pdTransfers(es []*enginesim.Engine) (transfers, claims uint64) {
	for _, e := range es {
		s := e.Stats()
		transfers += s.PDTransfers
		claims += s.PDClaimed
	}
	return
}

// TestPDEngines runs each engine's P/D flow through the daemon, streaming
// and not: every answer is complete, every decode leg claimed the transfer
// of its prefill leg (the emulators refuse a decode otherwise), and the
// receipt names the prefill engine that did the work.
func TestPDEngines(t *testing.T) {
	for i, engine := range []string{enginesim.EngineVLLM, enginesim.EngineSGLang, enginesim.EngineTRTLLM} {
		t.Run(engine, func(t *testing.T) {
			p := newPDPool(t, engine, 0, 91+i, 2, 2)
			decodes := map[int]int{}
			for n := 0; n < 6; n++ {
				before := p.prefill[0].Stats().PDTransfers
				r := p.chat(t, longPrompt(fmt.Sprintf("%s-%d", engine, n), n), n%2 == 1)
				decodes[r.decode]++
				ranFirst := p.prefill[0].Stats().PDTransfers != before
				if ranFirst != (r.prefill == 0) {
					t.Fatalf("receipt says prefill %d, but prefill 0 ran=%v", r.prefill, ranFirst)
				}
			}
			tr, cl := pdTransfers(p.prefill)
			if tr != 6 || cl != 6 {
				t.Fatalf("prefill transfers %d, claimed by decode legs %d; want 6 and 6", tr, cl)
			}
			if len(decodes) != 2 {
				t.Fatalf("decode legs did not spread: %v", decodes)
			}
		})
	}
}

// TestPDKVExactMode1: a repeated long prefix goes to the prefill worker
// holding it once its inventory (from the worker's own KV events) has it.
func TestPDKVExactMode1(t *testing.T) {
	p := newPDPool(t, enginesim.EngineVLLM, 1, 94, 3, 2)
	waitFor(t, "prefill subscribers connected", 15*time.Second, func() bool {
		return metricValue(metrics(t, p.d), "loxilb_kv_subscriber_connected") == 3
	})
	first := p.chat(t, longPrompt("mode1", 0), false)
	waitFor(t, "inventory of the prefill worker", 10*time.Second, func() bool {
		var inv struct{ Total int }
		getJSON(t, p.d.URL(fmt.Sprintf("/config/ai/kv/inventory?service_id=1&ep_idx=%d", first.prefill)), &inv)
		return inv.Total > 0 && inv.Total == p.prefill[first.prefill].Stats().BlocksUsed
	})
	for n := 1; n <= 4; n++ {
		r := p.chat(t, longPrompt("mode1", n), n%2 == 0)
		if r.prefill != first.prefill {
			t.Fatalf("repeat %d went to prefill %d (tier %s), the prefix is on %d", n, r.prefill, r.tier, first.prefill)
		}
	}
	// A session sticks to its workers across unrelated prompts.
	s := p.chat(t, longPrompt("session-a", 0), false, "X-Session", "conv-9")
	for n := 1; n <= 3; n++ {
		r := p.chat(t, longPrompt(fmt.Sprintf("session-%d", n), n), false, "X-Session", "conv-9")
		if r.prefill != s.prefill || r.decode != s.decode || r.tier != "session" {
			t.Fatalf("session request %d: %+v, session is on prefill %d decode %d", n, r, s.prefill, s.decode)
		}
	}
	// Subscriber, inventory, proxy, P/D and health series join on one label set.
	checkMetricLabels(t, metrics(t, p.d))
}

// TestPDFailures: a stopped prefill worker is skipped by connect
// failover, and a stopped decode worker gives a clean 502.
func TestPDFailures(t *testing.T) {
	p := newPDPool(t, enginesim.EngineVLLM, 0, 95, 2, 1)
	_ = p.prefill[0].Close()
	for n := 0; n < 3; n++ {
		// The receipt names the first choice; a connect failure there
		// moves the leg to the other prefill worker.
		p.chat(t, longPrompt(fmt.Sprintf("down-%d", n), n), false)
	}
	if got := p.prefill[1].Stats().PDTransfers; got != 3 {
		t.Fatalf("the live prefill worker ran %d of 3 prefills", got)
	}
	_ = p.decode[0].Close()
	resp, body := post(t, "http://"+p.vip+"/v1/completions", map[string]any{"model": model, "prompt": "hello there", "max_tokens": 2})
	if resp.StatusCode != 502 || !strings.Contains(string(body), "decode leg") {
		t.Fatalf("decode down: %d %s", resp.StatusCode, body)
	}
}
