package enginemetrics

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/engine"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/selector"
)

// engineMetricNames maps each engine's Prometheus names onto the three load
// signals the selectors and the router use. Several names per signal cover
// renames across engine releases; values of one name are summed over labels
// (several model names or DP ranks on one server).
var engineMetricNames = map[string]struct{ running, waiting, kv []string }{
	string(engine.VLLM):     {[]string{"vllm:num_requests_running"}, []string{"vllm:num_requests_waiting"}, []string{"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"}},
	string(engine.SGLang):   {[]string{"sglang:num_running_reqs"}, []string{"sglang:num_queue_reqs"}, []string{"sglang:token_usage"}},
	string(engine.TRTLLM):   {[]string{"trtllm:num_requests_running"}, []string{"trtllm:num_requests_waiting"}, []string{"trtllm:kv_cache_usage_perc"}},
	string(engine.LlamaCpp): {[]string{"llamacpp:requests_processing"}, []string{"llamacpp:requests_deferred"}, []string{"llamacpp:kv_cache_usage_ratio"}},
}

// Config tunes the engine-metrics scraper.
type Config struct {
	Interval time.Duration // default 1s
	Timeout  time.Duration // per scrape, default 500ms
	// MaxAge: a sample older than this is ignored (default 3 intervals), so
	// a dead metrics endpoint never pins a stale load on a worker.
	MaxAge  time.Duration
	MaxBody int64 // default 4 MiB
	// SelfInFlight, when set, counts this node's requests open to an
	// endpoint (the proxy's in-flight table). Each sample records it as
	// the scrape's answer arrives, so Others can tell this node's share
	// of the engine's running+waiting from what other nodes sent; nil
	// records 0.
	SelfInFlight func(service uint32, ep int) int
}

// Scraper polls every mode-4 endpoint's /metrics and serves the latest load
// signals (Metrics, RankMetrics, Others) and learned prefill budgets
// (LearnedSlots) to the gateway. It is a control.Reconciler (the target
// set follows the rules) with a Run loop.
type Scraper struct {
	cfg    Config
	client *http.Client
	logger *slog.Logger
	errs   *prometheus.CounterVec
	// budgetRejected counts engine values refused as (or for learning)
	// a prefill budget, by reason (budget.go).
	budgetRejected *prometheus.CounterVec

	mu      sync.RWMutex
	targets map[epKey]scrapeTarget
	samples map[epKey]sample
	budgets map[epKey]*learnedBudget
	// lmLast is each endpoint's last lmcache:num_hit_tokens (lmcache.go).
	lmLast map[epKey]float64
	lmHits *prometheus.CounterVec
}

type epKey struct {
	service uint32
	ep      int
}

type scrapeTarget struct {
	url    string
	engine string
}

type sample struct {
	m  selector.EngineMetrics
	at time.Time
	// self is this node's in-flight count to the endpoint when the
	// sample's answer arrived (0 without Config.SelfInFlight).
	self  int
	ranks rankSample // per data-parallel rank (rankscrape.go)
}

var _ control.Reconciler = (*Scraper)(nil)

// New builds a scraper and registers its metrics on reg (nil: none).
func New(cfg Config, logger *slog.Logger, reg prometheus.Registerer) (*Scraper, error) {
	if cfg.Interval <= 0 {
		cfg.Interval = time.Second
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 500 * time.Millisecond
	}
	if cfg.MaxAge <= 0 {
		cfg.MaxAge = 3 * cfg.Interval
	}
	if cfg.MaxBody <= 0 {
		cfg.MaxBody = 4 << 20
	}
	if logger == nil {
		logger = slog.Default()
	}
	s := &Scraper{cfg: cfg, logger: logger, targets: map[epKey]scrapeTarget{}, samples: map[epKey]sample{}, budgets: map[epKey]*learnedBudget{},
		lmLast: map[epKey]float64{}, lmHits: newLMCacheHits(),
		budgetRejected: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_kv_prefill_budget_rejected_total",
			Help: "Engine values refused for learning a prefill budget, by reason (bad_value: a running/waiting gauge or sequence cap that is NaN, negative or above 2^20; malformed: a server-info body that is not the expected JSON)."},
			[]string{"reason"}),
		errs: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_gateway_engine_scrape_errors_total",
			Help: "Failed scrapes of an engine's /metrics (load signals for gpu-aware selection and the KV load blend), by reason."},
			[]string{"service", "ep_idx", "reason"}),
		// Load hints only: an https endpoint's certificate is not verified
		// here (the proxy verifies it for traffic).
		client: &http.Client{Timeout: cfg.Timeout, Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 1,
			TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}, //nolint:gosec // documented: metrics are hints
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{s.errs, s.budgetRejected, s.lmHits} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return s, nil
}

// Name implements control.Reconciler.
func (s *Scraper) Name() string { return "engine-metrics" }

// Reconcile implements control.Reconciler: every endpoint of a mode-4 rule is
// scraped (P/D pools included: decode choice uses the same signals).
func (s *Scraper) Reconcile(_ context.Context, services []control.Service) error {
	next := map[epKey]scrapeTarget{}
	for _, svc := range services {
		r := svc.Rule
		if r.Service.Mode != lbrule.ModeFullProxy {
			continue
		}
		scheme := "http"
		if r.Service.Security == lbrule.SecurityE2ETLS {
			scheme = "https"
		}
		for i, ep := range r.Endpoints {
			next[epKey{svc.ID, i}] = scrapeTarget{url: scheme + "://" + net.JoinHostPort(ep.IP, strconv.Itoa(ep.Port)) + "/metrics", engine: r.Engine()}
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for k, t := range s.targets {
		if n, ok := next[k]; !ok || n != t {
			delete(s.samples, k)
			delete(s.budgets, k) // another engine or address: learn anew
			delete(s.lmLast, k)
			s.lmHits.DeleteLabelValues(strconv.FormatUint(uint64(k.service), 10), strconv.Itoa(k.ep))
			s.errs.DeletePartialMatch(prometheus.Labels{"service": strconv.FormatUint(uint64(k.service), 10), "ep_idx": strconv.Itoa(k.ep)})
		}
	}
	s.targets = next
	return nil
}

// Metrics returns the load signals of ep's last fresh scrape; ok is false
// without one.
func (s *Scraper) Metrics(service uint32, ep int) (selector.EngineMetrics, bool) {
	s.mu.RLock()
	smp, ok := s.samples[epKey{service, ep}]
	s.mu.RUnlock()
	if !ok || time.Since(smp.at) > s.cfg.MaxAge {
		return selector.EngineMetrics{}, false
	}
	return smp.m, true
}

// Others estimates the requests other gateway nodes have on an endpoint:
// the engine's running+waiting at the last fresh scrape less this node's
// in-flight count at that moment, at least 0. ok is false without a fresh
// sample.
func (s *Scraper) Others(service uint32, ep int) (int, bool) {
	s.mu.RLock()
	smp, ok := s.samples[epKey{service, ep}]
	s.mu.RUnlock()
	if !ok || time.Since(smp.at) > s.cfg.MaxAge {
		return 0, false
	}
	return max(smp.m.Running+smp.m.Waiting-smp.self, 0), true
}

// Run scrapes every target each interval, and the endpoints whose budget
// is still being learned more often while they may be queueing (probe.go),
// until ctx ends.
func (s *Scraper) Run(ctx context.Context) error {
	t := time.NewTicker(s.cfg.Interval)
	defer t.Stop()
	var probes sync.WaitGroup
	defer probes.Wait()
	probes.Go(func() { s.probeLoop(ctx, &probes) })
	for {
		s.scrapeAll(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

func (s *Scraper) scrapeAll(ctx context.Context) {
	s.mu.RLock()
	targets := make(map[epKey]scrapeTarget, len(s.targets))
	for k, v := range s.targets {
		targets[k] = v
	}
	s.mu.RUnlock()
	var wg sync.WaitGroup
	for k, t := range targets {
		wg.Go(func() { s.sampleOne(ctx, k, t) })
	}
	wg.Wait()
}

// sampleOne scrapes target t of k once and keeps what it says: the load
// sample, the LMCache hits, the learned budget (or the failure, counted).
func (s *Scraper) sampleOne(ctx context.Context, k epKey, t scrapeTarget) {
	var ranks rankSample
	m, hits, hasHits, reason := s.scrape(ctx, t, &ranks)
	if hasHits {
		s.mu.Lock()
		if s.targets[k] == t {
			s.lmcacheObserve(k, hits)
		}
		s.mu.Unlock()
	}
	if reason != "" {
		s.errs.WithLabelValues(strconv.FormatUint(uint64(k.service), 10), strconv.Itoa(k.ep), reason).Inc()
		if reason == budgetBadValue {
			s.budgetRejected.WithLabelValues(budgetBadValue).Inc()
		}
		return
	}
	if ranks.bad != "" {
		s.errs.WithLabelValues(strconv.FormatUint(uint64(k.service), 10), strconv.Itoa(k.ep), ranks.bad).Inc()
	}
	self := s.self(k)
	s.mu.Lock()
	if s.targets[k] == t {
		s.samples[k] = sample{m: m, at: time.Now(), self: self, ranks: ranks}
	}
	s.mu.Unlock()
	s.learn(ctx, k, t, m)
}

// self returns this node's requests open to k (0 without
// Config.SelfInFlight).
func (s *Scraper) self(k epKey) int {
	if f := s.cfg.SelfInFlight; f != nil {
		return f(k.service, k.ep)
	}
	return 0
}

// scrape reads one target: its load signals (or the failure reason), its
// per-rank load into ranks, and its LMCache hit counter when it exports one.
func (s *Scraper) scrape(ctx context.Context, t scrapeTarget, ranks *rankSample) (m selector.EngineMetrics, hits float64, hasHits bool, reason string) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, t.url, nil)
	if err != nil {
		return m, 0, false, "request"
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return m, 0, false, "unreachable"
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
		return m, 0, false, "status_" + strconv.Itoa(resp.StatusCode)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, s.cfg.MaxBody))
	if err != nil {
		return m, 0, false, "read"
	}
	hits, hasHits = lmcacheHitTokens(body)
	m, err = Parse(t.engine, body)
	if errors.Is(err, errBadValue) {
		return selector.EngineMetrics{}, hits, hasHits, budgetBadValue
	}
	if err != nil {
		return selector.EngineMetrics{}, hits, hasHits, "no_load_metrics"
	}
	*ranks = parseRankLoad(t.engine, body)
	return m, hits, hasHits, ""
}

// Parse reads an engine's Prometheus text exposition and returns its load
// signals. It fails when none of the engine's running or
// waiting gauges is present (a wrong port or an engine built without
// metrics), so a misconfiguration is counted instead of read as idle, and
// with an error wrapping errBadValue when one of the engine's gauges (or
// their sum) is NaN, infinite, negative or above 2^20: such a sample is
// neither load nor a prefill budget (budget.go).
func Parse(engine string, text []byte) (selector.EngineMetrics, error) {
	names, ok := engineMetricNames[engine]
	if !ok {
		return selector.EngineMetrics{}, fmt.Errorf("no metric names for engine %q", engine)
	}
	sums := map[string]float64{}
	series := map[string]int{} // samples of a name: one per label set (SGLang: per dp_rank)
	seen := map[string]bool{}
	bad := map[string]error{} // the first out-of-range sample of a name
	wanted := map[string]bool{}
	for _, l := range [][]string{names.running, names.waiting, names.kv} {
		for _, n := range l {
			wanted[n] = true
		}
	}
	sc := bufio.NewScanner(bytes.NewReader(text))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		name, val, ok := sampleLine(sc.Bytes())
		if !ok || !wanted[name] {
			continue
		}
		v, err := strconv.ParseFloat(val, 64)
		if err != nil {
			continue
		}
		sums[name] += v
		series[name]++
		seen[name] = true
		if bad[name] == nil {
			// Checked per sample too: a negative value can hide in a sum.
			bad[name] = checkCount(name, v)
		}
	}
	var badErr error
	pick := func(cands []string) (float64, bool) {
		for _, n := range cands {
			if seen[n] {
				if err := bad[n]; err != nil && badErr == nil {
					badErr = err
				} else if err := checkCount(n, sums[n]); err != nil && badErr == nil {
					badErr = err
				}
				return sums[n], true
			}
		}
		return 0, false
	}
	run, okR := pick(names.running)
	wait, okW := pick(names.waiting)
	// Request counts add up over an engine's series, but KV usage is a
	// fraction per series (a data-parallel SGLang publishes one per
	// dp_rank): the engine's is their mean, never above 1.
	kv, okKV := pick(names.kv)
	for _, n := range names.kv {
		if okKV && seen[n] {
			kv /= float64(series[n])
			break
		}
	}
	if !okR && !okW {
		return selector.EngineMetrics{}, fmt.Errorf("engine %s: no running/waiting gauges in /metrics", engine)
	}
	if badErr != nil {
		return selector.EngineMetrics{}, fmt.Errorf("engine %s: %w", engine, badErr)
	}
	return selector.EngineMetrics{Running: int(run), Waiting: int(wait), KVUsage: kv, Valid: true}, nil
}

// sampleLine splits one sample line of the Prometheus text format into the
// metric name and the value's text (labels and timestamp dropped); ok is
// false for a comment, a blank or a malformed line.
func sampleLine(line []byte) (name, value string, ok bool) {
	if len(line) == 0 || line[0] == '#' {
		return "", "", false
	}
	end := bytes.IndexAny(line, "{ ")
	if end <= 0 {
		return "", "", false
	}
	rest := line[end:]
	if rest[0] == '{' {
		c := bytes.LastIndexByte(rest, '}')
		if c < 0 {
			return "", "", false
		}
		rest = rest[c+1:]
	}
	fields := strings.Fields(string(rest))
	if len(fields) == 0 {
		return "", "", false
	}
	return string(line[:end]), fields[0], true
}
