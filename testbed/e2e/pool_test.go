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

// pool is a mode-4 rule over emulated engines on their own loopback hosts.
type pool struct {
	engines []*enginesim.Engine
	d       *daemontest.Daemon
	vip     string
}

type poolOpts struct {
	n        int
	net      int // third octet of 127.0.X.Y, distinct per test
	engine   func(i int, c *enginesim.Config)
	env      []string
	ruleArgs string // extra serviceArguments JSON fields, e.g. `"monitor":true`
	sel      int
	kvEngine string // rule kvEngineType, default vllm
	bs       int    // rule kvBlockSize, default 16
	ranks    int    // rule kvDpRankCount, default 1
}

func newPool(t *testing.T, o poolOpts) *pool {
	t.Helper()
	const port, zmqPort = 28000, 25557
	p := &pool{vip: fmt.Sprintf("127.0.%d.1:28080", o.net)}
	var eps []string
	for i := 0; i < o.n; i++ {
		host := fmt.Sprintf("127.0.%d.%d", o.net, 11+i)
		c := enginesim.Config{Engine: o.kvEngine, Listen: fmt.Sprintf("%s:%d", host, port), ZMQBind: host, ZMQPort: zmqPort,
			Seed: seed, TimeScale: 0, TimeScaleSet: true, DPRanks: o.ranks, BlockSize: o.bs}
		if c.Engine == "" {
			c.Engine = "vllm"
		}
		if o.engine != nil {
			o.engine(i, &c)
		}
		p.engines = append(p.engines, startEngine(t, c))
		eps = append(eps, fmt.Sprintf(`{"endpointIP":%q,"targetPort":%d,"weight":1}`, host, port))
	}
	env := append([]string{"LLB_KV_NONE_HASH_SEED=" + seed}, o.env...)
	p.d = daemontest.Start(t, bins, t.TempDir(), env, "--tokenizer-dir", tokenizerDir(), "--metrics", "--proxy-receipts", "on-request")
	extra := ""
	if o.ruleArgs != "" {
		extra = "," + o.ruleArgs
	}
	eng, bs, ranks := o.kvEngine, o.bs, o.ranks
	if eng == "" {
		eng = "vllm"
	}
	if bs == 0 {
		bs = 16
	}
	if ranks == 0 {
		ranks = 1
	}
	zmq := fmt.Sprintf(`"kvZmqPort":%d,"kvDpRankCount":%d,`, zmqPort, ranks)
	if eng == "trtllm" {
		zmq = "" // TensorRT-LLM events ride the serving port
	}
	rule := fmt.Sprintf(`{"serviceArguments":{"externalIP":"127.0.%d.1","port":28080,"protocol":"tcp","mode":4,"sel":%d,
		"kvExactMode":3,"kvEngineType":%q,%s"kvBlockSize":%d,"model_name":%q%s},"endpoints":[%s]}`,
		o.net, o.sel, eng, zmq, bs, model, extra, strings.Join(eps, ","))
	resp, body := post(t, p.d.URL("/config/loadbalancer"), json.RawMessage(rule))
	if resp.StatusCode != 200 {
		t.Fatalf("create rule: %d %s", resp.StatusCode, body)
	}
	waitFor(t, "subscribers connected", 15*time.Second, func() bool {
		return metricValue(metrics(t, p.d), "loxilb_kv_subscriber_connected") >= float64(o.n)
	})
	return p
}

// waitInventory waits until the gateway's inventory of ep equals the
// engine's own cache size.
func (p *pool) waitInventory(t *testing.T, ep int) {
	t.Helper()
	waitFor(t, fmt.Sprintf("inventory of endpoint %d", ep), 10*time.Second, func() bool {
		var inv struct{ Total int }
		getJSON(t, p.d.URL(fmt.Sprintf("/config/ai/kv/inventory?service_id=1&ep_idx=%d", ep)), &inv)
		return inv.Total > 0 && inv.Total == p.engines[ep].Stats().BlocksUsed
	})
}

// enginesimVLLM is a vLLM emulator on host:28000 publishing on host:25557.
func enginesimVLLM(host string) enginesim.Config {
	return enginesim.Config{Engine: "vllm", Listen: host + ":28000", ZMQBind: host, ZMQPort: 25557, Seed: seed, TimeScale: 0, TimeScaleSet: true}
}
