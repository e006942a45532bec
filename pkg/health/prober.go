package health

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Target is one endpoint of one rule to watch.
type Target struct {
	Service uint32
	EP      int
	Addr    netip.Addr
	Port    uint16 // the endpoint's target port
	// Monitor is the rule's `monitor` (see MonitorEnabled). When false, or
	// when Probe.Type is none, the endpoint is not probed and is healthy.
	Monitor bool
	Probe   Probe
}

type key struct {
	service uint32
	ep      int
}

// Change reports an endpoint going up or down.
type Change struct {
	Service uint32
	EP      int
	Addr    netip.AddrPort // the probed address
	Healthy bool
	Reason  string // failure reason when going down ("" when up)
	Err     error  // the last probe error when going down
}

// Config holds process-wide probe defaults.
type Config struct {
	// Interval is the default probe period. Default 10s.
	Interval time.Duration
	// Timeout bounds one probe attempt. Default 3s.
	Timeout time.Duration
	// Retries is the default number of consecutive failures before down.
	// Default 2.
	Retries int
	// TLSConfig is used by https probes. nil means no verification.
	TLSConfig *tls.Config
}

func (c Config) withDefaults() (Config, error) {
	if c.Interval == 0 {
		c.Interval = 10 * time.Second
	}
	if c.Timeout == 0 {
		c.Timeout = 3 * time.Second
	}
	if c.Retries == 0 {
		c.Retries = 2
	}
	if c.Interval < 0 || c.Timeout < 0 || c.Retries < 0 {
		return c, fmt.Errorf("%w: negative default interval %v, timeout %v or retries %d", ErrInvalidProbe, c.Interval, c.Timeout, c.Retries)
	}
	if c.TLSConfig == nil {
		// Liveness, not identity: see the package documentation.
		c.TLSConfig = &tls.Config{InsecureSkipVerify: true} //nolint:gosec // documented default, like loxilb
	}
	return c, nil
}

// Prober runs the probes. It is safe for concurrent use.
type Prober struct {
	cfg    Config
	logger *slog.Logger
	m      metrics
	http   *http.Client
	https  *http.Client
	ping   pinger

	mu      sync.RWMutex
	workers map[key]*worker
	runCtx  context.Context // non-nil while Run is active
	wg      sync.WaitGroup
	subs    map[int]func(Change)
	nextSub int
}

type worker struct {
	t       Target
	addr    netip.AddrPort
	healthy atomic.Bool
	fails   int // consecutive failures; owned by the worker goroutine
	cancel  context.CancelFunc
	labels  [2]string
}

type metrics struct {
	healthy  *prometheus.GaugeVec
	failures *prometheus.CounterVec
	changes  *prometheus.CounterVec
}

// New returns a Prober. reg may be nil.
func New(cfg Config, logger *slog.Logger, reg prometheus.Registerer) (*Prober, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	p := &Prober{
		cfg:     cfg,
		logger:  logger,
		workers: make(map[key]*worker),
		subs:    make(map[int]func(Change)),
		m: metrics{
			healthy: prometheus.NewGaugeVec(prometheus.GaugeOpts{
				Name: "loxilb_endpoint_healthy",
				Help: "1 when the endpoint passes its health probe, 0 when it is down. Only monitored endpoints have a series.",
			}, []string{"service", "ep_idx"}),
			failures: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "loxilb_endpoint_probe_failures_total",
				Help: "Failed health probes by reason.",
			}, []string{"service", "ep_idx", "reason"}),
			changes: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "loxilb_endpoint_state_changes_total",
				Help: "Endpoint up/down transitions.",
			}, []string{"service", "ep_idx"}),
		},
	}
	p.http = newHTTPClient(nil)
	p.https = newHTTPClient(cfg.TLSConfig)
	if reg != nil {
		for _, c := range []prometheus.Collector{p.m.healthy, p.m.failures, p.m.changes} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("register health metrics: %w", err)
			}
		}
	}
	return p, nil
}

func newHTTPClient(tlsCfg *tls.Config) *http.Client {
	tr := &http.Transport{
		DisableKeepAlives:  true, // each probe proves a fresh connection works
		TLSClientConfig:    tlsCfg,
		DisableCompression: true,
		Proxy:              nil, // never probe through HTTP_PROXY
	}
	return &http.Client{
		Transport:     tr,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
}

// Subscribe registers fn for state changes and returns a function that
// unregisters it. fn runs on a probe goroutine: it must return quickly and
// must not call Set.
func (p *Prober) Subscribe(fn func(Change)) (unsubscribe func()) {
	p.mu.Lock()
	id := p.nextSub
	p.nextSub++
	p.subs[id] = fn
	p.mu.Unlock()
	return func() {
		p.mu.Lock()
		delete(p.subs, id)
		p.mu.Unlock()
	}
}

// Healthy reports whether the endpoint may receive traffic. Endpoints the
// prober does not know, or does not monitor, are healthy.
func (p *Prober) Healthy(service uint32, ep int) bool {
	p.mu.RLock()
	w := p.workers[key{service, ep}]
	p.mu.RUnlock()
	return w == nil || w.healthy.Load()
}

// Set replaces the desired target set. Targets whose settings are unchanged
// keep probing undisturbed; a changed target keeps its state when its
// address is unchanged; removed targets stop and their series are deleted.
// Nothing changes if any target is invalid.
func (p *Prober) Set(targets []Target) error {
	want := make(map[key]Target, len(targets))
	for _, t := range targets {
		k := key{t.Service, t.EP}
		if _, dup := want[k]; dup {
			return fmt.Errorf("health target service %d ep %d: %w: listed twice", t.Service, t.EP, ErrInvalidProbe)
		}
		if !t.monitored() {
			continue
		}
		if err := t.Probe.validate(); err != nil {
			return fmt.Errorf("health target service %d ep %d: %w", t.Service, t.EP, err)
		}
		if !t.Addr.IsValid() {
			return fmt.Errorf("health target service %d ep %d: %w: no address", t.Service, t.EP, ErrInvalidProbe)
		}
		if t.probePort() == 0 {
			return fmt.Errorf("health target service %d ep %d: %w: no target or probe port", t.Service, t.EP, ErrInvalidProbe)
		}
		want[k] = t
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for k, w := range p.workers {
		t, ok := want[k]
		if ok && t == w.t {
			delete(want, k)
			continue
		}
		p.stopLocked(k, w, !ok)
		if ok && t.addrPort() == w.addr {
			nw := p.newWorker(t)
			nw.healthy.Store(w.healthy.Load())
			p.startLocked(k, nw)
			delete(want, k)
		}
	}
	for k, t := range want {
		p.startLocked(k, p.newWorker(t))
	}
	return nil
}

func (t Target) monitored() bool { return t.Monitor && t.Probe.Type != ProbeNone && t.Probe.Type != "" }

func (t Target) probePort() uint16 {
	if t.Probe.Port != 0 {
		return t.Probe.Port
	}
	return t.Port
}

func (t Target) addrPort() netip.AddrPort { return netip.AddrPortFrom(t.Addr, t.probePort()) }

func (p *Prober) newWorker(t Target) *worker {
	w := &worker{t: t, addr: t.addrPort()}
	w.labels = [2]string{strconv.FormatUint(uint64(t.Service), 10), strconv.Itoa(t.EP)}
	w.healthy.Store(true)
	return w
}

func (p *Prober) startLocked(k key, w *worker) {
	p.workers[k] = w
	up := 0.0
	if w.healthy.Load() {
		up = 1
	}
	p.m.healthy.WithLabelValues(w.labels[0], w.labels[1]).Set(up)
	if p.runCtx != nil {
		p.launchLocked(w)
	}
}

func (p *Prober) launchLocked(w *worker) {
	ctx, cancel := context.WithCancel(p.runCtx)
	w.cancel = cancel
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		p.loop(ctx, w)
	}()
}

func (p *Prober) stopLocked(k key, w *worker, deleteSeries bool) {
	if w.cancel != nil {
		w.cancel()
	}
	delete(p.workers, k)
	if deleteSeries {
		l := prometheus.Labels{"service": w.labels[0], "ep_idx": w.labels[1]}
		p.m.healthy.DeletePartialMatch(l)
		p.m.failures.DeletePartialMatch(l)
		p.m.changes.DeletePartialMatch(l)
	}
}

// Run probes until ctx is cancelled, then waits for in-flight probes.
func (p *Prober) Run(ctx context.Context) error {
	p.mu.Lock()
	if p.runCtx != nil {
		p.mu.Unlock()
		return errors.New("health prober already running")
	}
	p.runCtx = ctx
	for _, w := range p.workers {
		p.launchLocked(w)
	}
	p.mu.Unlock()

	<-ctx.Done()

	p.mu.Lock()
	p.runCtx = nil
	for _, w := range p.workers {
		w.cancel = nil
	}
	p.mu.Unlock()
	p.wg.Wait()
	return nil
}

func (p *Prober) loop(ctx context.Context, w *worker) {
	interval := w.t.Probe.Interval
	if interval == 0 {
		interval = p.cfg.Interval
	}
	// The attempt timeout is not capped at the interval: probes of one
	// target are sequential, so a slow probe only delays the next one.
	timeout := p.cfg.Timeout
	retries := w.t.Probe.Retries
	if retries == 0 {
		retries = p.cfg.Retries
	}
	timer := time.NewTimer(0) // first probe at once
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		pctx, cancel := context.WithTimeout(ctx, timeout)
		err := p.check(pctx, w.t, w.addr)
		cancel()
		if ctx.Err() != nil {
			return // stopped mid-probe: the result means nothing
		}
		p.record(w, err, retries)
		timer.Reset(interval)
	}
}

func (p *Prober) record(w *worker, err error, retries int) {
	if err == nil {
		w.fails = 0
		if !w.healthy.Swap(true) {
			p.transition(w, Change{Healthy: true})
		}
		return
	}
	reason := classify(err)
	p.m.failures.WithLabelValues(w.labels[0], w.labels[1], reason).Inc()
	w.fails++
	p.logger.Debug("health probe failed", "service", w.t.Service, "ep", w.t.EP, "addr", w.addr,
		"probe", w.t.Probe.Type, "reason", reason, "consecutive", w.fails, "err", err)
	if w.fails >= retries && w.healthy.Swap(false) {
		p.transition(w, Change{Healthy: false, Reason: reason, Err: err})
	}
}

func (p *Prober) transition(w *worker, c Change) {
	c.Service, c.EP, c.Addr = w.t.Service, w.t.EP, w.addr
	up := 0.0
	if c.Healthy {
		up = 1
	}
	p.mu.RLock()
	current := p.workers[key{w.t.Service, w.t.EP}] == w
	var subs []func(Change)
	if current {
		p.m.healthy.WithLabelValues(w.labels[0], w.labels[1]).Set(up)
		p.m.changes.WithLabelValues(w.labels[0], w.labels[1]).Inc()
		subs = make([]func(Change), 0, len(p.subs))
		for _, fn := range p.subs {
			subs = append(subs, fn)
		}
	}
	p.mu.RUnlock()
	if !current {
		return // replaced or removed while probing
	}
	if c.Healthy {
		p.logger.Info("endpoint up", "service", c.Service, "ep", c.EP, "addr", c.Addr, "probe", w.t.Probe.Type)
	} else {
		p.logger.Warn("endpoint down", "service", c.Service, "ep", c.EP, "addr", c.Addr, "probe", w.t.Probe.Type,
			"reason", c.Reason, "err", c.Err)
	}
	for _, fn := range subs {
		fn(c)
	}
}
