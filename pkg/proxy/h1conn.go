package proxy

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"sync"
	"time"
)

// The lean HTTP/1.1 server: one goroutine per client connection parses
// each request head in the connection's read buffer (h1parse.go), serves
// it through the same exchange as net/http's handler, and writes the
// answer straight into the connection's write buffer (h1writer.go).
// Forms it does not serve go, with the bytes already read, to net/http's
// server (handoff); heads that could smuggle are refused here.

const h1BufSize = 4096

var (
	h1ReaderPool = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, h1BufSize) }}
	h1WriterPool = sync.Pool{New: func() any { return bufio.NewWriterSize(nil, h1BufSize) }}
)

// watchDelay is how long a request runs before a read on its client
// connection watches for the client going away (a reset cancels the
// request's upstream work). Most requests end before it, so they cost no
// extra read and no extra goroutine. A watch costs a goroutine, a read
// that finds nothing, a wakeup and two deadline changes to stop it: under
// load, when queueing alone makes small requests last tens of
// milliseconds (256 keep-alive connections on two cores), a 5 ms delay
// put that on nearly every request, and the extra work lengthened the
// queue further. A tenth of a second is a few decode steps of an engine,
// which is all a departed client can still cost it.
const watchDelay = 100 * time.Millisecond

// rstAvoidanceDelay bounds how long a connection closed with an unread
// request body waits, after shutting down its sending side, for the client
// to read the answer (as net/http does).
const rstAvoidanceDelay = 500 * time.Millisecond

var aLongTimeAgo = time.Unix(1, 0)

// h1Conn is one client connection served by the lean server.
type h1Conn struct {
	s      *Server
	rwc    net.Conn // the accepted connection, or its TLS wrapper
	tc     *trackedConn
	br     *bufio.Reader
	bw     *bufio.Writer
	vals   context.Context
	local  net.Addr
	remote string
	tls    *tls.ConnectionState

	hd   h1Head
	body h1Body
	w    h1Writer
	hreq http.Request
	url  url.URL

	closing bool // close after this response

	// rdl is the read deadline in force on rwc (zero: none). Between a
	// request's head and its answer it is left as it was (see readHead):
	// every read of that time sets its own (readBody) or clears it
	// (watch).
	rdl time.Time

	// mu guards idle and shut against the server's shutdown.
	mu   sync.Mutex
	idle bool // waiting for a request head
	shut bool // closed by the shutdown

	// The client watcher: see watchDelay and arm.
	wmu      sync.Mutex
	wstate   int // wIdle, wArmed, wRunning
	wtimer   *time.Timer
	wpending bool      // wtimer is scheduled
	warmedAt time.Time // when the request being served armed the watch
	wwg      sync.WaitGroup
	eof      bool // the client half-closed (seen by the watcher)
}

const (
	wIdle = iota
	wArmed
	wRunning
)

// h1State tracks the lean server's listeners and connections for
// shutdown.
type h1State struct {
	mu      sync.Mutex
	closing bool
	lns     map[net.Listener]struct{}
	conns   map[*h1Conn]struct{}
	wg      sync.WaitGroup
}

// acceptLoop serves ln with the lean server until ln is closed. quiet
// reports whether an accept error is expected (the listener was removed
// on purpose).
func (s *Server) acceptLoop(ln *demuxListener, quiet func() bool) error {
	s.startHandoff()
	h := &s.h1
	h.mu.Lock()
	if h.closing {
		h.mu.Unlock()
		_ = ln.Close()
		return nil
	}
	h.lns[ln] = struct{}{}
	h.mu.Unlock()
	defer func() {
		h.mu.Lock()
		delete(h.lns, ln)
		h.mu.Unlock()
	}()
	var delay time.Duration
	for {
		c, err := ln.Accept()
		if err != nil {
			h.mu.Lock()
			closing := h.closing
			h.mu.Unlock()
			if closing || quiet() {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() || isTemporary(err) {
				delay = min(max(2*delay, 5*time.Millisecond), time.Second)
				s.logger.Debug("proxy: accept error, retrying", "err", err, "delay", delay)
				time.Sleep(delay)
				continue
			}
			return err
		}
		delay = 0
		s.startConn(c)
	}
}

func isTemporary(err error) bool {
	t, ok := err.(interface{ Temporary() bool })
	return ok && t.Temporary()
}

func (s *Server) startConn(c net.Conn) {
	raw := c
	if t, ok := c.(*tls.Conn); ok {
		raw = t.NetConn()
	}
	tc, _ := raw.(*trackedConn)
	hc := &h1Conn{s: s, rwc: c, tc: tc, local: c.LocalAddr(), remote: c.RemoteAddr().String()}
	h := &s.h1
	h.mu.Lock()
	if h.closing {
		h.mu.Unlock()
		_ = c.Close()
		return
	}
	h.conns[hc] = struct{}{}
	h.wg.Add(1)
	h.mu.Unlock()
	go hc.serve()
}

func (c *h1Conn) serve() {
	s := c.s
	handedOff := false
	defer func() {
		if c.wtimer != nil {
			c.wtimer.Stop()
		}
		if !handedOff {
			_ = c.rwc.Close()
		}
		c.releaseBuffers()
		s.h1.mu.Lock()
		delete(s.h1.conns, c)
		s.h1.mu.Unlock()
		s.h1.wg.Done()
	}()
	rht := s.readHeaderTimeout
	if t, ok := c.rwc.(*tls.Conn); ok {
		if rht > 0 {
			dl := time.Now().Add(rht)
			_ = c.setReadDeadline(dl)
			_ = c.rwc.SetWriteDeadline(dl)
		}
		if err := t.HandshakeContext(context.Background()); err != nil {
			var re tls.RecordHeaderError
			if errors.As(err, &re) && re.Conn != nil && looksLikeHTTP(re.RecordHeader) {
				_, _ = io.WriteString(re.Conn, "HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n")
			}
			s.logger.Debug("proxy: TLS handshake failed", "remote", c.remote, "err", err)
			return
		}
		_ = c.rwc.SetWriteDeadline(time.Time{})
		st := t.ConnectionState()
		c.tls = &st
		if p := st.NegotiatedProtocol; p != "" && p != "http/1.1" {
			c.br = h1ReaderPool.Get().(*bufio.Reader)
			c.br.Reset(c.rwc)
			handedOff = c.handoff(fallbackProtocol)
			return
		}
	}
	c.vals = context.WithValue(context.WithValue(context.Background(),
		http.LocalAddrContextKey, c.local), connKey{}, c.tc)
	c.br = h1ReaderPool.Get().(*bufio.Reader)
	c.br.Reset(c.rwc)
	for first := true; ; first = false {
		v, ok := c.readHead(first)
		if !ok {
			return
		}
		switch v {
		case h1Fallback:
			handedOff = c.handoff(c.hd.reason)
			return
		case h1Reject:
			c.reject()
			return
		}
		if !c.serveRequest() {
			return // cut
		}
		if c.closing || c.eof {
			c.closeGracefully()
			return
		}
	}
}

// setReadDeadline sets rwc's read deadline and remembers it.
func (c *h1Conn) setReadDeadline(t time.Time) error {
	c.rdl = t
	return c.rwc.SetReadDeadline(t)
}

// readWithin bounds the next reads to d from now, coarsely (deadline.go).
func (c *h1Conn) readWithin(d time.Duration) {
	if dl, change := coarseDeadline(c.rdl, time.Now(), d); change {
		_ = c.setReadDeadline(dl)
	}
}

// takeWriter gives the connection a write buffer for an answer. Between
// answers it holds none (giveWriter): at 256 keep-alive connections their
// own buffers were 256 pages each touched at its start per answer, where
// pooled ones are the few in cache.
func (c *h1Conn) takeWriter() {
	if c.bw == nil {
		c.bw = h1WriterPool.Get().(*bufio.Writer)
		c.bw.Reset(c.rwc)
	}
}

// giveWriter returns the flushed write buffer to the pool.
func (c *h1Conn) giveWriter() {
	if c.bw != nil && c.bw.Buffered() == 0 {
		c.bw.Reset(nil)
		h1WriterPool.Put(c.bw)
		c.bw = nil
	}
}

func (c *h1Conn) releaseBuffers() {
	if c.br != nil {
		c.br.Reset(nil)
		h1ReaderPool.Put(c.br)
		c.br = nil
	}
	if c.bw != nil {
		c.bw.Reset(nil)
		h1WriterPool.Put(c.bw)
		c.bw = nil
	}
}

// setIdle marks the connection as waiting for a request (the shutdown
// closes such connections) or not; it reports false if the shutdown
// already closed it.
func (c *h1Conn) setIdle(idle bool) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.shut {
		return false
	}
	c.idle = idle
	return true
}

// readHead reads until a complete head is buffered and parses it. ok is
// false when the connection is to be closed without an answer (the
// client closed it, or sent nothing in time), as net/http does.
func (c *h1Conn) readHead(first bool) (h1Verdict, bool) {
	s := c.s
	rht := s.readHeaderTimeout
	rearm := false
	if c.br.Buffered() == 0 {
		if !c.setIdle(true) {
			return 0, false
		}
		if s.dr.draining.Load() {
			return 0, false
		}
		wait := s.idleTimeout
		if first || wait == 0 {
			wait = rht
		}
		if wait > 0 {
			c.readWithin(wait)
		} else if !c.rdl.IsZero() {
			_ = c.setReadDeadline(time.Time{})
		}
		_, err := c.br.Peek(1)
		if !c.setIdle(false) || err != nil {
			return 0, false
		}
		// The header deadline replaces the idle one only if the head
		// needs another read: most arrive whole in the first, and a
		// deadline change is a timer update under the poller's lock.
		rearm = !first && rht > 0
	} else if rht > 0 {
		c.readWithin(rht)
	}
	for {
		buf, _ := c.br.Peek(c.br.Buffered())
		n := scanHead(buf)
		if n < 0 {
			c.hd.reason = fallbackLineEnd
			return h1Fallback, true
		}
		if n > 0 {
			v := parseHead(buf[:n], &c.hd)
			if v == h1OK {
				// The deadline stays: clearing it here and setting it
				// again before the next head were two timer updates
				// per request (deadline.go). Nothing reads the
				// connection before the answer without choosing its
				// own deadline (readBody, watch).
				_, _ = c.br.Discard(n)
			}
			return v, true
		}
		if c.br.Buffered() >= c.br.Size() {
			c.hd.reason = fallbackHeadSize
			return h1Fallback, true
		}
		if rearm {
			rearm = false
			_ = c.setReadDeadline(time.Now().Add(rht))
		}
		if _, err := c.br.Peek(c.br.Buffered() + 1); err != nil {
			return 0, false
		}
	}
}

// serveRequest serves the parsed head; it reports false if the connection
// was cut.
func (c *h1Conn) serveRequest() bool {
	s, hd := c.s, &c.hd
	c.takeWriter()
	c.body.reset(c, hd)
	c.w.reset(c, hd.method == http.MethodHead)
	c.url = url.URL{Path: hd.path, RawQuery: hd.query}
	if hd.header == nil {
		hd.header = http.Header{}
	}
	c.hreq = http.Request{
		Method: hd.method, URL: &c.url, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: hd.header, Body: &c.body, ContentLength: hd.contentLength, Host: hd.host,
		RemoteAddr: c.remote, RequestURI: hd.target, TLS: c.tls, Close: hd.close,
	}
	if c.body.done {
		c.hreq.Body = http.NoBody
	}
	if hd.chunked {
		c.hreq.TransferEncoding = chunkedTE
	}
	defer s.dr.begin()()
	rc := &reqCtx{vals: c.vals}
	if c.tc == nil || !c.tc.watch(rc) {
		if c.tc != nil {
			rc.cancel()
		}
	}
	_, cut := s.serveExchange(&c.w, &c.hreq, rc, c.local)
	c.disarm()
	if c.tc != nil {
		c.tc.unwatch()
	}
	rc.cancel()
	c.hreq = http.Request{}
	if cut {
		if c.w.headSent {
			_ = c.bw.Flush()
		}
		return false
	}
	c.w.finish()
	// Flushed even when a pipelined request is already buffered: that
	// one may take seconds, or be handed to net/http.
	if c.bw.Flush() != nil {
		return false
	}
	c.giveWriter()
	return true
}

var chunkedTE = []string{"chunked"}

func (c *h1Conn) writeErr() error {
	_, err := c.bw.Write(nil)
	return err
}

// arm starts the client watch: the body has been read, the client
// connection is quiet until the answer.
//
// The timer is not stopped when the request ends (disarm), nor set again
// by the next one while it is still scheduled: a timer update per arm and
// per disarm was two runtime timer-heap updates per request. When it
// fires it looks at the request armed then: none, and it stops; one armed
// less than watchDelay ago (a later request than the one it was set for),
// and it sets itself for the rest of that request's delay. So a busy
// connection costs a timer update per watchDelay, not two per request.
func (c *h1Conn) arm() {
	now := time.Now()
	c.wmu.Lock()
	c.wstate, c.warmedAt = wArmed, now
	if !c.wpending {
		c.wpending = true
		if c.wtimer == nil {
			c.wtimer = time.AfterFunc(watchDelay, c.watch)
		} else {
			c.wtimer.Reset(watchDelay)
		}
	}
	c.wmu.Unlock()
}

// watch reads the client connection while the request runs: a reset
// cancels the request (trackedConn), a half-close is remembered (and
// cancels it under AbortOnClientClose), bytes of a pipelined request stay
// buffered for later.
func (c *h1Conn) watch() {
	c.wmu.Lock()
	if c.wstate != wArmed {
		c.wpending = false
		c.wmu.Unlock()
		return
	}
	if left := watchDelay - time.Since(c.warmedAt); left > 0 {
		c.wtimer.Reset(left)
		c.wmu.Unlock()
		return
	}
	c.wpending = false
	c.wstate = wRunning
	c.wwg.Add(1)
	if !c.rdl.IsZero() {
		// The idle or header deadline left from the head (readHead)
		// would end the watch early.
		_ = c.setReadDeadline(time.Time{})
	}
	c.wmu.Unlock()
	defer c.wwg.Done()
	_, err := c.br.Peek(1)
	if err == io.EOF {
		c.eof = true
		if c.s.abortOnClose && c.tc != nil {
			c.tc.markGone()
		}
	}
	c.wmu.Lock()
	c.wstate = wIdle
	c.wmu.Unlock()
}

// disarm ends the watch, waiting for a running read to end; a scheduled
// timer stays (see arm).
func (c *h1Conn) disarm() {
	if c.wtimer == nil {
		return
	}
	c.wmu.Lock()
	running := c.wstate == wRunning
	c.wstate = wIdle
	c.wmu.Unlock()
	if running {
		_ = c.rwc.SetReadDeadline(aLongTimeAgo)
	}
	c.wwg.Wait()
	if running {
		_ = c.setReadDeadline(time.Time{})
	}
}

// reject answers a refused head the way net/http answers the ones it
// refuses, counts it and closes the connection.
func (c *h1Conn) reject() {
	hd := &c.hd
	c.s.m.connRejected.WithLabelValues(hd.reason).Inc()
	c.s.logger.Debug("proxy: request head refused", "reason", hd.reason, "status", hd.status, "remote", c.remote)
	c.takeWriter()
	bw := c.bw
	bw.WriteString("HTTP/1.1 ")
	bw.WriteString(statusLine(hd.status))
	bw.WriteString("\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n")
	bw.WriteString(statusLine(hd.status))
	bw.WriteString(": ")
	bw.WriteString(hd.reason)
	c.body.done = false // whatever follows the head is not read
	c.closeGracefully()
}

func statusLine(code int) string {
	return itoa(code) + " " + http.StatusText(code)
}

func itoa(n int) string {
	var b [8]byte
	i := len(b)
	for {
		i--
		b[i] = byte('0' + n%10)
		n /= 10
		if n == 0 {
			return string(b[i:])
		}
	}
}

// closeGracefully flushes the answer and closes the connection. If part
// of the request was left unread, it first shuts down the sending side and
// waits a moment for the client to read the answer, so closing with
// unread bytes does not reset the connection under it.
func (c *h1Conn) closeGracefully() {
	if c.bw != nil {
		_ = c.bw.Flush()
	}
	if c.body.done && c.br.Buffered() == 0 {
		return // serve's deferred Close
	}
	if cw, ok := c.rwc.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	_ = c.setReadDeadline(time.Now().Add(rstAvoidanceDelay))
	var sink [512]byte
	for {
		if _, err := c.rwc.Read(sink[:]); err != nil {
			return
		}
	}
}

// looksLikeHTTP reports whether a TLS record header is really the start
// of a plaintext HTTP request (net/http's check).
func looksLikeHTTP(hdr [5]byte) bool {
	switch string(hdr[:]) {
	case "GET /", "HEAD ", "POST ", "PUT /", "OPTIO":
		return true
	}
	return false
}

// handoff gives the connection, with the bytes already buffered, to
// net/http's server. It reports whether the connection was handed over
// (serve then must not close it).
func (c *h1Conn) handoff(reason string) bool {
	c.s.m.fallback.WithLabelValues(reason).Inc()
	var rest []byte
	if n := c.br.Buffered(); n > 0 {
		b, _ := c.br.Peek(n)
		rest = append([]byte(nil), b...)
	}
	_ = c.setReadDeadline(time.Time{})
	hc := &handoffConn{Conn: c.rwc, rest: rest, tc: c.tc, tls: c.tls}
	return c.s.handoff.push(hc)
}

// handoffConn is a connection the lean server gave to net/http: reads
// return the bytes it had buffered first.
type handoffConn struct {
	net.Conn
	rest []byte
	tc   *trackedConn
	tls  *tls.ConnectionState
}

func (h *handoffConn) Read(p []byte) (int, error) {
	if len(h.rest) > 0 {
		n := copy(p, h.rest)
		h.rest = h.rest[n:]
		return n, nil
	}
	return h.Conn.Read(p)
}

func (h *handoffConn) CloseWrite() error {
	if cw, ok := h.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// handoffListener feeds handed-over connections to net/http's server.
type handoffListener struct {
	ch   chan net.Conn
	done chan struct{}
	once sync.Once
}

func newHandoffListener() *handoffListener {
	return &handoffListener{ch: make(chan net.Conn), done: make(chan struct{})}
}

func (l *handoffListener) push(c net.Conn) bool {
	select {
	case l.ch <- c:
		return true
	case <-l.done:
		return false
	}
}

func (l *handoffListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ch:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *handoffListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *handoffListener) Addr() net.Addr { return handoffAddr{} }

type handoffAddr struct{}

func (handoffAddr) Network() string { return "handoff" }
func (handoffAddr) String() string  { return "handoff" }

// startHandoff starts net/http's server on the handoff listener, once.
func (s *Server) startHandoff() {
	s.handoffOnce.Do(func() {
		go func() {
			_ = s.srv.Serve(s.handoff)
			_ = s.handoff.Close()
		}()
	})
}

// h1Shutdown stops the lean server's listeners and closes its idle
// connections; active ones close after their current answer.
func (s *Server) h1Shutdown() {
	h := &s.h1
	h.mu.Lock()
	h.closing = true
	for ln := range h.lns {
		_ = ln.Close()
	}
	for c := range h.conns {
		c.mu.Lock()
		if c.idle {
			c.shut = true
			_ = c.rwc.Close()
		}
		c.mu.Unlock()
	}
	h.mu.Unlock()
}

// h1Wait waits until every lean connection is closed, or ctx ends.
func (s *Server) h1Wait(ctx context.Context) error {
	done := make(chan struct{})
	go func() { s.h1.wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// h1Close closes every lean listener and connection at once.
func (s *Server) h1Close() {
	s.h1Shutdown()
	h := &s.h1
	h.mu.Lock()
	for c := range h.conns {
		_ = c.rwc.Close()
	}
	h.mu.Unlock()
	_ = s.handoff.Close()
}
