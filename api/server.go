package api

import (
	"bytes"
	"context"
	"crypto/subtle"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/loxilb-llm/loxilb/pkg/cluster"
	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

//go:embed openapi.json
var openAPIDoc []byte

// OpenAPI returns the embedded OpenAPI document.
func OpenAPI() []byte { return openAPIDoc }

// Rules is the rule table the API drives (*control.Controller).
type Rules interface {
	Create(ctx context.Context, body []byte) (control.Service, bool, error)
	Delete(ctx context.Context, k lbrule.Key) error
	DeleteByName(ctx context.Context, name string) (int, error)
	List() []control.Service
	Get(id uint32) (control.Service, bool)
}

// Settings persists the server's own switches across restarts (the rule
// store). Setting returns nil when name was never stored.
type Settings interface {
	Setting(name string) ([]byte, error)
	PutSetting(name string, value []byte) error
}

// SettingMetrics is the stored state of the metrics export switch.
const SettingMetrics = "metrics_enabled"

// CapabilitySource lists capability entries; it must be cheap and never fail.
type CapabilitySource func() []Capability

// EndpointStates reports an endpoint's health for read-back ("active" or
// "inactive"); empty when the endpoint is not monitored.
type EndpointStates func(service uint32, ep int) string

// KVInspector exposes the live inventories and their ingestion state.
type KVInspector interface {
	// Snapshot returns up to limit block keys and the total held.
	Snapshot(service uint32, ep int, limit int) (blocks []uint64, total int)
	// Subscriber returns the ingestion state of one endpoint (JSON-ready).
	Subscriber(service uint32, ep int) (any, bool)
}

// PrefillBudgets reports the prefill admission budget the gateway applies
// to an endpoint (*gateway.Gateway): slots (0: not queued) and their
// source.
type PrefillBudgets interface {
	PrefillBudget(service uint32, ep int) (slots int, source string)
}

// Config configures the server.
type Config struct {
	Addr            string // listen address, default 127.0.0.1:11111
	Token           string // bearer token; empty disables authentication
	TLSCert, TLSKey string // serve HTTPS when both are set
	// AllowCleartext accepts a token over plain HTTP on a non-loopback
	// address (where anyone on the path can read it); refused otherwise.
	AllowCleartext bool
	MetricsEnabled bool // initial state of the metrics export
	Version        string

	// Limits; zero means the Default* value.
	ReadHeaderTimeout time.Duration // a request's headers must arrive within this
	ReadTimeout       time.Duration // a whole request, body included
	WriteTimeout      time.Duration // a whole response
	IdleTimeout       time.Duration // a keep-alive connection between requests
	MaxBodyBytes      int64         // larger bodies get 413 unread
	MaxConns          int           // connections open at once; more are closed at accept
}

func (c Config) withDefaults() Config {
	if c.Addr == "" {
		c.Addr = "127.0.0.1:11111"
	}
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	def(&c.ReadHeaderTimeout, DefaultReadHeaderTimeout)
	def(&c.ReadTimeout, DefaultReadTimeout)
	def(&c.WriteTimeout, DefaultWriteTimeout)
	def(&c.IdleTimeout, DefaultIdleTimeout)
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if c.MaxConns == 0 {
		c.MaxConns = DefaultMaxConns
	}
	return c
}

// Validate checks the configuration before anything is bound: the daemon
// calls it first, so a refused exposure never opens a socket.
func (c Config) Validate() error {
	c = c.withDefaults()
	if !loopbackAddr(c.Addr) {
		if c.Token == "" {
			return fmt.Errorf("%w: %s", ErrInsecureBind, c.Addr)
		}
		if c.TLSCert == "" && !c.AllowCleartext {
			return fmt.Errorf("%w: %s", ErrCleartextToken, c.Addr)
		}
	}
	if (c.TLSCert == "") != (c.TLSKey == "") {
		return errors.New("api: --tls-cert and --tls-key go together")
	}
	if c.ReadHeaderTimeout < 0 || c.ReadTimeout < 0 || c.WriteTimeout < 0 || c.IdleTimeout < 0 || c.MaxBodyBytes < 0 || c.MaxConns < 0 {
		return errors.New("api: negative timeout or limit")
	}
	return nil
}

// Deps are the server's collaborators. Rules is required.
type Deps struct {
	Rules        Rules
	Capabilities CapabilitySource
	States       EndpointStates
	KV           KVInspector
	// Prefill reports endpoints' prefill admission budgets in the KV
	// inventory; nil leaves them out.
	Prefill PrefillBudgets
	// RankLoad reports an endpoint's per-rank load in the KV inventory
	// (nil or an empty answer: none).
	RankLoad func(service uint32, ep int) []RankLoad
	Gatherer prometheus.Gatherer
	// Registerer receives the server's own metrics; nil keeps them
	// unregistered.
	Registerer prometheus.Registerer
	Logger     *slog.Logger
	// Settings keeps the metrics switch across restarts; nil forgets it.
	Settings Settings
	// InFlight reports the mode-4 requests open to an endpoint (the drain
	// API shows it, so an operator sees when a draining endpoint is
	// idle); nil leaves it out.
	InFlight func(service uint32, ep int) int
	// Diagnose runs the preflight checks (GET /diagnostics); nil answers
	// 503.
	Diagnose Diagnose
	// KVTrust reports an endpoint's hash-parity verdict ("" without a
	// KV-event subscription) and whether strict attestation keeps Tier-1.5
	// traffic off it, for read-back; nil leaves both out.
	KVTrust func(service uint32, ep int) (verdict string, excluded bool)
	// Cluster reports the nodes sharing the rule store and their drift
	// (GET /cluster); nil answers 503.
	Cluster func() cluster.View
	// KVRelay serves the TensorRT-LLM drain relay stream to the other
	// nodes of a cluster (kvevents.Manager.ServeRelay); nil answers 404.
	KVRelay http.Handler
}

// Server is the management REST server.
type Server struct {
	cfg     Config
	deps    Deps
	engine  *gin.Engine
	metrics atomic.Bool
	m       *metrics
	rlog    *rateLog
	http    *http.Server
}

// ErrInsecureBind: a non-loopback management address needs a token.
var ErrInsecureBind = errors.New("refusing to serve the management API on a non-loopback address without a bearer token (set --api-token-file)")

// ErrCleartextToken: a non-loopback management address with a token needs
// TLS, or the token crosses the network in clear.
var ErrCleartextToken = errors.New("refusing to send the management API's bearer token in cleartext on a non-loopback address (set --tls-cert and --tls-key, or accept the risk with --api-allow-cleartext)")

// New validates the configuration and builds the routes.
func New(cfg Config, deps Deps) (*Server, error) {
	if deps.Rules == nil {
		return nil, errors.New("api: Rules is required")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	if deps.Logger == nil {
		deps.Logger = slog.Default()
	}
	m, err := newMetrics(deps.Registerer)
	if err != nil {
		return nil, fmt.Errorf("api metrics: %w", err)
	}
	if deps.Registerer != nil && deps.Capabilities != nil {
		if err := deps.Registerer.Register(capabilityCollector{deps.Capabilities}); err != nil {
			return nil, fmt.Errorf("api metrics: %w", err)
		}
	}
	gin.SetMode(gin.ReleaseMode)
	s := &Server{cfg: cfg, deps: deps, engine: gin.New(), m: m,
		rlog: &rateLog{logger: deps.Logger, last: map[string]time.Time{}, quiet: map[string]int{}}}
	s.metrics.Store(cfg.MetricsEnabled)
	if deps.Settings != nil && !cfg.MetricsEnabled {
		// The last POST or DELETE /config/metrics survives a restart;
		// --metrics turns the export on whatever was stored.
		v, err := deps.Settings.Setting(SettingMetrics)
		if err != nil {
			return nil, fmt.Errorf("api: read the stored metrics switch: %w", err)
		}
		s.metrics.Store(string(v) == "on")
	}
	s.routes()
	return s, nil
}

func loopbackAddr(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// Handler exposes the routes (for tests and embedding).
func (s *Server) Handler() http.Handler { return s.engine }

// Serve listens on ln until ctx ends. Every connection is bounded in time
// (headers, whole request, response, idle) and in number.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	ln = &limitListener{Listener: ln, sem: make(chan struct{}, s.cfg.MaxConns), m: s.m, reject: func() {
		s.m.rejected.WithLabelValues(rejectConnLimit).Inc()
		s.rlog.warn(rejectConnLimit, "api: connection refused", "max_conns", s.cfg.MaxConns)
	}}
	s.http = &http.Server{Handler: s.engine, ReadHeaderTimeout: s.cfg.ReadHeaderTimeout, ReadTimeout: s.cfg.ReadTimeout,
		WriteTimeout: s.cfg.WriteTimeout, IdleTimeout: s.cfg.IdleTimeout, MaxHeaderBytes: maxHeaderBytes,
		ErrorLog: slog.NewLogLogger(s.deps.Logger.Handler(), slog.LevelDebug)}
	cs := &connStates{served: map[net.Conn]*atomic.Bool{}, closed: func() {
		s.m.rejected.WithLabelValues(rejectNoRequest).Inc()
		s.rlog.warn(rejectNoRequest, "api: connection closed without a complete request", "read_header_timeout", s.cfg.ReadHeaderTimeout)
	}}
	s.http.ConnState, s.http.ConnContext = cs.hook, cs.connContext
	errc := make(chan error, 1)
	go func() {
		if s.cfg.TLSCert != "" {
			errc <- s.http.ServeTLS(ln, s.cfg.TLSCert, s.cfg.TLSKey)
		} else {
			errc <- s.http.Serve(ln)
		}
	}()
	select {
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.http.Shutdown(sctx)
		return nil
	case err := <-errc:
		if errors.Is(err, http.ErrServerClosed) {
			return nil
		}
		return err
	}
}

func (s *Server) routes() {
	e := s.engine
	// Authentication runs before anything reads a body: a refused client's
	// body is never read, whatever its size or pace.
	e.Use(gin.Recovery(), s.logRequests, s.auth, s.limitBody)
	e.NoRoute(func(c *gin.Context) {
		s.fail(c, fmt.Errorf("%w: no route %s %s", errNotFound, c.Request.Method, c.Request.URL.Path))
	})
	e.HandleMethodNotAllowed = true
	e.NoMethod(func(c *gin.Context) {
		c.JSON(http.StatusMethodNotAllowed, ErrorBody{Code: http.StatusMethodNotAllowed, Message: "method " + c.Request.Method + " not allowed on " + c.Request.URL.Path})
	})
	g := e.Group(BasePath)
	g.POST("/config/loadbalancer", s.createLB)
	g.GET("/config/loadbalancer/all", s.listLB)
	g.DELETE("/config/loadbalancer/externalipaddress/:ip/port/:port/protocol/:proto", s.deleteLB)
	g.DELETE("/config/loadbalancer/name/:name", s.deleteLBByName)
	g.GET(drainPath, s.drain)
	g.POST(drainPath, s.drain)
	g.DELETE(drainPath, s.drain)
	g.GET("/status/capabilities", s.capabilities)
	g.GET("/config/metrics", s.metricsState)
	g.POST("/config/metrics", s.metricsSet(true))
	g.DELETE("/config/metrics", s.metricsSet(false))
	g.GET("/metrics", s.metricsExport)
	g.GET("/config/ai/kv/inventory", s.inventory)
	g.GET(KVRelayPath, s.kvRelay)
	g.GET(DiagnosticsPath, s.diagnostics)
	g.GET(ClusterPath, s.cluster)
	g.GET("/openapi.json", func(c *gin.Context) { c.Data(http.StatusOK, "application/json", openAPIDoc) })
	g.GET("/version", func(c *gin.Context) { c.JSON(http.StatusOK, Version{Version: s.cfg.Version}) })
}

// KVRelayPath is the TensorRT-LLM drain relay stream, under BasePath: the
// node that owns an endpoint's drain re-serves the drained events there.
const KVRelayPath = "/config/ai/kv/trtllm/relay"

func (s *Server) kvRelay(c *gin.Context) {
	if s.deps.KVRelay == nil {
		s.fail(c, fmt.Errorf("%w: this node serves no KV relay", errNotFound))
		return
	}
	s.deps.KVRelay.ServeHTTP(c.Writer, c.Request)
}

func (s *Server) logRequests(c *gin.Context) {
	markServed(c.Request)
	start := time.Now()
	c.Next()
	s.deps.Logger.Debug("api", "method", c.Request.Method, "path", c.Request.URL.Path, "status", c.Writer.Status(), "dur", time.Since(start))
}

// auth enforces the bearer token on every route when one is configured.
// The comparison is constant-time so the token cannot be guessed by timing.
func (s *Server) auth(c *gin.Context) {
	if s.cfg.Token == "" {
		return
	}
	h := c.GetHeader("Authorization")
	tok, ok := strings.CutPrefix(h, "Bearer ")
	if h == "" || !ok {
		c.Header("WWW-Authenticate", `Bearer realm="loxilb"`)
		s.refuse(c, rejectUnauthorized, errUnauthorized)
		return
	}
	if subtle.ConstantTimeCompare([]byte(strings.TrimSpace(tok)), []byte(s.cfg.Token)) != 1 {
		s.refuse(c, rejectForbidden, errForbidden)
	}
}

// limitBody refuses a declared body over MaxBodyBytes before reading it,
// and caps what an undeclared (chunked) body may deliver.
func (s *Server) limitBody(c *gin.Context) {
	if c.Request.ContentLength > s.cfg.MaxBodyBytes {
		s.refuse(c, rejectBodyTooLarge, fmt.Errorf("%w: %d bytes declared, the limit is %d (--api-max-body)", errBodyTooLarge, c.Request.ContentLength, s.cfg.MaxBodyBytes))
		return
	}
	c.Request.Body = http.MaxBytesReader(c.Writer, c.Request.Body, s.cfg.MaxBodyBytes)
}

// refuse answers err, counts and logs (rate-limited) the refusal, and
// closes the connection without reading what is left of the request.
func (s *Server) refuse(c *gin.Context, reason string, err error) {
	s.m.rejected.WithLabelValues(reason).Inc()
	s.rlog.warn(reason, "api: request refused", "remote", c.Request.RemoteAddr, "path", c.Request.URL.Path, "err", err)
	stopReading(c.Writer)
	s.fail(c, err)
	c.Abort()
}

// readBody reads a request body already capped by limitBody, turning the
// cap and the read timeout into their own statuses.
func (s *Server) readBody(c *gin.Context) ([]byte, error) {
	body, err := io.ReadAll(c.Request.Body)
	if err == nil {
		return body, nil
	}
	var tooBig *http.MaxBytesError
	var ne net.Error
	switch {
	case errors.As(err, &tooBig):
		s.m.rejected.WithLabelValues(rejectBodyTooLarge).Inc()
		s.rlog.warn(rejectBodyTooLarge, "api: request refused", "remote", c.Request.RemoteAddr, "path", c.Request.URL.Path)
		stopReading(c.Writer)
		return nil, fmt.Errorf("%w: the limit is %d bytes (--api-max-body)", errBodyTooLarge, s.cfg.MaxBodyBytes)
	case errors.As(err, &ne) && ne.Timeout():
		s.m.rejected.WithLabelValues(rejectBodyTimeout).Inc()
		s.rlog.warn(rejectBodyTimeout, "api: request body too slow", "remote", c.Request.RemoteAddr, "path", c.Request.URL.Path)
		c.Header("Connection", "close")
		return nil, fmt.Errorf("%w: the body did not arrive within %v (--api-read-timeout)", errBodyTimeout, s.cfg.ReadTimeout)
	}
	return nil, fmt.Errorf("%w: read body: %v", errBadRequest, err)
}

func (s *Server) fail(c *gin.Context, err error) {
	b := errorBody(err)
	reason := b.ReasonCode
	if reason == "" {
		reason = "none"
	}
	s.m.errors.WithLabelValues(strconv.Itoa(b.Code), reason).Inc()
	if b.Code >= 500 {
		s.deps.Logger.Error("api request failed", "path", c.Request.URL.Path, "err", err)
	}
	c.JSON(b.Code, b)
}

func (s *Server) createLB(c *gin.Context) {
	body, err := s.readBody(c)
	if err != nil {
		s.fail(c, err)
		return
	}
	svc, created, err := s.deps.Rules.Create(c.Request.Context(), body)
	if err != nil {
		s.fail(c, err)
		return
	}
	out := ResultBody{Result: "Success", ServiceID: svc.ID, Created: &created}
	if r, err := lbrule.Decode(body); err == nil {
		out.Inert = lbrule.Inert(r)
	}
	c.JSON(http.StatusOK, out)
}

// InertCapabilityPrefix names the capability entries of rule fields that
// are accepted but inert: "rule_field:serviceArguments.kvWarmupSec".
const InertCapabilityPrefix = "rule_field:"

// inertCapabilities lists every accepted-but-inert rule field.
func inertCapabilities() []Capability {
	var out []Capability
	for _, f := range lbrule.InertCatalog() {
		out = append(out, Capability{Name: InertCapabilityPrefix + f.Field, ReasonCode: "inert", Reason: f.Reason})
	}
	return out
}

func (s *Server) listLB(c *gin.Context) {
	withBody := false
	if v := c.Query("body"); v != "" {
		var err error
		if withBody, err = strconv.ParseBool(v); err != nil {
			s.fail(c, fmt.Errorf("%w: body %q is not true or false", errBadRequest, v))
			return
		}
	}
	out := LBList{LBAttr: []lbrule.Rule{}}
	var bodies [][]byte
	for _, svc := range s.deps.Rules.List() {
		r := svc.Rule.Clone()
		r.ServiceID = svc.ID
		r.Status = ruleStatus(svc.Status)
		r.CreateBody = nil
		if s.deps.States != nil {
			for i := range r.Endpoints {
				r.Endpoints[i].State = s.deps.States(svc.ID, i)
			}
		}
		for i := range r.Endpoints {
			r.Endpoints[i].Draining = svc.EndpointDraining(i)
			if s.deps.KVTrust != nil {
				r.Endpoints[i].KVParity, r.Endpoints[i].KVExcluded = s.deps.KVTrust(svc.ID, i)
			}
		}
		out.LBAttr = append(out.LBAttr, *r)
		bodies = append(bodies, svc.CreateBody)
	}
	if !withBody {
		c.JSON(http.StatusOK, out)
		return
	}
	b, err := withCreateBodies(out, bodies)
	if err != nil {
		s.fail(c, err)
		return
	}
	c.Data(http.StatusOK, "application/json; charset=utf-8", b)
}

// withCreateBodies encodes list with each rule's stored create body
// spliced in verbatim as "createBody": the encoder would compact a raw
// value, and the point of reading it back is the exact bytes. A body that
// is missing or not valid JSON is left out.
func withCreateBodies(list LBList, bodies [][]byte) ([]byte, error) {
	var buf bytes.Buffer
	buf.WriteString(`{"lbAttr":[`)
	for i, r := range list.LBAttr {
		rb, err := json.Marshal(r)
		if err != nil {
			return nil, fmt.Errorf("encode rule %d: %w", r.ServiceID, err)
		}
		if i > 0 {
			buf.WriteByte(',')
		}
		if len(bodies[i]) == 0 || !json.Valid(bodies[i]) || len(rb) < 2 {
			buf.Write(rb)
			continue
		}
		buf.Write(rb[:len(rb)-1]) // the rule's object, open
		buf.WriteString(`,"createBody":`)
		buf.Write(bodies[i])
		buf.WriteByte('}')
	}
	buf.WriteString("]}")
	return buf.Bytes(), nil
}

// ruleStatus renders a rule's status for read-back.
func ruleStatus(st control.RuleStatus) *lbrule.Status {
	if st.State == "" {
		return nil
	}
	out := &lbrule.Status{State: st.State, ReasonCode: st.Reason, Reason: st.Message, Attempts: st.Attempts}
	if !st.NextRetry.IsZero() {
		out.NextRetry = st.NextRetry.UTC().Format(time.RFC3339Nano)
	}
	return out
}

func (s *Server) deleteLB(c *gin.Context) {
	k, err := ruleKey(c)
	if err != nil {
		s.fail(c, err)
		return
	}
	if err := s.deps.Rules.Delete(c.Request.Context(), k); err != nil {
		s.fail(c, err)
		return
	}
	c.JSON(http.StatusOK, ResultBody{Result: "Success", Deleted: 1})
}

func canonical(ip net.IP) string {
	if v4 := ip.To4(); v4 != nil {
		return v4.String()
	}
	return ip.String()
}

func (s *Server) deleteLBByName(c *gin.Context) {
	n, err := s.deps.Rules.DeleteByName(c.Request.Context(), c.Param("name"))
	if err != nil {
		s.fail(c, err)
		return
	}
	c.JSON(http.StatusOK, ResultBody{Result: "Success", Deleted: n})
}

func (s *Server) capabilities(c *gin.Context) {
	out := Capabilities{Capabilities: []Capability{}}
	if s.deps.Capabilities != nil {
		out.Capabilities = append(out.Capabilities, s.deps.Capabilities()...)
	}
	out.Capabilities = append(out.Capabilities, inertCapabilities()...)
	c.JSON(http.StatusOK, out)
}

func (s *Server) metricsState(c *gin.Context) {
	c.JSON(http.StatusOK, MetricsState{Enabled: s.metrics.Load()})
}

func (s *Server) metricsSet(on bool) gin.HandlerFunc {
	return func(c *gin.Context) {
		if s.deps.Settings != nil {
			v := "off"
			if on {
				v = "on"
			}
			if err := s.deps.Settings.PutSetting(SettingMetrics, []byte(v)); err != nil {
				s.fail(c, fmt.Errorf("store the metrics switch: %w", err))
				return
			}
		}
		s.metrics.Store(on)
		s.deps.Logger.Info("metrics export", "enabled", on)
		c.JSON(http.StatusOK, MetricsState{Enabled: on})
	}
}

func (s *Server) metricsExport(c *gin.Context) {
	if !s.metrics.Load() {
		s.fail(c, fmt.Errorf("%w: metrics export is disabled: POST %s/config/metrics to enable it", errUnavailable, BasePath))
		return
	}
	if s.deps.Gatherer == nil {
		s.fail(c, fmt.Errorf("%w: no metrics registry", errUnavailable))
		return
	}
	promhttp.HandlerFor(s.deps.Gatherer, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}).ServeHTTP(c.Writer, c.Request)
}

// DefaultInventoryLimit bounds an inventory reply unless ?limit= says otherwise.
const (
	DefaultInventoryLimit = 1000
	MaxInventoryLimit     = 100000
)

func (s *Server) inventory(c *gin.Context) {
	sid, err := strconv.ParseUint(c.Query("service_id"), 10, 32)
	if err != nil {
		s.fail(c, fmt.Errorf("%w: service_id is required and must be a uint32 (got %q)", errBadRequest, c.Query("service_id")))
		return
	}
	ep, err := strconv.Atoi(c.Query("ep_idx"))
	if err != nil || ep < 0 {
		s.fail(c, fmt.Errorf("%w: ep_idx is required and must be a non-negative integer (got %q)", errBadRequest, c.Query("ep_idx")))
		return
	}
	limit := DefaultInventoryLimit
	if l := c.Query("limit"); l != "" {
		if limit, err = strconv.Atoi(l); err != nil || limit < 0 || limit > MaxInventoryLimit {
			s.fail(c, fmt.Errorf("%w: limit must be within 0..%d (got %q)", errBadRequest, MaxInventoryLimit, l))
			return
		}
	}
	svc, ok := s.deps.Rules.Get(uint32(sid))
	if !ok {
		s.fail(c, fmt.Errorf("%w: no service %d", errNotFound, sid))
		return
	}
	if ep >= len(svc.Rule.Endpoints) {
		s.fail(c, fmt.Errorf("%w: service %d has %d endpoints; ep_idx %d does not exist", errNotFound, sid, len(svc.Rule.Endpoints), ep))
		return
	}
	if s.deps.KV == nil {
		s.fail(c, fmt.Errorf("%w: KV inventory is not running", errUnavailable))
		return
	}
	keys, total := s.deps.KV.Snapshot(uint32(sid), ep, limit)
	epr := svc.Rule.Endpoints[ep]
	out := Inventory{ServiceID: uint32(sid), EPIdx: ep, Endpoint: net.JoinHostPort(epr.IP, strconv.Itoa(epr.Port)),
		HashAlgo: svc.Rule.Service.KVHashAlgo, Blocks: make([]InventoryBlock, 0, len(keys)), Total: total, Limit: limit, Truncated: total > len(keys)}
	for i, k := range keys {
		out.Blocks = append(out.Blocks, InventoryBlock{BlockIdx: i, Hash: k})
	}
	if st, ok := s.deps.KV.Subscriber(uint32(sid), ep); ok {
		out.Subscriber = st
	}
	if s.deps.KVTrust != nil {
		_, out.KVExcluded = s.deps.KVTrust(uint32(sid), ep)
	}
	if s.deps.Prefill != nil {
		n, src := s.deps.Prefill.PrefillBudget(uint32(sid), ep)
		out.PrefillSlots = &PrefillSlots{Slots: n, Source: src}
	}
	if s.deps.RankLoad != nil {
		out.RankLoad = s.deps.RankLoad(uint32(sid), ep)
	}
	c.JSON(http.StatusOK, out)
}
