package proxy

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"
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

var (
	protoHTTP  = []string{"http"}
	protoHTTPS = []string{"https"}
)

// newBodyBuf replays the buffered request body. It must stay a
// NopCloser around a *bytes.Reader: net/http recognises that as an
// in-memory body and writes headers and body in one system call instead
// of flushing the headers first.
func newBodyBuf(b []byte) io.ReadCloser { return io.NopCloser(bytes.NewReader(b)) }

var copyBufPool = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// ServeHTTP proxies one request. It is the handler of the proxy's
// http.Server and relies on the connection's local address to find the
// rule, so it is not meant to be mounted elsewhere.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ex := exchange{s: s, w: w, r: r, start: time.Now(), t: s.table.Load()}
	ex.res.Endpoint = -1
	ex.run()
	ex.finish()
	if ex.abort {
		// The status line is gone; the only honest signal left for a
		// failed relay is to cut the connection so the client sees a
		// truncated body instead of a clean end.
		panic(http.ErrAbortHandler)
	}
}

// exchange is one request's state, so the steps can be separate methods
// without long parameter lists.
type exchange struct {
	s     *Server
	t     *table
	svc   *service
	w     http.ResponseWriter
	r     *http.Request
	start time.Time
	plan  Plan
	res   Result
	wrote bool // response headers were sent
	abort bool // cut the client connection: the relay failed mid-body
	// pendingErr is the error answer finish will send.
	pendingErr *pendingError
}

func (ex *exchange) run() {
	r := ex.r
	ex.svc = ex.t.lookup(localAddr(r))
	if ex.svc == nil {
		ex.s.m.connRejected.WithLabelValues("no_service").Inc()
		ex.w.Header().Set("Connection", "close")
		ex.fail(fmt.Errorf("%w: %v", ErrNoService, localAddr(r)))
		return
	}
	if ex.svc.serverTLS != nil && r.TLS == nil {
		// A keep-alive connection accepted in plaintext before Update
		// turned TLS on for this rule must not go on carrying requests.
		ex.w.Header().Set("Connection", "close")
		ex.fail(fmt.Errorf("%w: service %d now requires TLS; reconnect", ErrUnavailable, ex.svc.cfg.ID))
		return
	}
	body, err := readBody(ex.w, r, ex.t.cfg.MaxBodyBytes, ex.t.cfg.BodyReadTimeout)
	ex.res.BytesIn = int64(len(body))
	if err != nil {
		// Whatever is left of the body must not be read as the next
		// request, and draining it would wait on the client.
		ex.w.Header().Set("Connection", "close")
		ex.fail(err)
		return
	}
	req := &Request{
		Service:    ex.svc.cfg.ID,
		Method:     r.Method,
		Path:       r.URL.Path,
		Model:      ModelOf(r.Header, body),
		Header:     r.Header,
		Body:       body,
		ClientAddr: remoteAddrPort(r.RemoteAddr),
	}
	plan, err := ex.s.picker.Pick(r.Context(), req)
	if err != nil {
		if r.Context().Err() != nil {
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
	res := ex.plan.Dispatch(ex.r.Context(), ex.w, req)
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

// forward tries the candidates in order. Only failures that prove the
// endpoint never saw the request (connect refused, TLS handshake) move on
// to the next one: anything later may have started generation, and
// replaying a POST would run it twice.
func (ex *exchange) forward(body []byte) {
	cands := ex.plan.Candidates
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
	inflight := ex.s.inflightCounter(ex.svc.cfg.ID, ep.Idx)
	inflight.Add(1)
	defer inflight.Add(-1)

	resp, err := ex.svc.up.roundTrip(ex.outbound(ep, body), ep.Addr)
	if err != nil {
		if ex.r.Context().Err() != nil {
			return false, fmt.Errorf("%w: waiting for endpoint %s: %w", ErrClientCanceled, ep.Addr, err)
		}
		wrapped, retryable := upstreamError(ep.Addr, err)
		ex.s.m.upstreamErrs.WithLabelValues(ex.svc.label, strconv.Itoa(ep.Idx), string(classify(wrapped).class)).Inc()
		return retryable, wrapped
	}
	ex.relay(ep, resp)
	return false, nil
}

// outbound builds the endpoint request. The body is replayed from the
// buffer, so a request whose write failed on a stale pooled connection
// can be sent again on a fresh one.
func (ex *exchange) outbound(ep Endpoint, body []byte) *http.Request {
	r := ex.r
	h := make(http.Header, len(r.Header)+2)
	for k, vv := range r.Header {
		h[k] = vv
	}
	removeHop(h)
	h.Del(HeaderReceiptRequest)
	h.Del("Expect") // the body is already here; no 100-continue dance with the endpoint
	if r.Header.Get("Te") == "trailers" {
		h.Set("Te", "trailers")
	}
	if _, ok := h["User-Agent"]; !ok {
		h["User-Agent"] = []string{""} // keep Go's default User-Agent out
	}
	if ip, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		if prior := h.Values("X-Forwarded-For"); len(prior) > 0 {
			ip = strings.Join(prior, ", ") + ", " + ip
		}
		h.Set("X-Forwarded-For", ip)
	}
	if r.TLS != nil {
		h["X-Forwarded-Proto"] = protoHTTPS // shared, never modified
	} else {
		h["X-Forwarded-Proto"] = protoHTTP
	}
	var rb io.ReadCloser = http.NoBody
	if len(body) > 0 {
		rb = newBodyBuf(body)
	}
	out := &http.Request{
		Method: r.Method,
		URL: &url.URL{
			Scheme:   ex.svc.scheme,
			Host:     ep.Addr,
			Path:     r.URL.Path,
			RawPath:  r.URL.RawPath,
			RawQuery: r.URL.RawQuery,
		},
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        h,
		Body:          rb,
		ContentLength: int64(len(body)),
		GetBody: func() (io.ReadCloser, error) {
			if len(body) == 0 {
				return http.NoBody, nil
			}
			return newBodyBuf(body), nil
		},
		Host: r.Host,
	}
	return out.WithContext(ex.r.Context())
}

// relay copies the endpoint's response to the client. SSE and
// unknown-length bodies are flushed after every write so each token event
// reaches the client as soon as the engine produced it; the usage tap sees
// the same bytes without delaying them.
func (ex *exchange) relay(ep Endpoint, resp *http.Response) {
	defer resp.Body.Close()
	h := ex.w.Header()
	for k, vv := range resp.Header {
		if IsRouteHeader(k) {
			continue // the receipt is ours to give; an endpoint cannot forge one
		}
		h[k] = vv
	}
	removeHop(h)
	streaming := isEventStream(resp.Header) || resp.ContentLength < 0
	ex.res.Streamed = streaming
	tap := usageTap{sse: isEventStream(resp.Header), limit: ex.t.cfg.UsageScanBytes}
	scan := tap.sse || isJSON(resp.Header)
	defer tap.release()

	ex.w.WriteHeader(resp.StatusCode)
	ex.wrote = true
	ex.res.Status = resp.StatusCode

	var flusher http.Flusher
	if streaming {
		flusher, _ = ex.w.(http.Flusher)
		ex.svc.mx.streams.Inc()
		defer ex.svc.mx.streams.Dec()
		if flusher != nil {
			flusher.Flush() // headers out now: the first token may be seconds away
		}
	}
	bp := copyBufPool.Get().(*[]byte)
	defer copyBufPool.Put(bp)
	buf := *bp
	for {
		n, rerr := resp.Body.Read(buf)
		if n > 0 {
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
				return
			}
			if flusher != nil {
				flusher.Flush()
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			if ex.r.Context().Err() != nil {
				ex.res.Class = ClassClientCanceled
				ex.res.Err = fmt.Errorf("%w: %w", ErrClientCanceled, rerr)
				ex.res.Status = StatusClientClosed
				return
			}
			wrapped, _ := upstreamError(ep.Addr, rerr)
			info := classify(wrapped)
			ex.s.m.upstreamErrs.WithLabelValues(ex.svc.label, strconv.Itoa(ep.Idx), string(info.class)).Inc()
			ex.res.Class, ex.res.Err = info.class, fmt.Errorf("relay body: %w", wrapped)
			ex.abort = true
			return
		}
	}
	for k, vv := range resp.Trailer {
		h[http.TrailerPrefix+k] = vv
	}
	if scan {
		tap.finish(&ex.res)
	}
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
	if lg := ex.s.logger; lg.Enabled(ex.r.Context(), slog.LevelDebug) {
		lg.LogAttrs(ex.r.Context(), slog.LevelDebug, "proxy: request",
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

// readBody reads the whole body, bounded by limit, under a read deadline
// that is lifted afterwards so streaming responses are not cut by it.
func readBody(w http.ResponseWriter, r *http.Request, limit int64, timeout time.Duration) (_ []byte, err error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	if r.ContentLength > limit {
		return nil, fmt.Errorf("%w: content-length %d exceeds the %d byte limit", ErrBodyTooLarge, r.ContentLength, limit)
	}
	if timeout > 0 {
		rc := http.NewResponseController(w)
		if rc.SetReadDeadline(time.Now().Add(timeout)) == nil {
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
	}
	var b []byte
	if r.ContentLength > 0 {
		b = make([]byte, r.ContentLength)
		_, err = io.ReadFull(r.Body, b)
	} else {
		b, err = io.ReadAll(io.LimitReader(r.Body, limit+1))
		if err == nil && int64(len(b)) > limit {
			return nil, fmt.Errorf("%w: body exceeds the %d byte limit", ErrBodyTooLarge, limit)
		}
	}
	switch {
	case err == nil:
		return b, nil
	case isTimeout(err):
		// Checked first: the server also cancels the request context
		// when the deadline fires, but this client is slow, not gone.
		return nil, fmt.Errorf("%w: request body not received within %v: %w", ErrBadRequest, timeout, err)
	case r.Context().Err() != nil:
		return nil, fmt.Errorf("%w: reading request body: %w", ErrClientCanceled, err)
	default:
		return nil, fmt.Errorf("%w: reading request body: %w", ErrBadRequest, err)
	}
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
