// Package proxy is the mode-4 (fullproxy) HTTP proxy: it terminates client
// connections on each rule's VIP:port, reads the OpenAI-style request,
// asks a Picker (the router) which endpoint should serve it, and relays
// the request and its response, streaming Server-Sent Events chunk by
// chunk.
//
// In: client connections, either on listeners Serve opens itself (one per
// rule; loopback VIPs need no privileges) or on a listener handed over by
// the daemon (ServeListener), typically the socket the eBPF sk_lookup
// program steers VIP traffic to. A connection's local address selects its
// rule, so one listener may carry many rules.
//
// Out: requests to endpoints over one pool of HTTP/1.1 keep-alive
// connections per rule (upstream.go; the request is written by wire.go,
// plain response heads are parsed by response.go and every other one by
// net/http), the only path from a mode-4 request to an endpoint; a
// request whole in the write buffer is sent inside the wait for its
// answer (flushAwait), which saves the read that would find nothing;
// per-request outcomes (status, bytes, usage.prompt_tokens_details.
// cached_tokens) back to the Picker through Plan.Done, so the router can
// compare predicted with actual cache hits; in-flight counts per endpoint
// in an InFlightTable (inflight.go) that the router reads into its score;
// Prometheus metrics labelled by service and endpoint.
//
// Client side: a lean HTTP/1.1 server (h1conn.go, h1parse.go, h1body.go,
// h1writer.go) serves every listener, plaintext or TLS, in place of
// net/http's server. On Linux both sides' plain TCP sockets are read and
// written with raw system calls through their RawConn (pkg/rawio):
// the same poller, locks and deadlines, without the scheduler's hand-off
// of the thread's P around each call, which under load cost the runtime's
// monitor and thread wakeups about a tenth of the CPU. One goroutine per connection parses each request
// head inside the connection's 4 KiB read buffer, with RFC 9112 framing
// and nothing looser than net/http: one private copy of the head per
// request holds every string (canonical field names rewritten in place),
// the header map and its values take two more allocations, and the answer
// is written straight into the connection's write buffer, the endpoint's
// header fields relayed from its own map (minus hop-by-hop ones) instead
// of copied into a ResponseWriter's (sorted, with a Date field if the
// endpoint sent none; no Content-Type sniffing). Keep-alive, pipelined requests
// (answered in order, each answer flushed), Expect: 100-continue (sent on the first body
// read), chunked request bodies (trailers read and dropped; the body is
// relayed with a Content-Length), HEAD, Connection: close and the
// ReadHeaderTimeout/IdleTimeout deadlines (coarse: see below) behave as under net/http. A
// request body left unread (413, a refused body) closes the connection
// after the answer, the sending side first so the client reads it.
// Client-gone detection costs nothing for short requests: 100 ms after
// its body was read (watchDelay), a read on the client connection starts
// watching for a reset, which cancels the upstream work; a half-close is
// remembered, the answer still sent, then the connection closed.
//
// What the lean server refuses itself, answered like net/http's own
// refusals (plain-text status, Connection: close) and counted in
// loxilb_proxy_conn_rejected_total: bad syntax in the request line or a
// field, a missing, repeated or invalid Host (bad_request, 400); a
// Content-Length that is not plain digits, a second Content-Length even
// with the same value, Transfer-Encoding together with Content-Length
// (framing, 400: net/http accepts the last two, HAProxy refuses them, and
// they are the classic smuggling shapes); obs-fold line continuations
// (obs_fold, 400: net/http joins them); a transfer coding other than one
// "chunked" (unsupported_te, 501). Malformed chunked framing is a 400 of
// the request.
//
// What it hands to net/http's server, with the bytes already read, for
// the rest of the connection (counted in loxilb_proxy_http1_fallback_total
// by reason): any version but HTTP/1.1 (HTTP/1.0, an HTTP/2 preface);
// request targets other than a plain origin-form path (absolute-form,
// CONNECT's authority-form, OPTIONS *, percent escapes or other bytes
// url.URL would rewrite in the path); heads with a bare LF or CR; an
// Expect other than 100-continue (net/http answers 417); heads larger than
// the read buffer or with more than 256 fields (net/http's 1 MiB limit and
// 431 apply); a TLS session that negotiated another protocol than
// http/1.1 (only http/1.1 is offered). So no form that served before is
// refused now, and net/http's answers for those forms are unchanged; the
// stricter refusals above are the only deliberate differences, listed in
// the corpus test (h1parse_test.go) that checks the parser against
// net/http's server input by input.
//
// Neighbours: the router implements Picker (and uses the tokenizer,
// blockhash and kvindex packages to decide); a control stage
// (reconcilers.Listeners) builds Config from the rules and
// calls Update when they change; the dataplane steers VIP traffic to its
// listener. The daemon creates the InFlightTable first and hands it to
// the gateway (which reads it) and to the Server (which counts into it,
// with the gateway as its Picker); nothing is connected after
// construction.
//
// Request handling, in order:
//
//  1. The body is read once, up to Config.MaxBodyBytes (413 beyond), so
//     the Picker can tokenize it; the same bytes are replayed upstream.
//  2. The model is the X-Model header, else the body's top-level JSON
//     "model" string (ModelOf).
//  3. Picker.Pick returns ordered candidates. A failure to connect (or to
//     complete the TLS handshake) to a candidate moves on to the next one;
//     once the endpoint may have seen the request, nothing is retried,
//     because replaying a generation request would run it twice.
//  4. The response is relayed; event streams and unknown-length bodies
//     are flushed after every write. Usage is extracted from JSON bodies
//     and from the last SSE event that carries it, without buffering the
//     stream.
//
// A Plan may instead carry its own flow (Plan.Dispatch: pkg/dispatch's
// prefill/decode flows). The proxy hands the flow, in Request.Legs, the
// rule's upstream (legs.go): every leg goes over the rule's connection
// pool with its TLS settings (security 2), counts in the endpoint's
// in-flight number while it runs, and fails with the proxy's error
// classes (connect, tls, timeout, protocol). A leg bounds its own time
// (proxy.Leg: the flow's dial timeout, its prefill and decode timeouts
// through the request context) instead of ResponseHeaderTimeout and
// StreamIdleTimeout. Transport is the same upstream without a Server, for
// flows run outside the listener (tests, benchmarks). The flow writes its
// client-facing response through the proxy (flowtap.go), which treats it
// like a single-endpoint relay: the plan's FirstByte fires at its first
// body byte (so followers coalesced behind a P/D leader are released when
// the decode leg starts answering), and its usage block is counted in
// loxilb_ai_usage_reported_total under Result.Endpoint (the decode
// endpoint) and handed to Done. A prefill leg's own answer never reaches
// the client and its usage is not counted: one usage block per answered
// request, as for single-endpoint requests.
//
// Every error of the mode-4 listener, the flows' included, is mapped to a
// status in one function (classify; VerdictFor and WriteError are its
// faces for flows that write their own answer): 400 malformed request,
// 413 body too large, 429 a P/D endpoint queue or the process-wide P/D cap
// full (with Retry-After), 502 upstream connect/TLS/protocol error, an
// endpoint's server error where a flow needs an answer, or missing or
// malformed transfer parameters, 503 no healthy endpoint (or, with
// Retry-After, the proxy's body memory is spent or a P/D request waited
// too long for an endpoint slot), 504 upstream timeout, 500 anything
// unclassified. Bodies follow the OpenAI shape
// {"error":{"message":...,"type":...,"param":null,"code":...}}.
// A response gets its status line with its first body byte (event streams
// at once), so an endpoint failing before that still yields a clean error;
// a failure after the status line was sent flushes what was relayed and
// cuts the client connection. A request never ends with an empty 200.
//
// Limits against hostile or broken peers (Config): request bodies grow as
// bytes arrive and all of them together hold at most MaxInflightBodyBytes;
// endpoint response headers are capped at MaxResponseHeaderBytes; the
// response headers and the first body byte must come within
// ResponseHeaderTimeout, and later no stream may stay silent for
// StreamIdleTimeout, nor an event stream run past its service's
// MaxStreamDuration; each listener keeps at most MaxConnsPerListener
// connections. The header, idle and first-byte bounds are coarse
// deadlines (deadline.go): moved only when they must be, so they fire up
// to a sixteenth of their duration late, and a keep-alive request
// updates no runtime timer; the client watch's timer likewise stays
// scheduled across requests (arm). A client that half-closes after its request still gets the
// answer: only a closed or failed connection cancels the request (unless
// AbortOnClientClose).
//
// Metrics (labels service and ep keep rules apart): loxilb_ai_requests_total
// {service,ep,status}, loxilb_ai_request_duration_seconds{service},
// loxilb_ai_active_streams{service}, loxilb_ai_upstream_errors_total
// {service,ep,class}, loxilb_proxy_connect_failover_total{service},
// loxilb_ai_bytes_total{service,ep,direction}, loxilb_ai_usage_reported_total
// {service,ep,cached}, loxilb_proxy_conn_rejected_total{reason} (no_service,
// conn_limit, body_memory), loxilb_proxy_upstream_limit_total
// {service,ep,limit} (response_header_bytes, response_header_timeout,
// stream_idle, stream_duration), loxilb_proxy_body_bytes_inflight and
// loxilb_proxy_http1_fallback_total{reason}; conn_rejected also counts the
// heads the lean server refuses (bad_request, framing, obs_fold,
// unsupported_te). A rule removed by Update loses its series.
//
// Security levels: 0 plaintext; 1 TLS terminated at the proxy; 2 TLS
// terminated and a new TLS session to the endpoint, whose certificate is
// verified (against Service.CAFile, or the system roots) unless
// Service.InsecureSkipVerify is set. Only HTTP/1.1 is offered on either
// leg. Protocol upgrades (WebSocket) are not relayed.
package proxy
