package e2e

import (
	"context"
	"encoding/json"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/loxilb-llm/loxilb/pkg/cluster"
	"github.com/loxilb-llm/loxilb/pkg/store/etcdtest"
	"github.com/loxilb-llm/loxilb/testbed/daemontest"
)

// Two gateway nodes on one etcd, started with different
// LLB_KV_NONE_HASH_SEED values: `loxicmd get cluster` lists both and the
// seed drift (exit 8), both report the cluster capability degraded and
// the drift in metrics, and neither seed appears in the API, the metrics,
// the logs or etcd. Killed (no chance to withdraw), a node leaves the list
// within its lease's TTL, and the drift clears.

const (
	clusterSeedA = "e2e-seed-alpha-5c3e1f"
	clusterSeedB = "e2e-seed-bravo-9d41a7"
	clusterTTL   = 3 * time.Second
)

func clusterView(t *testing.T, d *daemontest.Daemon) cluster.View {
	t.Helper()
	var v cluster.View
	getJSON(t, d.URL("/cluster"), &v)
	return v
}

func capability(t *testing.T, d *daemontest.Daemon, name string) (ready bool, code, reason string) {
	t.Helper()
	var caps struct {
		Capabilities []struct {
			Name       string `json:"name"`
			Ready      bool   `json:"ready"`
			ReasonCode string `json:"reason_code"`
			Reason     string `json:"reason"`
		} `json:"capabilities"`
	}
	getJSON(t, d.URL("/status/capabilities"), &caps)
	for _, c := range caps.Capabilities {
		if c.Name == name {
			return c.Ready, c.ReasonCode, c.Reason
		}
	}
	t.Fatalf("no %s capability", name)
	return
}

func TestClusterMembershipAndDrift(t *testing.T) {
	etcd := etcdtest.Start(t)
	storeFlag := "etcd://" + etcd.Endpoint
	start := func(name, seed string) *daemontest.Daemon {
		return daemontest.Start(t, bins, t.TempDir(), []string{"LLB_KV_NONE_HASH_SEED=" + seed},
			"--store", storeFlag, "--metrics", "--node-name", name, "--cluster-ttl", clusterTTL.String())
	}
	a, b := start("node-a", clusterSeedA), start("node-b", clusterSeedB)

	waitFor(t, "both nodes listed on both", 10*time.Second, func() bool {
		return len(clusterView(t, a).Nodes) == 2 && len(clusterView(t, b).Nodes) == 2
	})
	v := clusterView(t, a)
	if v.Backend != "etcd" || v.Self != "node-a" || !v.Registered || v.TTLSeconds != 3 || !v.Drifted {
		t.Fatalf("view from node-a: %+v", v)
	}
	if len(v.Drift) != 1 || v.Drift[0].Setting != cluster.SettingSeed || strings.Join(v.Drift[0].Drifting, ",") != "node-a,node-b" {
		t.Fatalf("drift: %+v", v.Drift)
	}
	want := map[string]string{"node-a": cluster.SeedFingerprint(clusterSeedA), "node-b": cluster.SeedFingerprint(clusterSeedB)}
	for _, n := range v.Nodes {
		if n.Settings[cluster.SettingSeed] != want[n.Name] || n.State != cluster.StateDegraded || n.Version == "" || !strings.HasPrefix(n.Address, "127.0.0.1:") {
			t.Fatalf("node %+v", n)
		}
		if n.Settings["LOXILB_KV_SPILL_MIN_LOAD"] == "" {
			t.Fatalf("node %s announces no routing settings: %v", n.Name, n.Settings)
		}
	}

	// loxicmd: table, JSON, exit 8.
	out, stderr, code := daemontest.CLI(t, bins, a.Port, "get", "cluster")
	if code != 8 || !strings.Contains(out, "node-a (this)") || !strings.Contains(out, "node-b") || !strings.Contains(out, "seed_fingerprint") ||
		!strings.Contains(out, want["node-b"]) || !strings.Contains(stderr, "settings differ between nodes") {
		t.Fatalf("get cluster: exit %d\n%s\nstderr: %s", code, out, stderr)
	}
	t.Logf("loxicmd get cluster on node-a (exit %d):\n%s", code, out)
	out, _, code = daemontest.CLI(t, bins, b.Port, "get", "cluster", "-o", "json")
	var jv cluster.View
	if err := json.Unmarshal([]byte(out), &jv); err != nil || code != 8 || len(jv.Nodes) != 2 || jv.Self != "node-b" || len(jv.Drift) != 1 {
		t.Fatalf("get cluster -o json: exit %d %v\n%s", code, err, out)
	}

	for _, d := range []*daemontest.Daemon{a, b} {
		ready, rc, reason := capability(t, d, "cluster")
		if ready || rc != "degraded" || !strings.Contains(reason, "seed_fingerprint differs") {
			t.Fatalf("cluster capability: %v %s %s", ready, rc, reason)
		}
		m := metrics(t, d)
		if metricValue(m, "loxilb_cluster_nodes") != 2 || metricValue(m, "loxilb_cluster_drift") != 1 || metricValue(m, "loxilb_cluster_self_degraded") != 1 {
			t.Fatalf("cluster metrics:\n%s", grepLines(m, "loxilb_cluster_"))
		}
	}

	// The seeds appear nowhere outside the processes.
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{etcd.Endpoint}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	all, err := cli.Get(ctx, "", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	var stored strings.Builder
	members := 0
	for _, kv := range all.Kvs {
		stored.WriteString(string(kv.Key) + "=" + string(kv.Value) + "\n")
		if strings.Contains(string(kv.Key), "/members/") {
			members++
		}
	}
	if members != 2 {
		t.Fatalf("%d member records in etcd:\n%s", members, stored.String())
	}
	for _, d := range []*daemontest.Daemon{a, b} {
		for name, text := range map[string]string{
			"GET /cluster": string(getRaw(t, d.URL("/cluster"))), "GET /status/capabilities": string(getRaw(t, d.URL("/status/capabilities"))),
			"GET /metrics": metrics(t, d), "GET /diagnostics": string(getRaw(t, d.URL("/diagnostics"))), "the daemon's log": d.Logs(),
			"etcd": stored.String(),
		} {
			for _, seed := range []string{clusterSeedA, clusterSeedB} {
				if strings.Contains(text, seed) {
					t.Fatalf("seed %q appears in %s", seed, name)
				}
			}
		}
	}

	// node-b dies without withdrawing: etcd drops its record when the
	// lease runs out, and node-a's drift clears.
	if err := b.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	if _, ok := b.Wait(10 * time.Second); !ok {
		t.Fatal("node-b survived SIGKILL")
	}
	waitFor(t, "node-b gone from node-a's view", 3*clusterTTL, func() bool { return len(clusterView(t, a).Nodes) == 1 })
	gone := time.Since(killed)
	t.Logf("killed node left the list %v after SIGKILL (lease ttl %v)", gone.Round(time.Millisecond), clusterTTL)
	// The lease outlives the last keepalive by at most the TTL; node-a
	// re-reads every second.
	if gone > clusterTTL+1500*time.Millisecond {
		t.Fatalf("killed node listed for %v, lease ttl %v", gone, clusterTTL)
	}
	if v := clusterView(t, a); v.Drifted || v.Nodes[0].Name != "node-a" || v.Nodes[0].State != cluster.StateOK {
		t.Fatalf("after node-b died: %+v", v)
	}
	if ready, _, reason := capability(t, a, "cluster"); !ready {
		t.Fatalf("cluster capability still not ready: %s", reason)
	}
	if _, _, code := daemontest.CLI(t, bins, a.Port, "get", "cluster"); code != 0 {
		t.Fatalf("get cluster without drift: exit %d", code)
	}

	// node-b restarted with node-a's seed (the fix): two nodes, no drift.
	b2 := start("node-b", clusterSeedA)
	waitFor(t, "node-b back, in agreement", 2*clusterTTL+5*time.Second, func() bool {
		v := clusterView(t, a)
		return len(v.Nodes) == 2 && !v.Drifted && clusterView(t, b2).Registered
	})

	// A clean stop withdraws at once (the lease is revoked).
	b2.Stop()
	stopped := time.Now()
	waitFor(t, "node-b withdrawn", 2*clusterTTL, func() bool { return len(clusterView(t, a).Nodes) == 1 })
	t.Logf("stopped node left the list %v after it exited", time.Since(stopped).Round(time.Millisecond))

	// node-c has the same seed but tokenizers staged that node-a lacks:
	// each model's checksum is a drifting setting.
	c := daemontest.Start(t, bins, t.TempDir(), []string{"LLB_KV_NONE_HASH_SEED=" + clusterSeedA},
		"--store", storeFlag, "--node-name", "node-c", "--cluster-ttl", clusterTTL.String(), "--tokenizer-dir", tokenizerDir())
	waitFor(t, "tokenizer drift", 10*time.Second, func() bool { return len(clusterView(t, c).Drift) > 0 && len(clusterView(t, a).Nodes) == 2 })
	v = clusterView(t, c)
	for _, d := range v.Drift {
		if !strings.HasPrefix(d.Setting, cluster.TokenizerPrefix) {
			t.Fatalf("drift on %s besides the tokenizers: %+v", d.Setting, v.Drift)
		}
	}
	tok := cluster.TokenizerPrefix + "Qwen/Qwen3-0.6B"
	var found bool
	for _, d := range v.Drift {
		if d.Setting == tok {
			found = true
			if d.Values[0].Node != "node-a" || d.Values[0].Value != "" || len(d.Values[1].Value) != 16 {
				t.Fatalf("%s drift: %+v", tok, d)
			}
		}
	}
	if !found {
		t.Fatalf("no drift on %s: %+v", tok, v.Drift)
	}
	out, _, code = daemontest.CLI(t, bins, c.Port, "get", "cluster")
	if code != 8 || !strings.Contains(out, tok) || !strings.Contains(out, "(unset)") {
		t.Fatalf("get cluster with a tokenizer drift: exit %d\n%s", code, out)
	}

	// etcd away for longer than the lease: the nodes' leases end, and
	// once etcd is back both announce themselves again.
	etcd.Stop()
	time.Sleep(clusterTTL + 2*time.Second)
	etcd.Restart()
	restarted := time.Now()
	for _, d := range []*daemontest.Daemon{a, c} {
		waitFor(t, "registered again after the etcd outage", 3*clusterTTL+10*time.Second, func() bool {
			v := clusterView(t, d)
			return v.Registered && len(v.Nodes) == 2 && v.Reason == ""
		})
	}
	t.Logf("both nodes announced again %v after etcd came back", time.Since(restarted).Round(time.Millisecond))
}

// TestClusterSingleNodeStore: with the embedded store, get cluster shows
// this node alone and exits 0.
func TestClusterSingleNodeStore(t *testing.T) {
	d := daemontest.Start(t, bins, t.TempDir(), nil, "--node-name", "solo")
	out, stderr, code := daemontest.CLI(t, bins, d.Port, "get", "cluster")
	if code != 0 || !strings.Contains(out, "solo (this)") || !strings.Contains(out, "1 node(s), store single") {
		t.Fatalf("get cluster on a single node: exit %d\n%s\n%s", code, out, stderr)
	}
	if ready, _, reason := capability(t, d, "cluster"); !ready {
		t.Fatalf("cluster capability on a single node: %s", reason)
	}
}
