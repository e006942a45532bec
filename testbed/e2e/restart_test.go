package e2e

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/daemontest"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// TestRestartAfterSubscribeAndReplay: the engines cache prefixes before the
// daemon subscribes, so the gateway learns them from the engines' replay
// buffers; one engine then restarts before publishing anything new. Its new
// process numbers batches from 0 again, the very seqs the replay applied,
// starting with AllBlocksCleared: the gateway must take that as a restart,
// not as duplicates of the replayed batches, so its inventory follows the
// engine to empty and a repeated prefix afterwards hits.
func TestRestartAfterSubscribeAndReplay(t *testing.T) {
	const octet, port, zmqPort = 91, 28000, 25557
	p := &pool{vip: fmt.Sprintf("127.0.%d.1:28080", octet)}
	var eps []string
	for i := 0; i < 2; i++ {
		host := fmt.Sprintf("127.0.%d.%d", octet, 11+i)
		e := startEngine(t, enginesim.Config{Engine: "vllm", Listen: fmt.Sprintf("%s:%d", host, port), ZMQBind: host,
			ZMQPort: zmqPort, Seed: seed, TimeScale: 0, TimeScaleSet: true})
		// History from before the daemon subscribes: only the replay
		// buffer can tell the gateway about it.
		for j := 0; j < 3; j++ {
			resp, body := post(t, fmt.Sprintf("http://%s:%d/v1/completions", host, port),
				map[string]any{"model": model, "prompt": longPrompt(fmt.Sprintf("history-%d-%d", i, j), j), "max_tokens": 4})
			if resp.StatusCode != 200 {
				t.Fatalf("engine %d history request: %d %s", i, resp.StatusCode, body)
			}
		}
		if e.Stats().BlocksUsed == 0 {
			t.Fatalf("engine %d cached nothing; the test proves nothing", i)
		}
		p.engines = append(p.engines, e)
		eps = append(eps, fmt.Sprintf(`{"endpointIP":%q,"targetPort":%d,"weight":1}`, host, port))
	}
	p.d = daemontest.Start(t, bins, t.TempDir(), []string{"LLB_KV_NONE_HASH_SEED=" + seed},
		"--tokenizer-dir", tokenizerDir(), "--metrics", "--proxy-receipts", "on-request")
	rule := fmt.Sprintf(`{"serviceArguments":{"externalIP":"127.0.%d.1","port":28080,"protocol":"tcp","mode":4,"sel":0,
		"kvExactMode":3,"kvEngineType":"vllm","kvZmqPort":%d,"kvDpRankCount":1,"kvBlockSize":16,"model_name":%q},"endpoints":[%s]}`,
		octet, zmqPort, model, strings.Join(eps, ","))
	resp, body := post(t, p.d.URL("/config/loadbalancer"), json.RawMessage(rule))
	if resp.StatusCode != 200 {
		t.Fatalf("create rule: %d %s", resp.StatusCode, body)
	}
	waitFor(t, "subscribers connected", 15*time.Second, func() bool {
		return metricValue(metrics(t, p.d), "loxilb_kv_subscriber_connected") >= 2
	})
	for ep := range p.engines {
		p.waitSameInventory(t, ep, "after the initial replay")
	}

	// No live batch has arrived since the replay.
	p.engines[0].Restart()
	p.waitSameInventory(t, 0, "after a restart right after the replay")
	if n := len(p.gatewayInventory(t, 0)); n != 0 {
		t.Fatalf("restarted engine is empty but the gateway holds %d blocks", n)
	}
	p.waitSameInventory(t, 1, "the other engine after the restart")

	first := complete(t, p.vip, longPrompt("after-restart", 1))
	for ep := range p.engines {
		p.waitSameInventory(t, ep, "after traffic following the restart")
	}
	time.Sleep(5500 * time.Millisecond) // speculative entries expire: the next hit comes from events
	r := complete(t, p.vip, longPrompt("after-restart", 2))
	if r.tier != "tier1.5" || r.ep != first.ep || r.cached == 0 {
		t.Fatalf("repeated prefix after the restart: %+v (first went to %d)", r, first.ep)
	}
}
