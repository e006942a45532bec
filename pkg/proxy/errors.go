package proxy

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"syscall"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/outlier"
)

// Sentinel errors. Callers (and the Picker) wrap them with fmt.Errorf("%w")
// and the proxy branches on them with errors.Is, never on message text.
var (
	// ErrBodyTooLarge means the request body exceeded Config.MaxBodyBytes.
	ErrBodyTooLarge = errors.New("request body too large")
	// ErrBadRequest means the request is malformed; a Picker returns it
	// (wrapped) to reject a request it cannot parse.
	ErrBadRequest = errors.New("malformed request")
	// ErrUnavailable means no healthy endpoint can take the request; a
	// Picker returns it (wrapped) when every endpoint is down or excluded.
	ErrUnavailable = errors.New("no healthy endpoint")
	// ErrNoService means the connection's local address matches no
	// mode-4 rule (a stale keep-alive connection after a rule was removed).
	ErrNoService = errors.New("no service on this address")
	// ErrUpstreamConnect means connecting to the endpoint failed.
	ErrUpstreamConnect = errors.New("upstream connect failed")
	// ErrUpstreamTLS means the TLS handshake with the endpoint failed,
	// typically certificate verification.
	ErrUpstreamTLS = errors.New("upstream TLS handshake failed")
	// ErrUpstreamProtocol means the endpoint answered with something that
	// is not a valid HTTP response, or closed the connection mid-request.
	ErrUpstreamProtocol = errors.New("upstream protocol error")
	// ErrUpstreamTimeout means the endpoint did not accept the connection
	// or send response headers in time.
	ErrUpstreamTimeout = errors.New("upstream timeout")
	// ErrClientCanceled means the client went away before the response
	// was complete.
	ErrClientCanceled = errors.New("client canceled")
	// ErrListen means a rule's VIP:port listener could not be opened; the
	// cause (EADDRINUSE, EADDRNOTAVAIL, EACCES) is wrapped with it.
	ErrListen = errors.New("cannot listen on the rule's address")
	// ErrOverloaded means the proxy refused the request to protect its
	// own memory (Config.MaxInflightBodyBytes); the client should retry
	// shortly (503 with Retry-After).
	ErrOverloaded = errors.New("proxy overloaded")

	// The sentinels below are returned by flows that run their own legs
	// (Plan.Dispatch: the prefill/decode flows of pkg/dispatch).

	// ErrQueueFull means the chosen endpoint is at its in-flight cap and
	// its wait queue is full (429 with Retry-After).
	ErrQueueFull = errors.New("endpoint queue full")
	// ErrTotalCap means the process-wide cap of concurrent flows is
	// reached (429 with Retry-After).
	ErrTotalCap = errors.New("total P/D in-flight cap reached")
	// ErrParkTimeout means a request waited too long for an endpoint
	// slot without getting one (503 with Retry-After).
	ErrParkTimeout = errors.New("waited too long for an endpoint slot")
	// ErrParamsMissing means a prefill leg succeeded without the transfer
	// parameters the decode leg needs (502).
	ErrParamsMissing = errors.New("prefill returned no transfer parameters")
	// ErrParamsMalformed means the transfer parameters cannot be used
	// (502).
	ErrParamsMalformed = errors.New("prefill returned malformed transfer parameters")
	// ErrUpstreamStatus means a leg's endpoint answered with a server
	// error where the flow needs an answer to go on (502).
	ErrUpstreamStatus = errors.New("upstream error status")
)

// LegError is a failed leg of a flow (Plan.Dispatch): which leg, to
// which endpoint, and why. Err wraps one of the sentinels. A broken leg
// answers code upstream_error whatever broke it, the code prefill/decode
// clients have always seen.
type LegError struct {
	Leg  string // prefill or decode
	Addr string // the endpoint's host:port
	Err  error
}

func (e *LegError) Error() string { return fmt.Sprintf("%s leg to %s: %v", e.Leg, e.Addr, e.Err) }

// Unwrap returns the cause.
func (e *LegError) Unwrap() error { return e.Err }

// Reason codes of ListenError, the same the management API answers a
// create with.
const (
	// ReasonVIPPortInUse: another process (or rule) holds the VIP:port.
	ReasonVIPPortInUse = "VIP_PORT_IN_USE"
	// ReasonVIPNotLocal: the VIP is not an address of this host and no
	// data plane makes it one.
	ReasonVIPNotLocal = "VIP_NOT_LOCAL"
	// ReasonListenPermission: a port below 1024 without
	// CAP_NET_BIND_SERVICE.
	ReasonListenPermission = "LISTEN_PERMISSION_DENIED"
	// ReasonListenFailed: any other listen failure.
	ReasonListenFailed = "LISTEN_FAILED"
)

// ListenError is one rule whose VIP:port listener could not be opened.
// The proxy serves every other rule; this one stays in the table and its
// listener is tried again at the next Update. errors.Is matches ErrListen
// and the cause (syscall.EADDRINUSE, ...).
type ListenError struct {
	ID   uint32         // the rule's service id
	Addr netip.AddrPort // the VIP:port
	Err  error          // from net.Listen
}

func (e *ListenError) Error() string {
	return fmt.Sprintf("%v: service %d: listen on %s: %v", ErrListen, e.ID, e.Addr, e.Err)
}

// Unwrap matches ErrListen and the cause.
func (e *ListenError) Unwrap() []error { return []error{ErrListen, e.Err} }

// Reason is the failure's reason code.
func (e *ListenError) Reason() string {
	switch {
	case errors.Is(e.Err, syscall.EADDRINUSE):
		return ReasonVIPPortInUse
	case errors.Is(e.Err, syscall.EADDRNOTAVAIL):
		return ReasonVIPNotLocal
	case errors.Is(e.Err, syscall.EACCES), errors.Is(e.Err, syscall.EPERM):
		return ReasonListenPermission
	}
	return ReasonListenFailed
}

// StatusClientClosed is the status recorded (never sent) for requests
// whose client disconnected; nginx's 499 convention.
const StatusClientClosed = 499

// errorInfo is what the client learns about a failure.
type errorInfo struct {
	status int
	typ    string // OpenAI-style error.type
	code   string // OpenAI-style error.code
	class  ErrorClass
	// retryAfter adds Retry-After: 1, for refusals that pass quickly.
	retryAfter bool
}

// classify is the one place that maps a proxy error to an HTTP status, an
// error type/code for the JSON body and a metric class. Order matters: a
// timeout while connecting is a timeout (504), not a refused connection,
// because the operator's fix differs (a slow or blackholed endpoint rather
// than a stopped one). Anything unrecognised is a 500, because an error we
// cannot name is our bug, not the endpoint's.
func classify(err error) errorInfo {
	switch {
	case err == nil:
		return errorInfo{status: http.StatusOK}
	case errors.Is(err, ErrClientCanceled), errors.Is(err, context.Canceled):
		return errorInfo{StatusClientClosed, "client_closed", "client_closed_request", ClassClientCanceled, false}
	case errors.Is(err, ErrBodyTooLarge):
		return errorInfo{http.StatusRequestEntityTooLarge, "invalid_request_error", "request_too_large", ClassBadRequest, false}
	case errors.Is(err, ErrBadRequest):
		return errorInfo{http.StatusBadRequest, "invalid_request_error", "bad_request", ClassBadRequest, false}
	case errors.Is(err, ErrOverloaded):
		return errorInfo{http.StatusServiceUnavailable, "service_unavailable", "proxy_overloaded", ClassUnavailable, true}
	case errors.Is(err, ErrQueueFull), errors.Is(err, ErrTotalCap):
		return errorInfo{http.StatusTooManyRequests, "service_unavailable", "pd_queue_full", ClassUnavailable, true}
	case errors.Is(err, ErrParkTimeout):
		return errorInfo{http.StatusServiceUnavailable, "service_unavailable", "pd_admission_timeout", ClassUnavailable, true}
	case errors.Is(err, ErrUnavailable), errors.Is(err, ErrNoService):
		return errorInfo{http.StatusServiceUnavailable, "service_unavailable", "no_healthy_endpoint", ClassUnavailable, false}
	case errors.Is(err, ErrUpstreamTimeout):
		return errorInfo{http.StatusGatewayTimeout, "upstream_error", "upstream_timeout", ClassTimeout, false}
	case errors.Is(err, ErrUpstreamTLS):
		return errorInfo{http.StatusBadGateway, "upstream_error", "upstream_tls_error", ClassTLS, false}
	case errors.Is(err, ErrUpstreamConnect):
		return errorInfo{http.StatusBadGateway, "upstream_error", "upstream_connect_error", ClassConnect, false}
	case errors.Is(err, ErrParamsMissing):
		return errorInfo{http.StatusBadGateway, "upstream_error", "pd_params_missing", ClassProtocol, false}
	case errors.Is(err, ErrParamsMalformed):
		return errorInfo{http.StatusBadGateway, "upstream_error", "pd_params_malformed", ClassProtocol, false}
	case errors.Is(err, ErrUpstreamStatus):
		return errorInfo{http.StatusBadGateway, "upstream_error", "upstream_error", ClassProtocol, false}
	case errors.Is(err, ErrUpstreamProtocol):
		code := "upstream_protocol_error"
		var le *LegError
		if errors.As(err, &le) {
			code = "upstream_error"
		}
		return errorInfo{http.StatusBadGateway, "upstream_error", code, ClassProtocol, false}
	default:
		return errorInfo{http.StatusInternalServerError, "internal_error", "internal_error", ClassInternal, false}
	}
}

// outcomeOf is what a failed attempt says about its endpoint, from the
// class classify gives its error: failing to reach it or to get an answer
// from it is a gateway failure; the client leaving says nothing.
func outcomeOf(err error) outlier.Outcome {
	switch classify(err).class {
	case ClassConnect, ClassTLS, ClassTimeout, ClassProtocol:
		return outlier.GatewayFailure
	}
	return outlier.Ignore
}

// StatusFor returns the HTTP status the proxy answers for err. It is the
// exported face of the single mapping function, for tests and callers that
// need to predict the proxy's answer.
func StatusFor(err error) int { return classify(err).status }

// Verdict is the proxy's answer for an error, as the single mapping
// function gives it.
type Verdict struct {
	// Status is the HTTP status; StatusClientClosed (499) is recorded,
	// never sent.
	Status int
	// Class is the error class (Result.Class, metric labels).
	Class ErrorClass
	// RetryAfter says the refusal passes quickly: the answer carries
	// Retry-After.
	RetryAfter bool
}

// VerdictFor maps err like the proxy does for its own failures.
func VerdictFor(err error) Verdict {
	info := classify(err)
	return Verdict{Status: info.status, Class: info.class, RetryAfter: info.retryAfter}
}

// WriteError answers the client with err exactly as the proxy answers its
// own failures (the OpenAI-style JSON error, status from the single
// mapping function), for flows that write their own response
// (Plan.Dispatch). retryAfter is the Retry-After value of refusals that
// pass quickly, rounded up to whole seconds and at least 1. Nothing is
// written for a client that went away.
func WriteError(w http.ResponseWriter, err error, retryAfter time.Duration) Verdict {
	info := classify(err)
	markOwn(w)
	writeErrorAfter(w, info, err, retryAfter)
	return Verdict{Status: info.status, Class: info.class, RetryAfter: info.retryAfter}
}

// upstreamError classifies a transport error from one attempt against the
// endpoint at addr and wraps it with the matching sentinel. retryable is
// true when the request cannot have reached the endpoint's application
// (dial or TLS handshake failed, or the connection broke before the whole
// request was written), so another candidate may be tried.
func upstreamError(addr string, err error) (wrapped error, retryable bool) {
	var (
		opErr   *net.OpError
		certErr *tls.CertificateVerificationError
		unkAuth x509.UnknownAuthorityError
		hostErr x509.HostnameError
		invErr  x509.CertificateInvalidError
		recErr  tls.RecordHeaderError
		alert   tls.AlertError
	)
	var connErr *connectError
	dial := errors.As(err, &connErr) || errors.As(err, &opErr) && opErr.Op == "dial"
	switch {
	case errors.As(err, &certErr), errors.As(err, &unkAuth), errors.As(err, &hostErr), errors.As(err, &invErr):
		return fmt.Errorf("%w: endpoint %s: certificate verification failed: %w", ErrUpstreamTLS, addr, err), true
	case errors.As(err, &recErr), errors.As(err, &alert), errors.As(err, &opErr) && opErr.Op == "remote error":
		// "remote error" is a TLS alert from the endpoint; under TLS 1.3
		// a refused client certificate arrives so, after the client's
		// side of the handshake, at the first read.
		return fmt.Errorf("%w: endpoint %s: %w", ErrUpstreamTLS, addr, err), true
	case isTimeout(err):
		return fmt.Errorf("%w: endpoint %s: %w", ErrUpstreamTimeout, addr, err), dial
	case dial:
		return fmt.Errorf("%w: endpoint %s: %w", ErrUpstreamConnect, addr, err), true
	case errors.Is(err, errWriteFailed):
		// The connection broke before the whole request was written: the
		// endpoint cannot have started it (a request is only run once its
		// body is complete), so another endpoint may take it.
		return fmt.Errorf("%w: endpoint %s: %w", ErrUpstreamProtocol, addr, err), true
	default:
		return fmt.Errorf("%w: endpoint %s: %w", ErrUpstreamProtocol, addr, err), false
	}
}

func isTimeout(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	// The common case, a *net.OpError itself, without errors.As (whose
	// target escapes: an allocation on every read that hits a deadline).
	if t, ok := err.(interface{ Timeout() bool }); ok {
		return t.Timeout()
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// writeError sends an OpenAI-style JSON error body:
// {"error":{"message":...,"type":...,"param":null,"code":...}}. param is
// always present, as in OpenAI's errors, so clients that read it find it.
func writeError(w http.ResponseWriter, info errorInfo, err error) {
	writeErrorAfter(w, info, err, time.Second)
}

func writeErrorAfter(w http.ResponseWriter, info errorInfo, err error, retryAfter time.Duration) {
	if info.status == StatusClientClosed {
		return // nobody is listening
	}
	var body struct {
		Error struct {
			Message string  `json:"message"`
			Type    string  `json:"type"`
			Param   *string `json:"param"`
			Code    string  `json:"code"`
		} `json:"error"`
	}
	body.Error.Message = err.Error()
	body.Error.Type = info.typ
	body.Error.Code = info.code
	b, mErr := json.Marshal(&body)
	if mErr != nil { // cannot happen for strings; keep the client informed anyway
		b = []byte(`{"error":{"message":"internal error","type":"internal_error","param":null,"code":"internal_error"}}`)
	}
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(b)+1))
	h.Del("Content-Encoding")
	if info.retryAfter {
		secs := "1"
		if retryAfter > time.Second {
			secs = strconv.Itoa(int((retryAfter + time.Second - 1) / time.Second))
		}
		h.Set("Retry-After", secs)
	}
	w.WriteHeader(info.status)
	_, _ = w.Write(append(b, '\n'))
}
