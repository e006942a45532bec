package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/bench"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// The -ttfb mode measures what a KV-exact rule adds to a chat request's
// time to first byte: the daemon reads the body, renders the chat
// template, tokenizes, hashes the blocks, scores the endpoint's inventory
// and forwards. One vLLM emulator (in this process, modelled delays off,
// so it answers as soon as it has tokenized the prompt itself) is the
// endpoint of a mode-4 rule with kvExactMode 3; the client sends the
// ~2k-token chat request of BenchmarkRoutingDecisionChat2k to the
// emulator directly and through the VIP, one request at a time on a
// keep-alive connection each, alternating which goes first. The added
// time is the paired difference (VIP minus direct) of consecutive
// requests, so the machine's noise at that moment hits both. A third
// connection straight to the emulator (the "control" row) is paired with
// direct the same way: its difference is what the harness itself cannot
// tell apart (the emulator's and this process's own pauses, the host's
// run queue), the floor under every daemon's figures, the p99 above all.

const ttfbModel = "Qwen/Qwen3-0.6B"

// ttfbControl names the row of a second direct connection: its "added"
// time is the harness's own noise.
const ttfbControl = "control"

// ttfbBodies are the request kinds of the mode: the same body every time
// (a retry, or many clients sending one prompt) and a new prompt every
// time (the long message ends differently, so the gateway has never seen
// its text; its word cache is warm, as in a running gateway).
var ttfbBodies = []string{"same", "new"}

// chatBody2k is the chat request of the gateway's routing-decision
// benchmark (pkg/gateway/bench_test.go, chatBodyVariant(2000, suffix, "")):
// a system prompt, a short exchange and a ~2k-token user message, 2,793
// prompt tokens with Qwen3's template. suffix ends the long message.
func chatBody2k(suffix string) []byte {
	var long strings.Builder
	for i := 0; long.Len() < 2000*5; i++ {
		fmt.Fprintf(&long, "Paragraph %d: the service routes each request to the worker that already holds its prefix, ", i)
		long.WriteString("so prefill is skipped and time to first token drops. Ünïcödé, 中文, emoji 🚀 and code `x := y[i]`. ")
	}
	long.WriteString(suffix)
	msgs := []map[string]string{
		{"role": "system", "content": "You are a precise assistant for platform engineers."},
		{"role": "user", "content": "Summarise the design."},
		{"role": "assistant", "content": "It is a KV-cache-aware load balancer."},
		{"role": "user", "content": long.String()},
	}
	b, _ := json.Marshal(map[string]any{"model": ttfbModel, "messages": msgs, "max_tokens": 1})
	return b
}

// ttfbTarget is where requests go: the emulator directly, or a daemon's VIP.
type ttfbTarget struct {
	name, addr string
	pid        int
	metrics    string // a daemon's metrics URL, for its allocation counter
	client     *http.Client
}

func newTTFBTarget(name, addr string, pid int) *ttfbTarget {
	// One connection, kept alive: the time measured is the request's, not
	// a handshake's.
	tr := &http.Transport{MaxIdleConnsPerHost: 1, MaxConnsPerHost: 1, DisableCompression: true,
		TLSNextProto: map[string]func(string, *tls.Conn) http.RoundTripper{}}
	return &ttfbTarget{name: name, addr: addr, pid: pid, client: &http.Client{Transport: tr, Timeout: 30 * time.Second}}
}

// ttfb posts body and returns the time from the start of the request to
// the first byte of the answer.
func (t *ttfbTarget) ttfb(ctx context.Context, body []byte) (time.Duration, error) {
	var start time.Time
	var first time.Duration
	trace := &httptrace.ClientTrace{GotFirstResponseByte: func() { first = time.Since(start) }}
	req, err := http.NewRequestWithContext(httptrace.WithClientTrace(ctx, trace), http.MethodPost,
		"http://"+t.addr+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	start = time.Now()
	resp, err := t.client.Do(req)
	if err != nil {
		return 0, err
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("%s: %d %s", t.name, resp.StatusCode, b)
	}
	return first, nil
}

// ttfbRep is one repetition of one body kind: per daemon, the paired
// differences to direct and the daemon's CPU time per request.
type ttfbRep struct {
	direct []time.Duration
	vip    map[string][]time.Duration
	diff   map[string][]time.Duration
	cpu    map[string]float64 // µs of daemon CPU per request
	alloc  map[string]float64 // KB the daemon allocated per request
	wait   map[string]float64 // µs the daemon's threads waited for a CPU per request
}

func runTTFB(ctx context.Context, o options) error {
	tokDir := o.tokenizers
	if tokDir == "" {
		wd, _ := os.Getwd()
		root, err := bench.FindRepoRoot(wd)
		if err != nil {
			return fmt.Errorf("find the repository for testdata/tokenizers (or pass -tokenizers): %w", err)
		}
		tokDir = bench.DefaultTokenizerDir(root)
	}
	tok, err := enginesim.LoadTokenizer(filepath.Join(tokDir, strings.ReplaceAll(ttfbModel, "/", "__")))
	if err != nil {
		return err
	}
	eng, err := enginesim.New(enginesim.Config{Engine: enginesim.EngineVLLM, Model: ttfbModel, Listen: "127.0.0.1:0",
		BlockSize: 16, Seed: "4242", MaxRunning: 64, TimeScale: 0, TimeScaleSet: true}, enginesim.Deps{Tokenizer: tok})
	if err != nil {
		return fmt.Errorf("engine: %w", err)
	}
	ectx, stopEngine := context.WithCancel(ctx)
	defer stopEngine()
	go func() { _ = eng.Run(ectx) }()
	zmq := eng.ZMQPorts()
	if len(zmq) != 1 {
		return errors.New("engine: no ZMQ publisher")
	}

	dir, err := os.MkdirTemp("", "proxybench-ttfb")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	direct := newTTFBTarget("direct", eng.Addr(), 0)
	// vips are the targets paired with direct: the control first, then
	// each daemon's VIP.
	vips := []*ttfbTarget{newTTFBTarget(ttfbControl, eng.Addr(), 0)}
	bins := []struct{ name, path string }{{"loxilb", o.bin}}
	if o.compare != "" {
		bins = append(bins, struct{ name, path string }{"compare", o.compare})
	}
	for _, b := range bins {
		d, err := startKVDaemon(ctx, b.path, filepath.Join(dir, b.name), tokDir, eng.Addr(), zmq[0], o.runFor(b.name))
		if err != nil {
			return fmt.Errorf("%s: %w", b.name, err)
		}
		defer d.stop()
		v := newTTFBTarget(b.name, d.vip, d.cmd.Process.Pid)
		v.metrics = d.metrics
		vips = append(vips, v)
	}
	targets := append([]*ttfbTarget{direct}, vips...)

	seq := 0
	bodyFor := func(kind string) []byte {
		seq++
		if kind == "same" {
			return chatBody2k("")
		}
		return chatBody2k(fmt.Sprintf(" Request %d.", seq))
	}
	// Warm-up: connections, the daemon's word cache and the engine's.
	for i := 0; i < 20; i++ {
		for _, t := range targets {
			if _, err := t.ttfb(ctx, bodyFor("new")); err != nil {
				return fmt.Errorf("warm-up: %w", err)
			}
		}
	}
	load := loadAvg()
	res := map[string][]ttfbRep{}
	for rep := range o.reps {
		for _, kind := range ttfbBodies {
			r := ttfbRep{vip: map[string][]time.Duration{}, diff: map[string][]time.Duration{}, cpu: map[string]float64{}, alloc: map[string]float64{}, wait: map[string]float64{}}
			cpu0, alloc0, wait0 := map[string]time.Duration{}, map[string]float64{}, map[string]time.Duration{}
			for _, v := range vips {
				if v.pid == 0 {
					continue
				}
				cpu0[v.name], wait0[v.name] = procCPU(v.pid), procRunDelay(v.pid)
				if alloc0[v.name], err = v.allocated(); err != nil {
					return err
				}
			}
			for i := 0; i < o.ttfbRequests; i++ {
				body := bodyFor(kind)
				got := make([]time.Duration, len(targets))
				for _, j := range ttfbOrder(i, len(targets)) {
					if got[j], err = targets[j].ttfb(ctx, body); err != nil {
						return err
					}
				}
				r.direct = append(r.direct, got[0])
				for k, v := range vips {
					r.vip[v.name] = append(r.vip[v.name], got[k+1])
					r.diff[v.name] = append(r.diff[v.name], got[k+1]-got[0])
				}
			}
			for _, v := range vips {
				if v.pid == 0 {
					fmt.Fprintf(os.Stderr, "rep %d  %-4s  %-8s added p50 %6.3f ms p99 %6.3f ms\n",
						rep+1, kind, v.name, ms(pct(r.diff[v.name], 50)), ms(pct(r.diff[v.name], 99)))
					continue
				}
				r.cpu[v.name] = float64((procCPU(v.pid) - cpu0[v.name]).Microseconds()) / float64(o.ttfbRequests)
				r.wait[v.name] = float64((procRunDelay(v.pid) - wait0[v.name]).Microseconds()) / float64(o.ttfbRequests)
				a, err := v.allocated()
				if err != nil {
					return err
				}
				r.alloc[v.name] = (a - alloc0[v.name]) / 1024 / float64(o.ttfbRequests)
				fmt.Fprintf(os.Stderr, "rep %d  %-4s  %-8s TTFB p50 %6.2f ms (direct %6.2f)  added p50 %6.3f ms p99 %6.3f ms  CPU %6.0f µs/req  run-queue wait %5.0f µs/req  %5.1f KB/req\n",
					rep+1, kind, v.name, ms(pct(r.vip[v.name], 50)), ms(pct(r.direct, 50)),
					ms(pct(r.diff[v.name], 50)), ms(pct(r.diff[v.name], 99)), r.cpu[v.name], r.wait[v.name], r.alloc[v.name])
			}
			res[kind] = append(res[kind], r)
		}
	}
	table := renderTTFB(o, vips, res, load, loadAvg())
	fmt.Print(table)
	if o.out != "" {
		return os.WriteFile(o.out, []byte(table), 0o644)
	}
	return nil
}

// ttfbOrder is the order in which request i goes to the n targets (0 is
// direct, 1 the control, then the daemons). It rotates, so no target
// always goes first (the first carries a new prompt the engine has not
// seen, and the engine's events for its new blocks then reach every
// daemon while the next targets are timed), and on every other cycle of
// n requests the daemons trade places, so each stands where the other
// stood relative to direct, the control and that event burst: a rotation
// alone times one daemon right after the control and the other right
// after it, which showed as 0.1-0.3 ms between two identical builds on
// new prompts.
func ttfbOrder(i, n int) []int {
	base := make([]int, n)
	for k := range base {
		base[k] = k
	}
	if (i/n)%2 == 1 && n > 2 {
		slices.Reverse(base[2:])
	}
	out := make([]int, n)
	for k := range out {
		out[k] = base[(k+i)%n]
	}
	return out
}

// renderTTFB prints, per body kind and daemon, the medians over the
// repetitions of each repetition's percentiles.
func renderTTFB(o options, vips []*ttfbTarget, res map[string][]ttfbRep, load0, load1 string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "proxybench -ttfb: %d requests per target and body kind in each of %d interleaved repetitions (medians), "+
		"2,793-token Qwen3 chat, kvExactMode 3, one vLLM emulator; %d CPUs, load average %s -> %s, %s\n\n",
		o.ttfbRequests, o.reps, runtime.NumCPU(), load0, load1, time.Now().UTC().Format(time.RFC3339))
	b.WriteString("| body | daemon | added TTFB p50 ms | added TTFB p99 ms | TTFB p50 ms via VIP | direct | daemon CPU µs/req | daemon run-queue wait µs/req | daemon KB allocated/req | added p50 per repetition |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---|\n")
	for _, kind := range ttfbBodies {
		reps := res[kind]
		for _, v := range vips {
			var d50, d99, v50, x50, cpu, wait, alloc []float64
			var each []string
			for _, r := range reps {
				d50 = append(d50, ms(pct(r.diff[v.name], 50)))
				d99 = append(d99, ms(pct(r.diff[v.name], 99)))
				v50 = append(v50, ms(pct(r.vip[v.name], 50)))
				x50 = append(x50, ms(pct(r.direct, 50)))
				cpu = append(cpu, r.cpu[v.name])
				alloc = append(alloc, r.alloc[v.name])
				wait = append(wait, r.wait[v.name])
				each = append(each, fmt.Sprintf("%.3f", d50[len(d50)-1]))
			}
			cost := fmt.Sprintf("%.0f | %.0f | %.1f", median(cpu), median(wait), median(alloc))
			if v.pid == 0 {
				cost = "- | - | -"
			}
			fmt.Fprintf(&b, "| %s | %s | %.3f | %.3f | %.2f | %.2f | %s | %s |\n", kind, v.name,
				median(d50), median(d99), median(v50), median(x50), cost, strings.Join(each, ", "))
		}
	}
	return b.String()
}

// pct is the p-th percentile of ds (nearest rank).
func pct(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[min(len(s)-1, len(s)*p/100)]
}

func ms(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e6 }

// loadAvg is the first three fields of /proc/loadavg.
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

// startKVDaemon runs the daemon with a KV-exact mode-4 rule (kvExactMode
// 3, vLLM sha256_cbor, the engine's ZMQ events) whose one endpoint is the
// engine, and waits until the VIP answers a chat request, the event
// subscription is up and the start-up tokenizer loads are done.
func startKVDaemon(ctx context.Context, bin, stateDir, tokDir, engine string, zmqPort int, run daemonRun) (*daemon, error) {
	c := &http.Client{Timeout: 5 * time.Second}
	var probe *ttfbTarget // one connection for every attempt
	run.env = append([]string{"LLB_KV_NONE_HASH_SEED=4242"}, run.env...)
	return startDaemonWith(ctx, bin, daemonSpec{stateDir: stateDir, daemonRun: run,
		args: []string{"--tokenizer-dir", tokDir, "--metrics"},
		rule: func(vh, vp string) string {
			eh, ep, _ := net.SplitHostPort(engine)
			return fmt.Sprintf(`{"serviceArguments":{"externalIP":%q,"port":%s,"protocol":"tcp","mode":4,"sel":0,"model_name":%q,`+
				`"kvExactMode":3,"kvEngineType":"vllm","kvZmqPort":%d,"kvBlockSize":16},`+
				`"endpoints":[{"endpointIP":%q,"targetPort":%s,"weight":1}]}`, vh, vp, ttfbModel, zmqPort, eh, ep)
		},
		ready: func(vip, base string) error {
			if probe == nil {
				probe = newTTFBTarget("probe", vip, 0)
			}
			if _, err := probe.ttfb(ctx, chatBody2k(" probe")); err != nil {
				return err
			}
			return settled(c, base+"/metrics", tokDir)
		},
	})
}

// settled succeeds once the daemon's export shows a connected KV event
// subscriber (without one its inventory of the engine stays empty) and a
// load attempt for every tokenizer staged in tokDir: at start the daemon
// loads them all in the background, and a model loading (a second or more
// of CPU and a hundred MB or more of garbage each) while requests are
// timed is start-up cost, not what the rule adds to a request.
func settled(c *http.Client, url, tokDir string) error {
	lines, err := scrape(c, url)
	if err != nil {
		return err
	}
	sub, loads := false, 0.0
	for _, l := range lines {
		l = strings.TrimSpace(l)
		switch {
		case strings.HasPrefix(l, "loxilb_kv_subscriber_connected") && strings.HasSuffix(l, " 1"):
			sub = true
		case strings.HasPrefix(l, "loxilb_tokenizer_loads_total{"):
			if v, err := strconv.ParseFloat(l[strings.LastIndexByte(l, ' ')+1:], 64); err == nil {
				loads += v
			}
		}
	}
	if !sub {
		return errors.New("no KV event subscriber connected yet")
	}
	if staged := stagedTokenizers(tokDir); loads < float64(staged) {
		return fmt.Errorf("%v of %d staged tokenizers loaded so far", loads, staged)
	}
	return nil
}

// stagedTokenizers counts the model directories in tokDir, as the
// daemon's start-up load walks them.
func stagedTokenizers(tokDir string) int {
	des, err := os.ReadDir(tokDir)
	if err != nil {
		return 0
	}
	n := 0
	for _, de := range des {
		if de.IsDir() {
			n++
		}
	}
	return n
}

// metricsClient reads the daemons' metrics on connections of its own,
// apart from the measured ones.
var metricsClient = &http.Client{Timeout: 10 * time.Second}

// scrape returns the lines of a metrics export.
func scrape(c *http.Client, url string) ([]string, error) {
	resp, err := c.Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return nil, err
	}
	return strings.Split(string(b), "\n"), nil
}

// allocated is the bytes the daemon's Go heap allocated since it started
// (go_memstats_alloc_bytes_total): over a repetition, with its CPU time,
// what a request costs it, garbage the collector must chase included.
func (t *ttfbTarget) allocated() (float64, error) {
	lines, err := scrape(metricsClient, t.metrics)
	if err != nil {
		return 0, fmt.Errorf("%s metrics: %w", t.name, err)
	}
	for _, l := range lines {
		if v, ok := strings.CutPrefix(l, "go_memstats_alloc_bytes_total "); ok {
			return strconv.ParseFloat(strings.TrimSpace(v), 64)
		}
	}
	return 0, fmt.Errorf("%s metrics: no go_memstats_alloc_bytes_total", t.name)
}
