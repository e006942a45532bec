package dispatch

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/outlier"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

// Leg names (metric label values).
const (
	legPrefill = "prefill"
	legDecode  = "decode"
)

// exchange is one request's state across its legs.
type exchange struct {
	d     *Dispatcher
	req   *Request
	c     Choice
	w     http.ResponseWriter
	label string
	res   proxy.Result
	body  map[string]json.RawMessage
	reqID string
	// prefillUsed is the prefill endpoint that completed its leg.
	prefillUsed *Endpoint
	wrote       bool   // response headers went to the client
	outcomeTag  string // overrides the derived outcome
}

func (x *exchange) outcome() string {
	if x.outcomeTag != "" {
		return x.outcomeTag
	}
	switch x.res.Class {
	case proxy.ClassNone:
		return "ok"
	case proxy.ClassClientCanceled:
		return "client_canceled"
	}
	return "error"
}

// parseBody accepts only a JSON object: every flow edits top-level fields.
func parseBody(b []byte) (map[string]json.RawMessage, error) {
	var m map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&m); err != nil || m == nil {
		if err == nil {
			err = errors.New("null")
		}
		return nil, fmt.Errorf("%w: P/D needs a JSON object body: %v", proxy.ErrBadRequest, err)
	}
	return m, nil
}

func cloneBody(m map[string]json.RawMessage) map[string]json.RawMessage {
	out := make(map[string]json.RawMessage, len(m)+4)
	for k, v := range m {
		out[k] = v
	}
	return out
}

// encodeBody writes the object back with keys sorted. The values are the
// client's own bytes (they decoded once, so they are valid JSON) and are
// copied as they are: json.Marshal would re-validate and compact every one.
func encodeBody(m map[string]json.RawMessage) []byte {
	keys := make([]string, 0, len(m))
	n := 2
	for k, v := range m {
		keys = append(keys, k)
		n += len(k) + len(v) + 8
	}
	sort.Strings(keys)
	b := make([]byte, 0, n)
	b = append(b, '{')
	for i, k := range keys {
		if i > 0 {
			b = append(b, ',')
		}
		kb, _ := json.Marshal(k) // JSON string quoting (strconv's is Go syntax)
		b = append(b, kb...)
		b = append(b, ':')
		b = append(b, m[k]...)
	}
	return append(b, '}')
}

func raw(v any) json.RawMessage {
	b, _ := json.Marshal(v)
	return b
}

// requestID is the client's X-Request-Id or a fresh random one; vLLM
// needs the same id on both legs.
func requestID(h http.Header) string {
	if v := h.Get("X-Request-Id"); v != "" {
		return v
	}
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	s := hex.EncodeToString(b[:])
	return s[:8] + "-" + s[8:12] + "-" + s[12:16] + "-" + s[16:20] + "-" + s[20:]
}

// newLeg builds one leg's HTTP request. Prefill legs ask for an identity
// encoding because the dispatcher parses their body. The leg bounds its
// own time (the prefill timeout, the decode watchdog), so the proxy's
// response timeouts do not apply; it is counted in the proxy's in-flight
// number of its endpoint.
func (x *exchange) newLeg(ctx context.Context, ep Endpoint, body []byte, prefill bool) *http.Request {
	ctx = proxy.WithLeg(ctx, proxy.Leg{Endpoint: ep.Idx, DialTimeout: x.d.cfg.DialTimeout, OwnTimeouts: true})
	h := make(http.Header, len(x.req.Header)+2)
	for k, vv := range x.req.Header {
		h[k] = vv
	}
	proxy.RemoveHopHeaders(h)
	h.Del("Content-Length")
	h.Del("Expect")
	h.Del(proxy.HeaderReceiptRequest)
	if prefill {
		h.Del("Accept-Encoding")
		h.Set("Accept", "application/json")
	}
	h.Set("Content-Type", "application/json")
	h.Set("X-Request-Id", x.reqID)
	if _, ok := h["User-Agent"]; !ok {
		h["User-Agent"] = []string{""}
	}
	scheme := x.req.Pool.Scheme
	if scheme == "" {
		scheme = "http"
	}
	r := &http.Request{
		Method:        http.MethodPost,
		URL:           &url.URL{Scheme: scheme, Host: ep.Addr(), Path: x.req.Path},
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        h,
		Body:          io.NopCloser(bytes.NewReader(body)),
		ContentLength: int64(len(body)),
		GetBody:       func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil },
		Host:          ep.Addr(),
	}
	return r.WithContext(ctx)
}

// roundTrip sends one leg through the proxy's upstream.
func (x *exchange) roundTrip(r *http.Request) (*http.Response, error) {
	return x.req.Legs.RoundTrip(r)
}

// prefillOutcome is a finished prefill leg.
type prefillOutcome struct {
	ep     Endpoint
	status int
	header http.Header
	body   []byte
	err    error
	// connectFailed: the request never reached the endpoint; another
	// prefill endpoint may be tried.
	connectFailed bool
}

// error is the leg's failure as an error (a transport error, or the
// engine's error status).
func (o prefillOutcome) error() error {
	if o.err != nil || o.status/100 == 2 {
		return o.err
	}
	return &proxy.LegError{Leg: legPrefill, Addr: o.ep.Addr(),
		Err: fmt.Errorf("%w: prefill endpoint answered %d: %s", proxy.ErrUpstreamStatus, o.status, excerpt(o.body))}
}

// prefillOnce runs one prefill leg to ep under the prefill timeout, holding
// an admission slot for its duration, and reads the whole (bounded) body.
func (x *exchange) prefillOnce(ctx context.Context, ep Endpoint, body []byte) prefillOutcome {
	out := prefillOutcome{ep: ep}
	release, err := x.d.adm.acquire(ctx, x.req.Pool.Service, x.label, ep.Idx)
	if err != nil {
		out.err = err
		return out
	}
	defer release()
	lctx, cancel := context.WithTimeout(ctx, x.d.cfg.PrefillTimeout)
	defer cancel()
	start := x.d.now()
	epl := strconv.Itoa(ep.Idx)
	resp, err := x.roundTrip(x.newLeg(lctx, ep, body, true))
	if err == nil {
		x.observe(ep, true, statusOutcome(resp.StatusCode))
		defer resp.Body.Close()
		out.status, out.header = resp.StatusCode, resp.Header
		out.body, err = io.ReadAll(io.LimitReader(resp.Body, x.d.cfg.MaxPrefillBody+1))
		if err == nil && int64(len(out.body)) > x.d.cfg.MaxPrefillBody {
			err = fmt.Errorf("%w: prefill response exceeds %d bytes", errTooLong, x.d.cfg.MaxPrefillBody)
		}
	}
	if err != nil {
		if ctx.Err() != nil {
			// The client left, or the other leg aborted this one.
			out.err = fmt.Errorf("%w: %w", context.Canceled, err)
			if errors.Is(context.Cause(ctx), errOtherLeg) {
				out.err = fmt.Errorf("%w: %w", errOtherLeg, err)
			}
			return out
		}
		wrapped, class, connect := legFailure(err)
		if out.status == 0 {
			x.observe(ep, true, outlier.GatewayFailure)
		}
		if class == proxy.ClassTimeout {
			wrapped = fmt.Errorf("%w: no complete prefill response within %v: %w", proxy.ErrUpstreamTimeout, x.d.cfg.PrefillTimeout, err)
			x.d.m.legTimeouts.WithLabelValues(x.label, epl, legPrefill).Inc()
		}
		x.d.m.legErrors.WithLabelValues(x.label, epl, legPrefill, string(class)).Inc()
		out.err = &proxy.LegError{Leg: legPrefill, Addr: ep.Addr(), Err: wrapped}
		out.connectFailed = connect
		return out
	}
	if out.status/100 != 2 {
		x.d.m.legErrors.WithLabelValues(x.label, epl, legPrefill, "status").Inc()
		return out
	}
	x.d.m.prefillDur.WithLabelValues(x.label, epl).Observe(x.d.now().Sub(start).Seconds())
	return out
}

// observe reports a leg's outcome to the request's passive health check.
func (x *exchange) observe(ep Endpoint, prefill bool, o outlier.Outcome) {
	if f := x.req.Observe; f != nil {
		f(ep, prefill, o)
	}
}

// statusOutcome is what an endpoint's response status says about it.
func statusOutcome(status int) outlier.Outcome {
	if status >= 500 {
		return outlier.ServerError
	}
	return outlier.Success
}

// errOtherLeg is the cancel cause when one SGLang leg aborts the other.
var errOtherLeg = errors.New("the other leg failed")

// runPrefill runs the prefill leg with connect failover over the ordered
// candidates; build makes the body for a given endpoint.
func (x *exchange) runPrefill(ctx context.Context, build func(Endpoint) []byte) prefillOutcome {
	var out prefillOutcome
	for i, ep := range x.c.Prefill {
		out = x.prefillOnce(ctx, ep, build(ep))
		x.res.Attempts++
		if !out.connectFailed || i == len(x.c.Prefill)-1 {
			return out
		}
		x.d.m.failover.WithLabelValues(x.label, strconv.Itoa(ep.Idx)).Inc()
		x.d.logger.Debug("dispatch: prefill connect failed, trying next endpoint",
			"service", x.req.Pool.Service, "ep", ep.Idx, "next", x.c.Prefill[i+1].Idx, "err", out.err)
	}
	return out
}

// failPrefill answers a failed prefill leg: a 4xx from the engine is the
// client's problem and is relayed as is; anything else becomes a clear
// gateway error.
func (x *exchange) failPrefill(ctx context.Context, out prefillOutcome) {
	x.res.Endpoint = out.ep.Idx
	if out.err != nil {
		x.fail(ctx, out.err)
		return
	}
	if out.status/100 == 4 {
		x.relayBuffered(out.status, out.header, out.body)
		x.res.Class, x.res.Err = proxy.ClassBadRequest, fmt.Errorf("prefill endpoint %s answered %d", out.ep.Addr(), out.status)
		x.outcomeTag = "prefill_error"
		return
	}
	x.fail(ctx, out.error())
	x.outcomeTag = "prefill_error"
}

func excerpt(b []byte) string {
	s := strings.TrimSpace(string(b))
	if len(s) > 256 {
		s = s[:256] + "..."
	}
	return s
}

// fail answers with the error if nothing was written yet; otherwise the
// response is already committed and the stream is cut (Result.Class set).
func (x *exchange) fail(ctx context.Context, err error) {
	if ctx.Err() != nil && errors.Is(err, context.Canceled) && !errors.Is(err, errOtherLeg) {
		err = fmt.Errorf("%w: %w", proxy.ErrClientCanceled, err)
	}
	v := proxy.VerdictFor(err)
	x.res.Class, x.res.Err = v.Class, err
	if v.RetryAfter {
		x.outcomeTag = "shed"
	}
	if v.Status == proxy.StatusClientClosed {
		x.res.Status = proxy.StatusClientClosed
		return
	}
	if x.wrote {
		return
	}
	x.res.Status = v.Status
	proxy.WriteError(x.w, err, x.d.cfg.RetryAfter)
	x.wrote = true
}

// relayBuffered sends a complete upstream response held in memory.
func (x *exchange) relayBuffered(status int, h http.Header, body []byte) {
	dst := x.w.Header()
	for k, vv := range h {
		if proxy.IsRouteHeader(k) {
			continue // the receipt is the proxy's; an engine cannot forge one
		}
		dst[k] = vv
	}
	proxy.RemoveHopHeaders(dst)
	dst.Set("Content-Length", strconv.Itoa(len(body)))
	x.w.WriteHeader(status)
	x.wrote = true
	n, _ := x.w.Write(body)
	x.res.Status = status
	x.res.BytesOut += int64(n)
}

// decodeLeg sends the decode (generation) leg holding a decode slot and
// relays its response. The client's status line is written only once the
// first body byte arrived, so a decode failure before that is still a
// clean JSON error. stop, when not nil, is closed by the caller to abort
// the relay (the other leg failed); its error then explains the cut.
//
// A decode endpoint that cannot be connected to (nothing was sent) is
// skipped for the next healthy one: the transfer parameters name the
// prefill side, so any decode worker can pull the KV cache.
func (x *exchange) decodeLeg(ctx context.Context, body []byte) error {
	eps := append([]Endpoint{x.c.Decode}, x.c.decodeAlt...)
	for i, ep := range eps {
		err, connectFailed := x.decodeOnce(ctx, ep, body)
		if err == nil {
			x.c.Decode = ep
			return nil
		}
		if !connectFailed || i == len(eps)-1 {
			return err
		}
		x.d.m.failover.WithLabelValues(x.label, strconv.Itoa(ep.Idx)).Inc()
		x.d.logger.Debug("dispatch: decode connect failed, trying next endpoint",
			"service", x.req.Pool.Service, "ep", ep.Idx, "next", eps[i+1].Idx, "err", err)
	}
	return nil
}

func (x *exchange) decodeOnce(ctx context.Context, ep Endpoint, body []byte) (err error, connectFailed bool) {
	x.res.Endpoint = ep.Idx
	epl := strconv.Itoa(ep.Idx)
	release, err := x.d.adm.acquire(ctx, x.req.Pool.Service, x.label, ep.Idx)
	if err != nil {
		return err, false
	}
	defer release()

	lctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	// One watchdog timer: the first-byte timeout, then re-armed with the
	// idle timeout after every read.
	var tmo atomic.Bool
	wd := time.AfterFunc(x.d.cfg.DecodeFirstByteTimeout, func() {
		tmo.Store(true)
		cancel(proxy.ErrUpstreamTimeout)
	})
	defer wd.Stop()
	timedOutNow := tmo.Load

	start := x.d.now()
	legErr := func(class proxy.ErrorClass, err error) error {
		x.d.m.legErrors.WithLabelValues(x.label, epl, legDecode, string(class)).Inc()
		if class == proxy.ClassTimeout {
			x.d.m.legTimeouts.WithLabelValues(x.label, epl, legDecode).Inc()
		}
		return &proxy.LegError{Leg: legDecode, Addr: ep.Addr(), Err: err}
	}
	resp, err := x.roundTrip(x.newLeg(lctx, ep, body, false))
	if err != nil {
		if timedOutNow() {
			x.observe(ep, false, outlier.GatewayFailure)
			return legErr(proxy.ClassTimeout, fmt.Errorf("%w: no response within %v: %w", proxy.ErrUpstreamTimeout, x.d.cfg.DecodeFirstByteTimeout, err)), false
		}
		if ctx.Err() != nil {
			return fmt.Errorf("%w: %w", context.Canceled, err), false
		}
		x.observe(ep, false, outlier.GatewayFailure)
		wrapped, class, connect := legFailure(err)
		return legErr(class, wrapped), connect
	}
	defer resp.Body.Close()
	x.observe(ep, false, statusOutcome(resp.StatusCode))

	bp := x.d.bufs.Get().(*[]byte)
	defer x.d.bufs.Put(bp)
	buf := *bp
	// Read the first bytes before committing the status line.
	n, rerr := io.ReadAtLeast(resp.Body, buf, 1)
	if n == 0 {
		if rerr == nil || rerr == io.EOF || rerr == io.ErrUnexpectedEOF {
			rerr = io.ErrUnexpectedEOF
		}
		switch {
		case timedOutNow():
			return legErr(proxy.ClassTimeout, fmt.Errorf("%w: no first byte within %v", proxy.ErrUpstreamTimeout, x.d.cfg.DecodeFirstByteTimeout)), false
		case ctx.Err() != nil:
			return fmt.Errorf("%w: %w", context.Canceled, rerr), false
		case resp.ContentLength == 0:
			// A legitimately empty body: relay it.
		default:
			return legErr(proxy.ClassProtocol, fmt.Errorf("%w: decode response ended before its first byte (status %d): %w", proxy.ErrUpstreamProtocol, resp.StatusCode, rerr)), false
		}
	}
	x.d.m.decodeTTFT.WithLabelValues(x.label, epl).Observe(x.d.now().Sub(start).Seconds())
	if resp.StatusCode/100 != 2 {
		x.d.m.legErrors.WithLabelValues(x.label, epl, legDecode, "status").Inc()
	}
	dst := x.w.Header()
	for k, vv := range resp.Header {
		if proxy.IsRouteHeader(k) {
			continue // the receipt is the proxy's; an engine cannot forge one
		}
		dst[k] = vv
	}
	proxy.RemoveHopHeaders(dst)
	streaming := isEventStream(resp.Header) || resp.ContentLength < 0
	x.res.Streamed = streaming
	x.w.WriteHeader(resp.StatusCode)
	x.wrote = true
	x.res.Status = resp.StatusCode
	if resp.StatusCode/100 != 2 {
		// The engine's own error is relayed as is (a clean relay, so no
		// error class), but the request did not succeed.
		x.outcomeTag = "decode_error"
	}
	flusher, _ := x.w.(http.Flusher)
	for {
		if n > 0 {
			wn, werr := x.w.Write(buf[:n])
			x.res.BytesOut += int64(wn)
			if werr != nil {
				return fmt.Errorf("%w: write to client: %w", proxy.ErrClientCanceled, werr), false
			}
			if streaming && flusher != nil {
				flusher.Flush()
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			switch {
			case timedOutNow():
				x.d.m.streamAborted.WithLabelValues(x.label, epl).Inc()
				return legErr(proxy.ClassTimeout, fmt.Errorf("%w: decode stalled for %v", proxy.ErrUpstreamTimeout, x.d.cfg.DecodeIdleTimeout)), false
			case ctx.Err() != nil:
				// The client left or the other leg failed; the caller
				// knows which and counts it.
				return fmt.Errorf("%w: %w", context.Canceled, rerr), false
			}
			x.d.m.streamAborted.WithLabelValues(x.label, epl).Inc()
			wrapped, class, _ := legFailure(rerr)
			return legErr(class, wrapped), false
		}
		wd.Reset(x.d.cfg.DecodeIdleTimeout)
		n, rerr = resp.Body.Read(buf)
	}
	if resp.StatusCode/100 == 2 {
		x.res.Endpoint = ep.Idx
	}
	return nil, false
}

func isEventStream(h http.Header) bool {
	mt, _, err := mime.ParseMediaType(h.Get("Content-Type"))
	return err == nil && mt == "text/event-stream"
}
