package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/cluster"
	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/ebpf"
	"github.com/loxilb-llm/loxilb/pkg/diag"
	"github.com/loxilb-llm/loxilb/pkg/dispatch"
	"github.com/loxilb-llm/loxilb/pkg/gateway"
	"github.com/loxilb-llm/loxilb/pkg/health"
	"github.com/loxilb-llm/loxilb/pkg/kvevents"
	"github.com/loxilb-llm/loxilb/pkg/kvindex"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/outlier"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/pkg/store"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

// runner is one long-lived component.
type runner struct {
	name string
	run  func(context.Context) error
}

func run(ctx context.Context, args []string, env func(string) (string, bool)) error {
	if len(args) > 0 && args[0] == "cleanup" {
		return cleanup(args[1:], os.Stdout, os.Stderr)
	}
	cfg, err := parseFlags(args, env, os.Stderr)
	if err != nil {
		return err
	}
	if cfg.showVersion {
		fmt.Println(version)
		return nil
	}
	// The management API's exposure is checked before anything is opened
	// or bound: a refused configuration leaves no trace.
	apiCfg := cfg.apiConfig()
	if err := apiCfg.Validate(); err != nil {
		return err
	}
	logger := cfg.logger(os.Stderr)
	getenv := func(k string) string { v, _ := env(k); return v }
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	st, err := openStore(cfg)
	if err != nil {
		return err // names the file or cluster, what is wrong and what to do
	}
	defer st.Close()
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "loxilb_store_backend_up",
		Help:        "1 while the rule store answers, 0 while it cannot be reached (rule changes are refused; applied rules keep serving).",
		ConstLabels: prometheus.Labels{"backend": st.Health().Backend}},
		func() float64 {
			if st.Health().Up {
				return 1
			}
			return 0
		}))

	// The KV plane: inventories fed by engine events.
	maxBlocks, err := envInt(getenv, "LOXILB_KV_MAX_BLOCKS", 1_000_000, 1000, 100_000_000)
	if err != nil {
		return err
	}
	index, err := kvindex.New(kvindex.Config{MaxBlocksPerEndpoint: maxBlocks}, reg)
	if err != nil {
		return err
	}
	kvCfg, err := kvevents.ConfigFromEnv(getenv)
	if err != nil {
		return err
	}
	// With an etcd store one node drains each TensorRT-LLM endpoint and
	// re-serves its events to the others.
	if err := drainRelay(cfg, st, &kvCfg); err != nil {
		return err
	}
	events := kvevents.New(kvCfg, index, logger, reg)

	tokens, err := tokenizer.NewRegistry(cfg.tokenizerDir, logger, reg)
	if err != nil {
		return fmt.Errorf("tokenizer registry: %w", err)
	}
	prober, err := health.New(health.Config{}, logger, reg)
	if err != nil {
		return err
	}
	rcfg, err := router.ConfigFromEnv(getenv)
	if err != nil {
		return err
	}
	// The zero-hit watchdog reads the event plane's parity verdicts to tell
	// uncached prompts from a hash mismatch.
	rt, err := router.New(rcfg, index, logger, reg, router.WithAttestation(events))
	if err != nil {
		return err
	}
	scraper, err := gateway.NewScraper(gateway.ScraperConfig{Interval: cfg.scrapeInterval}, logger, reg)
	if err != nil {
		return err
	}
	seed := getenv(lbrule.SeedEnv)
	coalesceWait, err := gateway.CoalesceWaitFromEnv(getenv)
	if err != nil {
		return err
	}
	prefillSlots, prefillWait, err := gateway.PrefillFromEnv(getenv)
	if err != nil {
		return err
	}
	outliers, err := outlier.New(cfg.outlier, logger, reg)
	if err != nil {
		return err
	}
	gw, err := gateway.New(gateway.Config{Seed: seed, Outliers: outliers, CertFile: cfg.proxyCert, KeyFile: cfg.proxyKey, CAFile: cfg.proxyCA,
		ClientCertFile: cfg.proxyClient.cert, ClientKeyFile: cfg.proxyClient.key, ClientCAFile: cfg.proxyClient.ca,
		Receipts: cfg.receipts, Proxy: cfg.proxyConfig(), CoalesceWait: coalesceWait,
		PrefillSlots: prefillSlots, PrefillQueueWait: prefillWait,
		MaxModelNameBytes: cfg.maxModelName, MaxPromptBytes: cfg.tokMaxBytes, MaxPromptTokens: cfg.tokMaxTokens,
		TokenizeConcurrency: cfg.tokConcurrency, KVParityStrict: cfg.kvParityStrict, Parity: events}, tokens, index, rt, prober, scraper, logger, reg)
	if err != nil {
		return err
	}
	pdCfg, err := dispatch.ConfigFromEnv(getenv)
	if err != nil {
		return err
	}
	pdCfg.MaxResponseHeaderBytes = int64(cfg.proxyLimits.maxResponseHeader)
	if pdCfg.TLS, err = endpointTLS(cfg.proxyCA, cfg.proxyClient); err != nil {
		return err
	}
	pdd, err := dispatch.New(pdCfg, logger, reg)
	if err != nil {
		return err
	}
	defer pdd.Close()
	// The proxy's picker: prefill/decode rules go to the dispatcher, every
	// other mode-4 rule to the gateway's single-pool routing.
	pd, err := gateway.NewPD(gw, pdd)
	if err != nil {
		return err
	}
	px, err := proxy.New(cfg.proxyConfig(), pd, logger, reg)
	if err != nil {
		return err
	}
	gw.SetProxy(px)

	ctl := control.New(st, lbrule.LookupEnv(env), logger)
	if err := ctl.RegisterMetrics(reg); err != nil {
		return err
	}
	reg.MustRegister(control.ServiceInfoCollector(ctl))
	ctl.AddReconciler(&gateway.HealthReconciler{Prober: prober})
	kernel, err := openDataplane(cfg, ctl, prober, logger, reg)
	if err != nil {
		return err
	}
	defer kernel.close()
	dpCap, steered := kernel.capab, kernel.steered
	ctl.AddReconciler(&gateway.KVReconciler{Subs: events, Inv: index, Seed: seed})
	ctl.AddReconciler(scraper)
	ctl.AddReconciler(gw)
	ctl.AddReconciler(pd)

	// Membership: this node announces itself (and its parity-relevant
	// settings) in the shared store and compares them with the others'.
	routing := rcfg.Settings()
	routing[gateway.EnvCoalesceWait] = cluster.FormatDuration(coalesceWait)
	routing[gateway.EnvPrefillSlots] = strconv.Itoa(prefillSlots)
	if prefillSlots == gateway.PrefillAuto {
		routing[gateway.EnvPrefillSlots] = "auto"
	}
	routing[gateway.EnvPrefillQueueWait] = prefillWait.String()
	routing["LOXILB_KV_PARITY_STRICT"] = strconv.FormatBool(cfg.kvParityStrict)
	ccfg := cluster.Config{Self: cluster.Member{Name: cfg.cluster.name, Address: cfg.cluster.address, Version: version, Started: time.Now().UTC()},
		Local: localSettings(seed, cluster.NewTokenizers(cfg.tokenizerDir), routing), TTL: cfg.cluster.ttl}
	if e, ok := st.(*store.Etcd); ok {
		ccfg.Backend = etcdMembers{e}
	}
	members, err := cluster.New(ccfg, logger, reg)
	if err != nil {
		return err
	}

	caps := &capabilities{env: env}
	caps.add(func() []api.Capability { return []api.Capability{dpCap} })
	caps.add(func() []api.Capability { return tokenizerCaps(tokens) })
	caps.add(func() []api.Capability { return parityCaps(events) })
	caps.add(func() []api.Capability { return []api.Capability{ruleCaps(ctl.List())} })
	caps.add(func() []api.Capability { return []api.Capability{storeCap(st)} })
	caps.add(func() []api.Capability { return []api.Capability{clusterCap(members.View())} })

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	runners := []runner{{"kvindex", index.Run}, {"kvevents", events.Run}, {"health", prober.Run}, {"engine-metrics", scraper.Run}, {"proxy", px.Serve},
		{"rule-retry", ctl.Run}, {"cluster", members.Run}}
	if steered != nil {
		runners = append(runners, runner{"proxy-steered", func(ctx context.Context) error { return px.ServeListener(ctx, steered) }})
	}
	// The management API (metrics included) keeps serving while the proxy
	// drains: it stops after every runner has returned.
	apiCtx, stopAPI := context.WithCancel(context.WithoutCancel(ctx))
	defer stopAPI()
	var wg sync.WaitGroup
	errc := make(chan error, len(runners)+1)
	for _, r := range runners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := r.run(ctx); err != nil && !errors.Is(err, context.Canceled) {
				errc <- fmt.Errorf("%s: %w", r.name, err)
			}
		}()
	}
	defer wg.Wait()
	defer cancel()

	// Load every staged tokenizer now, so a broken file shows in the
	// capabilities before the first request needs it.
	go func() {
		for _, st := range tokens.LoadAll() {
			if !st.Loaded {
				logger.Warn("staged tokenizer is not usable", "model", st.Model, "path", st.Path, "reason", st.Reason, "err", st.Error)
			}
		}
	}()

	// Rules are loaded once the proxy manages its listeners, so each
	// mode-4 rule's listen failure is reported (and retried) as its own.
	select {
	case <-px.Listening():
	case err := <-errc:
		return err
	case <-ctx.Done():
		return nil
	}
	if err := ctl.Load(ctx); err != nil {
		// Rules that cannot be applied are reported, listed with their
		// status and retried, never dropped from the store; the daemon
		// serves the others and the API.
		logger.Error("some stored rules were not applied", "err", err)
	}
	// A shared store is followed from now on: rules other nodes create,
	// change or delete are applied here within the watch's latency.
	if w, ok := st.(store.Watcher); ok {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = ctl.Follow(ctx, w)
		}()
	}
	// What the pinned maps still hold from a previous run and the store did
	// not claim is removed now, before the API accepts rules for it.
	if r, ok := kernel.dp.(dataplane.Recoverer); ok {
		if _, err := r.PruneRecovered(ctx); err != nil {
			logger.Error("removing services the rule store does not hold from the data plane", "err", err)
		}
	}

	srv, err := api.New(apiCfg,
		api.Deps{Rules: ctl, Capabilities: caps.list, Gatherer: reg, Registerer: reg, Logger: logger, Settings: st,
			KV: inspector{index: index, events: events}, Prefill: gw,
			States:  gateway.EndpointState(prober, ctl.Get),
			KVTrust: gw.KVTrust,
			KVRelay: http.HandlerFunc(events.ServeRelay),
			// The proxy counts the requests it forwards, the dispatcher
			// the legs of P/D requests it runs (which the proxy hands it).
			InFlight: func(s uint32, ep int) int { return max(px.InFlight(s, ep), pdd.InFlight(s, ep)) },
			Cluster:  members.View,
			Diagnose: diag.Sources{Rules: ctl.List, Events: events.Status, Seed: seed, SeedProblem: lbrule.SeedPrecondition(env),
				TokenizerDir: cfg.tokenizerDir, SidePort: pdd.SidePort}.Run})
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", cfg.apiAddr)
	if err != nil {
		return fmt.Errorf("management API: %w", err)
	}
	logger.Info("loxilb started", "version", version, "api", ln.Addr().String(), "state_dir", cfg.stateDir,
		"store", st.Health().Backend+" "+st.Health().Where, "node", cfg.cluster.name, "node_address", cfg.cluster.address,
		"tokenizer_dir", cfg.tokenizerDir, "rules", len(ctl.List()), "auth", cfg.apiToken != "", "tls", cfg.tlsCert != "",
		"api_read_timeout", cfg.api.readTimeout, "api_max_body", cfg.api.maxBody, "api_max_conns", cfg.api.maxConns,
		"coalesce_wait", max(coalesceWait, 0), "prefill_slots", prefillSlots, "prefill_queue_wait", prefillWait,
		"proxy_receipts", cfg.receipts.String(), "tokenize_max_bytes", cfg.tokMaxBytes, "tokenize_max_tokens", cfg.tokMaxTokens,
		"tokenize_concurrency", cfg.tokConcurrency)
	go func() {
		if err := srv.Serve(apiCtx, ln); err != nil {
			errc <- fmt.Errorf("management API: %w", err)
		}
		cancel()
	}()
	select {
	case <-ctx.Done():
		logger.Info("loxilb stopping: mode-4 listeners closed, draining requests in flight", "drain_timeout", cfg.resilience.drainTimeout)
		return nil
	case err := <-errc:
		logger.Error("component failed, stopping", "err", err)
		return err
	}
}

func envInt(getenv func(string) string, name string, def, lo, hi int) (int, error) {
	v := getenv(name)
	if v == "" {
		return def, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < lo || n > hi {
		return 0, fmt.Errorf("%s=%q: want an integer in %d..%d", name, v, lo, hi)
	}
	return n, nil
}

// kernelPlane is what openDataplane hands back: the capability entry, the
// data plane when it runs (nil otherwise), the steered proxy listener and
// what to do at exit.
type kernelPlane struct {
	capab   api.Capability
	dp      dataplane.Dataplane
	steered net.Listener
	close   func()
}

// openDataplane loads the eBPF data plane unless disabled. Without root or
// BPF support the daemon still runs, proxy-only: it says so once and the
// ebpf_dataplane capability carries the reason. A mistake in the data
// plane's configuration (an interface that does not exist) is an error: the
// daemon stops before touching what a previous run left pinned.
func openDataplane(cfg *config, ctl *control.Controller, prober *health.Prober, logger *slog.Logger, reg prometheus.Registerer) (kernelPlane, error) {
	kp := kernelPlane{capab: api.Capability{Name: "ebpf_dataplane"}, close: func() {}}
	capab := &kp.capab
	if cfg.noDataplane {
		capab.ReasonCode, capab.Reason = "disabled", "disabled with --no-dataplane: modes 0-3 and 5 are not served; mode 4 runs in the proxy"
		ctl.AddReconciler(control.KernelUnavailable{Why: capab.Reason})
		return kp, nil
	}
	dp, c, err := ebpf.Open(ebpf.Config{Interfaces: cfg.interfaces, PinPath: cfg.bpfPinPath}, logger, reg)
	capab.Ready, capab.Reason = c.Ready, c.Reason
	if errors.Is(err, dataplane.ErrConfig) {
		return kp, fmt.Errorf("eBPF data plane (--interfaces %q, --bpf-pin-path %s): %w", strings.Join(cfg.interfaces, ","), cfg.bpfPinPath, err)
	}
	if err != nil {
		capab.ReasonCode = "unavailable"
		logger.Warn("eBPF data plane unavailable: running proxy-only (mode 4); rules of modes 0-3 and 5 will be refused", "reason", c.Reason)
		ctl.AddReconciler(control.KernelUnavailable{Why: "unavailable: " + c.Reason})
		return kp, nil
	}
	if len(cfg.interfaces) == 0 {
		// Mode 4 is steered, but no packet reaches tc_lb: refuse what
		// would be accepted and never served.
		capab.Ready, capab.ReasonCode = false, "no_interfaces"
		ctl.AddReconciler(control.KernelUnavailable{Code: control.ReasonNoInterfaces,
			Why: "the data plane is attached to no interface: restart the daemon with --interfaces naming the interfaces the VIPs' traffic arrives on"})
		logger.Warn("eBPF data plane attached to no interface (no --interfaces): rules of modes 0-3 and 5 will be refused; mode 4 is steered")
	}
	kr := &control.KernelReconciler{DP: dp, Healthy: prober.Healthy}
	if steer, ok := dp.(dataplane.ProxySteerer); ok {
		// One listener receives every mode-4 VIP:port connection, steered by
		// sk_lookup; the proxy matches each to its rule by local address.
		// A plain TCP socket: SOCKMAP refuses MPTCP ones, Go's default.
		var lc net.ListenConfig
		lc.SetMultipathTCP(false)
		ln, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
		if err == nil {
			port := uint16(ln.Addr().(*net.TCPAddr).Port)
			if err = steer.RegisterProxyListener(port, ln.(*net.TCPListener)); err == nil {
				kr.ProxyPort = port
				kp.steered = ln
			} else {
				ln.Close()
			}
		}
		if err != nil {
			logger.Warn("mode-4 steering unavailable: the proxy binds each VIP:port itself", "err", err)
		}
	}
	ctl.AddReconciler(kr)
	unsubscribe := prober.Subscribe(func(ch health.Change) {
		if err := kr.SetHealth(context.Background(), ch.Service, ch.EP, ch.Healthy); err != nil {
			logger.Error("data plane endpoint health", "service", ch.Service, "ep", ch.EP, "err", err)
		}
	})
	logger.Info("eBPF data plane ready", "detail", c.Reason, "interfaces", cfg.interfaces, "mode4_steering", kr.ProxyPort != 0)
	kp.dp, kp.close = dp, func() { unsubscribe(); _ = dp.Close() }
	return kp, nil
}

// endpointTLS is the TLS the P/D dispatcher uses to endpoints of
// security 2 rules: verified against caFile (default: system roots),
// presenting the daemon's client certificate when one is set. nil when
// neither is set (Go's defaults).
func endpointTLS(caFile string, client clientTLS) (*tls.Config, error) {
	if caFile == "" && client.cert == "" {
		return nil, nil
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pool, err := loadCAPool("--proxy-tls-ca", caFile)
		if err != nil {
			return nil, err
		}
		tc.RootCAs = pool
	}
	if client.cert != "" {
		cert, err := tls.LoadX509KeyPair(client.cert, client.key)
		if err != nil {
			return nil, fmt.Errorf("--proxy-tls-client-cert %s / --proxy-tls-client-key %s: %w", client.cert, client.key, err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

// inspector serves the inventory API from the index and the subscribers.
type inspector struct {
	index  *kvindex.Index
	events *kvevents.Manager
}

func (i inspector) Snapshot(service uint32, ep, limit int) ([]uint64, int) {
	return i.index.Snapshot(service, ep, limit)
}

func (i inspector) Subscriber(service uint32, ep int) (any, bool) {
	st, ok := i.events.Status(service, ep)
	return st, ok
}

func tokenizerCaps(r *tokenizer.Registry) []api.Capability {
	var out []api.Capability
	for _, s := range r.Status() {
		c := api.Capability{Name: "tokenizer:" + s.Model, Ready: s.Loaded}
		if s.Model == "" {
			c.Name = "tokenizer:" + s.Slug
		}
		if !s.Loaded {
			c.ReasonCode, c.Reason = s.Reason, s.Error
			if c.Reason == "" {
				c.Reason = "staged at " + s.Path + ", loaded on first request"
			}
		}
		out = append(out, c)
	}
	return out
}

// ruleCaps is the "rules" capability: how many rules are applied,
// degraded and failed, and which are not applied.
func ruleCaps(list []control.Service) api.Capability {
	c := api.Capability{Name: "rules", Ready: true,
		Counts: map[string]int{control.StateApplied: 0, control.StateDegraded: 0, control.StateFailed: 0}}
	var bad []string
	for _, s := range list {
		c.Counts[s.Status.State]++
		if s.Status.State != control.StateApplied && len(bad) < 8 {
			bad = append(bad, fmt.Sprintf("rule %d (%s) %s %s", s.ID, s.Rule.Key(), s.Status.State, s.Status.Reason))
		}
	}
	c.Reason = fmt.Sprintf("%d applied, %d degraded, %d failed", c.Counts[control.StateApplied], c.Counts[control.StateDegraded], c.Counts[control.StateFailed])
	switch {
	case c.Counts[control.StateFailed] > 0:
		c.Ready, c.ReasonCode = false, "rules_failed"
	case c.Counts[control.StateDegraded] > 0:
		c.Ready, c.ReasonCode = false, "rules_degraded"
	}
	if len(bad) > 0 {
		c.Reason += ": " + strings.Join(bad, "; ")
	}
	return c
}

func parityCaps(m *kvevents.Manager) []api.Capability {
	var out []api.Capability
	for _, p := range m.Parity() {
		c := api.Capability{Name: fmt.Sprintf("kv_parity:%d/%d", p.Service, p.EPIdx), Ready: p.Verdict == "ok" && !p.Quarantined, ReasonCode: p.Verdict, Reason: p.Reason}
		out = append(out, c)
		if p.Quarantined {
			// Tier 1.5 is off for the endpoint: its inventory is empty.
			out = append(out, api.Capability{Name: fmt.Sprintf("kv_quarantine:%d/%d", p.Service, p.EPIdx),
				ReasonCode: "quarantined", Reason: p.QuarantineReason})
		}
	}
	return out
}

// capabilities assembles GET /status/capabilities from every stage.
type capabilities struct {
	env     func(string) (string, bool)
	mu      sync.Mutex
	sources []func() []api.Capability
}

func (c *capabilities) add(f func() []api.Capability) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sources = append(c.sources, f)
}

func (c *capabilities) list() []api.Capability {
	vllm := api.Capability{Name: "kv_exact_vllm", Ready: true}
	if e := lbrule.SeedPrecondition(c.env); e != nil {
		vllm.Ready, vllm.ReasonCode, vllm.Reason = false, e.Reason, e.Msg
	}
	out := []api.Capability{vllm}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, f := range c.sources {
		out = append(out, f()...)
	}
	return out
}
