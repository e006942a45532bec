package proxy

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/rawio"
	"github.com/prometheus/client_golang/prometheus"
)

// Server is the mode-4 proxy: it accepts client connections on every
// rule's VIP:port, asks the Picker where each request goes and relays it.
// All methods are safe for concurrent use.
//
// A Server runs once, like http.Server: when the context given to Serve
// or ServeListener ends, or Close is called, every listener and
// connection is shut down and the Server cannot serve again.
type Server struct {
	logger *slog.Logger
	picker Picker
	m      *metrics
	srv    *http.Server
	table  atomic.Pointer[table]
	// budget and maxConns are fixed at New: they protect the process,
	// not one rule.
	budget       bodyBudget
	maxConns     int
	abortOnClose bool
	listenCfg    net.ListenConfig // SO_REUSEPORT when Config.ReusePort
	rare         *rareLog
	dr           drainState

	// The lean HTTP/1.1 server (h1conn.go) serves the listeners; srv,
	// net/http's server, gets only the connections it hands over.
	h1                             h1State
	handoff                        *handoffListener
	handoffOnce                    sync.Once
	readHeaderTimeout, idleTimeout time.Duration

	// inflight counts requests being relayed per (service, endpoint
	// index); the daemon shares it with the router (InFlightTable).
	inflight *InFlightTable

	mu       sync.Mutex // guards everything below and serializes Update
	owned    map[netip.AddrPort]*ownedListener
	serving  bool // Serve is managing owned listeners
	shutdown bool
	errc     chan error // a listener failed unexpectedly
	done     chan struct{}
	// listening is closed once Serve manages the listeners: rules
	// given to Update from then on get theirs at once.
	listening chan struct{}
}

// table is an immutable snapshot of the configuration. Requests load it
// once through an atomic pointer, so Update never blocks or tears a
// request's view.
type table struct {
	cfg    Config
	byAddr map[netip.AddrPort]*service
	byPort map[uint16]*service // rules listening on an unspecified address
	list   []*service
}

// service is one rule plus the resources built from it.
type service struct {
	cfg       Service
	label     string // metric label, the decimal ID
	mx        *svcMetrics
	scheme    string // to the endpoint: http or https
	up        *upstream
	serverTLS *tls.Config
	// transportKey identifies everything the transport was built from, so
	// Update can keep the pooled connections when nothing relevant changed.
	transportKey string
}

type ownedListener struct {
	ln      net.Listener
	removed atomic.Bool
}

// New validates cfg, loads certificates and builds one pooled transport
// per service. picker and inflight (where the Server counts the requests
// it relays, shared with the picker's load blend) are required; logger
// and reg may be nil (no logs, metrics not registered). Listeners are
// opened by Serve.
func New(cfg Config, picker Picker, inflight *InFlightTable, logger *slog.Logger, reg prometheus.Registerer) (*Server, error) {
	if picker == nil {
		return nil, errors.New("proxy: picker is nil")
	}
	if inflight == nil {
		return nil, errors.New("proxy: in-flight table is nil")
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("proxy config: %w", err)
	}
	m, err := newMetrics(reg)
	if err != nil {
		return nil, err
	}
	t, err := buildTable(cfg, nil, m)
	if err != nil {
		return nil, fmt.Errorf("proxy config: %w", err)
	}
	s := &Server{
		logger:    logger,
		picker:    picker,
		inflight:  inflight,
		m:         m,
		owned:     map[netip.AddrPort]*ownedListener{},
		errc:      make(chan error, 1),
		done:      make(chan struct{}),
		listening: make(chan struct{}),
		budget:    bodyBudget{max: cfg.MaxInflightBodyBytes},
		rare:      newRareLog(logger, 10*time.Second),
		handoff:   newHandoffListener(),
		h1: h1State{
			lns:   map[net.Listener]struct{}{},
			conns: map[*h1Conn]struct{}{},
		},
		readHeaderTimeout: cfg.ReadHeaderTimeout,
		idleTimeout:       cfg.IdleTimeout,
	}
	s.maxConns, s.abortOnClose = cfg.MaxConnsPerListener, cfg.AbortOnClientClose
	if cfg.ReusePort {
		s.listenCfg.Control = reusePort
	}
	if err := s.dr.init(reg); err != nil {
		return nil, fmt.Errorf("register proxy metrics: %w", err)
	}
	if reg != nil {
		held := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "loxilb_proxy_body_bytes_inflight",
			Help: "Bytes the request body buffers of all requests in flight hold, against MaxInflightBodyBytes.",
		}, func() float64 { return float64(s.budget.used.Load()) })
		if err := reg.Register(held); err != nil {
			return nil, fmt.Errorf("register proxy metrics: %w", err)
		}
	}
	var protos http.Protocols
	protos.SetHTTP1(true)
	s.srv = &http.Server{
		Handler:           s,
		ReadHeaderTimeout: cfg.ReadHeaderTimeout,
		IdleTimeout:       cfg.IdleTimeout,
		MaxHeaderBytes:    1 << 20,
		Protocols:         &protos,
		ConnContext:       connContext,
		// Client-side noise (TLS handshakes from scanners, resets) is
		// debug material, not an operator alert.
		ErrorLog: slog.NewLogLogger(logger.Handler(), slog.LevelDebug),
	}
	s.table.Store(t)
	return s, nil
}

func buildTable(cfg Config, old *table, m *metrics) (*table, error) {
	t := &table{
		cfg:    cfg,
		byAddr: make(map[netip.AddrPort]*service, len(cfg.Services)),
		byPort: map[uint16]*service{},
	}
	var errs []error
	for _, sc := range cfg.Services {
		svc, err := buildService(cfg, sc, old, m)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		t.list = append(t.list, svc)
		ap := normAddrPort(sc.Listen)
		if ap.Addr().IsUnspecified() {
			t.byPort[ap.Port()] = svc
		} else {
			t.byAddr[ap] = svc
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return t, nil
}

func buildService(cfg Config, sc Service, old *table, m *metrics) (*service, error) {
	svc := &service{cfg: sc, label: strconv.FormatUint(uint64(sc.ID), 10), scheme: "http"}
	svc.mx = m.forService(svc.label)
	if sc.Security != SecurityPlain {
		tc, err := sc.serverTLS(func(reason string) { m.connRejected.WithLabelValues(reason).Inc() })
		if err != nil {
			return nil, err
		}
		svc.serverTLS = tc
	}
	var upTLS *tls.Config
	var ca []byte
	if sc.Security == SecurityE2ETLS {
		svc.scheme = "https"
		tc, err := sc.upstreamTLS()
		if err != nil {
			return nil, err
		}
		upTLS = tc
		if sc.CAFile != "" {
			ca, _ = os.ReadFile(sc.CAFile) // already read successfully by upstreamTLS
		}
	}
	svc.transportKey = fmt.Sprintf("%d|%s|%s|%s|%s|%t|%x|%v|%v|%v|%d",
		sc.Security, sc.CAFile, sc.ClientCertFile, sc.ClientKeyFile, sc.UpstreamServerName,
		sc.InsecureSkipVerify, ca, cfg.DialTimeout, cfg.ResponseHeaderTimeout,
		cfg.UpstreamIdleTimeout, cfg.MaxIdleConnsPerHost)
	if old != nil {
		for _, o := range old.list {
			if o.cfg.ID == sc.ID && o.transportKey == svc.transportKey {
				svc.up = o.up
				return svc, nil
			}
		}
	}
	svc.up = newUpstream(cfg, upTLS)
	return svc, nil
}

// Update swaps in a new configuration without dropping listeners or
// in-flight requests: requests already routed finish on the old
// snapshot, new requests (also on existing keep-alive connections) see
// the new one. Services whose upstream TLS and transport settings are
// unchanged keep their pooled endpoint connections. When Serve manages
// the listeners, listeners of rules that have none are opened and
// listeners of removed rules are closed. A rule whose listener cannot be
// opened (its VIP:port is held) does not hold the others back: the new
// configuration is applied, Update returns a *ListenError per such rule
// (joined), and the next Update tries its listener again.
//
// ReadHeaderTimeout, IdleTimeout, ShutdownGrace, MaxInflightBodyBytes and
// MaxConnsPerListener and AbortOnClientClose are fixed at New.
func (s *Server) Update(cfg Config) error {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return fmt.Errorf("proxy config: %w", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.shutdown {
		return errors.New("proxy: update after shutdown")
	}
	old := s.table.Load()
	if cfg.ReadHeaderTimeout != old.cfg.ReadHeaderTimeout || cfg.IdleTimeout != old.cfg.IdleTimeout {
		s.logger.Warn("proxy: read-header and idle timeouts change only at restart",
			"read_header_timeout", old.cfg.ReadHeaderTimeout, "idle_timeout", old.cfg.IdleTimeout)
	}
	nt, err := buildTable(cfg, old, s.m)
	if err != nil {
		return fmt.Errorf("proxy config: %w", err)
	}
	var added []*ownedListener
	var listenErrs error
	if s.serving {
		added, listenErrs = s.bindMissingLocked(nt)
	}
	s.table.Store(nt)
	for _, ol := range added {
		s.serveOwned(ol)
	}
	if s.serving {
		s.closeStaleLocked(nt)
	}
	keep := map[*upstream]bool{}
	ids := map[uint32]bool{}
	for _, svc := range nt.list {
		keep[svc.up] = true
		ids[svc.cfg.ID] = true
	}
	for _, o := range old.list {
		if !keep[o.up] {
			o.up.closeIdle(true)
		}
		if !ids[o.cfg.ID] {
			s.m.forget(o.label)
		}
	}
	return listenErrs
}

// Serve opens a listener on every rule's VIP:port and serves until ctx
// ends (graceful shutdown, bounded by ShutdownGrace) or Close is called.
// Rules added later by Update get listeners too. A listener that cannot
// be opened is logged and tried again at the next Update; the other rules
// are served. Loopback VIPs such as 127.0.0.10 need no privileges on Linux.
func (s *Server) Serve(ctx context.Context) error {
	s.mu.Lock()
	if s.shutdown {
		s.mu.Unlock()
		return http.ErrServerClosed
	}
	if s.serving {
		s.mu.Unlock()
		return errors.New("proxy: Serve already running")
	}
	added, err := s.bindMissingLocked(s.table.Load())
	if err != nil {
		s.logger.Warn("proxy: some rules have no listener yet", "err", err)
	}
	s.serving = true
	close(s.listening)
	for _, ol := range added {
		s.serveOwned(ol)
	}
	s.mu.Unlock()
	return s.wait(ctx)
}

// Listening is closed once Serve has opened the listeners of the rules it
// was given and opens those of later Updates itself. Load rules after it,
// so that a rule's listener failure is reported to its Update.
func (s *Server) Listening() <-chan struct{} { return s.listening }

// ServeListener serves an externally created listener, for instance the
// socket the eBPF sk_lookup program steers VIP traffic to. One listener
// may carry several rules: each connection is matched to its rule by its
// local (destination) address. Connections to an address no rule owns are
// closed and counted. ServeListener takes ownership of ln and blocks like
// Serve.
func (s *Server) ServeListener(ctx context.Context, ln net.Listener) error {
	s.mu.Lock()
	if s.shutdown {
		s.mu.Unlock()
		_ = ln.Close()
		return http.ErrServerClosed
	}
	s.mu.Unlock()
	go func() {
		if err := s.acceptLoop(s.newDemux(ln), func() bool { return false }); err != nil {
			s.fail(fmt.Errorf("serve %s: %w", ln.Addr(), err))
		}
	}()
	return s.wait(ctx)
}

// Addrs returns the addresses of the listeners Serve opened, for
// diagnostics.
func (s *Server) Addrs() []net.Addr {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]net.Addr, 0, len(s.owned))
	for _, ol := range s.owned {
		out = append(out, ol.ln.Addr())
	}
	return out
}

// Close stops every listener and closes every connection at once.
// In-flight requests are cut. Serve and ServeListener return nil.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.shutdown {
		s.mu.Unlock()
		return nil
	}
	s.shutdown = true
	close(s.done)
	s.mu.Unlock()
	s.h1Close()
	err := s.srv.Close()
	s.closeTransports()
	return err
}

func (s *Server) wait(ctx context.Context) error {
	select {
	case <-s.done:
		return nil
	case err := <-s.errc:
		s.gracefulStop()
		return err
	case <-ctx.Done():
		s.gracefulStop()
		return nil
	}
}

func (s *Server) closeTransports() {
	for _, svc := range s.table.Load().list {
		svc.up.closeIdle(true)
	}
}

func (s *Server) fail(err error) {
	select {
	case s.errc <- err:
	default:
	}
}

// bindMissingLocked opens listeners for rules of t that have none, each
// on its own: it returns the listeners it opened and a *ListenError
// (joined) for every rule whose listener could not be opened.
func (s *Server) bindMissingLocked(t *table) ([]*ownedListener, error) {
	var added []*ownedListener
	var errs []error
	for _, svc := range t.list {
		ap := normAddrPort(svc.cfg.Listen)
		if _, ok := s.owned[ap]; ok {
			continue
		}
		ln, err := s.listenCfg.Listen(context.Background(), "tcp", ap.String())
		if err != nil {
			errs = append(errs, &ListenError{ID: svc.cfg.ID, Addr: ap, Err: err})
			continue
		}
		ol := &ownedListener{ln: ln}
		s.owned[ap] = ol
		added = append(added, ol)
	}
	return added, errors.Join(errs...)
}

func (s *Server) serveOwned(ol *ownedListener) {
	s.logger.Info("proxy: listening", "addr", ol.ln.Addr().String())
	go func() {
		if err := s.acceptLoop(s.newDemux(ol.ln), ol.removed.Load); err != nil {
			s.fail(fmt.Errorf("serve %s: %w", ol.ln.Addr(), err))
		}
	}()
}

// closeStaleLocked closes listeners whose rule is gone. Connections
// already accepted on them stay open until idle; their requests get 503.
func (s *Server) closeStaleLocked(t *table) {
	for ap, ol := range s.owned {
		if t.lookupAddrPort(ap) != nil {
			continue
		}
		ol.removed.Store(true)
		_ = ol.ln.Close()
		delete(s.owned, ap)
		s.logger.Info("proxy: stopped listening", "addr", ap.String())
	}
}

func (t *table) lookupAddrPort(ap netip.AddrPort) *service {
	ap = normAddrPort(ap)
	if svc := t.byAddr[ap]; svc != nil {
		return svc
	}
	return t.byPort[ap.Port()]
}

func (t *table) lookup(a net.Addr) *service {
	ap := addrPortOf(a)
	if !ap.IsValid() {
		return nil
	}
	return t.lookupAddrPort(ap)
}

func addrPortOf(a net.Addr) netip.AddrPort {
	switch v := a.(type) {
	case *net.TCPAddr:
		return v.AddrPort()
	case nil:
		return netip.AddrPort{}
	default:
		ap, _ := netip.ParseAddrPort(a.String())
		return ap
	}
}

// demuxListener matches each accepted connection to its rule by local
// address and wraps it in TLS when the rule terminates TLS. tls.Server is
// lazy (the handshake runs on first read, in the connection's goroutine),
// so Accept never blocks on a slow client.
//
// It also enforces Config.MaxConnsPerListener: a connection beyond the cap
// is closed at once, before any byte is read, so a flood of idle
// connections costs the proxy a file descriptor for a moment rather than
// a goroutine and buffers each.
type demuxListener struct {
	net.Listener
	s     *Server
	slots connSlots
}

func (s *Server) newDemux(ln net.Listener) *demuxListener {
	return &demuxListener{Listener: ln, s: s, slots: connSlots{max: int64(s.maxConns)}}
}

func (l *demuxListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		svc := l.s.table.Load().lookup(c.LocalAddr())
		if svc == nil {
			l.s.m.connRejected.WithLabelValues("no_service").Inc()
			l.s.logger.Debug("proxy: connection to an address no rule owns", "local", c.LocalAddr().String(), "remote", c.RemoteAddr().String())
			_ = c.Close()
			continue
		}
		if !l.slots.take() {
			l.s.m.connRejected.WithLabelValues("conn_limit").Inc()
			l.s.rare.warn("conn_limit", "proxy: connection refused, listener at its connection cap",
				"listener", l.Listener.Addr().String(), "max_conns", l.slots.max, "remote", c.RemoteAddr().String())
			_ = c.Close()
			continue
		}
		tc := &trackedConn{Conn: c, raw: rawio.New(c), slots: &l.slots}
		if svc.serverTLS != nil {
			return tls.Server(tc, svc.serverTLS), nil
		}
		return tc, nil
	}
}
