package e2e

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/testbed/daemontest"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// longPrompt returns a prompt of several hundred tokens whose first part is
// shared by every call with the same topic.
func longPrompt(topic string, suffix int) string {
	var b strings.Builder
	for i := 0; i < 40; i++ {
		fmt.Fprintf(&b, "Section %d of the %s handbook explains how operators keep services healthy. ", i, topic)
	}
	fmt.Fprintf(&b, "Question %d: what comes next?", suffix)
	return b.String()
}

type route struct {
	ep      int
	rank    int // data-parallel rank the receipt names, -1 when none
	tier    string
	matched int
	cached  int
}

func complete(t *testing.T, vip, prompt string) route {
	t.Helper()
	resp, body := post(t, "http://"+vip+"/v1/completions", map[string]any{"model": model, "prompt": prompt, "max_tokens": 4}, "X-Loxilb-Receipt", "1")
	if resp.StatusCode != 200 {
		t.Fatalf("completion: %d %s", resp.StatusCode, body)
	}
	rc, err := router.ParseReceipt(resp.Header.Get("X-Loxilb-Route"))
	if err != nil {
		t.Fatalf("receipt %q: %v", resp.Header.Get("X-Loxilb-Route"), err)
	}
	var out struct {
		Usage struct {
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	_ = json.Unmarshal(body, &out)
	rank := -1
	if rc.RankSet {
		rank = rc.Rank
	}
	return route{ep: rc.EP, rank: rank, tier: rc.Tier, matched: rc.Matched, cached: out.Usage.Details.Cached}
}

// TestKVExactVerifyFlow is the spec's "Verify" flow for a vLLM single pool:
// warm a prefix through the VIP, inventories grow, Tier-1.5 hits increase,
// the repeated prefix lands on the warm endpoint, and the watchdog stays quiet.
func TestKVExactVerifyFlow(t *testing.T) {
	const zmqPort = 25557
	var engines []*enginesim.Engine
	var eps []string
	for i := 0; i < 4; i++ {
		host := fmt.Sprintf("127.0.0.%d", 41+i)
		e := startEngine(t, enginesim.Config{Engine: "vllm", Listen: host + ":28000", ZMQBind: host, ZMQPort: zmqPort,
			Seed: seed, TimeScale: 0, TimeScaleSet: true})
		engines = append(engines, e)
		eps = append(eps, fmt.Sprintf(`{"endpointIP":%q,"targetPort":28000,"weight":1}`, host))
	}
	d := daemontest.Start(t, bins, t.TempDir(), []string{"LLB_KV_NONE_HASH_SEED=" + seed, "LLB_KV_MIN_MATCH_TOKENS=16"},
		"--tokenizer-dir", tokenizerDir(), "--metrics", "--proxy-receipts", "on-request")
	vip := "127.0.0.40:28080"
	rule := fmt.Sprintf(`{"serviceArguments":{"externalIP":"127.0.0.40","port":28080,"protocol":"tcp","mode":4,"sel":0,
		"kvExactMode":3,"kvEngineType":"vllm","kvZmqPort":%d,"kvBlockSize":16,"model_name":%q},"endpoints":[%s]}`, zmqPort, model, strings.Join(eps, ","))
	resp, body := post(t, d.URL("/config/loadbalancer"), json.RawMessage(rule))
	if resp.StatusCode != 200 {
		t.Fatalf("create rule: %d %s", resp.StatusCode, body)
	}
	// Wait for every subscriber to connect.
	waitFor(t, "subscribers connected", 15*time.Second, func() bool {
		return metricValue(metrics(t, d), "loxilb_kv_subscriber_connected") == 4
	})

	first := complete(t, vip, longPrompt("networking", 0))
	if first.tier != router.TierFallback {
		t.Fatalf("a cold fleet cannot hit: %+v", first)
	}
	warm := first.ep
	// The engine's BlockStored events reach the gateway's inventory.
	var inv struct {
		Total      int
		Subscriber struct {
			Connected bool
		}
	}
	waitFor(t, "inventory of the warm endpoint", 10*time.Second, func() bool {
		getJSON(t, d.URL(fmt.Sprintf("/config/ai/kv/inventory?service_id=1&ep_idx=%d", warm)), &inv)
		return inv.Total > 0
	})
	if got := engines[warm].Stats().BlocksUsed; inv.Total != got {
		t.Errorf("inventory holds %d blocks, engine %d", inv.Total, got)
	}
	// Speculative entries expire; repeated prefixes must still find the warm endpoint from real events.
	time.Sleep(100 * time.Millisecond)
	hits := 0
	for i := 1; i <= 6; i++ {
		r := complete(t, vip, longPrompt("networking", i))
		if r.ep != warm {
			t.Errorf("request %d went to %d, warm endpoint is %d (%+v)", i, r.ep, warm, r)
		}
		if r.tier == router.TierKV {
			hits++
		}
		if r.cached == 0 {
			t.Errorf("request %d: engine reports no cached tokens (%+v)", i, r)
		}
	}
	if hits < 5 {
		t.Errorf("only %d of 6 repeated-prefix requests were Tier-1.5 hits", hits)
	}
	m := metrics(t, d)
	if v := metricValue(m, "loxilb_pd_kv_tier15_hits_total"); v < float64(hits) {
		t.Errorf("tier15 hits metric %v < %d", v, hits)
	}
	if v := metricValue(m, "loxilb_pd_kv_blocks", fmt.Sprintf(`ep_idx="%d"`, warm)); v <= 0 {
		t.Errorf("loxilb_pd_kv_blocks for the warm endpoint is %v", v)
	}
	if v := metricValue(m, "loxilb_pd_kv_zero_hit_watchdog_total"); v != 0 {
		t.Errorf("watchdog fired: %v", v)
	}
	var caps struct {
		Capabilities []struct {
			Name       string
			Ready      bool
			ReasonCode string `json:"reason_code"`
		}
	}
	getJSON(t, d.URL("/status/capabilities"), &caps)
	okParity := 0
	for _, c := range caps.Capabilities {
		if strings.HasPrefix(c.Name, "kv_parity:") && c.ReasonCode == "ok" {
			okParity++
		}
	}
	if okParity == 0 {
		t.Errorf("no endpoint attested parity ok: %+v", caps)
	}
}
