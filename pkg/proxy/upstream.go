package proxy

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/rawio"
)

// upstream is the proxy's HTTP/1.1 client for one service: a pool of
// keep-alive connections per endpoint address.
//
// It replaces http.Transport on the hot path. Transport hands every
// request to a writer goroutine and every response back from a reader
// goroutine; for small LLM control requests those hand-offs were a large
// share of the proxy's CPU time. Here the request goroutine writes the
// request and reads the response itself, on a connection it owns until
// the body is finished. The price is that an idle pooled connection has
// no reader watching it. A connection idle for probeAfterIdle or longer
// is probed with a non-blocking peek before reuse (see alive) to drop it
// if the endpoint has closed it, which is what Transport's idle reader
// achieves; one reused sooner is not probed, and if the endpoint closed it
// anyway the request is sent again on a fresh connection (roundTrip).
type upstream struct {
	dialer      net.Dialer
	tlsConf     *tls.Config // nil for plain HTTP to endpoints
	lim         limits      // the service's time bounds (Config)
	headerLimit int64
	idleTimeout time.Duration
	maxIdle     int

	mu     sync.Mutex
	idle   map[string][]*pconn // endpoint address -> idle connections, most recent last
	closed bool

	dials  atomic.Int64 // connections opened, for tests
	probes atomic.Int64 // liveness probes run, for tests
	awaits atomic.Int64 // requests sent by flushAwait's wait, for tests
}

func newUpstream(cfg Config, tlsConf *tls.Config) *upstream {
	return &upstream{
		dialer:      net.Dialer{KeepAlive: 30 * time.Second},
		tlsConf:     tlsConf,
		lim:         limits{dial: cfg.DialTimeout, header: cfg.ResponseHeaderTimeout, idle: cfg.StreamIdleTimeout},
		headerLimit: int64(cfg.MaxResponseHeaderBytes),
		idleTimeout: cfg.UpstreamIdleTimeout,
		maxIdle:     cfg.MaxIdleConnsPerHost,
		idle:        map[string][]*pconn{},
	}
}

// pconn is one connection to an endpoint.
type pconn struct {
	u      *upstream
	addr   string
	conn   net.Conn
	raw    net.Conn    // the TCP connection under TLS, for the liveness peek
	lr     capReader   // conn, capped while response headers are read
	rio    *rawio.Conn // conn's socket when it is plain TCP (pkg/rawio; flushAwait)
	writes int         // writes to conn through bw (see flushAwait)
	// flushAwait's state, with its callback bound once.
	awaitFn  func(uintptr) bool
	flushed  bool
	flushErr error
	br       *bufio.Reader // reads lr
	bw       *bufio.Writer
	idleAt   time.Time
	reused   bool
	// unprobed: reused without the liveness probe (idle for less than
	// probeAfterIdle), so an endpoint close may have crossed the request.
	unprobed bool
	stopCanc func() bool // detaches the request context's cancellation
	watched  *reqCtx     // or this holds pc.cancel in its upstream slot
	cancelFn func()      // pc.cancel, bound once per connection
	probe    *peekProbe  // liveness probe state, built on first reuse
	// dmu orders deadline changes against the request context firing: once
	// cancelled is set the deadline stays in the past, so a later header
	// timeout or its reset cannot re-arm a read that should have stopped.
	dmu       sync.Mutex
	cancelled bool
	// rdl is the read deadline set by setReadDeadline (zero: none).
	// Only the goroutine that owns the connection reads it, so a
	// deadline that is already clear is not cleared again, and a coarse
	// one still in range is not moved (readWithin).
	rdl time.Time
}

// cancel poisons the connection's deadlines: every blocked or later read
// and write fails at once. It runs when the request context fires.
func (pc *pconn) cancel() {
	pc.dmu.Lock()
	defer pc.dmu.Unlock()
	pc.cancelled = true
	_ = pc.conn.SetDeadline(time.Unix(1, 0))
}

// setReadDeadline moves the read deadline unless the request was
// cancelled.
func (pc *pconn) setReadDeadline(t time.Time) {
	pc.dmu.Lock()
	defer pc.dmu.Unlock()
	if !pc.cancelled {
		_ = pc.conn.SetReadDeadline(t)
		pc.rdl = t
	}
}

// readWithin bounds the next reads to d from now, coarsely (deadline.go):
// a deadline per endpoint answer, or per event of a stream, was a timer
// update each.
func (pc *pconn) readWithin(d time.Duration) {
	if dl, change := coarseDeadline(pc.rdl, time.Now(), d); change {
		pc.setReadDeadline(dl)
	}
}

// ErrUpstreamHeaderTooLarge means an endpoint's response headers exceeded
// Config.MaxResponseHeaderBytes. It wraps ErrUpstreamProtocol (502).
var ErrUpstreamHeaderTooLarge = fmt.Errorf("%w: response headers too large", ErrUpstreamProtocol)

// errHeaderCap is what the capped reader returns once the header budget is
// spent; exchange turns it into ErrUpstreamHeaderTooLarge.
var errHeaderCap = errors.New("response header byte limit reached")

// capReader is the connection as the response parser sees it. While armed
// it lets through at most left more bytes, so an endpoint that never ends
// its header block (or sends interim responses forever) costs a bounded
// buffer instead of growing the parser's line until memory runs out.
type capReader struct {
	conn  io.Reader // the connection, or its raw reader
	armed bool
	left  int64
	got   int64 // bytes read in the current exchange
}

func (r *capReader) Read(p []byte) (int, error) {
	if !r.armed {
		n, err := r.conn.Read(p)
		r.got += int64(n)
		return n, err
	}
	if r.left <= 0 {
		return 0, errHeaderCap
	}
	if int64(len(p)) > r.left {
		p = p[:r.left]
	}
	n, err := r.conn.Read(p)
	r.left -= int64(n)
	r.got += int64(n)
	return n, err
}

// idleError is a body read that hit the stream idle (or first-byte)
// timeout. It unwraps to the deadline error, so it classifies as a
// timeout.
type idleError struct {
	first bool // no body byte had arrived yet
	after time.Duration
	err   error
}

func (e *idleError) Error() string {
	if e.first {
		return fmt.Sprintf("no response body byte within %v: %v", e.after, e.err)
	}
	return fmt.Sprintf("response stalled: no byte for %v: %v", e.after, e.err)
}

func (e *idleError) Unwrap() error { return e.err }

func (pc *pconn) wasCancelled() bool {
	pc.dmu.Lock()
	defer pc.dmu.Unlock()
	return pc.cancelled
}

// connectError wraps a failure to obtain a connection (dial or TLS
// handshake): the request was never sent, so another endpoint may be
// tried.
type connectError struct{ err error }

func (e *connectError) Error() string { return "connect: " + e.err.Error() }
func (e *connectError) Unwrap() error { return e.err }

// probeAfterIdle is how long a pooled connection must have been idle
// before reuse costs a liveness probe. Engines close idle keep-alive
// connections after seconds (uvicorn 5 s, Go 90 s by default), so a
// connection released moments ago is nearly always still open; probing it
// cost one recvfrom per request that always found it so. The rare close
// inside this window is caught after the fact: see emptyResponse.
const probeAfterIdle = 250 * time.Millisecond

// emptyResponse reports whether an exchange on a connection reused
// without a probe failed because the endpoint had closed the connection:
// its end-of-file or reset came before a single response byte. An endpoint
// closing a connection a moment after answering on it, while the request
// was on its way, looks exactly like this; but so does an endpoint that
// read the request and dropped the connection, which may have started it.
// So only a replayable request (see replayable) is sent again on a fresh
// connection; an inference POST gets the error (and the caller's
// retry-before-start rules), never a second run on the engine.
func (pc *pconn) emptyResponse(err error) bool {
	if !pc.unprobed || pc.lr.got > 0 || pc.wasCancelled() {
		return false
	}
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// replayable reports whether req may be sent twice: an idempotent method
// (RFC 9110 9.2.2) or a request carrying an idempotency key, as Go's
// http.Transport and HAProxy's "http-reuse safe" also decide.
func replayable(req *http.Request) bool {
	if req == nil {
		return false
	}
	switch req.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace, http.MethodPut, http.MethodDelete:
		return true
	}
	return req.Header.Get("Idempotency-Key") != "" || req.Header.Get("X-Idempotency-Key") != ""
}

// errWriteFailed marks a failure to send the request on a reused
// connection: the endpoint cannot have received a complete request, so
// the request may be sent again on a fresh connection.
var errWriteFailed = errors.New("write request")

// requestWriter writes one request to an endpoint connection; rewind
// readies it to be written again, for a resend on a fresh connection.
type requestWriter interface {
	writeRequest(bw *bufio.Writer) error
	rewind() error
}

// stdRequest writes an http.Request (the P/D flows' legs). rewind takes a
// fresh body from GetBody into a copy, so the caller's request keeps its.
type stdRequest struct{ req *http.Request }

func (s *stdRequest) writeRequest(bw *bufio.Writer) error { return s.req.Write(bw) }

func (s *stdRequest) rewind() error {
	req := s.req
	if req.Body == nil || req.Body == http.NoBody {
		return nil
	}
	if req.GetBody == nil {
		return errors.New("request body cannot be replayed")
	}
	body, err := req.GetBody()
	if err != nil {
		return err
	}
	s.req = req.WithContext(req.Context())
	s.req.Body = body
	return nil
}

// limits bound one exchange in time; a zero field means no bound.
type limits struct {
	dial   time.Duration // connect and TLS handshake
	header time.Duration // response headers, then the first body byte
	idle   time.Duration // silence between two body reads
}

// roundTrip sends req to addr and returns the response with its headers
// read. The response body must be read to EOF or closed; either returns
// the connection to the pool or closes it.
func (u *upstream) roundTrip(req *http.Request, addr string) (*http.Response, error) {
	return u.sendWithin(req.Context(), addr, &stdRequest{req: req}, req, req.Close, u.lim)
}

// send writes the request w to addr under ctx and returns the response
// with its headers read. parse is the request the response answers, as
// the response parser needs it (its method); closeAfter says the
// connection is not to be reused.
func (u *upstream) send(ctx context.Context, addr string, w requestWriter, parse *http.Request, closeAfter bool) (*http.Response, error) {
	return u.sendWithin(ctx, addr, w, parse, closeAfter, u.lim)
}

// sendWithin is send under the time bounds lim instead of the service's.
func (u *upstream) sendWithin(ctx context.Context, addr string, w requestWriter, parse *http.Request, closeAfter bool, lim limits) (*http.Response, error) {
	for try := 0; ; try++ {
		pc, err := u.get(ctx, addr, try > 0, lim.dial)
		if err != nil {
			return nil, &connectError{err: err}
		}
		resp, err := pc.exchange(ctx, w, parse, closeAfter, lim)
		if err == nil {
			return resp, nil
		}
		pc.close()
		resend := errors.Is(err, errWriteFailed) || (pc.emptyResponse(err) && replayable(parse))
		if !resend || !pc.reused || try > 0 || ctx.Err() != nil {
			return nil, err
		}
		if w.rewind() != nil {
			return nil, err
		}
	}
}

// get returns a live idle connection or dials a new one within dial.
func (u *upstream) get(ctx context.Context, addr string, fresh bool, dial time.Duration) (*pconn, error) {
	if !fresh {
		for {
			pc := u.popIdle(addr)
			if pc == nil {
				break
			}
			idle := time.Since(pc.idleAt)
			if idle >= u.idleTimeout {
				_ = pc.conn.Close()
				continue
			}
			pc.unprobed = idle < probeAfterIdle
			if !pc.unprobed && !pc.rdl.IsZero() {
				// An expired deadline would fail the liveness probe.
				pc.setReadDeadline(time.Time{})
			}
			if pc.unprobed && pc.br.Buffered() == 0 || pc.alive() {
				pc.reused = true
				return pc, nil
			}
			_ = pc.conn.Close()
		}
	}
	return u.dial(ctx, addr, dial)
}

func (u *upstream) popIdle(addr string) *pconn {
	u.mu.Lock()
	defer u.mu.Unlock()
	l := u.idle[addr]
	if len(l) == 0 {
		return nil
	}
	pc := l[len(l)-1]
	l[len(l)-1] = nil
	u.idle[addr] = l[:len(l)-1]
	return pc
}

func (u *upstream) dial(ctx context.Context, addr string, timeout time.Duration) (*pconn, error) {
	dialer := u.dialer
	dialer.Timeout = timeout
	raw, err := dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	u.dials.Add(1)
	conn := raw
	if u.tlsConf != nil {
		tc := u.tlsConf
		if tc.ServerName == "" {
			tc = tc.Clone()
			host, _, splitErr := net.SplitHostPort(addr)
			if splitErr != nil {
				host = addr
			}
			tc.ServerName = host
		}
		tlsConn := tls.Client(raw, tc)
		hctx, cancel := ctx, context.CancelFunc(func() {})
		if timeout > 0 {
			hctx, cancel = context.WithTimeout(ctx, timeout)
		}
		err := tlsConn.HandshakeContext(hctx)
		cancel()
		if err != nil {
			_ = raw.Close()
			return nil, err
		}
		conn = tlsConn
	}
	return u.newPconn(addr, conn, raw), nil
}

// newPconn wraps an established connection (raw is the TCP connection
// under TLS, or conn itself).
func (u *upstream) newPconn(addr string, conn, raw net.Conn) *pconn {
	pc := &pconn{
		u:    u,
		addr: addr,
		conn: conn,
		raw:  raw,
	}
	pc.rio = rawio.New(conn)
	pc.lr.conn = conn
	if pc.rio != nil {
		pc.lr.conn = pc.rio
	}
	pc.bw = bufio.NewWriterSize(pcWriter{pc}, 32<<10)
	pc.br = bufio.NewReaderSize(&pc.lr, 32<<10)
	return pc
}

// pcWriter is the connection under pc.bw: it counts the writes, so
// flushAwait knows whether a request went out in parts.
type pcWriter struct{ pc *pconn }

func (w pcWriter) Write(p []byte) (int, error) {
	w.pc.writes++
	if w.pc.rio != nil {
		return w.pc.rio.Write(p)
	}
	return w.pc.conn.Write(p)
}

// flushAwait sends the buffered request and returns once the connection
// is readable (or its wait failed: the read that follows reports why).
//
// A plain read right after the request finds nothing nearly every time:
// the endpoint has not answered yet, so the read fails, the goroutine
// parks, and a second read takes the answer. Go's poller forgets an
// earlier readiness when a wait begins, which is why a read always comes
// first. Here the wait begins before the request is written (the write
// happens inside it), so the endpoint's answer, or the reset of a
// connection it closed, is an edge the wait cannot miss; the endpoint
// sends nothing unasked on a connection the pool hands out (bytes left
// over in the buffer are refused at reuse), so nothing earlier can be
// lost. One system call per request less. TLS connections and anything
// but TCP use the plain flush.
//
// Only a request that is still whole in the buffer is sent this way: if
// part of it already went out, the endpoint may have answered early (a
// refusal before the body's end), and that edge would be forgotten.
func (pc *pconn) flushAwait(whole bool) error {
	if pc.rio == nil || !whole || pc.br.Buffered() > 0 {
		return pc.bw.Flush()
	}
	if pc.awaitFn == nil {
		pc.awaitFn = pc.awaitStep // bound once: a closure per request would allocate
	}
	pc.flushed, pc.flushErr = false, nil
	pc.u.awaits.Add(1)
	_ = pc.rio.RawConn().Read(pc.awaitFn)
	if !pc.flushed {
		// The wait could not begin (closed, or the deadline poisoned):
		// send the request the plain way, which reports it.
		return pc.bw.Flush()
	}
	err := pc.flushErr
	pc.flushErr = nil
	return err
}

// awaitStep is flushAwait's callback: the first call sends the request and
// asks for a wait, the next one (the connection is readable) ends it.
func (pc *pconn) awaitStep(uintptr) bool {
	if pc.flushed {
		return true
	}
	pc.flushed = true
	pc.flushErr = pc.bw.Flush()
	return pc.flushErr != nil
}

// exchange writes the request and reads the response headers. The
// request context's cancellation is wired to the connection's deadline
// until the body is done, so a client that goes away unblocks any read or
// write.
func (pc *pconn) exchange(ctx context.Context, w requestWriter, req *http.Request, closeAfter bool, lim limits) (*http.Response, error) {
	pc.lr.got = 0
	if pc.cancelFn == nil {
		pc.cancelFn = pc.cancel
	}
	pc.watch(ctx)
	w0 := pc.writes
	if err := w.writeRequest(pc.bw); err != nil {
		return nil, fmt.Errorf("%w: %w", errWriteFailed, err)
	}
	switch {
	case lim.header > 0:
		// Before the flush: flushAwait waits for the answer in it.
		pc.readWithin(lim.header)
	case !pc.rdl.IsZero():
		pc.setReadDeadline(time.Time{}) // left by the previous exchange
	}
	if err := pc.flushAwait(pc.writes == w0); err != nil {
		return nil, fmt.Errorf("%w: %w", errWriteFailed, err)
	}
	var (
		resp  *http.Response
		body  *bodyReader
		fixed bool // a fixedBody over pc.br
	)
	if pc.u.headerLimit > 0 {
		pc.lr.armed, pc.lr.left = true, pc.u.headerLimit
	}
	for {
		if _, err := pc.br.Peek(1); err != nil {
			if pc.lr.armed && pc.lr.left <= 0 {
				return nil, fmt.Errorf("%w: endpoint sent more than %d bytes without ending its headers", ErrUpstreamHeaderTooLarge, pc.u.headerLimit)
			}
			if err == io.EOF {
				err = io.ErrUnexpectedEOF // as http.ReadResponse says
			}
			return nil, err
		}
		if ur := readResponseFast(pc.br, req); ur != nil {
			resp, body = &ur.resp, &ur.body
			fixed = true
			break
		}
		r, err := http.ReadResponse(pc.br, req)
		if err != nil {
			if pc.lr.armed && pc.lr.left <= 0 {
				return nil, fmt.Errorf("%w: endpoint sent more than %d bytes without ending its headers", ErrUpstreamHeaderTooLarge, pc.u.headerLimit)
			}
			return nil, err
		}
		if r.StatusCode < 100 {
			// "000" parses; relayed, it would make WriteHeader panic.
			return nil, fmt.Errorf("%w: endpoint sent status %03d", ErrUpstreamProtocol, r.StatusCode)
		}
		// Interim responses (100 Continue, 103 Early Hints) are not
		// relayed; the final one follows on the same connection.
		if r.StatusCode >= 100 && r.StatusCode < 200 && r.StatusCode != http.StatusSwitchingProtocols {
			continue
		}
		resp, body = r, &bodyReader{}
		break
	}
	pc.lr.armed = false
	// The header deadline stays until the body's first read, which sets
	// its own bound if it has to wait (bodyReader.Read).
	if resp.StatusCode == http.StatusSwitchingProtocols {
		return nil, errors.New("endpoint switched protocols, which the proxy does not relay")
	}
	*body = bodyReader{rc: resp.Body, pc: pc, reusable: !resp.Close && !closeAfter, first: lim.header, idle: lim.idle, fixed: fixed}
	resp.Body = body
	return resp, nil
}

// release puts the connection back into the pool, unless the request
// context fired (its deadline is poisoned) or the pool is full.
func (pc *pconn) release() {
	if !pc.unwatch() {
		_ = pc.conn.Close()
		return
	}
	// A read deadline left armed is cleared only when the connection is
	// reused (get, exchange): the next exchange usually replaces it.
	u := pc.u
	u.mu.Lock()
	if u.closed || len(u.idle[pc.addr]) >= u.maxIdle {
		u.mu.Unlock()
		_ = pc.conn.Close()
		return
	}
	pc.idleAt = time.Now()
	l := append(u.idle[pc.addr], pc)
	// The oldest connections sit at the front; drop the expired ones
	// here so an endpoint that went quiet does not keep sockets forever
	// without a background reaper.
	var stale []*pconn
	for len(l) > 0 && pc.idleAt.Sub(l[0].idleAt) >= u.idleTimeout {
		stale = append(stale, l[0])
		l[0] = nil
		l = l[1:]
	}
	u.idle[pc.addr] = l
	u.mu.Unlock()
	for _, s := range stale {
		_ = s.conn.Close()
	}
}

func (pc *pconn) close() {
	pc.unwatch()
	_ = pc.conn.Close()
}

// watch wires the request context's cancellation to pc.cancel: through
// the proxy's own request context's slot when it is one (no allocation),
// otherwise with context.AfterFunc.
func (pc *pconn) watch(ctx context.Context) {
	if rc, ok := ctx.(*reqCtx); ok && rc.watchUpstream(pc.cancelFn) {
		pc.watched = rc
		return
	}
	pc.stopCanc = context.AfterFunc(ctx, pc.cancelFn)
}

// unwatch undoes watch. It reports false if the cancellation already
// fired: the connection's deadlines are poisoned and it must not be
// reused.
func (pc *pconn) unwatch() bool {
	ok := true
	if rc := pc.watched; rc != nil {
		pc.watched = nil
		ok = rc.unwatchUpstream()
	}
	if stop := pc.stopCanc; stop != nil {
		pc.stopCanc = nil
		ok = stop()
	}
	return ok
}

// closeIdle closes every pooled connection; with final set, connections
// returned later are closed instead of pooled.
func (u *upstream) closeIdle(final bool) {
	u.mu.Lock()
	idle := u.idle
	u.idle = map[string][]*pconn{}
	if final {
		u.closed = true
	}
	u.mu.Unlock()
	for _, l := range idle {
		for _, pc := range l {
			_ = pc.conn.Close()
		}
	}
}

// bodyReader returns the connection to the pool once the body was read
// to its end, and closes it if the body is abandoned or broken.
//
// Every read is bounded: until the first body byte by the response header
// timeout (an SSE stream's headers come at once, its first event only
// after prefill), afterwards by the stream idle timeout, so an endpoint
// that stalls mid-stream cannot hold the client and the connection
// forever.
type bodyReader struct {
	rc       io.ReadCloser
	pc       *pconn
	reusable bool
	// first and idle are the exchange's header and idle bounds.
	first, idle time.Duration
	done        bool
	started     bool // a body byte arrived
	// fixed: rc is a fixedBody over the connection's buffer, which
	// answers from the buffer without touching the socket while it
	// holds bytes: such a read cannot wait, so it needs no deadline.
	fixed bool
}

func (b *bodyReader) Read(p []byte) (int, error) {
	if b.done {
		return 0, io.EOF
	}
	wait := b.idle
	if !b.started {
		wait = b.first
	}
	switch {
	case b.fixed && b.pc.br.Buffered() > 0:
	case wait > 0:
		b.pc.readWithin(wait)
	case !b.pc.rdl.IsZero():
		b.pc.setReadDeadline(time.Time{}) // unbounded: no earlier bound may linger
	}
	n, err := b.rc.Read(p)
	if n > 0 {
		b.started = true
	}
	if err != nil && err != io.EOF && wait > 0 && isTimeout(err) && !b.pc.wasCancelled() {
		err = &idleError{first: !b.started, after: wait, err: err}
	}
	switch {
	case err == io.EOF:
		b.finish(b.reusable)
	case err != nil:
		b.finish(false)
	}
	return n, err
}

func (b *bodyReader) Close() error {
	if !b.done {
		b.finish(false)
	}
	return nil
}

func (b *bodyReader) finish(reuse bool) {
	b.done = true
	if reuse {
		b.pc.release()
	} else {
		b.pc.close()
	}
}
