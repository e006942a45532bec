package outlier

import (
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Outcome is what one attempt against an endpoint showed.
type Outcome uint8

// Attempt outcomes.
const (
	// Ignore is an attempt that says nothing about the endpoint (the
	// client went away, the request was refused before forwarding).
	Ignore Outcome = iota
	// Success is a response below 500.
	Success
	// GatewayFailure is a connect failure (refused, unreachable, timed
	// out, TLS handshake) or a connection reset or timed out before a
	// response arrived.
	GatewayFailure
	// ServerError is a 5xx response from the endpoint.
	ServerError
)

// Role separates the pools of one rule: the endpoints of a plain rule are
// one pool, a prefill/decode rule has a prefill and a decode pool.
type Role uint8

// Pool roles.
const (
	RoleNone Role = iota
	RolePrefill
	RoleDecode
)

func (r Role) String() string {
	switch r {
	case RolePrefill:
		return "prefill"
	case RoleDecode:
		return "decode"
	}
	return "none"
}

// Pool names the endpoint group an attempt belongs to; the ejection cap
// applies to it. Size is the number of endpoints in the group.
type Pool struct {
	Service uint32
	Role    Role
	Size    int
}

// Defaults of Config.
const (
	DefaultGatewayFailures   = 3
	DefaultServerErrors      = 5
	DefaultBaseEjection      = 30 * time.Second
	DefaultMaxEjection       = 300 * time.Second
	DefaultMaxEjectedPercent = 50
)

// Config sets the detector's thresholds. Zero fields take the defaults.
type Config struct {
	// Disabled turns ejection off: Observe only counts nothing and
	// Ejected is always false.
	Disabled bool
	// GatewayFailures is how many consecutive gateway failures eject an
	// endpoint (1..1000).
	GatewayFailures int
	// ServerErrors is how many consecutive 5xx answers eject an endpoint
	// (1..1000).
	ServerErrors int
	// PDOriginErrors, when above 0, replaces both thresholds for
	// prefill/decode pools: consecutive origin errors (5xx or gateway
	// failures) of a prefill or decode endpoint that open its breaker
	// (LLB_PD_ORIGIN_ERR_THRESHOLD).
	PDOriginErrors int
	// BaseEjection is the first ejection's length.
	BaseEjection time.Duration
	// MaxEjection caps an ejection's length; it is also how long an
	// endpoint must stay un-ejected before its ejections count from the
	// first again.
	MaxEjection time.Duration
	// MaxEjectedPercent is the largest share of a pool that may be
	// ejected at once (0..100); the last endpoint is never ejected.
	MaxEjectedPercent int
}

// WithDefaults fills zero fields.
func (c Config) WithDefaults() Config {
	if c.GatewayFailures == 0 {
		c.GatewayFailures = DefaultGatewayFailures
	}
	if c.ServerErrors == 0 {
		c.ServerErrors = DefaultServerErrors
	}
	if c.BaseEjection == 0 {
		c.BaseEjection = DefaultBaseEjection
	}
	if c.MaxEjection == 0 {
		c.MaxEjection = DefaultMaxEjection
	}
	if c.MaxEjectedPercent == 0 {
		c.MaxEjectedPercent = DefaultMaxEjectedPercent
	}
	return c
}

// Validate reports the first setting out of range, naming it.
func (c Config) Validate() error {
	switch {
	case c.GatewayFailures < 1 || c.GatewayFailures > 1000:
		return fmt.Errorf("outlier gateway failures %d: want 1..1000", c.GatewayFailures)
	case c.ServerErrors < 1 || c.ServerErrors > 1000:
		return fmt.Errorf("outlier consecutive 5xx %d: want 1..1000", c.ServerErrors)
	case c.PDOriginErrors < 0 || c.PDOriginErrors > 1000:
		return fmt.Errorf("P/D origin error threshold %d: want 0..1000 (0: the outlier thresholds)", c.PDOriginErrors)
	case c.BaseEjection < 100*time.Millisecond || c.BaseEjection > time.Hour:
		return fmt.Errorf("outlier base ejection %v: want 100ms..1h", c.BaseEjection)
	case c.MaxEjection < c.BaseEjection || c.MaxEjection > 24*time.Hour:
		return fmt.Errorf("outlier max ejection %v: want the base ejection (%v)..24h", c.MaxEjection, c.BaseEjection)
	case c.MaxEjectedPercent < 0 || c.MaxEjectedPercent > 100:
		return fmt.Errorf("outlier max ejected percent %d: want 0..100", c.MaxEjectedPercent)
	}
	return nil
}

// Ejection reasons (label of loxilb_outlier_ejections_total).
const (
	ReasonGateway   = "gateway_failure"
	Reason5xx       = "consecutive_5xx"
	ReasonPDOrigin  = "pd_origin_error"
	ReasonProbation = "probation_failure"
)

type poolKey struct {
	service uint32
	role    Role
}

// state is one endpoint's record. It exists only while the endpoint has
// failed recently or has an ejection to remember.
type state struct {
	ep        int // index in the rule, for metric labels
	gw, srv   int // consecutive failures of each kind
	ejections int // ejections in the current series
	until     time.Time
	probation bool
}

// Detector tracks endpoints' consecutive failures and ejections. It is safe
// for concurrent use; Observe and Ejected take one mutex for a map lookup.
type Detector struct {
	cfg    Config
	logger *slog.Logger
	now    func() time.Time

	mu    sync.Mutex
	pools map[poolKey]map[string]*state // endpoint address -> state

	ejections *prometheus.CounterVec
	capped    *prometheus.CounterVec
	ejectedD  *prometheus.Desc
}

// New builds a detector. reg may be nil.
func New(cfg Config, logger *slog.Logger, reg prometheus.Registerer) (*Detector, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = slog.Default()
	}
	d := &Detector{cfg: cfg, logger: logger, now: time.Now, pools: map[poolKey]map[string]*state{},
		ejections: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_outlier_ejections_total",
			Help: "Endpoints ejected by passive health checking, by reason (gateway_failure, consecutive_5xx, pd_origin_error, probation_failure)."},
			[]string{"service", "ep_idx", "role", "reason"}),
		capped: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_outlier_ejections_capped_total",
			Help: "Ejections refused because the pool already had its maximum share of endpoints ejected (or only one left)."},
			[]string{"service", "role"}),
		ejectedD: prometheus.NewDesc("loxilb_outlier_ejected",
			"1 while an endpoint is ejected by passive health checking.", []string{"service", "ep_idx", "role"}, nil),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{d.ejections, d.capped, d} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return d, nil
}

// Config returns the effective configuration.
func (d *Detector) Config() Config { return d.cfg }

// Observe records one attempt's outcome against the endpoint with index ep
// and dial address addr of pool p. It returns true when this attempt
// ejected the endpoint.
func (d *Detector) Observe(p Pool, ep int, addr string, o Outcome) bool {
	if d == nil || d.cfg.Disabled || o == Ignore {
		return false
	}
	now := d.now()
	pk := poolKey{p.Service, p.Role}
	d.mu.Lock()
	defer d.mu.Unlock()
	eps := d.pools[pk]
	st := eps[addr]
	if o == Success {
		if st == nil || st.until.After(now) {
			return false // nothing to reset, or a request routed before the ejection
		}
		st.gw, st.srv, st.probation = 0, 0, false
		if !st.until.After(now) && now.Sub(st.until) >= d.cfg.MaxEjection {
			delete(eps, addr) // nothing left to remember
		}
		return false
	}
	if st == nil {
		if eps == nil {
			eps = map[string]*state{}
			d.pools[pk] = eps
		}
		st = &state{}
		eps[addr] = st
	}
	st.ep = ep
	if st.until.After(now) {
		return false // already ejected: a request that was routed before
	}
	switch o {
	case GatewayFailure:
		st.gw++
		st.srv++
	case ServerError:
		st.srv++
		st.gw = 0
	}
	reason := ""
	switch {
	case st.probation:
		reason = ReasonProbation
	case p.Role != RoleNone && d.cfg.PDOriginErrors > 0:
		if st.srv >= d.cfg.PDOriginErrors {
			reason = ReasonPDOrigin
		}
	case st.gw >= d.cfg.GatewayFailures:
		reason = ReasonGateway
	case st.srv >= d.cfg.ServerErrors:
		reason = Reason5xx
	}
	if reason == "" {
		return false
	}
	svc := strconv.FormatUint(uint64(p.Service), 10)
	if !d.roomLocked(eps, p.Size, now) {
		d.capped.WithLabelValues(svc, p.Role.String()).Inc()
		return false
	}
	if !st.until.IsZero() && now.Sub(st.until) >= d.cfg.MaxEjection {
		st.ejections = 0 // healthy long enough: a new series
	}
	st.ejections++
	dur := d.cfg.BaseEjection
	for i := 1; i < st.ejections && dur < d.cfg.MaxEjection; i++ {
		dur *= 2
	}
	dur = min(dur, d.cfg.MaxEjection)
	st.until = now.Add(dur)
	st.gw, st.srv, st.probation = 0, 0, true
	d.ejections.WithLabelValues(svc, strconv.Itoa(ep), p.Role.String(), reason).Inc()
	d.logger.Warn("endpoint ejected by passive health checking", "service", p.Service, "ep", ep, "addr", addr,
		"role", p.Role.String(), "reason", reason, "for", dur, "ejections", st.ejections)
	return true
}

// roomLocked reports whether one more endpoint of a pool of size n may be
// ejected.
func (d *Detector) roomLocked(eps map[string]*state, n int, now time.Time) bool {
	ejected := 0
	for _, s := range eps {
		if s.until.After(now) {
			ejected++
		}
	}
	limit := min(n*d.cfg.MaxEjectedPercent/100, n-1)
	return ejected < limit
}

// Ejected reports whether the endpoint at addr of the pool is ejected now.
func (d *Detector) Ejected(service uint32, role Role, addr string) bool {
	if d == nil || d.cfg.Disabled {
		return false
	}
	now := d.now()
	d.mu.Lock()
	defer d.mu.Unlock()
	st := d.pools[poolKey{service, role}][addr]
	return st != nil && st.until.After(now)
}

// Forget drops a removed rule's records and metric series.
func (d *Detector) Forget(service uint32) {
	if d == nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for k := range d.pools {
		if k.service == service {
			delete(d.pools, k)
		}
	}
	l := prometheus.Labels{"service": strconv.FormatUint(uint64(service), 10)}
	d.ejections.DeletePartialMatch(l)
	d.capped.DeletePartialMatch(l)
}

// Describe implements prometheus.Collector for loxilb_outlier_ejected.
func (d *Detector) Describe(ch chan<- *prometheus.Desc) { ch <- d.ejectedD }

// Collect implements prometheus.Collector: one sample per endpoint
// ejected now (an ejection that has expired shows no sample).
func (d *Detector) Collect(ch chan<- prometheus.Metric) {
	now := d.now()
	d.mu.Lock()
	defer d.mu.Unlock()
	for k, eps := range d.pools {
		for _, s := range eps {
			if s.until.After(now) {
				ch <- prometheus.MustNewConstMetric(d.ejectedD, prometheus.GaugeValue, 1,
					strconv.FormatUint(uint64(k.service), 10), strconv.Itoa(s.ep), k.role.String())
			}
		}
	}
}

var _ prometheus.Collector = (*Detector)(nil)
