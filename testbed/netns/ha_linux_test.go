//go:build linux

package netns

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/cluster"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/dataplanetest"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/store/etcdtest"
	"github.com/loxilb-llm/loxilb/testbed/daemontest"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
	"github.com/loxilb-llm/loxilb/testbed/fleet"
)

const (
	haLabEnv   = "LOXILB_HA_LAB"
	haModel    = "Qwen/Qwen3-0.6B"
	haVIPPort  = 8080
	haEnginePt = 8000
	haZMQPort  = 5557
)

// TestSeveralNodes runs three real daemons, each in its own namespace with
// its eBPF data plane (mode-4 VIP made local, SYNs steered by sk_lookup),
// on one etcd, behind a router that spreads the VIP over them with an ECMP
// multipath route hashing on the 5-tuple, and checks what running several
// nodes promises: a rule created on one node is served by all; client
// connections spread over the nodes; every node's KV inventories follow
// every engine; killing a node loses only the connections it held, and
// once the router withdraws its next hop (what BGP does when the node's
// session drops) every new connection succeeds; an etcd restart loses
// nothing and writes work again after it; the killed node, started again,
// reads every rule from etcd and serves its share once announced. That
// restart uses another hash seed, so the membership check must flag it:
// the other nodes list it as drifting, its own cluster capability is
// degraded, and restarted with the right seed it clears. (kvBlockSize is
// per rule and the rules are shared, so only the seed can drift.)
func TestSeveralNodes(t *testing.T) {
	dataplanetest.RequirePrivileged(t)
	etcdtest.Binary(t) // skips (fails in CI) before building anything
	if !dataplanetest.InNetNS() {
		lab, err := BuildHA(3, 3)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := lab.Destroy(); err != nil {
				t.Error(err)
			}
		})
		desc, _ := json.Marshal(lab)
		// The test body runs in the services namespace, beside etcd and
		// the engines; it reaches the nodes and the client through dialIn.
		dataplanetest.RunInNetNS(t, lab.Services, haLabEnv+"="+string(desc))
		return
	}
	var lab HALab
	if err := json.Unmarshal([]byte(os.Getenv(haLabEnv)), &lab); err != nil {
		t.Fatal(err)
	}
	// The binaries build while etcd and the engines start.
	start := time.Now()
	type built struct {
		b   *daemontest.Binaries
		err error
	}
	building := make(chan built, 1)
	go func() { b, err := daemontest.Build(); building <- built{b, err} }()
	defer func() {
		if r := <-building; r.b != nil {
			os.RemoveAll(r.b.Dir)
		}
	}()
	tokDir := filepath.Join(daemontest.RepoRoot(), "testdata", "tokenizers")
	var cfgs []enginesim.Config
	var eps []string
	for i := range 3 {
		host := HAEngineAddr(i).String()
		cfgs = append(cfgs, enginesim.Config{Engine: "sglang", Model: haModel, Listen: net.JoinHostPort(host, fmt.Sprint(haEnginePt)),
			ZMQBind: host, ZMQPort: haZMQPort, TimeScale: 0, TimeScaleSet: true})
		eps = append(eps, fmt.Sprintf(`{"endpointIP":%q,"targetPort":%d,"weight":1}`, host, haEnginePt))
	}
	type fleetUp struct {
		f   *fleet.Fleet
		err error
	}
	starting := make(chan fleetUp, 1)
	go func() {
		f, err := fleet.Start(context.Background(), cfgs, fleet.Options{TokenizerDir: filepath.Join(tokDir, "Qwen__Qwen3-0.6B")})
		starting <- fleetUp{f, err}
	}()
	etcd := etcdtest.StartOn(t, HAStoreAddr().String())
	t.Logf("etcd up after %v", time.Since(start).Round(time.Millisecond))
	up := <-starting
	if up.err != nil {
		t.Fatal(up.err)
	}
	engines := up.f
	t.Cleanup(func() { engines.Stop() })
	t.Logf("3 engines up after %v", time.Since(start).Round(time.Millisecond))
	r := <-building
	building <- r // for the deferred removal
	if r.err != nil {
		t.Fatal(r.err)
	}
	bins := r.b
	t.Logf("binaries built after %v", time.Since(start).Round(time.Millisecond))
	nodes := make([]*haNode, len(lab.Nodes))
	for i, ns := range lab.Nodes {
		// A short lease lets the killed node take its name back soon.
		nodes[i] = launchHANode(t, bins, ns, []string{haSeedEnv(haSeed)}, "--store", "etcd://"+etcd.Endpoint, "--store-timeout", "500ms",
			"--interfaces", "n0", "--tokenizer-dir", tokDir, "--node-name", haNodeName(i),
			"--advertise-addr", haAdvertised(i), "--cluster-ttl", "3s")
	}
	// The nodes load their data planes concurrently, as separate hosts would.
	errs := make(chan error, len(nodes))
	for _, n := range nodes {
		go func() { errs <- n.waitUp(30 * time.Second) }()
	}
	for range nodes {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("3 nodes up after %v", time.Since(start).Round(time.Millisecond))
	clusterAgrees(t, nodes[0], len(nodes), "")

	// A KV-exact rule created on node 1 is applied by every node. The
	// first such rule loads its model's tokenizer on each node, which takes
	// seconds on a loaded machine, so its convergence is not timed.
	vip := net.JoinHostPort(HAVIP().String(), fmt.Sprint(haVIPPort))
	rule := fmt.Sprintf(`{"serviceArguments":{"externalIP":%q,"port":%d,"protocol":"tcp","mode":4,"sel":0,"name":"ha",
		"kvExactMode":3,"kvEngineType":"sglang","kvZmqPort":%d,"kvBlockSize":16,"model_name":%q},"endpoints":[%s]}`,
		HAVIP(), haVIPPort, haZMQPort, haModel, strings.Join(eps, ","))
	if code, body := nodes[0].post(t, "/config/loadbalancer", rule); code != http.StatusOK {
		t.Fatalf("create on node 1: %d %s\n%s", code, body, nodes[0].Logs())
	}
	converged(t, nodes, vip, time.Now(), 30*time.Second)
	// A plain mode-4 rule on node 2 shows how fast a change reaches the others.
	plain := func(port int, name string) string {
		return fmt.Sprintf(`{"serviceArguments":{"externalIP":%q,"port":%d,"protocol":"tcp","mode":4,"sel":0,"name":%q},"endpoints":[%s]}`,
			HAVIP(), port, name, strings.Join(eps, ","))
	}
	vipPlain := net.JoinHostPort(HAVIP().String(), fmt.Sprint(haVIPPort+1))
	created := time.Now()
	if code, body := nodes[1].post(t, "/config/loadbalancer", plain(haVIPPort+1, "plain")); code != http.StatusOK {
		t.Fatalf("create on node 2: %d %s", code, body)
	}
	t.Logf("plain rule created on node 2 applied on nodes 1 and 3 after %v (polled together)",
		converged(t, []*haNode{nodes[0], nodes[2]}, vipPlain, created, 5*time.Second))
	for i, n := range nodes {
		if out, err := Exec(n.ns, "ip", "-4", "route", "show", "table", "local", HAVIP().String()); err != nil || !strings.Contains(out, "local "+HAVIP().String()) {
			t.Fatalf("node %d: VIP not made local by its data plane: %q %v\n%s", i+1, out, err, n.Logs())
		}
		waitFor(t, fmt.Sprintf("node %d subscribed to every engine", i+1), 15*time.Second, func() bool {
			return metricValue(n.metrics(t), "loxilb_kv_subscriber_connected") == float64(len(engines.Members))
		})
	}

	// Connections spread over the nodes, counted by each node's proxy.
	client := nsClient(lab.Client)
	before := requestsPerNode(t, nodes)
	steeredBefore := steeredPerNode(t, nodes)
	const spread = 60
	for i := range spread {
		if err := complete(client, vip, haPrompt(i)); err != nil {
			t.Fatalf("request %d through the VIP: %v", i, err)
		}
	}
	per := requestsPerNode(t, nodes)
	total := 0.0
	for i := range per {
		per[i] -= before[i]
		total += per[i]
	}
	t.Logf("%d connections through the VIP served per node: %v", spread, per)
	if total != spread || per[0] == 0 || per[1] == 0 || per[2] == 0 {
		t.Fatalf("%d connections counted %v per node: want all served, by every node", spread, per)
	}
	// Each node's sk_lookup program handed its connections to the proxy:
	// the data plane steers mode 4 in every node namespace.
	for i, s := range steeredPerNode(t, nodes) {
		if s-steeredBefore[i] < per[i] {
			t.Fatalf("node %d: %v connections steered by sk_lookup, %v served", i+1, s-steeredBefore[i], per[i])
		}
	}
	// No KV state is synchronised between nodes, yet each node's inventory
	// of each engine matches the engine: every node reads every publisher.
	for i, n := range nodes {
		waitFor(t, fmt.Sprintf("node %d's inventories match the engines", i+1), 10*time.Second, func() bool {
			for ep, e := range engines.Members {
				if n.inventory(t, ep) != e.Sim.Stats().BlocksUsed {
					return false
				}
			}
			return true
		})
	}

	// Kill node 2: only the connections it held are lost.
	held := openKept(t, lab, 24)
	defer func() {
		for _, k := range held {
			k.c.Close()
		}
	}()
	on := connectionsByNode(t, nodes, held)
	t.Logf("24 kept-alive connections held per node: %v", countByNode(on, len(nodes)))
	const dead = 1
	if err := nodes[dead].cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-nodes[dead].done
	killed := time.Now()
	lost := 0
	for i, k := range held {
		err := k.do(haPrompt(1000 + i))
		switch {
		case on[i] == dead && err == nil:
			t.Errorf("connection %d held by the killed node still answered", i)
		case on[i] != dead && err != nil:
			t.Errorf("connection %d held by node %d failed after node %d was killed: %v", i, on[i]+1, dead+1, err)
		case err != nil:
			lost++
		}
	}
	t.Logf("node %d killed: %d of 24 kept connections lost, all of them its own", dead+1, lost)

	// Until the router withdraws the dead node's next hop, new connections
	// hashed to it are refused; after, every one succeeds.
	refused := 0
	for i := range 30 {
		if complete(client, vip, haPrompt(2000+i)) != nil {
			refused++
		}
	}
	t.Logf("before the withdrawal %d of 30 new connections failed (hashed to the dead node)", refused)
	if refused == 0 {
		t.Errorf("no new connection failed while the route still pointed at the dead node: the lab is not spreading")
	}
	withdraw := time.Now()
	if err := lab.RouteVIP(0, 2); err != nil {
		t.Fatal(err)
	}
	var firstOK time.Duration
	for i := range 60 {
		if err := complete(client, vip, haPrompt(3000+i)); err != nil {
			t.Fatalf("new connection %d after the withdrawal (%v after it): %v", i, time.Since(withdraw), err)
		}
		if i == 0 {
			firstOK = time.Since(withdraw)
		}
	}
	t.Logf("route withdrawn %v after the kill; first new connection served %v after the withdrawal, 60 of 60 after it",
		withdraw.Sub(killed).Round(time.Millisecond), firstOK.Round(time.Millisecond))
	// The withdrawn hop was the middle one, so hash-threshold ECMP keeps
	// the others' flows where they were (see ARCHITECTURE.md).
	for i, k := range held {
		if on[i] != dead {
			if err := k.do(haPrompt(4000 + i)); err != nil {
				t.Errorf("connection %d held by node %d failed after the withdrawal: %v", i, on[i]+1, err)
			}
		}
	}
	live := []*haNode{nodes[0], nodes[2]}

	// etcd restarts: the nodes keep serving, refuse writes, then lose
	// nothing and take writes again.
	etcd.Stop()
	for i, n := range live {
		waitFor(t, fmt.Sprintf("live node %d sees etcd down", i+1), 5*time.Second, func() bool { return !n.storeReady(t) })
	}
	for i := range 20 {
		if err := complete(client, vip, haPrompt(5000+i)); err != nil {
			t.Fatalf("request %d with etcd down: %v", i, err)
		}
	}
	second := plain(haVIPPort+2, "after")
	if code, body := live[1].post(t, "/config/loadbalancer", second); code != http.StatusServiceUnavailable || !strings.Contains(string(body), "STORE_UNAVAILABLE") {
		t.Fatalf("create with etcd down: %d %s, want 503 STORE_UNAVAILABLE", code, body)
	}
	etcd.Restart()
	for i, n := range live {
		waitFor(t, fmt.Sprintf("live node %d sees etcd back", i+1), 5*time.Second, func() bool { return n.storeReady(t) })
		if s := n.ruleState(t, vip); s != "applied" {
			t.Fatalf("after the etcd restart live node %d lists the rule as %q", i+1, s)
		}
	}
	created = time.Now()
	if code, body := live[1].post(t, "/config/loadbalancer", second); code != http.StatusOK {
		t.Fatalf("create after etcd came back: %d %s", code, body)
	}
	vip2 := net.JoinHostPort(HAVIP().String(), fmt.Sprint(haVIPPort+2))
	t.Logf("rule created on node 3 after the etcd restart applied on node 1 after %v", converged(t, live[:1], vip2, created, 5*time.Second))
	for i := range 10 {
		if err := complete(client, vip2, haPrompt(6000+i)); err != nil {
			t.Fatalf("request %d to the rule created after the etcd restart: %v", i, err)
		}
	}

	// The killed node comes back, started with another hash seed: it reads
	// the rules from etcd (including the one created while it was down),
	// the router announces it again, and it takes its share of new
	// connections; the membership check flags its seed.
	restarted := time.Now()
	nodes[dead].env = []string{haSeedEnv(haSeed + "-drifted")}
	nodes[dead].start(t)
	if err := nodes[dead].waitUp(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	converged(t, nodes[dead:dead+1], vip2, restarted, 30*time.Second)
	t.Logf("killed node restarted and serving all rules after %v", time.Since(restarted).Round(time.Millisecond))
	if err := lab.RouteVIP(0, 1, 2); err != nil {
		t.Fatal(err)
	}
	before = requestsPerNode(t, nodes)
	for i := range 30 {
		if err := complete(client, vip2, haPrompt(7000+i)); err != nil {
			t.Fatalf("request %d after the node came back: %v", i, err)
		}
	}
	per = requestsPerNode(t, nodes)
	if d := per[dead] - before[dead]; d == 0 {
		t.Fatalf("the restarted node served none of 30 new connections: %v before, %v after", before, per)
	}
	clusterAgrees(t, nodes[0], len(nodes), haNodeName(dead))
	t.Logf("seed drift of the restarted node flagged on node 1 by %v after its start", time.Since(restarted).Round(time.Millisecond))
	var c api.Capability
	waitFor(t, "the restarted node's cluster capability degraded", 5*time.Second, func() bool {
		c = nodes[dead].capability(t, "cluster")
		return !c.Ready && c.ReasonCode == cluster.StateDegraded
	})
	if !strings.Contains(c.Reason, cluster.SettingSeed) {
		t.Fatalf("restarted node's cluster capability: %q, want it to name %s", c.Reason, cluster.SettingSeed)
	}
	// loxicmd, run where the services are, reads node 3 at its advertised
	// address and fails the rollout: exit 8 naming the drifting node. Each
	// node re-reads the records every second, so node 3's view is awaited
	// first.
	clusterAgrees(t, nodes[2], len(nodes), haNodeName(dead))
	out, code := loxicmdIn(t, bins, haAdvertised(2), "get", "cluster")
	if code != 8 || !onlyMarked(out, haNodeName(dead)) || !strings.Contains(out, cluster.SettingSeed) {
		t.Fatalf("loxicmd get cluster on node 3 with node %d drifting: exit %d\n%s", dead+1, code, out)
	}

	// Started again with the right seed (stopped cleanly, so its lease is
	// revoked at once), the node agrees again.
	daemontest.StopProcess(nodes[dead].cmd.Process, nodes[dead].done)
	nodes[dead].env = []string{haSeedEnv(haSeed)}
	fixed := time.Now()
	nodes[dead].start(t)
	if err := nodes[dead].waitUp(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	clusterAgrees(t, nodes[0], len(nodes), "")
	waitFor(t, "the node restarted with the right seed ready in the cluster", 5*time.Second, func() bool {
		return nodes[dead].capability(t, "cluster").Ready
	})
	t.Logf("restarted with the right seed: drift cleared %v after the restart", time.Since(fixed).Round(time.Millisecond))
	t.Logf("whole lab run %v", time.Since(start).Round(time.Millisecond))
}

// haSeed is the lab's LLB_KV_NONE_HASH_SEED.
const haSeed = "4242"

func haSeedEnv(seed string) string { return lbrule.SeedEnv + "=" + seed }

// haNodeName is node i's --node-name (0-based).
func haNodeName(i int) string { return fmt.Sprintf("node%d", i+1) }

// haAdvertised is node i's --advertise-addr: its API on its lab address.
func haAdvertised(i int) string { return net.JoinHostPort(HANodeAddr(i).String(), "11111") }

// clusterAgrees waits until n's GET /cluster lists want live nodes, each
// at its advertised address, and either no drift (drifting "") or only the
// seed fingerprint, with exactly that node away from the others.
func clusterAgrees(t *testing.T, n *haNode, want int, drifting string) {
	t.Helper()
	var last []byte
	ok := func() bool {
		last = n.get(t, "/netlox/v1/cluster")
		var v cluster.View
		if err := json.Unmarshal(last, &v); err != nil {
			t.Fatalf("%s: GET /cluster: %v\n%s", n.ns, err, last)
		}
		if !v.Registered || len(v.Nodes) != want {
			return false
		}
		for i, node := range v.Nodes {
			if node.Name != haNodeName(i) || node.Address != haAdvertised(i) {
				return false
			}
		}
		if drifting == "" {
			return !v.Drifted && len(v.Drift) == 0
		}
		return v.Drifted && len(v.Drift) == 1 && v.Drift[0].Setting == cluster.SettingSeed &&
			len(v.Drift[0].Drifting) == 1 && v.Drift[0].Drifting[0] == drifting
	}
	deadline := time.Now().Add(15 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: cluster not %d nodes with drift %q within 15s; last view:\n%s", n.ns, want, drifting, last)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// loxicmdIn runs loxicmd in the test's namespace against the API at addr
// and returns its output and exit code.
func loxicmdIn(t *testing.T, b *daemontest.Binaries, addr string, args ...string) (string, int) {
	t.Helper()
	host, port, _ := net.SplitHostPort(addr)
	out, err := exec.Command(b.Loxicmd, append([]string{"-s", host, "-p", port, "--token-file", haTokenFile(t)}, args...)...).CombinedOutput()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("loxicmd: %v", err)
	}
	if exit != nil {
		return string(out), exit.ExitCode()
	}
	return string(out), 0
}

// onlyMarked reports whether the rows loxicmd marks drifting ("*") are
// all node's, and there is one.
func onlyMarked(out, node string) bool {
	marked := 0
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) > 0 && f[len(f)-1] == "*" {
			if !slices.Contains(f, node) {
				return false
			}
			marked++
		}
	}
	return marked > 0
}

// haPrompt is prompt i: distinct, a few blocks long.
func haPrompt(i int) string {
	return fmt.Sprintf("Request %d of the lab. Operators run several gateway nodes behind one VIP so that one node can fail "+
		"without the service going down, and every node reads every engine's cache events.", i)
}

func completionBody(prompt string) []byte {
	b, _ := json.Marshal(map[string]any{"model": haModel, "prompt": prompt, "max_tokens": 2})
	return b
}

// complete sends one completion through vip on a new connection.
func complete(c *http.Client, vip, prompt string) error {
	resp, err := c.Post("http://"+vip+"/v1/completions", "application/json", bytes.NewReader(completionBody(prompt)))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%d %s", resp.StatusCode, b)
	}
	return nil
}

// haNode is one daemon process running in a node namespace; its API
// listens on 127.0.0.1 there and is reached through dialIn.
type haNode struct {
	ns   string
	args []string // of nsenter, which runs the daemon
	env  []string // added to the daemon's environment at each start
	cmd  *exec.Cmd
	http *http.Client
	done chan struct{}
	mu   sync.Mutex
	logs bytes.Buffer
}

func (n *haNode) Write(p []byte) (int, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.logs.Write(p)
}

// Logs returns what the daemon printed so far.
func (n *haNode) Logs() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.logs.String()
}

const haAPI = "127.0.0.1:11111"

// launchHANode starts a daemon in namespace ns with env added to its
// environment; it is stopped when the test ends.
func launchHANode(t *testing.T, b *daemontest.Binaries, ns string, env []string, args ...string) *haNode {
	t.Helper()
	n := &haNode{ns: ns, http: nsClient(ns), env: env}
	n.http.Transport = bearer{n.http.Transport}
	// The API listens on every address, so it takes a token (in cleartext:
	// the lab's links are its own): the others reach it at the node's
	// advertised address, the test at haAPI.
	n.args = append([]string{"--net=/run/netns/" + ns, b.Loxilb, "--api-addr", "0.0.0.0:11111", "--api-token-file", haTokenFile(t), "--api-allow-cleartext", "--state-dir", t.TempDir(),
		"--no-dataplane=false", "--bpf-pin-path", daemonPin(t), "--metrics"}, args...)
	n.start(t)
	t.Cleanup(func() { daemontest.StopProcess(n.cmd.Process, n.done) })
	return n
}

// haToken is every node's API bearer token.
const haToken = "lab-token-5f0c2a9e41d7b386"

func haTokenFile(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(p, []byte(haToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// bearer adds the lab's API token to each request.
type bearer struct{ next http.RoundTripper }

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+haToken)
	return b.next.RoundTrip(r)
}

// start runs the daemon process; after a kill it starts it again on the
// same state directory and pin path, as a rebooted node would.
func (n *haNode) start(t *testing.T) {
	t.Helper()
	n.done = make(chan struct{})
	// nsenter execs the daemon, so the process is the daemon itself.
	n.cmd = exec.Command("nsenter", n.args...)
	n.cmd.Env = append(os.Environ(), n.env...)
	n.cmd.Stdout, n.cmd.Stderr = n, n
	if err := n.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	cmd, done := n.cmd, n.done
	go func() { _ = cmd.Wait(); close(done) }()
}

// waitUp waits until the daemon's API answers.
func (n *haNode) waitUp(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if resp, err := n.http.Get("http://" + haAPI + "/netlox/v1/version"); err == nil {
			resp.Body.Close()
			return nil
		}
		select {
		case <-n.done:
			return fmt.Errorf("daemon in %s exited:\n%s", n.ns, n.Logs())
		case <-time.After(50 * time.Millisecond):
		}
	}
	return fmt.Errorf("daemon in %s did not come up in %v:\n%s", n.ns, timeout, n.Logs())
}

func (n *haNode) get(t *testing.T, path string) []byte {
	t.Helper()
	resp, err := n.http.Get("http://" + haAPI + path)
	if err != nil {
		t.Fatalf("%s: GET %s: %v", n.ns, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: GET %s: %d %s", n.ns, path, resp.StatusCode, b)
	}
	return b
}

func (n *haNode) post(t *testing.T, path, body string) (int, []byte) {
	t.Helper()
	resp, err := n.http.Post("http://"+haAPI+"/netlox/v1"+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("%s: POST %s: %v", n.ns, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

func (n *haNode) metrics(t *testing.T) string {
	t.Helper()
	return string(n.get(t, "/netlox/v1/metrics"))
}

// ruleState is the listed state of the rule on vip ("" when not listed).
func (n *haNode) ruleState(t *testing.T, vip string) string {
	t.Helper()
	st, err := n.ruleStateErr(vip)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func (n *haNode) ruleStateErr(vip string) (string, error) {
	var list struct {
		LBAttr []struct {
			Service struct {
				ExternalIP string `json:"externalIP"`
				Port       int    `json:"port"`
			} `json:"serviceArguments"`
			Status *struct {
				State string `json:"state"`
			} `json:"ruleStatus"`
		} `json:"lbAttr"`
	}
	resp, err := n.http.Get("http://" + haAPI + "/netlox/v1/config/loadbalancer/all")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil {
		return "", fmt.Errorf("%s: rule list: %w", n.ns, err)
	}
	for _, r := range list.LBAttr {
		if net.JoinHostPort(r.Service.ExternalIP, fmt.Sprint(r.Service.Port)) == vip && r.Status != nil {
			return r.Status.State, nil
		}
	}
	return "", nil
}

func (n *haNode) storeReady(t *testing.T) bool {
	t.Helper()
	return n.capability(t, "rule_store").Ready
}

// capability is n's capability name, as GET /status/capabilities shows it.
func (n *haNode) capability(t *testing.T, name string) api.Capability {
	t.Helper()
	var caps struct {
		Capabilities []api.Capability `json:"capabilities"`
	}
	if err := json.Unmarshal(n.get(t, "/netlox/v1/status/capabilities"), &caps); err != nil {
		t.Fatal(err)
	}
	for _, c := range caps.Capabilities {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("%s: no %s capability", n.ns, name)
	return api.Capability{}
}

// inventory is the number of blocks the node holds for endpoint ep of
// the first rule.
func (n *haNode) inventory(t *testing.T, ep int) int {
	t.Helper()
	var inv struct {
		Total int `json:"total"`
	}
	if err := json.Unmarshal(n.get(t, fmt.Sprintf("/netlox/v1/config/ai/kv/inventory?service_id=1&ep_idx=%d", ep)), &inv); err != nil {
		t.Fatal(err)
	}
	return inv.Total
}

func requestsPerNode(t *testing.T, nodes []*haNode) []float64 {
	t.Helper()
	out := make([]float64, len(nodes))
	for i, n := range nodes {
		out[i] = max(0, metricValue(n.metrics(t), "loxilb_ai_requests_total"))
	}
	return out
}

// steeredPerNode is each node's count of connections its sk_lookup
// program handed to the mode-4 proxy.
func steeredPerNode(t *testing.T, nodes []*haNode) []float64 {
	t.Helper()
	out := make([]float64, len(nodes))
	for i, n := range nodes {
		out[i] = max(0, metricValue(n.metrics(t), "loxilb_dataplane_packets_total", `reason="proxy_steered"`))
	}
	return out
}

// kept is a client connection kept alive across requests.
type kept struct {
	c    net.Conn
	r    *bufio.Reader
	port int // the client's source port
}

// do sends one completion on the connection and reads the answer.
func (k *kept) do(prompt string) error {
	body := completionBody(prompt)
	_ = k.c.SetDeadline(time.Now().Add(10 * time.Second))
	req := fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: lab\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	if _, err := io.WriteString(k.c, req); err != nil {
		return err
	}
	resp, err := http.ReadResponse(k.r, nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%d %s", resp.StatusCode, b)
	}
	return nil
}

// openKept opens n connections from the client to the VIP and sends one
// request on each, so each is established with a node.
func openKept(t *testing.T, lab HALab, n int) []*kept {
	t.Helper()
	var out []*kept
	for i := range n {
		c, err := dialIn(context.Background(), lab.Client, net.JoinHostPort(HAVIP().String(), fmt.Sprint(haVIPPort)))
		if err != nil {
			t.Fatalf("kept connection %d: %v", i, err)
		}
		k := &kept{c: c, r: bufio.NewReader(c), port: c.LocalAddr().(*net.TCPAddr).Port}
		out = append(out, k)
		if err := k.do(haPrompt(500 + i)); err != nil {
			t.Fatalf("kept connection %d: first request: %v", i, err)
		}
	}
	return out
}

// connectionsByNode says which node (0-based) holds each kept connection,
// from the sockets established on the VIP in each node's namespace.
func connectionsByNode(t *testing.T, nodes []*haNode, held []*kept) []int {
	t.Helper()
	byPort := map[int]int{}
	for i, n := range nodes {
		out, err := Exec(n.ns, "ss", "-Htn", "state", "established", "src", net.JoinHostPort(HAVIP().String(), fmt.Sprint(haVIPPort)))
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			f := strings.Fields(line)
			if len(f) < 4 {
				continue
			}
			_, p, _ := net.SplitHostPort(f[len(f)-1])
			port, _ := strconv.Atoi(p)
			byPort[port] = i
		}
	}
	on := make([]int, len(held))
	for i, k := range held {
		node, ok := byPort[k.port]
		if !ok {
			t.Fatalf("kept connection %d (client port %d) established on no node", i, k.port)
		}
		on[i] = node
	}
	return on
}

// converged polls nodes together until each lists the rule on vip as
// applied, and returns each one's time since created; it fails the test
// after limit.
func converged(t *testing.T, nodes []*haNode, vip string, created time.Time, limit time.Duration) []time.Duration {
	t.Helper()
	out := make([]time.Duration, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i] = -1
			for time.Since(created) < limit {
				if st, err := n.ruleStateErr(vip); err == nil && st == "applied" {
					out[i] = time.Since(created).Round(time.Millisecond)
					return
				}
				time.Sleep(5 * time.Millisecond)
			}
		}()
	}
	wg.Wait()
	for i, d := range out {
		if d < 0 {
			t.Fatalf("rule on %s not applied by %s within %v:\n%s", vip, nodes[i].ns, limit, nodes[i].Logs())
		}
	}
	return out
}

func countByNode(on []int, nodes int) []int {
	out := make([]int, nodes)
	for _, n := range on {
		out[n]++
	}
	return out
}

func waitFor(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
