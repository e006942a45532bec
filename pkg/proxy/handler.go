package proxy

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/outlier"
)

// Headers the proxy reads or writes.
const (
	// HeaderReceiptRequest asks for the routing receipt when set to "1".
	HeaderReceiptRequest = "X-Loxilb-Receipt"
	// HeaderRoute carries the routing receipt in the response.
	HeaderRoute = "X-Loxilb-Route"
)

// IsRouteHeader reports whether an upstream response header key is the
// receipt header, which is never relayed from an endpoint.
func IsRouteHeader(k string) bool { return strings.EqualFold(k, HeaderRoute) }

// hopHeaders apply to one connection only and are never relayed
// (RFC 9110 §7.6.1), plus the ones the proxy consumes itself.
var hopHeaders = []string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

var copyBufPool = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// ServeHTTP proxies one request. It is the handler of the proxy's
// http.Server and relies on the connection's local address to find the
// rule, so it is not meant to be mounted elsewhere.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	defer s.dr.begin()()
	ctx := r.Context()
	if !s.abortOnClose {
		if tc, rc := requestContext(ctx); rc != nil {
			ctx = rc
			defer endRequest(tc, rc)
		}
	}
	if r.TLS == nil {
		// A TLS connection the lean server handed over (see handoff).
		r.TLS, _ = ctx.Value(tlsStateKey{}).(*tls.ConnectionState)
	}
	wrote, cut := s.serveExchange(w, r, ctx, localAddr(r))
	if cut {
		// After a failed relay the status line is gone; the only honest
		// signal left is to cut the connection so the client sees a
		// truncated body instead of a clean end. Whatever was buffered is
		// sent first, so the cut shows after the bytes that did arrive.
		// A request that wrote nothing (its client is gone) is cut too:
		// returning would make net/http send an empty 200.
		if f, ok := w.(http.Flusher); ok && wrote {
			f.Flush()
		}
		panic(http.ErrAbortHandler)
	}
}

// serveExchange proxies one request for either server (net/http's or the
// lean one) under ctx. local is the address the client connected to. It
// reports whether a response head was written and whether the client
// connection must be cut instead of ending the response cleanly.
func (s *Server) serveExchange(w http.ResponseWriter, r *http.Request, ctx context.Context, local net.Addr) (wrote, cut bool) {
	ex := exchangePool.Get().(*exchange)
	*ex = exchange{s: s, w: w, r: r, ctx: ctx, local: local, start: time.Now(), t: s.table.Load()}
	ex.res.Endpoint = -1
	ex.run()
	ex.finish()
	wrote, cut = ex.wrote, ex.abort || !ex.wrote
	ex.recycle()
	return wrote, cut
}

// exchangePool recycles exchange structs: one escapes to the heap per
// request (the request writer inside it goes to the upstream as an
// interface), and nothing holds it once ServeHTTP returns.
var exchangePool = sync.Pool{New: func() any { return new(exchange) }}

// recycle returns the request's body budget and the exchange to its pool.
func (ex *exchange) recycle() {
	ex.s.budget.release(ex.reserved)
	*ex = exchange{}
	exchangePool.Put(ex)
}

// exchange is one request's state, so the steps can be separate methods
// without long parameter lists.
type exchange struct {
	s   *Server
	t   *table
	svc *service
	w   http.ResponseWriter
	r   *http.Request
	// ctx is what upstream work runs under: it ends when the client
	// connection is gone, not when the client only half-closed.
	ctx      context.Context
	local    net.Addr // the address the client connected to
	reserved int64    // request body bytes held against Server.budget
	start    time.Time
	req      Request // what the Picker sees; part of the pooled exchange
	plan     Plan
	res      Result
	wire     wireRequest // the request as sent to the current endpoint
	wrote    bool        // response headers were sent
	abort    bool        // cut the client connection: the relay failed mid-body
	// pendingErr is the error answer finish will send.
	pendingErr *pendingError
}

func (ex *exchange) run() {
	r := ex.r
	ex.svc = ex.t.lookup(ex.local)
	if ex.svc == nil {
		ex.s.m.connRejected.WithLabelValues("no_service").Inc()
		ex.w.Header().Set("Connection", "close")
		ex.fail(fmt.Errorf("%w: %v", ErrNoService, ex.local))
		return
	}
	if ex.svc.serverTLS != nil && r.TLS == nil {
		// A keep-alive connection accepted in plaintext before Update
		// turned TLS on for this rule must not go on carrying requests.
		ex.w.Header().Set("Connection", "close")
		ex.fail(fmt.Errorf("%w: service %d now requires TLS; reconnect", ErrUnavailable, ex.svc.cfg.ID))
		return
	}
	body, err := ex.readBody()
	ex.res.BytesIn = int64(len(body))
	if err != nil {
		// Whatever is left of the body must not be read as the next
		// request, and draining it would wait on the client.
		ex.w.Header().Set("Connection", "close")
		ex.fail(err)
		return
	}
	if lw, ok := ex.w.(*h1Writer); ok {
		lw.c.arm() // the client connection is quiet from now on
	}
	ex.req = Request{
		Service:    ex.svc.cfg.ID,
		Method:     r.Method,
		Path:       r.URL.Path,
		Model:      ModelOf(r.Header, body),
		Header:     r.Header,
		Body:       body,
		ClientAddr: remoteAddrPort(r.RemoteAddr),
	}
	req := &ex.req
	plan, err := ex.s.picker.Pick(ex.ctx, req)
	if err != nil {
		if ex.ctx.Err() != nil {
			err = fmt.Errorf("%w: %w", ErrClientCanceled, err)
		}
		ex.fail(fmt.Errorf("pick endpoint: %w", err))
		return
	}
	ex.plan = plan
	if plan.Receipt != "" && ex.svc.cfg.Receipts.wants(r.Header) {
		ex.w.Header().Set(HeaderRoute, plan.Receipt)
	}
	if plan.Dispatch != nil {
		ex.dispatch(req)
		return
	}
	if len(plan.Candidates) == 0 {
		ex.fail(fmt.Errorf("%w: the router returned no candidate endpoint", ErrUnavailable))
		return
	}
	ex.forward(body)
}

// dispatch hands the exchange to the plan's own flow (prefill/decode).
func (ex *exchange) dispatch(req *Request) {
	bytesIn := ex.res.BytesIn
	req.Legs = legTripper{s: ex.s, service: ex.svc.cfg.ID, svc: ex.svc}
	res := ex.runFlow(req)
	res.BytesIn = bytesIn
	if res.Status == 0 {
		err := res.Err
		if err == nil {
			err = fmt.Errorf("%w: dispatch wrote no response", ErrUnavailable)
		}
		ex.res.Endpoint = res.Endpoint
		ex.fail(err)
		return
	}
	ex.res = res
	ex.wrote = true
	// A flow that failed after sending a success status cannot say so in
	// the status line any more: cut the connection so the client sees a
	// truncated body, exactly as a failed single-endpoint relay does.
	ex.abort = res.Err != nil && res.Status/100 == 2 && res.Class != ClassClientCanceled
}

// forward tries the candidates in order, at most 1 + Config.MaxRetries of
// them. Only failures that prove the endpoint never started the request
// (connect refused, TLS handshake, connection broken while the request was
// written) move on to the next one: anything later may have started
// generation, and replaying a POST would run it twice.
func (ex *exchange) forward(body []byte) {
	cands := ex.plan.Candidates
	if n := 1 + max(ex.t.cfg.MaxRetries, 0); len(cands) > n {
		cands = cands[:n]
	}
	for i, ep := range cands {
		ex.res.Endpoint = ep.Idx
		ex.res.Attempts++
		retryable, err := ex.attempt(ep, body)
		if err == nil {
			return
		}
		if !retryable || i == len(cands)-1 {
			ex.fail(err)
			return
		}
		ex.svc.mx.failover.Inc()
		ex.s.logger.Debug("proxy: connect failed, trying next endpoint",
			"service", ex.svc.cfg.ID, "ep", ep.Idx, "next", cands[i+1].Idx, "err", err)
	}
}

// attempt sends the request to one endpoint and relays the answer. It
// returns an error only when nothing was sent to the client, and says
// whether the next candidate may be tried.
func (ex *exchange) attempt(ep Endpoint, body []byte) (retryable bool, err error) {
	inflight := ex.s.inflight.Counter(ex.svc.cfg.ID, ep.Idx)
	inflight.Add(1)
	defer inflight.Add(-1)

	ex.wire = wireRequest{r: ex.r, ep: ep, body: body, https: ex.r.TLS != nil}
	if ep.Body != nil {
		ex.wire.body = ep.Body
	}
	resp, err := ex.svc.up.send(ex.ctx, ep.Addr, &ex.wire, ex.r, false)
	if err != nil {
		if ex.ctx.Err() != nil {
			return false, fmt.Errorf("%w: waiting for endpoint %s: %w", ErrClientCanceled, ep.Addr, err)
		}
		wrapped, retryable := upstreamError(ep.Addr, err)
		ex.countUpstreamErr(ep, wrapped)
		ex.observe(ep, outcomeOf(wrapped))
		return retryable, wrapped
	}
	o := outlier.Success
	if resp.StatusCode >= 500 {
		o = outlier.ServerError
	}
	ex.observe(ep, o)
	return false, ex.relay(ep, resp)
}

// observe hands one attempt's outcome to the plan's passive health check.
func (ex *exchange) observe(ep Endpoint, o outlier.Outcome) {
	if f := ex.plan.Observe; f != nil && o != outlier.Ignore {
		f(ep, o)
	}
}

// countUpstreamErr counts a failed attempt by class and, when a proxy
// limit cut it, by that limit.
func (ex *exchange) countUpstreamErr(ep Endpoint, err error) {
	epl := strconv.Itoa(ep.Idx)
	ex.s.m.upstreamErrs.WithLabelValues(ex.svc.label, epl, string(classify(err).class)).Inc()
	var (
		idle *idleError
		dial *connectError
	)
	limit := ""
	switch {
	case errors.Is(err, ErrUpstreamHeaderTooLarge):
		limit = "response_header_bytes"
	case errors.As(err, &idle) && !idle.first:
		limit = "stream_idle"
	case errors.Is(err, ErrUpstreamTimeout) && !errors.As(err, &dial):
		limit = "response_header_timeout"
	default:
		return
	}
	ex.s.m.upstreamLimit.WithLabelValues(ex.svc.label, epl, limit).Inc()
	ex.s.rare.warn(limit, "proxy: endpoint response cut by a limit",
		"service", ex.svc.cfg.ID, "ep", ep.Idx, "addr", ep.Addr, "err", err)
}

// relay copies the endpoint's response to the client. SSE and
// unknown-length bodies are flushed after every write so each token event
// reaches the client as soon as the engine produced it; the usage tap sees
// the same bytes without delaying them.
//
// Other responses get their status line only with their first body byte:
// an endpoint that fails before that still lets the client have a clean
// error status. relay returns an error only in that case, when nothing
// was sent.
func (ex *exchange) relay(ep Endpoint, resp *http.Response) error {
	defer resp.Body.Close()
	streaming := isEventStream(resp.Header) || resp.ContentLength < 0
	ex.res.Streamed = streaming
	tap := usageTap{sse: isEventStream(resp.Header), limit: ex.t.cfg.UsageScanBytes}
	scan := tap.sse || isJSON(resp.Header)
	defer tap.release()

	var flusher http.Flusher
	if streaming {
		flusher, _ = ex.w.(http.Flusher)
		ex.svc.mx.streams.Inc()
		defer ex.svc.mx.streams.Dec()
		ex.commit(resp)
		if flusher != nil {
			flusher.Flush() // headers out now: the first token may be seconds away
		}
	}
	bp := copyBufPool.Get().(*[]byte)
	defer copyBufPool.Put(bp)
	buf := *bp
	var deadline time.Time
	if d := ex.svc.cfg.MaxStreamDuration; d > 0 && tap.sse {
		deadline = time.Now().Add(d)
	}
	for {
		n, rerr := resp.Body.Read(buf)
		if n > 0 {
			if !ex.wrote {
				ex.commit(resp)
			}
			if fb := ex.plan.FirstByte; fb != nil {
				ex.plan.FirstByte = nil
				fb()
			}
			if scan {
				tap.Write(buf[:n])
			}
			wn, werr := ex.w.Write(buf[:n])
			ex.res.BytesOut += int64(wn)
			if werr != nil {
				ex.res.Class = ClassClientCanceled
				ex.res.Err = fmt.Errorf("%w: write to client: %w", ErrClientCanceled, werr)
				ex.res.Status = StatusClientClosed
				return nil
			}
			if flusher != nil {
				flusher.Flush()
			}
			if !deadline.IsZero() && rerr != io.EOF && time.Now().After(deadline) {
				ex.cutStream(ep)
				return nil
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			if ex.ctx.Err() != nil {
				ex.res.Class = ClassClientCanceled
				ex.res.Err = fmt.Errorf("%w: %w", ErrClientCanceled, rerr)
				ex.res.Status = StatusClientClosed
				return nil
			}
			wrapped, _ := upstreamError(ep.Addr, rerr)
			ex.countUpstreamErr(ep, wrapped)
			if !ex.wrote {
				return fmt.Errorf("relay body: %w", wrapped)
			}
			info := classify(wrapped)
			ex.res.Class, ex.res.Err = info.class, fmt.Errorf("relay body: %w", wrapped)
			ex.abort = true
			return nil
		}
	}
	if !ex.wrote {
		ex.commit(resp) // an empty body
	}
	if len(resp.Trailer) > 0 {
		h := ex.w.Header()
		for k, vv := range resp.Trailer {
			h[http.TrailerPrefix+k] = vv
		}
	}
	if scan {
		tap.finish(&ex.res)
	}
	return nil
}

// cutStream ends an event stream that outlived the service's
// MaxStreamDuration: the client sees a truncated body, the limit is counted.
func (ex *exchange) cutStream(ep Endpoint) {
	d := ex.svc.cfg.MaxStreamDuration
	ex.res.Class = ClassTimeout
	ex.res.Err = fmt.Errorf("%w: event stream cut after max_stream_duration_sec (%v)", ErrUpstreamTimeout, d)
	ex.abort = true
	ex.s.m.upstreamLimit.WithLabelValues(ex.svc.label, strconv.Itoa(ep.Idx), "stream_duration").Inc()
	ex.s.rare.warn("stream_duration", "proxy: event stream cut at its maximum duration",
		"service", ex.svc.cfg.ID, "ep", ep.Idx, "max", d)
}

// commit sends the endpoint's status line and headers to the client.
func (ex *exchange) commit(resp *http.Response) {
	if lw, ok := ex.w.(*h1Writer); ok {
		// The lean server writes the endpoint's fields as they are,
		// minus hop-by-hop ones, without copying them.
		lw.upHdr = resp.Header
		lw.WriteHeader(resp.StatusCode)
		ex.wrote = true
		ex.res.Status = resp.StatusCode
		return
	}
	h := ex.w.Header()
	for k, vv := range resp.Header {
		if IsRouteHeader(k) {
			continue // the receipt is ours to give; an endpoint cannot forge one
		}
		h[k] = vv
	}
	removeHop(h)
	ex.w.WriteHeader(resp.StatusCode)
	ex.wrote = true
	ex.res.Status = resp.StatusCode
}

// fail records err and, if nothing was sent yet, answers with the status
// the single mapping function chooses.
func (ex *exchange) fail(err error) {
	info := classify(err)
	ex.res.Err, ex.res.Class = err, info.class
	if info.status == StatusClientClosed {
		ex.res.Status = StatusClientClosed
		return
	}
	if ex.wrote {
		return
	}
	ex.res.Status = info.status
	ex.pendingErr = &pendingError{info: info, err: err}
}

// finish writes a pending error answer, updates metrics, logs and calls
// Plan.Done exactly once.
func (ex *exchange) finish() {
	if p := ex.pendingErr; p != nil && !ex.wrote {
		writeError(ex.w, p.info, p.err)
		ex.wrote = true
	}
	ex.res.Duration = time.Since(ex.start)
	svcLabel, epLabel := "none", "none"
	m := ex.s.m
	var em *epMetrics
	if ex.svc != nil {
		svcLabel = ex.svc.label
		ex.svc.mx.duration.Observe(ex.res.Duration.Seconds())
		if ex.res.Endpoint >= 0 {
			em = ex.svc.mx.ep(ex.res.Endpoint)
			epLabel = em.label
		}
	} else {
		m.duration.WithLabelValues(svcLabel).Observe(ex.res.Duration.Seconds())
	}
	switch {
	case em != nil && ex.res.Status == http.StatusOK:
		em.ok.Inc()
	default:
		m.requests.WithLabelValues(svcLabel, epLabel, strconv.Itoa(ex.res.Status)).Inc()
	}
	if em != nil {
		if ex.res.BytesIn > 0 {
			em.bytesIn.Add(float64(ex.res.BytesIn))
		}
		if ex.res.BytesOut > 0 {
			em.bytesOut.Add(float64(ex.res.BytesOut))
		}
	} else if ex.res.BytesIn > 0 {
		m.bytes.WithLabelValues(svcLabel, epLabel, "in").Add(float64(ex.res.BytesIn))
	}
	if ex.res.HasUsage && em != nil {
		if ex.res.HasCachedTokens {
			em.usage[1].Inc()
		} else {
			em.usage[0].Inc()
		}
	}
	if lg := ex.s.logger; lg.Enabled(ex.ctx, slog.LevelDebug) {
		lg.LogAttrs(ex.ctx, slog.LevelDebug, "proxy: request",
			slog.String("service", svcLabel), slog.String("ep", epLabel),
			slog.String("method", ex.r.Method), slog.String("path", ex.r.URL.Path),
			slog.Int("status", ex.res.Status), slog.Int("attempts", ex.res.Attempts),
			slog.Duration("duration", ex.res.Duration), slog.String("receipt", ex.plan.Receipt),
			slog.String("class", string(ex.res.Class)), slog.Any("err", ex.res.Err))
	}
	if ex.plan.Done != nil {
		ex.plan.Done(ex.res)
	}
}

type pendingError struct {
	info errorInfo
	err  error
}

// bodyChunk is the unit request bodies are read in. A body declared no
// larger (nearly every chat request) takes exactly one allocation of its
// declared length. Larger bodies, and bodies of unknown length, are read
// into pooled chunks of this size as bytes actually arrive and copied into
// one buffer of their real length at the end; so a client declaring 32 MiB
// and sending one byte costs one chunk, not 32 MiB, and the chunks of
// abandoned bodies are reused instead of becoming garbage of every size.
const bodyChunk = 64 << 10

var bodyChunkPool = sync.Pool{New: func() any { b := make([]byte, bodyChunk); return &b }}

// readBody reads the whole body, bounded by MaxBodyBytes, under a read
// deadline that is lifted afterwards so streaming responses are not cut
// by it. The buffer's capacity is held against the server's body budget
// until the request ends.
func (ex *exchange) readBody() (_ []byte, err error) {
	r, limit, timeout := ex.r, ex.t.cfg.MaxBodyBytes, ex.t.cfg.BodyReadTimeout
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	if r.ContentLength > limit {
		return nil, fmt.Errorf("%w: content-length %d exceeds the %d byte limit", ErrBodyTooLarge, r.ContentLength, limit)
	}
	rc := http.NewResponseController(ex.w)
	if timeout > 0 && !bodyBuffered(ex.w) && rc.SetReadDeadline(time.Now().Add(timeout)) == nil {
		// Lifted only on success: after a failed read the server
		// drains what is left of the body before answering, and an
		// expired deadline is what keeps that drain from waiting
		// on the slow client forever.
		defer func() {
			if err == nil {
				_ = rc.SetReadDeadline(time.Time{})
			}
		}()
	}
	// want is the most the buffer can need: the declared length, or one
	// byte past the limit, which tells an oversize body of unknown length.
	want := limit + 1
	if r.ContentLength >= 0 {
		want = r.ContentLength
	}
	b, err := ex.fill(r.Body, want)
	switch {
	case err == nil:
		if r.ContentLength < 0 && int64(len(b)) > limit {
			return nil, fmt.Errorf("%w: body exceeds the %d byte limit", ErrBodyTooLarge, limit)
		}
		// Read to its end: closed now, net/http need not look for (and
		// allocate a reader to discard) a rest after the handler.
		_ = r.Body.Close()
		return b, nil
	case errors.Is(err, ErrOverloaded):
		// The rest of the body is not wanted: stop waiting for it, so the
		// refusal goes out now and the connection closes.
		_ = rc.SetReadDeadline(time.Unix(1, 0))
		ex.s.m.connRejected.WithLabelValues("body_memory").Inc()
		ex.s.rare.warn("body_memory", "proxy: request refused, request bodies in flight hold the whole body budget",
			"max_inflight_body_bytes", ex.s.budget.max, "remote", r.RemoteAddr, "content_length", r.ContentLength)
		return nil, err
	case isTimeout(err):
		// Checked first: the server also cancels the request context
		// when the deadline fires, but this client is slow, not gone.
		return nil, fmt.Errorf("%w: request body not received within %v: %w", ErrBadRequest, timeout, err)
	case ex.ctx.Err() != nil:
		return nil, fmt.Errorf("%w: reading request body: %w", ErrClientCanceled, err)
	default:
		return nil, fmt.Errorf("%w: reading request body: %w", ErrBadRequest, err)
	}
}

// bodyBuffered reports whether the lean server already holds the whole
// request body: most small requests arrive with their head in one read,
// and reading them needs no deadline (two timer updates saved).
func bodyBuffered(w http.ResponseWriter) bool {
	lw, ok := w.(*h1Writer)
	return ok && lw.c.body.buffered()
}

// fill reads src until EOF or until want bytes are held, reserving every
// buffer against the server's body budget before it is taken.
func (ex *exchange) fill(src io.Reader, want int64) ([]byte, error) {
	if want <= 0 {
		return nil, nil
	}
	if want <= bodyChunk {
		if err := ex.reserve(want); err != nil {
			return nil, err
		}
		b := make([]byte, want)
		n := 0
		for n < len(b) {
			m, err := src.Read(b[n:])
			n += m
			if err == io.EOF {
				break // net/http says ErrUnexpectedEOF for a short declared body
			}
			if err != nil {
				return nil, err
			}
		}
		return b[:n], nil
	}
	var chunks []*[]byte
	defer func() {
		for _, c := range chunks {
			bodyChunkPool.Put(c)
		}
	}()
	var total int64
	last := 0 // bytes used in the last chunk
	for total < want {
		if len(chunks) == 0 || last == bodyChunk {
			if err := ex.reserve(bodyChunk); err != nil {
				return nil, err
			}
			chunks = append(chunks, bodyChunkPool.Get().(*[]byte))
			last = 0
		}
		c := *chunks[len(chunks)-1]
		n, err := src.Read(c[last:min(int64(bodyChunk), int64(last)+want-total)])
		last += n
		total += int64(n)
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
	}
	// The chunks' reservation passes to the assembled body; the copy is
	// transient and not counted.
	b := make([]byte, 0, total)
	for i, c := range chunks {
		if i == len(chunks)-1 {
			b = append(b, (*c)[:last]...)
		} else {
			b = append(b, *c...)
		}
	}
	ex.unreserve(int64(len(chunks))*bodyChunk - total)
	return b, nil
}

func (ex *exchange) reserve(n int64) error {
	if !ex.s.budget.reserve(n) {
		return fmt.Errorf("%w: request bodies in flight would exceed %d bytes; retry shortly", ErrOverloaded, ex.s.budget.max)
	}
	ex.reserved += n
	return nil
}

func (ex *exchange) unreserve(n int64) {
	ex.s.budget.release(n)
	ex.reserved -= n
}

// removeHop deletes hop-by-hop headers, including those the Connection
// header names.
func removeHop(h http.Header) {
	for _, v := range h["Connection"] {
		for _, f := range strings.Split(v, ",") {
			if f = strings.TrimSpace(f); f != "" {
				h.Del(f)
			}
		}
	}
	for _, k := range hopHeaders {
		h.Del(k)
	}
}

func isEventStream(h http.Header) bool { return mediaType(h) == "text/event-stream" }

func isJSON(h http.Header) bool {
	mt := mediaType(h)
	return mt == "application/json" || strings.HasSuffix(mt, "+json")
}

// mediaType returns the lower-cased media type of Content-Type without
// parameters. mime.ParseMediaType would also parse (and allocate) the
// parameters, which the proxy never needs.
func mediaType(h http.Header) string {
	ct := h.Get("Content-Type")
	if i := strings.IndexByte(ct, ';'); i >= 0 {
		ct = ct[:i]
	}
	ct = strings.TrimSpace(ct)
	for i := 0; i < len(ct); i++ {
		if c := ct[i]; 'A' <= c && c <= 'Z' {
			return strings.ToLower(ct)
		}
	}
	return ct
}

func localAddr(r *http.Request) net.Addr {
	a, _ := r.Context().Value(http.LocalAddrContextKey).(net.Addr)
	return a
}

func remoteAddrPort(s string) netip.AddrPort {
	ap, err := netip.ParseAddrPort(s)
	if err != nil {
		return netip.AddrPort{}
	}
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}

var _ http.Handler = (*Server)(nil)
