package e2e

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/store/etcdtest"
	"github.com/loxilb-llm/loxilb/testbed/daemontest"
)

// Two gateway nodes (daemon processes with their own API ports and state
// directories) on one etcd: a mode-4 rule created on node A serves on node
// B within a second, and with etcd stopped both keep serving while rule
// changes get 503; restarted, etcd has lost nothing.

func storeCapability(t *testing.T, d *daemontest.Daemon) (ready bool, code, reason string) {
	t.Helper()
	return capability(t, d, "rule_store")
}

// served sends n requests through vip, each on a new connection, and
// returns how many each node's proxy counted.
func served(t *testing.T, vip string, n int, nodes ...*daemontest.Daemon) []float64 {
	t.Helper()
	before := make([]float64, len(nodes))
	for i, d := range nodes {
		before[i] = metricValue(metrics(t, d), "loxilb_ai_requests_total")
	}
	for i := 0; i < n; i++ {
		if body, err := viaVIP(vip); err != nil || body != "backend" {
			t.Fatalf("request %d through %s: %q %v", i, vip, body, err)
		}
	}
	out := make([]float64, len(nodes))
	for i, d := range nodes {
		out[i] = metricValue(metrics(t, d), "loxilb_ai_requests_total") - before[i]
	}
	return out
}

func TestSharedStoreTwoNodes(t *testing.T) {
	etcd := etcdtest.Start(t)
	ep := "127.0.151.10:28410"
	backend(t, ep, "backend")
	storeFlag := "etcd://" + etcd.Endpoint
	a := daemontest.Start(t, bins, t.TempDir(), nil, "--store", storeFlag, "--metrics", "--store-timeout", "500ms")
	b := daemontest.Start(t, bins, t.TempDir(), nil, "--store", storeFlag, "--metrics", "--store-timeout", "500ms")
	for _, d := range []*daemontest.Daemon{a, b} {
		if ready, code, reason := storeCapability(t, d); !ready || !strings.Contains(reason, etcd.Endpoint) {
			t.Fatalf("rule_store capability with etcd up: %v %s %s", ready, code, reason)
		}
	}

	const vip = "127.0.151.1:28401"
	createRule(t, a, plainRule("127.0.151.1", 28401, "shared", ep))
	created := time.Now()
	onB := time.Duration(-1)
	for time.Since(created) <= time.Second {
		if r, ok := listRules(t, b)[vip]; ok && r.Status != nil && r.Status.State == "applied" {
			onB = time.Since(created)
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if onB < 0 {
		t.Fatalf("rule created on A not applied on B within a second; B lists %+v\nB's log:\n%s", listRules(t, b), b.Logs())
	}
	t.Logf("created on A, applied on B after %v", onB.Round(time.Millisecond))
	// New connections are spread over both nodes' listeners: B serves.
	counts := served(t, vip, 32, a, b)
	if counts[0]+counts[1] != 32 || counts[1] == 0 || counts[0] == 0 {
		t.Fatalf("32 requests counted A %v, B %v: want both nodes serving", counts[0], counts[1])
	}
	// The same rule posted on B is a duplicate there already.
	if resp, body := post(t, b.URL("/config/loadbalancer"), plainRule("127.0.151.1", 28401, "shared", ep)); resp.StatusCode != 409 {
		t.Fatalf("same rule on B: %d %s", resp.StatusCode, body)
	}

	// The same new rule posted to both nodes at once: one 200, one 409,
	// and both serve the winner.
	const vip2 = "127.0.151.3:28403"
	codes := make(chan int, 2)
	for _, d := range []*daemontest.Daemon{a, b} {
		go func() {
			resp, _ := post(t, d.URL("/config/loadbalancer"), plainRule("127.0.151.3", 28403, "raced", ep))
			codes <- resp.StatusCode
		}()
	}
	if c1, c2 := <-codes, <-codes; c1+c2 != 200+409 {
		t.Fatalf("concurrent creates of one rule on both nodes: %d and %d, want 200 and 409", c1, c2)
	}
	for _, d := range []*daemontest.Daemon{a, b} {
		waitFor(t, "raced rule applied on both nodes", time.Second, func() bool {
			r, ok := listRules(t, d)[vip2]
			return ok && r.Status != nil && r.Status.State == "applied"
		})
	}
	if counts := served(t, vip2, 32, a, b); counts[0] == 0 || counts[1] == 0 {
		t.Fatalf("raced rule: 32 requests counted A %v, B %v", counts[0], counts[1])
	}

	etcd.Stop()
	for _, d := range []*daemontest.Daemon{a, b} {
		waitFor(t, "rule_store capability down", 5*time.Second, func() bool {
			ready, code, _ := storeCapability(t, d)
			return !ready && code == "store_unreachable"
		})
		if v := metricValue(metrics(t, d), "loxilb_store_backend_up", `backend="etcd"`); v != 0 {
			t.Fatalf("loxilb_store_backend_up = %v with etcd stopped", v)
		}
	}
	counts = served(t, vip, 32, a, b)
	if counts[0] == 0 || counts[1] == 0 {
		t.Fatalf("with etcd stopped, 32 requests counted A %v, B %v: want both nodes still serving", counts[0], counts[1])
	}
	resp, body := post(t, a.URL("/config/loadbalancer"), plainRule("127.0.151.2", 28402, "new", ep))
	if resp.StatusCode != 503 || !strings.Contains(string(body), "STORE_UNAVAILABLE") || !strings.Contains(string(body), etcd.Endpoint) {
		t.Fatalf("create with etcd stopped: %d %s", resp.StatusCode, body)
	}
	req, _ := http.NewRequest(http.MethodDelete, b.URL("/config/loadbalancer/name/shared"), nil)
	dresp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	dbody, _ := io.ReadAll(dresp.Body)
	dresp.Body.Close()
	if dresp.StatusCode != 503 {
		t.Fatalf("delete with etcd stopped: %d %s", dresp.StatusCode, dbody)
	}
	if r, ok := listRules(t, b)[vip]; !ok || r.Status.State != "applied" {
		t.Fatalf("refused delete changed B's rules: %+v", listRules(t, b))
	}

	// etcd back with its data: nothing was lost, and changes flow again.
	etcd.Restart()
	for _, d := range []*daemontest.Daemon{a, b} {
		waitFor(t, "rule_store capability up", 5*time.Second, func() bool { ready, _, _ := storeCapability(t, d); return ready })
	}
	if resp, body := post(t, a.URL("/config/loadbalancer"), plainRule("127.0.151.2", 28402, "new", ep)); resp.StatusCode != 200 {
		t.Fatalf("create after etcd came back: %d %s", resp.StatusCode, body)
	}
	waitFor(t, "rule created after the outage applied on B", time.Second, func() bool {
		rules := listRules(t, b)
		r, ok := rules["127.0.151.2:28402"]
		return ok && r.Status != nil && r.Status.State == "applied" && len(rules) == 3
	})
}
