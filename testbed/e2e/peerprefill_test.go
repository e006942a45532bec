package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/store/etcdtest"
	"github.com/loxilb-llm/loxilb/testbed/daemontest"
)

// TestClusterPrefillCoalescingTwoNodes: two daemon processes on one etcd
// serve one KV-exact rule in front of one vLLM emulator. Siblings of a new
// prefix sent at once, on separate connections that the kernel spreads
// over both nodes' listeners, make the engine compute the prefix once: the
// node that did not start its prefill holds its siblings behind the
// other's announcement (and, for a sibling that crossed it, behind the
// tie-break) until the engine has the prefix.
func TestClusterPrefillCoalescingTwoNodes(t *testing.T) {
	etcd := etcdtest.Start(t)
	const host, vipHost = "127.0.65.11", "127.0.65.1"
	c := enginesimVLLM(host)
	// A slow prefill (about 1.2 s for the prefix) keeps every sibling of
	// a burst inside the first one's prefill on a loaded machine.
	c.TimeScale, c.PrefillUsPerToken = 1, 2000
	eng := startEngine(t, c)
	// The tie-break window is wide for a loaded test machine, so two
	// nodes' crossing leaders always hear each other within it.
	env := []string{"LLB_KV_NONE_HASH_SEED=" + seed, "LOXILB_KV_CLUSTER_TIEBREAK_MS=100"}
	var nodes []*daemontest.Daemon
	for _, name := range []string{"node-a", "node-b"} {
		nodes = append(nodes, daemontest.Start(t, bins, t.TempDir(), env, "--store", "etcd://"+etcd.Endpoint,
			"--node-name", name, "--tokenizer-dir", tokenizerDir(), "--metrics", "--proxy-receipts", "on-request"))
	}
	createRule(t, nodes[0], json.RawMessage(fmt.Sprintf(`{"serviceArguments":{"externalIP":%q,"port":28080,"protocol":"tcp","mode":4,"sel":0,
		"kvExactMode":3,"kvEngineType":"vllm","kvZmqPort":25557,"kvBlockSize":16,"model_name":%q},
		"endpoints":[{"endpointIP":%q,"targetPort":28000,"weight":1}]}`, vipHost, model, host)))
	for _, d := range nodes {
		waitFor(t, "each node subscribed and hearing the other's announcements", 15*time.Second, func() bool {
			m := metrics(t, d)
			return metricValue(m, "loxilb_kv_subscriber_connected") == 1 && metricValue(m, "loxilb_cluster_prefill_peers") == 1
		})
	}
	vip := vipHost + ":28080"
	client := &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	send := func(prompt string) error {
		resp, err := client.Post("http://"+vip+"/v1/completions", "application/json",
			strings.NewReader(fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, model, prompt)))
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		return nil
	}
	served := func() []float64 {
		out := make([]float64, len(nodes))
		for i, d := range nodes {
			out[i] = metricValue(metrics(t, d), "loxilb_ai_requests_total")
		}
		return out
	}
	// Each node loads the tokenizer on its first prompt: a short one on
	// new connections until both have served, so the burst is not split
	// by one node's start-up.
	waitFor(t, "both nodes served a warm-up prompt", 30*time.Second, func() bool {
		if err := send("warm up"); err != nil {
			t.Fatal(err)
		}
		s := served()
		return s[0] > 0 && s[1] > 0
	})

	const siblings = 8
	for burst := 0; ; burst++ {
		if burst == 10 {
			t.Fatal("10 bursts of 8 connections all reached one node")
		}
		before, st0 := served(), eng.Stats()
		var wg sync.WaitGroup
		errs := make(chan error, siblings)
		for i := 0; i < siblings; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs <- send(longPrompt(fmt.Sprintf("burst %d", burst), i))
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
		after, st1 := served(), eng.Stats()
		if after[0] == before[0] || after[1] == before[1] {
			continue // all on one node: that is single-node coalescing
		}
		prompt := st1.PromptTokens - st0.PromptTokens
		missed := prompt - (st1.HitTokens - st0.HitTokens)
		perReq := prompt / siblings
		// Computed once: one whole prompt, then each sibling's own tail
		// (its last partial block and the block where it differs).
		if limit := perReq + (siblings-1)*64; missed > limit {
			var diag []string
			for _, d := range nodes {
				m := metrics(t, d)
				diag = append(diag, fmt.Sprintf("coalesced %v tiebreak yielded %v kept %v duplicates %v begins received %v",
					metricValue(m, "loxilb_kv_coalesced_total", `outcome="released"`),
					metricValue(m, "loxilb_cluster_prefill_tiebreak_total", `outcome="yielded"`),
					metricValue(m, "loxilb_cluster_prefill_tiebreak_total", `outcome="kept"`),
					metricValue(m, "loxilb_cluster_prefill_duplicate_leaders_total"),
					metricValue(m, "loxilb_cluster_prefill_received_total", `kind="begin"`)))
			}
			t.Fatalf("burst %d over both nodes (%v and %v requests): the engine computed %d of %d prompt tokens (%d per request), want at most %d: the prefix was computed more than once\n%s",
				burst, after[0]-before[0], after[1]-before[1], missed, prompt, perReq, limit, strings.Join(diag, "\n"))
		}
		t.Logf("burst %d: %v and %v siblings per node, the engine computed %d of %d prompt tokens", burst,
			after[0]-before[0], after[1]-before[1], missed, prompt)
		return
	}
}
