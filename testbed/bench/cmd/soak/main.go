// Command soak runs the real loxilb daemon for a fixed duration under mixed
// streaming and non-streaming load through a KV-exact VIP whose rule also
// holds a hostile KV-event publisher and a hostile backend, and reports
// the daemon's resident memory and goroutines before, during and after
// the load. It exits non-zero when the daemon dies, crosses the memory
// guard, or does not return to its starting footprint after the load
// (a leak), and writes soak.json and soak.md.
//
// Everything runs on loopback: three vLLM emulators (127.0.N.11-13)
// publishing KV events over ZMQ, a fourth emulator (127.0.N.14) whose
// event port and replay port are answered by the hostile publisher, and
// the hostile backend (127.0.N.15), all endpoints of one KV-exact rule on
// the VIP 127.0.N.1.
//
// The run: warm-up load, a settle, the "before" sample; the load for
// -duration with a sample every -sample-every; a settle after it, the
// "after" sample. A sample is the daemon's VmRSS (/proc/PID/status) and
// go_goroutines (its /netlox/v1/metrics export); the peak RSS is read
// four times a second, and above -rss-limit the daemon is killed so that a
// runaway does not take the machine down.
//
//	make bench-soak                                  # 10 minutes, every attack
//	make bench-soak ARGS='-duration 2m -huge-frame=false -endless-header=false -bad-handshake=false'
//	make bench-soak ARGS='-daemon-args "--log-level info"'
//
// The three attacks with their own flags are the ones that crash or
// exhaust a daemon outright; they are on by default, and a run without
// them still measures the rest. Clients give up on a request after
// -req-timeout, whatever the daemon's own upstream timeouts, so load keeps
// flowing past a backend that never answers.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/bench"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

func main() {
	code, err := run()
	if err != nil {
		fmt.Fprintln(os.Stderr, "soak:", err)
		os.Exit(2)
	}
	os.Exit(code)
}

// options are the command's flags.
type options struct {
	binDir, out, daemonArgs, env string
	from                         string
	duration, warmup, settle     time.Duration
	every, reqTimeout            time.Duration
	workers                      int
	rate                         float64
	net                          int
	port, zmqPort, vipPort       int
	seed                         uint64
	hugeFrame, badHandshake      bool
	endlessHeader                bool
	endlessCapMiB                int64
	bounds                       Bounds
}

func parseFlags() options {
	var o options
	flag.StringVar(&o.binDir, "bin", "", "directory holding a prebuilt loxilb (built into a temp dir when empty)")
	flag.StringVar(&o.out, "out", "testbed/bench/results", "directory for soak.json and soak.md, relative to the repository root (none when empty)")
	flag.StringVar(&o.daemonArgs, "daemon-args", "", "extra daemon flags, space-separated, after the soak's own (a repeated flag wins)")
	flag.StringVar(&o.env, "env", "", "extra daemon environment, KEY=VALUE[,KEY=VALUE]")
	flag.DurationVar(&o.duration, "duration", 10*time.Minute, "how long the load runs")
	flag.DurationVar(&o.warmup, "warmup", 15*time.Second, "load before the 'before' sample")
	flag.DurationVar(&o.settle, "settle", 30*time.Second, "idle time before the 'before' and 'after' samples")
	flag.DurationVar(&o.every, "sample-every", 30*time.Second, "sampling interval during the load")
	flag.DurationVar(&o.reqTimeout, "req-timeout", 30*time.Second, "client deadline of one request")
	flag.IntVar(&o.workers, "workers", 16, "concurrent clients")
	flag.Float64Var(&o.rate, "rate", 40, "requests per second over all clients (at most)")
	flag.IntVar(&o.net, "net", 94, "third octet of the loopback addresses (VIP 127.0.N.1)")
	flag.IntVar(&o.port, "engine-port", 28400, "engines' HTTP port")
	flag.IntVar(&o.zmqPort, "zmq-port", 25957, "engines' KV-event PUB port (replay on +1000)")
	flag.IntVar(&o.vipPort, "vip-port", 28480, "VIP port")
	flag.Uint64Var(&o.seed, "seed", 20261201, "seed of the load and the attacks")
	flag.BoolVar(&o.hugeFrame, "huge-frame", true, "bad publisher sends frame headers announcing 2^40 bytes")
	flag.BoolVar(&o.badHandshake, "bad-handshake", true, "bad publisher sometimes sends a truncated ZMTP READY")
	flag.BoolVar(&o.endlessHeader, "endless-header", true, "bad backend sometimes sends a response header line that does not end")
	flag.Int64Var(&o.endlessCapMiB, "endless-header-cap", 1024, "MiB after which one endless header line stops")
	flag.IntVar(&o.bounds.GoroutineSlack, "goroutine-slack", 50, "goroutines the settled daemon may have above its count before the load")
	flag.Int64Var(&o.bounds.RSSGrowthMiB, "rss-growth", 128, "MiB the settled daemon's RSS may be above its RSS before the load")
	flag.Int64Var(&o.bounds.RSSLimitMiB, "rss-limit", 3072, "MiB of RSS at which the daemon is killed and the run fails (protects the machine)")
	flag.StringVar(&o.from, "from", "", "re-render the table and soak.md of an existing soak.json (written next to it) instead of running")
	flag.Parse()
	return o
}

// check rejects flag values the run cannot work with.
func (o options) check() error {
	switch {
	case o.duration <= 0 || o.every <= 0 || o.reqTimeout <= 0 || o.warmup < 0 || o.settle < 0:
		return errors.New("-duration, -sample-every and -req-timeout must be positive, -warmup and -settle not negative")
	case o.workers < 1 || o.rate <= 0:
		return errors.New("-workers must be at least 1 and -rate positive")
	case o.net < 0 || o.net > 255:
		return errors.New("-net must be 0-255")
	case o.bounds.RSSLimitMiB <= 0:
		return errors.New("-rss-limit must be positive")
	}
	return nil
}

// The emulated model; its tokenizer is staged in testdata/tokenizers.
const model = bench.Model

func host(net, i int) string { return fmt.Sprintf("127.0.%d.%d", net, i) }

func run() (int, error) {
	o := parseFlags()
	// zmq4 logs through the standard logger; in this process that is the
	// emulators' replay sockets reporting the daemon's aborted dials,
	// noise next to the soak's own output.
	log.SetOutput(io.Discard)
	if o.from != "" {
		return rerender(o.from)
	}
	if err := o.check(); err != nil {
		return 0, err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	wd, _ := os.Getwd()
	root, err := bench.FindRepoRoot(wd)
	if err != nil {
		return 0, err
	}
	bin := filepath.Join(o.binDir, "loxilb")
	if o.binDir == "" {
		dir, err := os.MkdirTemp("", "soak-bin")
		if err != nil {
			return 0, err
		}
		defer os.RemoveAll(dir)
		fmt.Fprintln(os.Stderr, "building loxilb ...")
		bins, err := bench.BuildBinaries(ctx, root, dir)
		if err != nil {
			return 0, err
		}
		bin = bins.Loxilb
	}
	tokDir := bench.DefaultTokenizerDir(root)

	// The fleet: three honest engines, one honest engine whose event
	// ports belong to the bad publisher, and the bad backend.
	tok, err := enginesim.LoadTokenizer(filepath.Join(tokDir, strings.ReplaceAll(model, "/", "__")))
	if err != nil {
		return 0, err
	}
	fctx, stopFleet := context.WithCancel(context.WithoutCancel(ctx))
	defer stopFleet()
	var fleetWG sync.WaitGroup
	var engines []*enginesim.Engine
	defer func() {
		stopFleet()
		fleetWG.Wait()
		for _, e := range engines {
			_ = e.Close()
		}
	}()
	for i := 0; i < 4; i++ {
		zmq := o.zmqPort
		if i == 3 {
			zmq = -1
		}
		c := enginesim.Config{Engine: enginesim.EngineVLLM, Model: model, Listen: fmt.Sprintf("%s:%d", host(o.net, 11+i), o.port),
			ZMQBind: host(o.net, 11+i), ZMQPort: zmq, BlockSize: 16, CapacityBlocks: 2048, Seed: "4242",
			PrefillUsPerToken: 20, DecodeUsPerToken: 2000, MaxRunning: 4, TimeScale: 1, TimeScaleSet: true, RandSeed: o.seed + uint64(i)}
		e, err := enginesim.New(c, enginesim.Deps{Tokenizer: tok})
		if err != nil {
			return 0, fmt.Errorf("engine on %s: %w", c.Listen, err)
		}
		engines = append(engines, e)
		fleetWG.Add(1)
		go func() { defer fleetWG.Done(); _ = e.Run(fctx) }()
	}
	pub, err := startBadPublisher(fctx, host(o.net, 14), o.zmqPort, o.zmqPort+1000,
		publisherAttacks{HugeFrame: o.hugeFrame, BadHandshake: o.badHandshake}, o.seed)
	if err != nil {
		return 0, err
	}
	defer pub.Close()
	be, err := startBadBackend(fctx, fmt.Sprintf("%s:%d", host(o.net, 15), o.port), o.endlessHeader, o.endlessCapMiB<<20, o.seed)
	if err != nil {
		return 0, err
	}
	defer be.Close()

	state, err := os.MkdirTemp("", "soak-state")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(state)
	env := []string{"LLB_KV_NONE_HASH_SEED=4242"}
	if o.env != "" {
		env = append(env, strings.Split(o.env, ",")...)
	}
	d, err := startDaemon(ctx, bin, state, tokDir, env, strings.Fields(o.daemonArgs))
	if err != nil {
		return 0, err
	}
	defer d.stop()
	vip := fmt.Sprintf("%s:%d", host(o.net, 1), o.vipPort)
	if err := createRule(ctx, d, o, vip); err != nil {
		return 0, err
	}
	if err := waitReady(ctx, d, vip); err != nil {
		return 0, err
	}

	res := &Result{Started: time.Now().UTC(), Duration: o.duration.String(), Machine: bench.DescribeMachine(), Bounds: o.bounds,
		Config: map[string]any{"workers": o.workers, "rate_per_s": o.rate, "req_timeout": o.reqTimeout.String(),
			"warmup": o.warmup.String(), "settle": o.settle.String(), "daemon_args": o.daemonArgs, "env": env,
			"huge_frame": o.hugeFrame, "bad_handshake": o.badHandshake, "endless_header": o.endlessHeader,
			"endless_header_cap_mib": o.endlessCapMiB, "vip": vip, "seed": o.seed,
			"engines": "3 vLLM emulators publishing over ZMQ, 1 vLLM emulator behind the bad publisher, 1 bad backend"}}

	// runCtx ends when the daemon dies, the guard kills it, or on ^C.
	runCtx, cancelRun := context.WithCancel(ctx)
	defer cancelRun()
	var phase atomic.Value // the run's current phase, for a death report
	phase.Store("warm-up")
	runStart := time.Now()
	diedIn := make(chan string, 1)
	go func() {
		select {
		case <-d.done:
			diedIn <- fmt.Sprintf("%s, %.0f s into the run", phase.Load(), time.Since(runStart).Seconds())
			cancelRun()
		case <-runCtx.Done():
		}
	}()
	var guardTripped atomic.Bool
	var peakRSS atomic.Int64
	go guard(runCtx, d, o.bounds.RSSLimitMiB<<10, &peakRSS, &guardTripped, cancelRun)

	t := newTally()
	var loadStart time.Time
	sample := func(phase string) *Sample {
		rss, err1 := d.rssKiB()
		g, err2 := d.goroutines()
		if err1 != nil || err2 != nil || d.exited() {
			return nil
		}
		total, ok := t.snapshot()
		s := Sample{Phase: phase, RSSKiB: rss, Goroutines: g, Requests: total, OK: ok}
		if !loadStart.IsZero() {
			s.AtSeconds = time.Since(loadStart).Seconds()
		}
		res.Samples = append(res.Samples, s)
		fmt.Fprintf(os.Stderr, "%-6s t=%4.0fs RSS %s MiB goroutines %d requests %d ok %d\n", phase, s.AtSeconds, mib(rss), g, total, ok)
		return &s
	}
	lc := loadConfig{VIP: vip, Model: model, Workers: o.workers, Rate: o.rate, ReqTimeout: o.reqTimeout, Seed: o.seed}

	fmt.Fprintf(os.Stderr, "warm-up %s, settle %s ...\n", o.warmup, o.settle)
	wctx, wcancel := context.WithTimeout(runCtx, o.warmup)
	runLoad(wctx, lc, newTally())
	wcancel()
	phase.Store("settle before the load")
	sleepCtx(runCtx, o.settle)
	before := sample("before")
	phase.Store("load")

	if runCtx.Err() == nil {
		fmt.Fprintf(os.Stderr, "load %s ...\n", o.duration)
	}
	loadStart = time.Now()
	lctx, lcancel := context.WithTimeout(runCtx, o.duration)
	loadDone := make(chan struct{})
	go func() { runLoad(lctx, lc, t); close(loadDone) }()
	ticker := time.NewTicker(o.every)
	for waiting := true; waiting; {
		select {
		case <-loadDone:
			waiting = false
		case <-ticker.C:
			sample("load")
		}
	}
	ticker.Stop()
	lcancel()
	phase.Store("settle after the load")
	sleepCtx(runCtx, o.settle)
	after := sample("after")

	res.Requests = t.summary()
	res.Daemon = daemonCounters(d)
	res.DaemonAlive = !d.exited()
	res.Publisher, res.Backend = pub.Counts(), be.Counts()
	res.summarize()
	res.RSS.Peak = max(res.RSS.Peak, peakRSS.Load())
	res.Failures = verdict(res.DaemonAlive, guardTripped.Load(), before, after, res.RSS.Peak, o.bounds)
	if ctx.Err() != nil {
		res.Failures = append(res.Failures, "interrupted")
	}
	res.Pass = len(res.Failures) == 0
	if !res.DaemonAlive {
		res.DaemonExit = d.exitState()
		select {
		case w := <-diedIn:
			res.DaemonExit += " during " + w
		default:
		}
		res.DaemonLog = d.crashLog(6000)
	}
	res.Elapsed = time.Since(res.Started).Round(time.Second).String()

	fmt.Println()
	res.writeTable(os.Stdout)
	if !res.DaemonAlive {
		fmt.Fprintf(os.Stderr, "\ndaemon exited (%s); its last output:\n%s\n", res.DaemonExit, res.DaemonLog)
	}
	if o.out != "" {
		dir := o.out
		if !filepath.IsAbs(dir) {
			dir = filepath.Join(root, dir)
		}
		if err := res.writeFiles(dir); err != nil {
			return 0, err
		}
		fmt.Fprintf(os.Stderr, "wrote %s/soak.json and soak.md\n", dir)
	}
	if !res.Pass {
		return 1, nil
	}
	return 0, nil
}

// guard reads the daemon's RSS four times a second, keeps the peak, and
// kills the daemon when it crosses limitKiB: a daemon growing without
// bound would otherwise take the machine with it.
func guard(ctx context.Context, d *daemon, limitKiB int64, peak *atomic.Int64, tripped *atomic.Bool, cancel context.CancelFunc) {
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rss, err := d.rssKiB()
		if err != nil {
			continue
		}
		if rss > peak.Load() {
			peak.Store(rss)
		}
		if rss > limitKiB {
			tripped.Store(true)
			fmt.Fprintf(os.Stderr, "daemon RSS %s MiB above the %d MiB guard: killing it\n", mib(rss), limitKiB>>10)
			d.kill()
			cancel()
			return
		}
	}
}

func sleepCtx(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

// createRule installs the KV-exact rule: the four emulators and the bad
// backend behind one VIP.
func createRule(ctx context.Context, d *daemon, o options, vip string) error {
	var eps []string
	for i := 0; i < 5; i++ {
		eps = append(eps, fmt.Sprintf(`{"endpointIP":%q,"targetPort":%d,"weight":1}`, host(o.net, 11+i), o.port))
	}
	body := fmt.Sprintf(`{"serviceArguments":{"externalIP":%q,"port":%d,"protocol":"tcp","mode":4,"sel":0,"model_name":%q,`+
		`"kvExactMode":3,"kvEngineType":"vllm","kvZmqPort":%d,"kvBlockSize":16},"endpoints":[%s]}`,
		host(o.net, 1), o.vipPort, model, o.zmqPort, strings.Join(eps, ","))
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, d.url("/config/loadbalancer"), strings.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := d.api.Do(req)
	if err != nil {
		return fmt.Errorf("create rule: %w", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("create rule: %d %s", resp.StatusCode, b)
	}
	return nil
}

// waitReady waits until the VIP answers and the three honest publishers
// are subscribed.
func waitReady(ctx context.Context, d *daemon, vip string) error {
	c := &http.Client{Timeout: 2 * time.Second}
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if v, ok := d.metric("loxilb_kv_subscriber_connected"); ok && v >= 3 {
			resp, err := c.Get("http://" + vip + "/v1/models")
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					return nil
				}
			}
		}
		if d.exited() {
			return fmt.Errorf("daemon died before the rule was ready (%s):\n%s", d.exitState(), d.crashLog(4000))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return errors.New("rule not ready in 30s (VIP or event subscribers)\n" + d.Logs(4000))
}

// daemonCounters reads the daemon's counters of rejected input and event
// handling at the end of the run (empty when it is gone).
func daemonCounters(d *daemon) map[string]float64 {
	out := map[string]float64{}
	for _, n := range []string{"loxilb_ai_requests_total", "loxilb_ai_upstream_errors_total", "loxilb_proxy_conn_rejected_total",
		"loxilb_kv_subscriber_reconnect_total", "loxilb_kv_subscriber_recv_error_total", "loxilb_kv_decode_errors_total",
		"loxilb_kv_seq_gaps_total", "loxilb_kv_replays_total", "loxilb_kv_resets_total", "loxilb_kv_block_events_applied_total",
		"loxilb_kv_inv_cap_evictions_total", "loxilb_kv_inv_rejected_total", "loxilb_pd_kv_blocks",
		"loxilb_gateway_engine_scrape_errors_total"} {
		if v, ok := d.metric(n); ok {
			out[n] = v
		}
	}
	return out
}

// rerender prints the table of a soak.json and rewrites the soak.md next
// to it.
func rerender(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	var r Result
	if err := json.Unmarshal(b, &r); err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	r.writeTable(os.Stdout)
	if err := os.WriteFile(filepath.Join(filepath.Dir(path), "soak.md"), []byte(r.markdown()), 0o644); err != nil {
		return 0, err
	}
	if !r.Pass {
		return 1, nil
	}
	return 0, nil
}
