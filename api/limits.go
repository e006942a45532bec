package api

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Defaults of the management server's limits; every one is a daemon flag.
const (
	DefaultReadHeaderTimeout = 5 * time.Second
	DefaultReadTimeout       = 15 * time.Second
	DefaultWriteTimeout      = 60 * time.Second
	DefaultIdleTimeout       = 60 * time.Second
	DefaultMaxBodyBytes      = 1 << 20 // lbrule.MaxBodyBytes: no valid rule is larger
	DefaultMaxConns          = 256
	maxHeaderBytes           = 64 << 10
)

// Reasons of rejected connections and requests (label of
// loxilb_api_rejected_total).
const (
	rejectUnauthorized = "unauthorized"
	rejectForbidden    = "forbidden"
	rejectBodyTooLarge = "body_too_large"
	rejectBodyTimeout  = "body_timeout"
	rejectConnLimit    = "conn_limit"
	rejectNoRequest    = "no_request"
)

type metrics struct {
	rejected *prometheus.CounterVec
	errors   *prometheus.CounterVec
	conns    prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_api_rejected_total",
			Help: "Management API connections and requests refused, by reason (unauthorized, forbidden, body_too_large, body_timeout: the body did not arrive within --api-read-timeout, conn_limit: over --api-max-conns, no_request: closed before a complete request, e.g. headers not sent within --api-read-header-timeout or malformed).",
		}, []string{"reason"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_api_errors_total",
			Help: "Management API error answers, by HTTP status and reason code (\"none\" when the error has none): 4xx are client or configuration mistakes, 5xx the daemon's own failures.",
		}, []string{"status", "reason"}),
		conns: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "loxilb_api_open_connections",
			Help: "Management API connections currently open (bounded by --api-max-conns).",
		}),
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.rejected, m.errors, m.conns} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// rateLog logs a repeatable rejection at most once per second per reason,
// with the number suppressed since, so a client cannot flood the log.
type rateLog struct {
	logger *slog.Logger
	mu     sync.Mutex
	last   map[string]time.Time
	quiet  map[string]int
}

func (r *rateLog) warn(reason, msg string, args ...any) {
	r.mu.Lock()
	now := time.Now()
	if now.Sub(r.last[reason]) < time.Second {
		r.quiet[reason]++
		r.mu.Unlock()
		return
	}
	n := r.quiet[reason]
	r.last[reason], r.quiet[reason] = now, 0
	r.mu.Unlock()
	r.logger.Warn(msg, append(args, "reason", reason, "suppressed", n)...)
}

// limitListener holds at most cap connections open; a connection over the
// cap is closed at once and counted, so slow clients cannot take every
// file descriptor the daemon (and its proxy) needs.
type limitListener struct {
	net.Listener
	sem    chan struct{}
	m      *metrics
	reject func()
}

func (l *limitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		select {
		case l.sem <- struct{}{}:
			l.m.conns.Inc()
			return &limitConn{Conn: c, release: func() { <-l.sem; l.m.conns.Dec() }}, nil
		default:
			_ = c.Close()
			l.reject()
		}
	}
}

type limitConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *limitConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}

// stopReading ends the request's body at once: the server answers and
// closes the connection without waiting for (or reading) the rest of a
// body it has refused.
func stopReading(w http.ResponseWriter) {
	w.Header().Set("Connection", "close")
	_ = http.NewResponseController(w).SetReadDeadline(time.Now())
}

// connStates counts connections that close without ever carrying a
// complete request to a handler: headers too slow (cut by
// ReadHeaderTimeout), a malformed request, or a client that connected and
// left. net/http calls a connection active from its first byte, so the
// handler marks its connection served through the connection's context.
type connStates struct {
	mu     sync.Mutex
	served map[net.Conn]*atomic.Bool
	closed func()
}

type servedKey struct{}

// connContext gives each connection the flag its handlers set.
func (c *connStates) connContext(ctx context.Context, conn net.Conn) context.Context {
	f := new(atomic.Bool)
	c.mu.Lock()
	c.served[conn] = f
	c.mu.Unlock()
	return context.WithValue(ctx, servedKey{}, f)
}

func (c *connStates) hook(conn net.Conn, st http.ConnState) {
	if st != http.StateClosed && st != http.StateHijacked {
		return
	}
	c.mu.Lock()
	f, ok := c.served[conn]
	delete(c.served, conn)
	c.mu.Unlock()
	if ok && !f.Load() && st == http.StateClosed {
		c.closed()
	}
}

// markServed records that the request's connection carried a request.
func markServed(r *http.Request) {
	if f, ok := r.Context().Value(servedKey{}).(*atomic.Bool); ok {
		f.Store(true)
	}
}
