package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/cluster"
	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/diag"
	"github.com/loxilb-llm/loxilb/pkg/dispatch"
	"github.com/loxilb-llm/loxilb/pkg/enginemetrics"
	"github.com/loxilb-llm/loxilb/pkg/gateway"
	"github.com/loxilb-llm/loxilb/pkg/health"
	"github.com/loxilb-llm/loxilb/pkg/kvevents"
	"github.com/loxilb-llm/loxilb/pkg/kvindex"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/outlier"
	"github.com/loxilb-llm/loxilb/pkg/peerprefill"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/reconcilers"
	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/pkg/store"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

// daemon holds the components run builds, in the order of its steps: the
// rule store, the KV plane, mode-4 routing (the P/D dispatcher and the
// in-flight table included), the proxy, then the controller and the data
// plane that apply the rules.
type daemon struct {
	cfg    *config
	logger *slog.Logger
	reg    *prometheus.Registry
	// closers run in reverse order at exit.
	closers []func()

	st      ruleStore
	index   *kvindex.Index
	events  *kvevents.Manager
	tokens  *tokenizer.Registry
	prober  *health.Prober
	scraper *enginemetrics.Scraper
	// inflight counts the requests the proxy sends per endpoint; the
	// gateway reads it as local load and the drain API as what is left.
	inflight *proxy.InFlightTable
	gw       *gateway.Gateway
	pdd      *dispatch.Dispatcher
	px       *proxy.Server
	ctl      *control.Controller
	kernel   kernelPlane
	caps     *capabilities
	members  *cluster.Membership
	peers    *peerprefill.Node // prefill announcements between nodes; nil alone
	// seedFP identifies LLB_KV_NONE_HASH_SEED without revealing it, in the
	// membership record and in diagnostics alike; computed once, as it is
	// deliberately slow.
	seedFP string
}

func (d *daemon) close() {
	for i := len(d.closers) - 1; i >= 0; i-- {
		d.closers[i]()
	}
}

// openStore opens the rule store and exports whether it answers.
func (d *daemon) openStore() error {
	st, err := openStore(d.cfg)
	if err != nil {
		return err // names the file or cluster, what is wrong and what to do
	}
	d.st = st
	d.closers = append(d.closers, func() { st.Close() })
	d.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "loxilb_store_backend_up",
		Help:        "1 while the rule store answers, 0 while it cannot be reached (rule changes are refused; applied rules keep serving).",
		ConstLabels: prometheus.Labels{"backend": st.Health().Backend}},
		func() float64 {
			if st.Health().Up {
				return 1
			}
			return 0
		}))
	return nil
}

// buildKVPlane creates the inventories and the engine-event subscribers
// that feed them.
func (d *daemon) buildKVPlane() error {
	index, err := kvindex.New(kvindex.Config{MaxBlocksPerEndpoint: d.cfg.maxBlocks}, d.reg)
	if err != nil {
		return err
	}
	d.index = index
	kv := d.cfg.kv
	// With an etcd store one node drains each TensorRT-LLM endpoint and
	// re-serves its events to the others.
	if err := drainRelay(d.cfg, d.st, &kv); err != nil {
		return err
	}
	d.events = kvevents.New(kv, index, d.logger, d.reg)
	return nil
}

// buildRouting creates mode-4 routing: tokenizers, health probes, the
// Tier-1.5 router, passive health checks, the P/D dispatcher, the
// in-flight table, the engine-metrics scraper, the socket of cross-node
// prefill coalescing and the gateway composing them.
func (d *daemon) buildRouting() error {
	cfg, logger, reg := d.cfg, d.logger, d.reg
	var err error
	if d.tokens, err = tokenizer.NewRegistry(cfg.tokenizerDir, logger, reg, tokenizer.WithCacheBytes(cfg.tokenizerCache)); err != nil {
		return fmt.Errorf("tokenizer registry: %w", err)
	}
	if d.prober, err = health.New(health.Config{}, logger, reg); err != nil {
		return err
	}
	// The zero-hit watchdog reads the event plane's parity verdicts to tell
	// uncached prompts from a hash mismatch.
	rcfg := cfg.router
	rcfg.ColdRendezvous = cfg.clusterRoutingOn()
	rt, err := router.New(rcfg, d.index, logger, reg, router.WithAttestation(d.events))
	if err != nil {
		return err
	}
	outliers, err := outlier.New(cfg.outlier, logger, reg)
	if err != nil {
		return err
	}
	// The dispatcher runs prefill/decode rules for the gateway.
	if d.pdd, err = dispatch.New(cfg.dispatchConfig(), logger, reg); err != nil {
		return err
	}
	// Created before its users, so the gateway (the proxy's Picker), the
	// proxy and the scraper need no link to each other after construction.
	d.inflight = new(proxy.InFlightTable)
	// The scraper records this node's open requests with each sample, so
	// it can tell the other nodes' share of an engine's load.
	if d.scraper, err = enginemetrics.New(enginemetrics.Config{Interval: cfg.scrapeInterval, SelfInFlight: d.inflight.Count}, logger, reg); err != nil {
		return err
	}
	signals := gateway.EngineSignals{Load: d.scraper, Ranks: d.scraper, Budgets: d.scraper, Others: d.scraper}
	if err := d.buildPeers(); err != nil {
		return err
	}
	gcfg := gateway.Config{Seed: cfg.seed, Outliers: outliers, PD: d.pdd, CoalesceWait: cfg.gatewayCoalesceWait(),
		PrefillSlots: cfg.prefillSlots, PrefillQueueWait: cfg.prefillWait,
		MaxModelNameBytes: cfg.maxModelName, MaxPromptBytes: cfg.tokMaxBytes, MaxPromptTokens: cfg.tokMaxTokens,
		TokenizeConcurrency: cfg.tokConcurrency, BodyCacheBytes: int64(cfg.bodyCacheBytes), KVParityStrict: cfg.kvParityStrict, Parity: d.events,
		ClusterLoad: cfg.clusterRoutingOn(), ClusterTieBreak: cfg.clusterTieBreak, Engine: signals}
	if d.peers != nil {
		// A nil *Node in the interface would be a peer set that is
		// there and fails; alone, the gateway is given none.
		gcfg.Peers = d.peers
		if cfg.clusterLoadInterval > 0 {
			gcfg.PeerLoad = d.peers
		}
	}
	d.gw, err = gateway.New(gcfg, d.tokens, d.index, rt, d.prober, d.inflight, logger, reg)
	return err
}

// buildPeers binds the socket of cross-node prefill coalescing when
// several nodes share an etcd store with cluster routing on: the gateway
// announces its leaders through it from its construction, and the node's
// runner hands the other nodes' to the gateway. Alone, there is none.
func (d *daemon) buildPeers() error {
	cfg := d.cfg
	if _, shared := d.st.(*store.Etcd); !shared || !cfg.clusterRoutingOn() {
		return nil
	}
	// The members are read when the node runs, after joinCluster.
	node, err := peerprefill.New(peerprefill.Config{Listen: cfg.cluster.peerListen(), LoadInterval: cfg.clusterLoadInterval,
		Peers: func() []string { return d.members.PeerAddrs() }}, d.logger, d.reg)
	if err != nil {
		return fmt.Errorf("--cluster-peer-port: %w", err)
	}
	d.peers = node
	return nil
}

// buildProxy creates the mode-4 proxy, with the gateway as its picker
// (prefill/decode rules through the dispatcher, every other mode-4 rule
// through single-pool routing) and counting into the shared in-flight
// table.
func (d *daemon) buildProxy() error {
	var err error
	d.px, err = proxy.New(d.cfg.proxyConfig(), d.gw, d.inflight, d.logger, d.reg)
	return err
}

// buildControl creates the controller, opens the data plane and registers
// every reconciler, then the capability sources.
func (d *daemon) buildControl() error {
	d.ctl = control.New(d.st, d.cfg.ruleSettings(), d.logger)
	if err := d.ctl.RegisterMetrics(d.reg); err != nil {
		return err
	}
	d.reg.MustRegister(control.ServiceInfoCollector(d.ctl))
	d.ctl.AddReconciler(&reconcilers.Health{Prober: d.prober})
	kernel, err := openDataplane(d.cfg, d.ctl, d.prober, d.logger, d.reg)
	if err != nil {
		return err
	}
	d.kernel = kernel
	d.closers = append(d.closers, kernel.close)
	d.ctl.AddReconciler(&reconcilers.KVEvents{Subs: d.events, Inv: d.index, Seed: d.cfg.seed})
	d.ctl.AddReconciler(d.scraper)
	// The proxy's listeners go in just before the gateway's routing table:
	// a listener failure (VIP:port held, TLS files missing) is the rule's
	// "proxy" failure, and a removed rule's listener closes before its
	// routing state goes.
	d.ctl.AddReconciler(&reconcilers.Listeners{Proxy: d.px, Config: d.cfg.listenerConfig()})
	d.ctl.AddReconciler(d.gw)

	d.caps = &capabilities{rules: d.cfg.ruleSettings()}
	d.caps.add(func() []api.Capability { return []api.Capability{kernel.capab} })
	d.caps.add(func() []api.Capability { return tokenizerCaps(d.tokens) })
	d.caps.add(func() []api.Capability { return parityCaps(d.events) })
	d.caps.add(func() []api.Capability { return []api.Capability{ruleCaps(d.ctl.List())} })
	d.caps.add(func() []api.Capability { return []api.Capability{storeCap(d.st)} })
	return nil
}

// joinCluster announces this node (and its parity-relevant settings) in
// the shared store and compares them with the other nodes'; with bbolt
// the view is this node alone.
func (d *daemon) joinCluster() error {
	cfg := d.cfg
	d.seedFP = cluster.SeedFingerprint(cfg.seed)
	ccfg := cluster.Config{Self: cluster.Member{Name: cfg.cluster.name, Address: cfg.cluster.address, Version: version, Started: time.Now().UTC()},
		Local: localSettings(d.seedFP, cluster.NewTokenizers(cfg.tokenizerDir), cfg.routingSettings()), TTL: cfg.cluster.ttl}
	if e, ok := d.st.(*store.Etcd); ok {
		ccfg.Backend = etcdMembers{e}
	}
	if d.peers != nil {
		// Cross-node prefill coalescing: the other members send their
		// leaders to the address this record advertises.
		ccfg.Self.Peer = cfg.cluster.peerAdvertised(d.peers.Addr().Port())
	}
	var err error
	if d.members, err = cluster.New(ccfg, d.logger, d.reg); err != nil {
		return err
	}
	d.caps.add(func() []api.Capability { return []api.Capability{clusterCap(d.members.View())} })
	return nil
}

// serve runs every component until ctx ends or one fails, applies the
// stored rules once the proxy manages its listeners, then serves the
// management API. The API (metrics included) keeps serving while the
// proxy drains: it stops after every runner has returned.
func (d *daemon) serve(ctx context.Context, apiCfg api.Config) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	apiCtx, stopAPI := context.WithCancel(context.WithoutCancel(ctx))
	defer stopAPI()
	var wg sync.WaitGroup
	errc := d.startRunners(ctx, &wg)
	defer wg.Wait()
	defer cancel()
	go d.loadTokenizers()

	// Rules are loaded once the proxy manages its listeners, so each
	// mode-4 rule's listen failure is reported (and retried) as its own.
	select {
	case <-d.px.Listening():
	case err := <-errc:
		return err
	case <-ctx.Done():
		return nil
	}
	d.applyRules(ctx, &wg)
	if err := d.startAPI(apiCtx, apiCfg, errc, cancel); err != nil {
		return err
	}
	select {
	case <-ctx.Done():
		d.logger.Info("loxilb stopping: mode-4 listeners closed, draining requests in flight", "drain_timeout", d.cfg.resilience.drainTimeout)
		return nil
	case err := <-errc:
		d.logger.Error("component failed, stopping", "err", err)
		return err
	}
}

// startRunners starts every long-lived component; the first failure of
// one arrives on the returned channel.
func (d *daemon) startRunners(ctx context.Context, wg *sync.WaitGroup) chan error {
	runners := []runner{{"kvindex", d.index.Run}, {"kvevents", d.events.Run}, {"health", d.prober.Run}, {"engine-metrics", d.scraper.Run},
		{"proxy", d.px.Serve}, {"rule-retry", d.ctl.Run}, {"cluster", d.members.Run}}
	if d.peers != nil {
		// The gateway, built with the node, holds the other nodes'
		// announcements it receives.
		runners = append(runners, runner{"cluster-prefill", func(ctx context.Context) error { return d.peers.Run(ctx, d.gw) }})
	}
	if steered := d.kernel.steered; steered != nil {
		runners = append(runners, runner{"proxy-steered", func(ctx context.Context) error { return d.px.ServeListener(ctx, steered) }})
	}
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
	return errc
}

// loadTokenizers loads every staged tokenizer now, so a broken file shows
// in the capabilities before the first request needs it.
func (d *daemon) loadTokenizers() {
	for _, st := range d.tokens.LoadAll() {
		if !st.Loaded {
			d.logger.Warn("staged tokenizer is not usable", "model", st.Model, "path", st.Path, "reason", st.Reason, "err", st.Error)
		}
	}
}

// applyRules applies the stored rules, follows a shared store from then on
// and removes from the data plane what a previous run left and the store
// does not claim.
func (d *daemon) applyRules(ctx context.Context, wg *sync.WaitGroup) {
	if err := d.ctl.Load(ctx); err != nil {
		// Rules that cannot be applied are reported, listed with their
		// status and retried, never dropped from the store; the daemon
		// serves the others and the API.
		d.logger.Error("some stored rules were not applied", "err", err)
	}
	// A shared store is followed from now on: rules other nodes create,
	// change or delete are applied here within the watch's latency.
	if w, ok := d.st.(store.Watcher); ok {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = d.ctl.Follow(ctx, w)
		}()
	}
	// What the pinned maps still hold from a previous run and the store did
	// not claim is removed now, before the API accepts rules for it.
	if r, ok := d.kernel.dp.(dataplane.Recoverer); ok {
		if _, err := r.PruneRecovered(ctx); err != nil {
			d.logger.Error("removing services the rule store does not hold from the data plane", "err", err)
		}
	}
}

// startAPI binds and serves the management API until apiCtx ends; a
// failure arrives on errc and stops the daemon (cancel).
func (d *daemon) startAPI(apiCtx context.Context, apiCfg api.Config, errc chan error, cancel func()) error {
	cfg, gw, inflight, pdd := d.cfg, d.gw, d.inflight, d.pdd
	srv, err := api.New(apiCfg,
		api.Deps{Rules: d.ctl, Capabilities: d.caps.list, Gatherer: d.reg, Registerer: d.reg, Logger: d.logger, Settings: d.st,
			KV: inspector{index: d.index, events: d.events}, Prefill: gw,
			States:  health.EndpointState(d.prober, d.ctl.Get),
			KVTrust: gw.KVTrust,
			RankLoad: func(s uint32, ep int) []api.RankLoad {
				var out []api.RankLoad
				for _, r := range gw.RankLoad(s, ep) {
					out = append(out, api.RankLoad{Rank: r.Rank, InFlight: r.InFlight, PlacedRecently: r.Placed, Running: r.Running, Waiting: r.Waiting})
				}
				return out
			},
			KVRelay: http.HandlerFunc(d.events.ServeRelay),
			Cluster: d.members.View,
			// The proxy counts the requests it forwards and the P/D legs
			// it carries; the dispatcher counts those legs from their
			// admission on, a wait for an endpoint slot included.
			InFlight: func(s uint32, ep int) int { return max(inflight.Count(s, ep), pdd.InFlight(s, ep)) },
			Diagnose: diag.Sources{Rules: d.ctl.List, Events: d.events.Status, SeedFingerprint: d.seedFP, SeedProblem: lbrule.SeedPrecondition(cfg.ruleSettings()),
				TokenizerDir: cfg.tokenizerDir, SidePort: pdd.SidePort}.Run})
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", cfg.apiAddr)
	if err != nil {
		return fmt.Errorf("management API: %w", err)
	}
	d.logger.Info("loxilb started", "version", version, "api", ln.Addr().String(), "state_dir", cfg.stateDir,
		"store", d.st.Health().Backend+" "+d.st.Health().Where, "node", cfg.cluster.name, "node_address", cfg.cluster.address,
		"tokenizer_dir", cfg.tokenizerDir, "rules", len(d.ctl.List()), "auth", cfg.apiToken != "", "tls", cfg.tlsCert != "",
		"api_read_timeout", cfg.api.readTimeout, "api_max_body", cfg.api.maxBody, "api_max_conns", cfg.api.maxConns,
		"coalesce_wait", cfg.coalesceWait, "cluster_tiebreak", cfg.clusterTieBreak, "cluster_load_interval", cfg.clusterLoadInterval, "prefill_slots", cfg.prefillSlots, "prefill_queue_wait", cfg.prefillWait,
		"proxy_receipts", cfg.receipts.String(), "tokenize_max_bytes", cfg.tokMaxBytes, "tokenize_max_tokens", cfg.tokMaxTokens,
		"tokenize_concurrency", cfg.tokConcurrency)
	go func() {
		if err := srv.Serve(apiCtx, ln); err != nil {
			errc <- fmt.Errorf("management API: %w", err)
		}
		cancel()
	}()
	return nil
}
