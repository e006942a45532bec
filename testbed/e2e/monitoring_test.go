package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/daemontest"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// The dashboard and the rules shipped in deploy/.
var (
	dashboardPath = filepath.Join("deploy", "grafana", "loxilb-llm.json")
	rulesPath     = filepath.Join("deploy", "prometheus", "loxilb-rules.yml")
)

type dashTarget struct {
	RefID      string `json:"refId"`
	Expr       string `json:"expr"`
	Datasource struct {
		UID string `json:"uid"`
	} `json:"datasource"`
}

type dashPanel struct {
	ID         int    `json:"id"`
	Type       string `json:"type"`
	Title      string `json:"title"`
	Datasource struct {
		UID string `json:"uid"`
	} `json:"datasource"`
	Targets []dashTarget `json:"targets"`
	Panels  []dashPanel  `json:"panels"`
}

type dashVariable struct {
	Name     string `json:"name"`
	Type     string `json:"type"`
	Query    any    `json:"query"`
	AllValue string `json:"allValue"`
}

type dashboard struct {
	SchemaVersion int `json:"schemaVersion"`
	Templating    struct {
		List []dashVariable `json:"list"`
	} `json:"templating"`
	Panels []dashPanel `json:"panels"`
}

func loadDashboard(t *testing.T) dashboard {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(daemontest.RepoRoot(), dashboardPath))
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", dashboardPath, err)
	}
	return d
}

// queryPanels returns the dashboard's panels that run queries, rows
// flattened.
func (d dashboard) queryPanels() []dashPanel {
	var out []dashPanel
	var walk func([]dashPanel)
	walk = func(ps []dashPanel) {
		for _, p := range ps {
			if p.Type == "row" {
				walk(p.Panels)
				continue
			}
			out = append(out, p)
		}
	}
	walk(d.Panels)
	return out
}

// variableQuery returns a query variable's query text.
func (v dashVariable) variableQuery() string {
	switch q := v.Query.(type) {
	case string:
		return q
	case map[string]any:
		s, _ := q["query"].(string)
		return s
	}
	return ""
}

var metricName = regexp.MustCompile(`\bloxilb_[a-z0-9_]+`)

// TestDashboardFile checks the dashboard's structure and that every metric
// it names is exported by the code, without a Prometheus.
func TestDashboardFile(t *testing.T) {
	d := loadDashboard(t)
	if d.SchemaVersion < 39 {
		t.Errorf("schemaVersion %d, want >= 39", d.SchemaVersion)
	}
	vars := map[string]dashVariable{}
	for _, v := range d.Templating.List {
		vars[v.Name] = v
	}
	if v, ok := vars["DS_PROMETHEUS"]; !ok || v.Type != "datasource" {
		t.Errorf("no datasource variable DS_PROMETHEUS: %+v", vars)
	}
	for _, name := range []string{"service", "ep_idx"} {
		if v, ok := vars[name]; !ok || v.Type != "query" || v.variableQuery() == "" || v.AllValue != ".*" {
			t.Errorf("variable %s: %+v, want a query variable with allValue .*", name, v)
		}
	}
	source := exportedMetrics(t)
	ids := map[int]string{}
	panels := d.queryPanels()
	if len(panels) < 20 {
		t.Fatalf("%d panels", len(panels))
	}
	for _, p := range panels {
		if other, dup := ids[p.ID]; dup {
			t.Errorf("panel id %d used by %q and %q", p.ID, other, p.Title)
		}
		ids[p.ID] = p.Title
		if p.Datasource.UID != "${DS_PROMETHEUS}" || len(p.Targets) == 0 {
			t.Errorf("panel %q: datasource %q, %d targets", p.Title, p.Datasource.UID, len(p.Targets))
		}
		for _, tg := range p.Targets {
			if tg.Datasource.UID != "${DS_PROMETHEUS}" {
				t.Errorf("panel %q target %s: datasource %q", p.Title, tg.RefID, tg.Datasource.UID)
			}
			for _, m := range metricName.FindAllString(tg.Expr, -1) {
				base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(m, "_bucket"), "_sum"), "_count")
				if !source[base] {
					t.Errorf("panel %q target %s: metric %s is not exported by the code", p.Title, tg.RefID, m)
				}
			}
		}
	}
}

// exportedMetrics returns the loxilb_ metric names declared in the Go
// sources of pkg/ and api/.
func exportedMetrics(t *testing.T) map[string]bool {
	t.Helper()
	decl := regexp.MustCompile(`(?:Name:\s*|NewDesc\()"(loxilb_[a-z0-9_]+)"`)
	out := map[string]bool{}
	root := daemontest.RepoRoot()
	for _, dir := range []string{"pkg", "api"} {
		err := filepath.WalkDir(filepath.Join(root, dir), func(path string, e os.DirEntry, err error) error {
			if err != nil || e.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			for _, m := range decl.FindAllStringSubmatch(string(b), -1) {
				out[m[1]] = true
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if len(out) < 50 {
		t.Fatalf("found only %d metric declarations", len(out))
	}
	return out
}

// requirePrometheus returns the paths of Debian's prometheus and promtool.
// CI installs them (.ci/run): there a missing binary fails the test.
func requirePrometheus(t *testing.T) (prom, promtool string) {
	t.Helper()
	var err error
	if prom, err = exec.LookPath("prometheus"); err == nil {
		promtool, err = exec.LookPath("promtool")
	}
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("prometheus and promtool are required in CI (Debian package prometheus, installed by .ci/run): %v", err)
		}
		t.Skipf("prometheus or promtool not installed (apt-get install prometheus): %v", err)
	}
	return prom, promtool
}

// TestPrometheusRulesCheck: the shipped rule file passes promtool.
func TestPrometheusRulesCheck(t *testing.T) {
	_, promtool := requirePrometheus(t)
	out, err := exec.Command(promtool, "check", "rules", filepath.Join(daemontest.RepoRoot(), rulesPath)).CombinedOutput()
	if err != nil {
		t.Fatalf("promtool check rules %s: %v\n%s", rulesPath, err, out)
	}
	if !strings.Contains(string(out), "SUCCESS") {
		t.Fatalf("promtool check rules: %s", out)
	}
}

// promServer is a Prometheus process scraping the daemon.
type promServer struct {
	url  string
	cmd  *exec.Cmd
	logs *lockedBuf
}

type lockedBuf struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// startPrometheus runs prom scraping the daemon every second, with the
// shipped rule file evaluated every second.
func startPrometheus(t *testing.T, prom string, d *daemontest.Daemon) *promServer {
	t.Helper()
	dir := t.TempDir()
	cfg := fmt.Sprintf(`global:
  scrape_interval: 1s
  scrape_timeout: 900ms
  evaluation_interval: 1s
rule_files:
  - %q
scrape_configs:
  - job_name: loxilb
    metrics_path: /netlox/v1/metrics
    static_configs:
      - targets: ["127.0.0.1:%d"]
`, filepath.Join(daemontest.RepoRoot(), rulesPath), d.Port)
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	port := daemontest.FreePort(t)
	p := &promServer{url: fmt.Sprintf("http://127.0.0.1:%d", port), logs: &lockedBuf{}}
	p.cmd = exec.Command(prom, "--config.file", filepath.Join(dir, "prometheus.yml"), "--storage.tsdb.path", filepath.Join(dir, "data"),
		"--web.listen-address", fmt.Sprintf("127.0.0.1:%d", port), "--log.level", "warn")
	p.cmd.Stdout, p.cmd.Stderr = p.logs, p.logs
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = p.cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = p.cmd.Process.Kill()
			<-done
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if resp, err := http.Get(p.url + "/-/ready"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return p
			}
		}
		select {
		case <-done:
			t.Fatalf("prometheus exited:\n%s", p.logs.String())
		case <-time.After(100 * time.Millisecond):
		}
	}
	t.Fatalf("prometheus not ready:\n%s", p.logs.String())
	return nil
}

type promSample struct {
	Metric map[string]string `json:"metric"`
	Value  [2]any            `json:"value"`
}

// query evaluates expr now and returns the series, or the error
// Prometheus gave (a parse error names the position).
func (p *promServer) query(expr string) ([]promSample, error) {
	resp, err := http.Get(p.url + "/api/v1/query?query=" + url.QueryEscape(expr))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var out struct {
		Status    string `json:"status"`
		Error     string `json:"error"`
		ErrorType string `json:"errorType"`
		Data      struct {
			ResultType string       `json:"resultType"`
			Result     []promSample `json:"result"`
		} `json:"data"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, fmt.Errorf("HTTP %d: %s", resp.StatusCode, b)
	}
	if out.Status != "success" {
		return nil, fmt.Errorf("%s: %s", out.ErrorType, out.Error)
	}
	if out.Data.ResultType != "vector" {
		return nil, fmt.Errorf("result type %s", out.Data.ResultType)
	}
	return out.Data.Result, nil
}

func (p *promServer) getJSON(t *testing.T, path string, out any) {
	t.Helper()
	resp, err := http.Get(p.url + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		t.Fatal(err)
	}
}

// scrapes returns how many samples of up the daemon's target has.
func (p *promServer) scrapes(t *testing.T) int {
	t.Helper()
	r, err := p.query(`count_over_time(up{job="loxilb"}[10m])`)
	if err != nil {
		t.Fatal(err)
	}
	if len(r) == 0 {
		return 0
	}
	var n int
	fmt.Sscanf(fmt.Sprint(r[0].Value[1]), "%d", &n)
	return n
}

// expandVariables substitutes the dashboard's variables as Grafana does
// with "All" selected, and its interval variables with what Grafana uses
// for a recent short range: a capture-group reference such as ${1} in
// label_replace is no variable and stays.
func expandVariables(expr string) string {
	vals := map[string]string{"service": ".*", "ep_idx": ".*", "__rate_interval": "1m", "__interval": "1s", "__range": "5m"}
	re := regexp.MustCompile(`\$\{(\w+)\}|\$(\w+)`)
	return re.ReplaceAllStringFunc(expr, func(m string) string {
		name := strings.Trim(m, "${}")
		if v, ok := vals[name]; ok {
			return v
		}
		return m
	})
}

// TestDashboardAgainstPrometheus runs the daemon with two rules (a vLLM
// KV-exact pool and a vLLM prefill/decode pair) over engine emulators,
// Prometheus scraping it every second with the shipped rules, drives
// traffic that produces every condition a panel shows (Tier-1.5 hits, a
// cold seed, spills, an event gap and its replay, coalescing, a queued
// prefill admission, P/D admission queueing and shedding), and evaluates
// every query of the dashboard through Prometheus' HTTP API: each must
// parse and return a series. The data-plane panels need the eBPF data plane
// (root); outside CI without root they are skipped with a message.
func TestDashboardAgainstPrometheus(t *testing.T) {
	prom, _ := requirePrometheus(t)
	testStart := time.Now()
	root := os.Geteuid() == 0
	if !root && os.Getenv("CI") == "true" {
		t.Fatal("CI runs as root: the data-plane panels must be checked")
	}
	dash := loadDashboard(t)
	const kvNet, pdNet, port, zmqPort = 201, 202, 28000, 25557
	tok, err := enginesim.LoadTokenizer(filepath.Join(tokenizerDir(), "Qwen__Qwen3-0.6B"))
	if err != nil {
		t.Fatal(err)
	}
	engine := func(c enginesim.Config) *enginesim.Engine {
		c.Model = model
		e, err := enginesim.New(c, enginesim.Deps{Tokenizer: tok})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { _ = e.Run(ctx); close(done) }()
		t.Cleanup(func() { cancel(); <-done })
		return e
	}

	// Rule 1: vLLM KV-exact pool of two engines, health-probed.
	var kvEngines []*enginesim.Engine
	var kvEps []string
	for i := 0; i < 2; i++ {
		host := fmt.Sprintf("127.0.%d.%d", kvNet, 11+i)
		kvEngines = append(kvEngines, engine(enginesim.Config{Engine: "vllm", Listen: fmt.Sprintf("%s:%d", host, port),
			ZMQBind: host, ZMQPort: zmqPort, Seed: seed, TimeScale: 1, TimeScaleSet: true, PrefillUsPerToken: 100, DecodeUsPerToken: 5000}))
		kvEps = append(kvEps, fmt.Sprintf(`{"endpointIP":%q,"targetPort":%d,"weight":1}`, host, port))
	}
	// Rule 2: vLLM prefill/decode pair.
	var pdEngines []*enginesim.Engine
	var pdEps []string
	for i, role := range []string{enginesim.RolePrefill, enginesim.RoleDecode} {
		host := fmt.Sprintf("127.0.%d.%d", pdNet, 11+i)
		pdEngines = append(pdEngines, engine(enginesim.Config{Engine: "vllm", Role: role, Listen: fmt.Sprintf("%s:%d", host, port),
			ZMQBind: host, ZMQPort: -1, Seed: seed, TimeScale: 0, TimeScaleSet: true}))
		pdEps = append(pdEps, fmt.Sprintf(`{"endpointIP":%q,"targetPort":%d,"weight":1,"ep_role":%d}`, host, port, i+1))
	}

	env := []string{"LLB_KV_NONE_HASH_SEED=" + seed,
		// One prefill slot per endpoint: a second cold prompt queues.
		"LOXILB_KV_PREFILL_SLOTS=1", "LOXILB_KV_PREFILL_QUEUE_MS=5000",
		// Every third hit seeds the endpoint that holds no block yet.
		"LOXILB_KV_COLDSTART_SEED_N=3", "LOXILB_KV_COLDSTART_MIN_BLOCKS=1",
		// Two endpoints: spill once the warm one is above the mean.
		"LOXILB_KV_MEAN_LOAD_FACTOR=100",
		// P/D: one leg in flight and one waiting per endpoint.
		"LLB_PD_MAX_INFLIGHT_PER_EP=1", "LLB_PD_QUEUE_DEPTH_PER_EP=1"}
	args := []string{"--tokenizer-dir", tokenizerDir(), "--metrics", "--proxy-receipts", "on-request"}
	if root {
		pin := filepath.Join("/sys/fs/bpf", fmt.Sprintf("loxilb-mon-%d", os.Getpid()))
		t.Cleanup(func() { _ = os.RemoveAll(pin) })
		args = append(args, "--no-dataplane=false", "--bpf-pin-path", pin)
	}
	t.Logf("engines up in %v", time.Since(testStart).Round(time.Millisecond))
	d := daemontest.Start(t, bins, t.TempDir(), env, args...)
	for _, rule := range []string{
		fmt.Sprintf(`{"serviceArguments":{"name":"chat-kv","externalIP":"127.0.%d.1","port":28080,"protocol":"tcp","mode":4,"sel":0,
			"kvExactMode":3,"kvEngineType":"vllm","kvZmqPort":%d,"kvDpRankCount":1,"kvBlockSize":16,"model_name":%q,
			"monitor":true,"probetype":"http","probereq":"/health","probeTimeout":1,"probeRetries":1},"endpoints":[%s]}`,
			kvNet, zmqPort, model, strings.Join(kvEps, ",")),
		fmt.Sprintf(`{"serviceArguments":{"name":"chat-pd","externalIP":"127.0.%d.1","port":28080,"protocol":"tcp","mode":4,"sel":0,
			"pd_disagg_mode":true,"kvExactMode":0,"kvEngineType":"vllm","model_name":%q},"endpoints":[%s]}`,
			pdNet, model, strings.Join(pdEps, ",")),
	} {
		if resp, body := post(t, d.URL("/config/loadbalancer"), json.RawMessage(rule)); resp.StatusCode != 200 {
			t.Fatalf("create rule: %d %s", resp.StatusCode, body)
		}
	}
	kv := &pool{engines: kvEngines, d: d, vip: fmt.Sprintf("127.0.%d.1:28080", kvNet)}
	pdVIP := fmt.Sprintf("127.0.%d.1:28080", pdNet)
	t.Logf("daemon up in %v", time.Since(testStart).Round(time.Millisecond))
	waitFor(t, "subscribers connected", 15*time.Second, func() bool {
		return metricValue(metrics(t, d), "loxilb_kv_subscriber_connected") >= 2
	})
	setup := time.Since(testStart)
	ps := startPrometheus(t, prom, d)
	// Prometheus hands static targets to its scrape loop only after its
	// discovery throttle (about 5 s): gauges sampled by the traffic below
	// (a waiting prefill) exist for a few seconds only, so scraping must
	// already run when it starts.
	waitFor(t, "prometheus to scrape the daemon", 30*time.Second, func() bool { return ps.scrapes(t) >= 1 })
	start := time.Now()
	t.Logf("daemon and engines up in %v, prometheus in %v", setup.Round(time.Millisecond), time.Since(testStart.Add(setup)).Round(time.Millisecond))

	// Tier-1.5: a miss warms one endpoint, repeats hit it, every third
	// hit seeds the cold endpoint.
	first := complete(t, kv.vip, longPrompt("monitoring", 0))
	kv.waitInventory(t, first.ep)
	for i := 1; i <= 6; i++ {
		complete(t, kv.vip, longPrompt("monitoring", i))
	}

	// A lost event batch: the next batch reveals the gap, replay repairs it.
	for _, e := range kvEngines {
		if err := e.SetFaults(enginesim.Faults{DropBatches: 1}); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < 20 && metricValue(metrics(t, d), "loxilb_kv_seq_gaps_total") == 0; i++ {
		complete(t, kv.vip, longPrompt(fmt.Sprintf("gap-%d", i), i))
		time.Sleep(50 * time.Millisecond)
	}
	if metricValue(metrics(t, d), "loxilb_kv_seq_gaps_total") == 0 {
		t.Fatal("dropped event batches produced no sequence gap")
	}

	// A burst of siblings sharing a new prefix while the engines stall:
	// followers coalesce behind the first, then queue for the single
	// prefill slot, and the load spills to the other endpoint.
	for _, e := range kvEngines {
		if err := e.SetFaults(enginesim.Faults{StallMs: 700}); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			complete(t, kv.vip, longPrompt("burst", 100+i))
		}()
		time.Sleep(20 * time.Millisecond)
	}
	wg.Wait()
	// Cold prompts the selector spreads while the engines stall longer than
	// two scrapes: the second on an endpoint waits for its prefill slot
	// until Prometheus has seen it waiting.
	for _, e := range kvEngines {
		if err := e.SetFaults(enginesim.Faults{StallMs: 2500}); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			complete(t, kv.vip, longPrompt(fmt.Sprintf("cold-%d", i), i))
		}()
	}
	waitFor(t, "prometheus to scrape a waiting prefill", 10*time.Second, func() bool {
		r, err := ps.query(`max(loxilb_kv_prefill_queue_depth) > 0`)
		return err == nil && len(r) > 0
	})
	wg.Wait()
	// An engine error the proxy relays: a 5xx answer.
	for _, e := range kvEngines {
		if err := e.SetFaults(enginesim.Faults{FailRequests: 1, FailStatus: 503}); err != nil {
			t.Fatal(err)
		}
	}
	if resp, body := post(t, "http://"+kv.vip+"/v1/completions", map[string]any{"model": model, "prompt": longPrompt("fail", 0), "max_tokens": 4}); resp.StatusCode/100 != 5 {
		t.Fatalf("injected engine failure answered %d %s", resp.StatusCode, body)
	}
	for _, e := range kvEngines {
		_ = e.SetFaults(enginesim.Faults{})
	}

	// P/D: plain requests, then a burst against one in-flight leg and a
	// queue of one: one leg queues, the rest are shed.
	chat := func(i int) int {
		resp, body := post(t, "http://"+pdVIP+"/v1/chat/completions", map[string]any{"model": model, "max_tokens": 4,
			"messages": []map[string]string{{"role": "user", "content": longPrompt("pd", i)}}})
		if resp.StatusCode != 200 && resp.StatusCode != 429 && resp.StatusCode != 503 {
			t.Errorf("P/D chat: %d %s", resp.StatusCode, body)
		}
		return resp.StatusCode
	}
	for i := 0; i < 3; i++ {
		if code := chat(i); code != 200 {
			t.Fatalf("P/D chat %d: %d", i, code)
		}
	}
	if err := pdEngines[0].SetFaults(enginesim.Faults{StallMs: 600}); err != nil {
		t.Fatal(err)
	}
	codes := make([]int, 4)
	for i := range codes {
		wg.Add(1)
		go func() { defer wg.Done(); codes[i] = chat(10 + i) }()
		time.Sleep(20 * time.Millisecond)
	}
	wg.Wait()
	_ = pdEngines[0].SetFaults(enginesim.Faults{})

	m := metrics(t, d)
	checkMetricLabels(t, m)
	t.Logf("traffic took %v: hits %v, cold seeds %v, spills %v, gaps %v, coalesced %v, prefill queued %v, P/D codes %v, P/D shed %v",
		time.Since(start).Round(time.Millisecond), metricValue(m, "loxilb_pd_kv_tier15_hits_total"),
		metricValue(m, "loxilb_pd_kv_tier15_cold_seeds_total"), metricValue(m, "loxilb_pd_kv_tier15_spills_total"),
		metricValue(m, "loxilb_kv_seq_gaps_total"), metricValue(m, "loxilb_kv_coalesced_total"),
		metricValue(m, "loxilb_kv_prefill_admitted_total", `outcome="queued"`), codes, metricValue(m, "loxilb_pd_admission_shed_total"))

	// loxicmd top reads the same state from the API alone.
	out, errs, code := daemontest.CLI(t, bins, d.Port, "top", "chat-kv", "--once", "--interval", "300ms")
	if code != 0 || !strings.Contains(out, "service 1 chat-kv") || strings.Count(out, fmt.Sprintf("127.0.%d.", kvNet)) != 3 ||
		strings.Count(out, " ok ") != 2 || strings.Count(out, "connected") != 2 {
		t.Errorf("loxicmd top chat-kv --once: exit %d\n%s%s", code, out, errs)
	}
	t.Logf("loxicmd top chat-kv --once:\n%s", out)
	out, errs, code = daemontest.CLI(t, bins, d.Port, "top", "--once", "--interval", "300ms", "-o", "json")
	var frame struct {
		Services []struct {
			Name      string
			Endpoints []struct {
				Blocks *float64 `json:"kv_blocks"`
			}
		}
	}
	if err := json.Unmarshal([]byte(out), &frame); code != 0 || err != nil || len(frame.Services) != 2 ||
		frame.Services[0].Endpoints[0].Blocks == nil || *frame.Services[0].Endpoints[0].Blocks == 0 {
		t.Errorf("loxicmd top --once -o json: exit %d %v\n%s%s", code, err, out, errs)
	}

	checkTopInTerminal(t, d.Port, kvNet)

	// Two more scrapes after the traffic.
	n0 := ps.scrapes(t)
	waitFor(t, "two scrapes after the traffic", 15*time.Second, func() bool { return ps.scrapes(t) >= n0+2 })
	if r, err := ps.query(`up{job="loxilb"} == 1`); err != nil || len(r) != 1 {
		t.Fatalf("daemon target not up: %v %v\n%s", r, err, ps.logs.String())
	}

	// The variables.
	for _, v := range dash.Templating.List {
		q := v.variableQuery()
		if v.Type != "query" || q == "" {
			continue
		}
		switch {
		case strings.HasPrefix(q, "query_result(") && strings.HasSuffix(q, ")"):
			r, err := ps.query(expandVariables(strings.TrimSuffix(strings.TrimPrefix(q, "query_result("), ")")))
			if err != nil || len(r) < 2 {
				t.Errorf("variable %s (%s): %d series, %v", v.Name, q, len(r), err)
			}
		case strings.HasPrefix(q, "label_values(") && strings.HasSuffix(q, ")"):
			inner := strings.TrimSuffix(strings.TrimPrefix(q, "label_values("), ")")
			i := strings.LastIndex(inner, ",")
			sel, label := expandVariables(strings.TrimSpace(inner[:i])), strings.TrimSpace(inner[i+1:])
			var out struct {
				Status string
				Data   []string
			}
			ps.getJSON(t, "/api/v1/label/"+label+"/values?match[]="+url.QueryEscape(sel), &out)
			if out.Status != "success" || len(out.Data) == 0 {
				t.Errorf("variable %s (%s): %+v", v.Name, q, out)
			}
		default:
			t.Errorf("variable %s: query %q is neither query_result nor label_values", v.Name, q)
		}
	}

	// Every panel's every query.
	checked, skipped := 0, 0
	for _, p := range dash.queryPanels() {
		for _, tg := range p.Targets {
			if !root && strings.Contains(tg.Expr, "loxilb_dataplane_") {
				skipped++
				continue
			}
			expr := expandVariables(tg.Expr)
			r, err := ps.query(expr)
			switch {
			case err != nil:
				t.Errorf("panel %q target %s: %v\n%s", p.Title, tg.RefID, err, expr)
			case len(r) == 0:
				t.Errorf("panel %q target %s returned no series:\n%s", p.Title, tg.RefID, expr)
			default:
				for _, s := range r {
					if s.Metric["service"] != "" && s.Metric["name"] == "" {
						t.Errorf("panel %q target %s: series %v lacks the rule name", p.Title, tg.RefID, s.Metric)
					}
				}
			}
			checked++
		}
	}
	if skipped > 0 {
		t.Logf("skipped %d data-plane queries: the eBPF data plane needs root (they run in CI)", skipped)
	}

	// The shipped rules: loaded, healthy, and every recording rule has
	// series.
	var rules struct {
		Status string
		Data   struct {
			Groups []struct {
				Name  string
				Rules []struct {
					Name, Type, Health, LastError string
				}
			}
		}
	}
	waitFor(t, "every rule evaluated", 10*time.Second, func() bool {
		ps.getJSON(t, "/api/v1/rules", &rules)
		for _, g := range rules.Data.Groups {
			for _, r := range g.Rules {
				if r.Health == "unknown" {
					return false
				}
			}
		}
		return len(rules.Data.Groups) > 0
	})
	nRules := 0
	for _, g := range rules.Data.Groups {
		for _, r := range g.Rules {
			nRules++
			if r.Health != "ok" {
				t.Errorf("rule %s (%s): health %s: %s", r.Name, g.Name, r.Health, r.LastError)
			}
			if r.Type != "recording" {
				continue
			}
			// A group's first evaluations can precede the samples its
			// windows need: wait for the series, bounded.
			var got []promSample
			var err error
			for i := 0; i < 100; i++ {
				if got, err = ps.query(r.Name); err == nil && len(got) > 0 {
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
			if len(got) == 0 {
				var raw json.RawMessage
				ps.getJSON(t, "/api/v1/rules?type=record", &raw)
				t.Errorf("recording rule %s: no series (%v); rules: %s", r.Name, err, raw)
			}
		}
	}
	if nRules < 10 {
		t.Errorf("prometheus loaded %d rules from %s", nRules, rulesPath)
	}
	t.Logf("%d dashboard queries returned series, %d rules healthy, in %v", checked, nRules, time.Since(start).Round(time.Millisecond))
}

// checkTopInTerminal runs the live `loxicmd top` in a real terminal (a
// detached tmux pane) and reads the screen as a user sees it: one frame at
// a time (each redraw clears the previous one), redrawn every interval, and
// Ctrl-C ends it cleanly.
func checkTopInTerminal(t *testing.T, port, kvNet int) {
	t.Helper()
	tmux, err := exec.LookPath("tmux")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("tmux not installed (.ci/run installs it): the live view cannot be checked in a terminal")
		}
		t.Log("tmux not installed: skipping the terminal check of loxicmd top (CI installs it)")
		return
	}
	sock := filepath.Join(t.TempDir(), "tmux.sock")
	run := func(args ...string) (string, error) {
		out, err := exec.Command(tmux, append([]string{"-S", sock}, args...)...).CombinedOutput()
		return string(out), err
	}
	shell := fmt.Sprintf("%s -p %d top chat-kv --interval 300ms; echo top-exited-$?; sleep 30", bins.Loxicmd, port)
	if out, err := run("new-session", "-d", "-s", "top", "-x", "180", "-y", "50", shell); err != nil {
		t.Fatalf("tmux new-session: %v\n%s", err, out)
	}
	t.Cleanup(func() { _, _ = run("kill-server") })
	capture := func() string {
		out, err := run("capture-pane", "-p", "-t", "top")
		if err != nil {
			t.Fatalf("tmux capture-pane: %v\n%s", err, out)
		}
		return out
	}
	header := regexp.MustCompile(`loxicmd top  (\S+)  rates over`)
	var first, screen string
	waitFor(t, "two different frames of loxicmd top in the terminal", 15*time.Second, func() bool {
		screen = capture()
		m := header.FindStringSubmatch(screen)
		if m == nil || !strings.Contains(screen, "service 1 chat-kv") {
			return false
		}
		if first == "" {
			first = m[1]
		}
		return m[1] != first
	})
	if n := strings.Count(screen, "loxicmd top "); n != 1 {
		t.Errorf("terminal shows %d frame headers, want 1 (each redraw clears the screen):\n%s", n, screen)
	}
	if !strings.Contains(screen, "EP  ENDPOINT") || strings.Count(screen, fmt.Sprintf("127.0.%d.", kvNet)) != 3 {
		t.Errorf("terminal frame lacks the endpoint table:\n%s", screen)
	}
	if out, err := run("send-keys", "-t", "top", "C-c"); err != nil {
		t.Fatalf("tmux send-keys: %v\n%s", err, out)
	}
	waitFor(t, "loxicmd top to exit on Ctrl-C", 10*time.Second, func() bool { return strings.Contains(capture(), "top-exited-0") })
	t.Logf("loxicmd top in a 180x50 terminal:\n%s", screen)
}
