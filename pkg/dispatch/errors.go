package dispatch

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

// Sentinel errors. Serve answers with the status classify picks for them;
// callers branch with errors.Is.
var (
	// ErrQueueFull means the chosen endpoint is at its in-flight cap and
	// its wait queue is full (429 with Retry-After).
	ErrQueueFull = errors.New("endpoint queue full")
	// ErrParkTimeout means a request waited LLB_PD_MAX_PARK_SEC for an
	// endpoint slot without getting one (503 with Retry-After).
	ErrParkTimeout = errors.New("waited too long for an endpoint slot")
	// ErrTotalCap means LLB_PD_MAX_TOTAL_INFLIGHT requests are running
	// (429 with Retry-After).
	ErrTotalCap = errors.New("total P/D in-flight cap reached")
	// ErrNoEndpoint means no healthy prefill or decode endpoint (503).
	ErrNoEndpoint = errors.New("no healthy endpoint")
	// ErrParamsMissing means the prefill leg succeeded without transfer
	// parameters (502).
	ErrParamsMissing = errors.New("prefill returned no transfer parameters")
	// ErrParamsMalformed means the transfer parameters cannot be used (502).
	ErrParamsMalformed = errors.New("prefill returned malformed transfer parameters")
	// ErrLegConnect means connecting to a leg's endpoint failed (502).
	ErrLegConnect = errors.New("connect failed")
	// ErrLegTimeout means a leg exceeded its timeout (504).
	ErrLegTimeout = errors.New("leg timed out")
	// ErrLegProtocol means a leg's response was broken or truncated (502).
	ErrLegProtocol = errors.New("upstream protocol error")
	// ErrLegStatus means the prefill endpoint answered with a server
	// error (502). A 4xx prefill answer is relayed to the client as is.
	ErrLegStatus = errors.New("upstream error status")
	// ErrBadRequest means the client body is not a JSON object (400).
	ErrBadRequest = errors.New("malformed request")
	// ErrClientGone means the client went away (recorded as 499, not sent).
	ErrClientGone = errors.New("client canceled")
)

type errorInfo struct {
	status     int
	code       string
	class      proxy.ErrorClass
	retryAfter bool
}

// classify is the one place mapping a dispatch error to the client status,
// the JSON error code and the proxy's error class.
func classify(err error) errorInfo {
	switch {
	case errors.Is(err, ErrClientGone):
		return errorInfo{proxy.StatusClientClosed, "client_closed_request", proxy.ClassClientCanceled, false}
	case errors.Is(err, ErrBadRequest):
		return errorInfo{http.StatusBadRequest, "bad_request", proxy.ClassBadRequest, false}
	case errors.Is(err, ErrQueueFull), errors.Is(err, ErrTotalCap):
		return errorInfo{http.StatusTooManyRequests, "pd_queue_full", proxy.ClassUnavailable, true}
	case errors.Is(err, ErrParkTimeout):
		return errorInfo{http.StatusServiceUnavailable, "pd_admission_timeout", proxy.ClassUnavailable, true}
	case errors.Is(err, ErrNoEndpoint):
		return errorInfo{http.StatusServiceUnavailable, "no_healthy_endpoint", proxy.ClassUnavailable, false}
	case errors.Is(err, ErrLegTimeout):
		return errorInfo{http.StatusGatewayTimeout, "upstream_timeout", proxy.ClassTimeout, false}
	case errors.Is(err, ErrParamsMissing):
		return errorInfo{http.StatusBadGateway, "pd_params_missing", proxy.ClassProtocol, false}
	case errors.Is(err, ErrParamsMalformed):
		return errorInfo{http.StatusBadGateway, "pd_params_malformed", proxy.ClassProtocol, false}
	case errors.Is(err, ErrLegConnect):
		return errorInfo{http.StatusBadGateway, "upstream_connect_error", proxy.ClassConnect, false}
	case errors.Is(err, ErrLegProtocol), errors.Is(err, ErrLegStatus):
		return errorInfo{http.StatusBadGateway, "upstream_error", proxy.ClassProtocol, false}
	default:
		return errorInfo{http.StatusInternalServerError, "internal_error", proxy.ClassInternal, false}
	}
}

// StatusFor returns the status Serve answers for err.
func StatusFor(err error) int { return classify(err).status }

// legError is a failed leg: which one, where, and why.
type legError struct {
	leg   string // prefill or decode
	addr  string
	class string // metric class: connect, timeout, protocol, status
	err   error
}

func (e *legError) Error() string { return fmt.Sprintf("%s leg to %s: %v", e.leg, e.addr, e.err) }
func (e *legError) Unwrap() error { return e.err }

// transportError wraps a transport error with the sentinel for its class.
// dialed reports whether the request may have reached the endpoint (false
// only when the TCP connect itself failed, so a retry elsewhere is safe).
func transportError(err error) (wrapped error, class string, connectFailed bool) {
	var opErr *net.OpError
	dial := errors.As(err, &opErr) && opErr.Op == "dial"
	var ne net.Error
	switch {
	case errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()):
		return fmt.Errorf("%w: %w", ErrLegTimeout, err), "timeout", false
	case dial:
		return fmt.Errorf("%w: %w", ErrLegConnect, err), "connect", true
	default:
		return fmt.Errorf("%w: %w", ErrLegProtocol, err), "protocol", false
	}
}

// writeError sends an OpenAI-style JSON error, the same shape the proxy uses.
func writeError(w http.ResponseWriter, info errorInfo, err error, retryAfter time.Duration) {
	if info.status == proxy.StatusClientClosed {
		return
	}
	var body struct {
		Error struct {
			Message string `json:"message"`
			Type    string `json:"type"`
			Code    string `json:"code"`
		} `json:"error"`
	}
	body.Error.Message = err.Error()
	body.Error.Type = "upstream_error"
	switch {
	case info.status == http.StatusBadRequest:
		body.Error.Type = "invalid_request_error"
	case info.retryAfter || info.status == http.StatusServiceUnavailable:
		body.Error.Type = "service_unavailable"
	case info.status == http.StatusInternalServerError:
		body.Error.Type = "internal_error"
	}
	body.Error.Code = info.code
	b, _ := json.Marshal(&body)
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(b)+1))
	if info.retryAfter {
		secs := int((retryAfter + time.Second - 1) / time.Second)
		h.Set("Retry-After", strconv.Itoa(max(secs, 1)))
	}
	w.WriteHeader(info.status)
	_, _ = w.Write(append(b, '\n'))
}
