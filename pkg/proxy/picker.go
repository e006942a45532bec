package proxy

import (
	"context"
	"net/http"
	"net/netip"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/outlier"
)

// Request is what the proxy knows about one client request when it asks
// the Picker where to send it. The proxy reads the body once (bounded by
// Config.MaxBodyBytes) so the Picker can tokenize it; the same bytes are
// replayed to the chosen endpoint.
type Request struct {
	// Service is the rule (service) number the request arrived on.
	Service uint32
	// Method is the client's HTTP method.
	Method string
	// Path is the request path without the query string.
	Path string
	// Model is the X-Model header if present, else the top-level JSON
	// "model" string of the body, else empty.
	Model string
	// Header is the client's request header. The Picker must not modify it.
	Header http.Header
	// Body is the complete request body. The Picker must not modify or
	// retain it after Pick returns.
	Body []byte
	// ClientAddr is the client's address as seen by the proxy.
	ClientAddr netip.AddrPort
	// Legs is set by the Server just before it hands the exchange to
	// Plan.Dispatch: the rule's pooled endpoint connections for the
	// flow's legs (Server.RoundTripper for this service). It is nil when
	// the Picker runs.
	Legs http.RoundTripper
}

// Endpoint is one upstream candidate chosen by the Picker.
type Endpoint struct {
	// Idx is the endpoint's index in the rule's endpoint list. In-flight
	// accounting (InFlightTable) and metric labels use it.
	Idx int
	// Addr is the endpoint's dial address, host:port.
	Addr string
	// Body, when not nil, is sent to this endpoint instead of the
	// client's body: the Picker rewrote it for this endpoint (for example
	// to name the data-parallel rank that must serve the request).
	Body []byte
	// Header, when not nil, holds request headers set on the request to
	// this endpoint, replacing any the client sent under the same names.
	Header http.Header
}

// Plan is the Picker's routing decision for one request.
type Plan struct {
	// Candidates are ordered: the first is the chosen endpoint, the
	// following ones are failover targets tried in order when connecting
	// to the previous one fails before any byte reached the client.
	Candidates []Endpoint
	// Receipt explains the decision (tier, endpoint, matched blocks,
	// reason). It is logged at debug level and returned to the client in
	// the X-Loxilb-Route response header when asked for.
	Receipt string
	// Done, if not nil, is called exactly once when the request is over,
	// with its outcome. It runs on the request goroutine after the last
	// byte was written, so it must be cheap and must not block.
	Done func(Result)
	// FirstByte, if not nil, is called at most once, when the first byte of
	// the chosen endpoint's response body arrives: for a streamed
	// completion that is the first token, so the endpoint has finished the
	// prompt's prefill. It runs on the request goroutine before the byte is
	// written to the client and must not block. With Dispatch it is the
	// first body byte the flow relays to the client (the decode leg's, as
	// a P/D request's prefill is then over), not the proxy's own error
	// answer (WriteError). It is not called when the response has no body;
	// Done always follows.
	FirstByte func()
	// Observe, if not nil, is called once per attempt against a candidate
	// with what it showed about the endpoint (passive health checking): a
	// gateway failure (connect, reset or timeout before the response
	// headers), a 5xx answer, or a success once the response headers
	// arrived. Attempts the client abandoned report nothing. It runs on
	// the request goroutine and must not block.
	Observe func(ep Endpoint, o outlier.Outcome)
	// Dispatch, when set, takes the exchange over instead of the proxy's
	// single-endpoint forwarding: prefill/decode flows need several
	// upstream legs per request. The proxy has read the body (req.Body) and
	// set the receipt header; Dispatch writes the whole response (status,
	// headers, body, flushing as it streams) and returns its outcome, which
	// the proxy records in its metrics and hands to Done. Candidates are
	// ignored. If Dispatch returns Result.Status 0 nothing was written and
	// the proxy answers with the error class of Result.Err; a 2xx Status
	// with a non-nil Err means the flow broke mid-body, and the proxy cuts
	// the client connection. req.Legs gives the flow the rule's pooled,
	// TLS-configured endpoint connections, the proxy's error classes and
	// in-flight accounting. The proxy reads what the flow writes as it
	// reads a single-endpoint relay: FirstByte fires at its first body
	// byte, and the usage block of the client-facing response fills the
	// Result's usage fields unless the flow set them itself.
	Dispatch func(ctx context.Context, w http.ResponseWriter, req *Request) Result
}

// ErrorClass names why a proxied request did not complete normally. The
// values are also the "class" label of loxilb_ai_upstream_errors_total.
type ErrorClass string

// Error classes reported in Result.Class and in metrics.
const (
	ClassNone           ErrorClass = ""
	ClassConnect        ErrorClass = "connect"         // dial refused/unreachable
	ClassTLS            ErrorClass = "tls"             // TLS handshake or verification with the endpoint failed
	ClassTimeout        ErrorClass = "timeout"         // dial or response-header timeout
	ClassProtocol       ErrorClass = "protocol"        // malformed or truncated upstream response
	ClassClientCanceled ErrorClass = "client_canceled" // the client went away
	ClassUnavailable    ErrorClass = "unavailable"     // no endpoint to try
	ClassBadRequest     ErrorClass = "bad_request"     // request rejected before forwarding
	ClassInternal       ErrorClass = "internal"        // a bug or an unclassified picker error
)

// Result is the outcome of one request, handed to Plan.Done.
type Result struct {
	// Endpoint is the Idx of the endpoint that served the response, or of
	// the last one tried when none did; -1 when no endpoint was tried.
	Endpoint int
	// Status is the HTTP status sent to the client (0 if none was sent).
	Status int
	// Attempts is how many candidates were tried.
	Attempts int
	// BytesIn is the request body size, BytesOut the response body bytes
	// written to the client.
	BytesIn, BytesOut int64
	// PromptTokens and CachedTokens are usage.prompt_tokens and
	// usage.prompt_tokens_details.cached_tokens from the response (the
	// JSON body, or the last SSE event carrying usage). HasUsage says
	// whether usage was seen at all; HasCachedTokens whether
	// cached_tokens specifically was present.
	PromptTokens    int64
	CachedTokens    int64
	HasUsage        bool
	HasCachedTokens bool
	// Streamed is true when the response was relayed with a flush after
	// every write (SSE or unknown length).
	Streamed bool
	// Class is ClassNone on success.
	Class ErrorClass
	// Err is the error behind Class, nil on success.
	Err error
	// Duration is from the first byte of the request to the last byte of
	// the response.
	Duration time.Duration
}

// Picker decides where a request goes. The router implements it.
//
// Pick is called concurrently from many request goroutines and must be
// safe for that. It should return quickly (it is on the latency path of
// every request), unless holding the request is the decision (the gateway
// holds one until an earlier request has computed the prompt prefix both
// share). ctx is cancelled when the client goes away. req is the
// proxy's to reuse once the request is over (after Plan.Done, or after
// Dispatch returns): keep what it points to (Header, Body), never req
// itself.
//
// Errors: wrap ErrUnavailable when no healthy endpoint can serve the
// request (503) and ErrBadRequest when the request is malformed (400);
// any other error is answered with 500. A Plan with no Candidates is
// answered with 503. When Pick returns an error, Plan.Done is not called.
type Picker interface {
	Pick(ctx context.Context, req *Request) (Plan, error)
}

// PickerFunc adapts a function to the Picker interface.
type PickerFunc func(ctx context.Context, req *Request) (Plan, error)

// Pick calls f.
func (f PickerFunc) Pick(ctx context.Context, req *Request) (Plan, error) { return f(ctx, req) }

var _ Picker = PickerFunc(nil)
