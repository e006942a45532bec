package proxy

import (
	"context"
	"crypto/tls"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/rawio"
)

// connSlots counts the open client connections of one listener against
// Config.MaxConnsPerListener.
type connSlots struct {
	max  int64 // 0: unlimited
	open atomic.Int64
}

// take claims a slot. Accept runs in one goroutine per listener, so the
// check and the increment cannot race with another take; releases only
// make room.
func (s *connSlots) take() bool {
	if s.max > 0 && s.open.Load() >= s.max {
		return false
	}
	s.open.Add(1)
	return true
}

// trackedConn is an accepted client connection. It returns its listener
// slot when closed, and tells the request being served when the client is
// really gone, as opposed to half-closed.
//
// net/http cancels a request's context as soon as a background read sees
// the client's end of stream. A client that shut down only its sending
// side after the request (CloseWrite) still reads the answer; treating
// that as a cancellation left it with an empty 200. So the proxy does its
// upstream work under its own context, cancelled only when the connection
// is closed or fails (a reset, a write error).
type trackedConn struct {
	net.Conn
	raw    *rawio.Conn // Conn's socket when it is plain TCP (pkg/rawio)
	slots  *connSlots
	closed atomic.Bool

	// vals is the connection's context without its cancellation: every
	// request on the connection carries the same values, so the first
	// request's serve them all.
	vals context.Context

	mu   sync.Mutex
	gone bool
	req  *reqCtx // of the request being served
}

func (c *trackedConn) Read(p []byte) (n int, err error) {
	if c.raw != nil {
		n, err = c.raw.Read(p)
	} else {
		n, err = c.Conn.Read(p)
	}
	if err != nil && err != io.EOF && !isTimeout(err) {
		c.markGone()
	}
	return n, err
}

func (c *trackedConn) Write(p []byte) (n int, err error) {
	if c.raw != nil {
		n, err = c.raw.Write(p)
	} else {
		n, err = c.Conn.Write(p)
	}
	if err != nil && !isTimeout(err) {
		c.markGone()
	}
	return n, err
}

func (c *trackedConn) Close() error {
	err := c.Conn.Close()
	if c.closed.CompareAndSwap(false, true) {
		c.slots.open.Add(-1)
		c.markGone()
	}
	return err
}

// CloseWrite lets net/http half-close before it closes a connection whose
// request body was not read (a refused body), so the client reads the
// error instead of a reset.
func (c *trackedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

func (c *trackedConn) markGone() {
	c.mu.Lock()
	c.gone = true
	req := c.req
	c.req = nil
	c.mu.Unlock()
	if req != nil {
		req.cancel()
	}
}

// watch registers the current request's context; it reports false (and
// registers nothing) if the client is already gone.
func (c *trackedConn) watch(req *reqCtx) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gone {
		return false
	}
	c.req = req
	return true
}

func (c *trackedConn) unwatch() {
	c.mu.Lock()
	c.req = nil
	c.mu.Unlock()
}

type connKey struct{}

// tlsStateKey carries the TLS state of a connection the lean server
// handed to net/http after the handshake (net/http sees no *tls.Conn).
type tlsStateKey struct{}

// connContext is the http.Server's ConnContext hook: it makes the
// trackedConn reachable from every request on the connection.
func connContext(ctx context.Context, c net.Conn) context.Context {
	if hc, ok := c.(*handoffConn); ok {
		if hc.tls != nil {
			ctx = context.WithValue(ctx, tlsStateKey{}, hc.tls)
		}
		c = hc.tc
	}
	if tc, ok := c.(*tls.Conn); ok {
		c = tc.NetConn()
	}
	if tc, ok := c.(*trackedConn); ok {
		return context.WithValue(ctx, connKey{}, tc)
	}
	return ctx
}

// requestContext returns the context upstream work runs under, or nil
// when r did not arrive on a trackedConn. It carries the request's values
// but is cancelled only when the client connection is gone (see
// trackedConn), not when the client merely half-closed. endRequest ends
// it.
func requestContext(r context.Context) (*trackedConn, *reqCtx) {
	tc, _ := r.Value(connKey{}).(*trackedConn)
	if tc == nil {
		return nil, nil
	}
	if tc.vals == nil {
		// Requests on one connection are served one after the other.
		tc.vals = context.WithoutCancel(r)
	}
	rc := &reqCtx{vals: tc.vals}
	if !tc.watch(rc) {
		rc.cancel()
	}
	return tc, rc
}

// endRequest detaches rc from the connection and cancels it, so work
// derived from it stops with the request.
func endRequest(tc *trackedConn, rc *reqCtx) {
	tc.unwatch()
	rc.cancel()
}

// bodyBudget bounds the bytes all request body buffers hold together
// (Config.MaxInflightBodyBytes).
type bodyBudget struct {
	max  int64 // 0: unlimited
	used atomic.Int64
}

func (b *bodyBudget) reserve(n int64) bool {
	if b.max <= 0 {
		return true
	}
	if b.used.Add(n) > b.max {
		b.used.Add(-n)
		return false
	}
	return true
}

func (b *bodyBudget) release(n int64) {
	if b.max > 0 && n != 0 {
		b.used.Add(-n)
	}
}

// rareLog logs a condition a peer can repeat at will at most once per
// interval per reason, with the number of occurrences not logged since.
// Reasons are a fixed set of constants, so the maps stay small.
type rareLog struct {
	lg    *slog.Logger
	every time.Duration
	mu    sync.Mutex
	last  map[string]time.Time
	muted map[string]int
}

func newRareLog(lg *slog.Logger, every time.Duration) *rareLog {
	return &rareLog{lg: lg, every: every, last: map[string]time.Time{}, muted: map[string]int{}}
}

func (r *rareLog) warn(reason, msg string, args ...any) {
	now := time.Now()
	r.mu.Lock()
	if t, ok := r.last[reason]; ok && now.Sub(t) < r.every {
		r.muted[reason]++
		r.mu.Unlock()
		return
	}
	r.last[reason] = now
	muted := r.muted[reason]
	r.muted[reason] = 0
	r.mu.Unlock()
	r.lg.Warn(msg, append(args, "reason", reason, "suppressed_since_last", muted)...)
}
