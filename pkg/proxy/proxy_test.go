package proxy

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// echoBackend answers with what it received, so tests can see what the
// proxy forwarded.
type echoed struct {
	Method  string      `json:"method"`
	Path    string      `json:"path"`
	Query   string      `json:"query"`
	Host    string      `json:"host"`
	Body    string      `json:"body"`
	Header  http.Header `json:"header"`
	Backend string      `json:"backend"`
}

func echoBackend(t *testing.T, name string) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	conns := new(atomic.Int64)
	b := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Backend", name)
		_ = json.NewEncoder(w).Encode(echoed{
			Method: r.Method, Path: r.URL.Path, Query: r.URL.RawQuery, Host: r.Host,
			Body: string(body), Header: r.Header, Backend: name,
		})
	}))
	b.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	b.Start()
	t.Cleanup(b.Close)
	return b, conns
}

func hostPort(s *httptest.Server) string { return s.Listener.Addr().String() }

func decodeEcho(t *testing.T, resp *http.Response) echoed {
	t.Helper()
	defer resp.Body.Close()
	var e echoed
	if err := json.NewDecoder(resp.Body).Decode(&e); err != nil {
		t.Fatalf("decode echo: %v", err)
	}
	return e
}

func TestForwardsEveryPath(t *testing.T) {
	b, _ := echoBackend(t, "b0")
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.10", Config{}, Service{}, p)
	c := newClient()

	cases := []struct {
		method, path, body string
	}{
		{"GET", "/health", ""},
		{"GET", "/v1/models", ""},
		{"POST", "/v1/chat/completions", `{"model":"m","messages":[]}`},
		{"PUT", "/some/other/path?x=1&y=%2F", "payload"},
		{"DELETE", "/", ""},
	}
	for _, tc := range cases {
		t.Run(tc.method+tc.path, func(t *testing.T) {
			req, _ := http.NewRequest(tc.method, "http://"+px.addr+tc.path, strings.NewReader(tc.body))
			req.Header.Set("Connection", "keep-alive, X-Hop")
			req.Header.Set("X-Hop", "must not pass")
			req.Header.Set("X-Forwarded-For", "192.0.2.1")
			req.Header.Set("X-End-To-End", "kept")
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			if resp.StatusCode != 200 {
				t.Fatalf("status %d", resp.StatusCode)
			}
			e := decodeEcho(t, resp)
			wantPath, wantQuery, _ := strings.Cut(tc.path, "?")
			if e.Method != tc.method || e.Path != wantPath || e.Query != wantQuery || e.Body != tc.body {
				t.Errorf("forwarded %s %s?%s body %q, want %s %s?%s body %q", e.Method, e.Path, e.Query, e.Body, tc.method, wantPath, wantQuery, tc.body)
			}
			if e.Host != px.addr {
				t.Errorf("Host %q, want the client's %q", e.Host, px.addr)
			}
			if got := e.Header.Get("X-Hop"); got != "" {
				t.Errorf("Connection-listed header relayed: %q", got)
			}
			if got := e.Header.Get("X-End-To-End"); got != "kept" {
				t.Errorf("end-to-end header lost: %q", got)
			}
			if got := e.Header.Get("X-Forwarded-For"); got != "192.0.2.1, 127.0.0.1" {
				t.Errorf("X-Forwarded-For %q, want the client appended", got)
			}
			if got := e.Header.Get("X-Forwarded-Proto"); got != "http" {
				t.Errorf("X-Forwarded-Proto %q", got)
			}
			if got := e.Header.Get("User-Agent"); got != "Go-http-client/1.1" {
				t.Errorf("client User-Agent not relayed: %q", got)
			}
		})
	}
}

func TestKeepAliveReuse(t *testing.T) {
	b, backendConns := echoBackend(t, "b0")
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.11", Config{}, Service{}, p)
	c := newClient()
	const n = 50
	for i := range n {
		resp, err := c.Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(fmt.Sprintf(`{"model":"m","prompt":"%d"}`, i)))
		if err != nil {
			t.Fatal(err)
		}
		_ = decodeEcho(t, resp)
	}
	if got := px.accept.Load(); got != 1 {
		t.Errorf("client opened %d connections to the proxy for %d sequential requests, want 1", got, n)
	}
	if got := backendConns.Load(); got != 1 {
		t.Errorf("proxy opened %d connections to the endpoint for %d sequential requests, want 1 (pooled)", got, n)
	}
}

func TestModelFromHeaderOrBody(t *testing.T) {
	b, _ := echoBackend(t, "b0")
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.12", Config{}, Service{ID: 42}, p)
	c := newClient()
	cases := []struct{ header, body, want string }{
		{"", `{"model":"qwen/Qwen2.5-7B","messages":[]}`, "qwen/Qwen2.5-7B"},
		{"hdr-model", `{"model":"body-model"}`, "hdr-model"},
		{"", `{"messages":[{"content":"{\"model\":\"inner\"}"}],"model":"outer"}`, "outer"},
		{"", `not json`, ""},
		{"", ``, ""},
	}
	for _, tc := range cases {
		req, _ := http.NewRequest("POST", "http://"+px.addr+"/v1/chat/completions", strings.NewReader(tc.body))
		if tc.header != "" {
			req.Header.Set("X-Model", tc.header)
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		e := decodeEcho(t, resp)
		got := p.lastReq(t)
		if got.Model != tc.want {
			t.Errorf("header %q body %q: model %q, want %q", tc.header, tc.body, got.Model, tc.want)
		}
		if got.Service != 42 || got.Path != "/v1/chat/completions" || string(got.Body) != tc.body || !got.ClientAddr.IsValid() {
			t.Errorf("picker request = %+v", got)
		}
		if e.Body != tc.body {
			t.Errorf("body not replayed intact: %q", e.Body)
		}
	}
}

func TestBodyLimit(t *testing.T) {
	var hits atomic.Int64
	b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits.Add(1) }))
	defer b.Close()
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.13", Config{MaxBodyBytes: 1024}, Service{}, p)
	c := newClient()

	for _, chunked := range []bool{false, true} {
		body := strings.Repeat("x", 2048)
		var r io.Reader = strings.NewReader(body)
		if chunked {
			r = io.MultiReader(strings.NewReader(body)) // unknown length: sent chunked
		}
		req, _ := http.NewRequest("POST", "http://"+px.addr+"/v1/completions", r)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		ei := readErrorBody(t, resp)
		if resp.StatusCode != http.StatusRequestEntityTooLarge || ei.Code != "request_too_large" {
			t.Errorf("chunked=%v: status %d code %q, want 413 request_too_large", chunked, resp.StatusCode, ei.Code)
		}
	}
	// Exactly at the limit passes.
	resp, err := c.Post("http://"+px.addr+"/v1/completions", "text/plain", strings.NewReader(strings.Repeat("y", 1024)))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("body at the limit: status %d", resp.StatusCode)
	}
	if hits.Load() != 1 {
		t.Errorf("endpoint saw %d requests, want only the one within the limit", hits.Load())
	}
	if got := testutil.ToFloat64(px.m.requests.WithLabelValues("7", "none", "413")); got != 2 {
		t.Errorf("413 counter %v, want 2", got)
	}
}

type errorBody struct {
	Message, Type, Code string
}

func readErrorBody(t *testing.T, resp *http.Response) errorBody {
	t.Helper()
	defer resp.Body.Close()
	var b struct {
		Error errorBody `json:"error"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&b); err != nil {
		t.Fatalf("status %d: error body is not OpenAI-style JSON: %v", resp.StatusCode, err)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("error Content-Type %q", ct)
	}
	return b.Error
}

func TestFailoverOnConnectRefused(t *testing.T) {
	b, _ := echoBackend(t, "good")
	p := newStaticPicker(refusedAddr(t), refusedAddr(t), hostPort(b))
	px := startProxy(t, "127.0.0.14", Config{}, Service{}, p)
	resp, err := newClient().Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"x"}`))
	if err != nil {
		t.Fatal(err)
	}
	if e := decodeEcho(t, resp); resp.StatusCode != 200 || e.Backend != "good" {
		t.Fatalf("status %d from %q, want 200 from good", resp.StatusCode, e.Backend)
	}
	res := p.waitResult(t)
	if res.Endpoint != 2 || res.Attempts != 3 || res.Status != 200 || res.Err != nil {
		t.Errorf("result %+v, want endpoint 2 after 3 attempts", res)
	}
	if got := testutil.ToFloat64(px.m.failover.WithLabelValues("7")); got != 2 {
		t.Errorf("loxilb_proxy_connect_failover_total = %v, want 2", got)
	}
	if got := testutil.ToFloat64(px.m.upstreamErrs.WithLabelValues("7", "0", "connect")); got != 1 {
		t.Errorf("connect errors for ep 0 = %v, want 1", got)
	}
	if got := testutil.ToFloat64(px.m.requests.WithLabelValues("7", "2", "200")); got != 1 {
		t.Errorf("requests{ep=2,status=200} = %v", got)
	}
}

func TestErrorStatusMapping(t *testing.T) {
	hang := make(chan struct{})
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body) // lets the server notice the proxy hanging up
		select {
		case <-hang:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(slow.Close)
	t.Cleanup(func() { close(hang) }) // runs before slow.Close
	garbage, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { garbage.Close() })
	go func() {
		for {
			c, err := garbage.Accept()
			if err != nil {
				return
			}
			go func() {
				_, _ = bufio.NewReader(c).ReadString('\n')
				_, _ = c.Write([]byte("SSH-2.0-not-http\r\n\r\n"))
				c.Close()
			}()
		}
	}()

	cases := []struct {
		name       string
		cands      []string
		pickErr    error
		wantStatus int
		wantCode   string
	}{
		{"all refused", []string{refusedAddr(t), refusedAddr(t)}, nil, 502, "upstream_connect_error"},
		{"garbage answer", []string{garbage.Addr().String()}, nil, 502, "upstream_protocol_error"},
		{"header timeout", []string{hostPort(slow)}, nil, 504, "upstream_timeout"},
		{"no candidates", nil, nil, 503, "no_healthy_endpoint"},
		{"picker unavailable", nil, fmt.Errorf("all endpoints down: %w", ErrUnavailable), 503, "no_healthy_endpoint"},
		{"picker bad request", nil, fmt.Errorf("messages is not an array: %w", ErrBadRequest), 400, "bad_request"},
		{"picker unknown error", nil, errors.New("boom"), 500, "internal_error"},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := newStaticPicker(tc.cands...)
			p.err = tc.pickErr
			px := startProxy(t, fmt.Sprintf("127.0.0.%d", 20+i), Config{ResponseHeaderTimeout: 100 * time.Millisecond}, Service{}, p)
			resp, err := newClient().Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{"model":"m"}`))
			if err != nil {
				t.Fatal(err)
			}
			eb := readErrorBody(t, resp)
			if resp.StatusCode != tc.wantStatus || eb.Code != tc.wantCode || eb.Message == "" {
				t.Errorf("got %d %+v, want %d code %s", resp.StatusCode, eb, tc.wantStatus, tc.wantCode)
			}
			if tc.pickErr == nil {
				if r := p.waitResult(t); r.Status != tc.wantStatus || r.Err == nil {
					t.Errorf("Done result %+v", r)
				}
			}
		})
	}
}

func TestStatusFor(t *testing.T) {
	cases := []struct {
		err  error
		want int
	}{
		{fmt.Errorf("x: %w", ErrBodyTooLarge), 413},
		{fmt.Errorf("x: %w", ErrBadRequest), 400},
		{fmt.Errorf("x: %w", ErrUnavailable), 503},
		{ErrNoService, 503},
		{fmt.Errorf("x: %w", ErrUpstreamConnect), 502},
		{fmt.Errorf("x: %w", ErrUpstreamTLS), 502},
		{fmt.Errorf("x: %w", ErrUpstreamProtocol), 502},
		{fmt.Errorf("x: %w", ErrUpstreamTimeout), 504},
		{context.Canceled, StatusClientClosed},
		{errors.New("other"), 500},
	}
	for _, tc := range cases {
		if got := StatusFor(tc.err); got != tc.want {
			t.Errorf("StatusFor(%v) = %d, want %d", tc.err, got, tc.want)
		}
	}
}

func TestReceiptHeader(t *testing.T) {
	b, _ := echoBackend(t, "b0")
	p := newStaticPicker(hostPort(b))
	p.receipt = "tier=1.5 ep=0 matched=12/16 reason=longest-prefix"
	px := startProxy(t, "127.0.0.30", Config{}, Service{Receipts: ReceiptsOnRequest}, p)
	c := newClient()
	get := func(ask bool) (string, http.Header) {
		req, _ := http.NewRequest("POST", "http://"+px.addr+"/v1/completions", strings.NewReader(`{}`))
		if ask {
			req.Header.Set(HeaderReceiptRequest, "1")
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		e := decodeEcho(t, resp)
		return resp.Header.Get(HeaderRoute), e.Header
	}
	if got, fwd := get(true); got != p.receipt {
		t.Errorf("asked: %s = %q, want %q", HeaderRoute, got, p.receipt)
	} else if fwd.Get(HeaderReceiptRequest) != "" {
		t.Error("receipt request header leaked to the endpoint")
	}
	if got, _ := get(false); got != "" {
		t.Errorf("not asked: %s = %q, want none", HeaderRoute, got)
	}

	// The per-rule flag adds it to every response, applied by Update on
	// the same listener and keep-alive connection.
	cfg := Config{Services: []Service{{ID: 7, Listen: px.table.Load().list[0].cfg.Listen, Receipts: ReceiptsAlways}}}
	if err := px.Update(cfg); err != nil {
		t.Fatal(err)
	}
	if got, _ := get(false); got != p.receipt {
		t.Errorf("rule flag: %s = %q, want %q", HeaderRoute, got, p.receipt)
	}
	if px.accept.Load() != 1 {
		t.Errorf("client needed %d connections across Update, want 1", px.accept.Load())
	}
}

// TestReceiptOffByDefault: a receipt says how much of a prompt an endpoint
// holds, so a client that asks for one on a rule without the operator's
// consent learns nothing.
func TestReceiptOffByDefault(t *testing.T) {
	b, _ := echoBackend(t, "b0")
	p := newStaticPicker(hostPort(b))
	p.receipt = "tier=1.5 ep=0 matched=8/8 reason=longest-prefix"
	px := startProxy(t, "127.0.0.31", Config{}, Service{}, p)
	req, _ := http.NewRequest("POST", "http://"+px.addr+"/v1/completions", strings.NewReader(`{}`))
	req.Header.Set(HeaderReceiptRequest, "1")
	resp, err := newClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	e := decodeEcho(t, resp)
	if got := resp.Header.Get(HeaderRoute); got != "" {
		t.Errorf("receipts off: %s = %q, want none", HeaderRoute, got)
	}
	if e.Header.Get(HeaderReceiptRequest) != "" {
		t.Error("receipt request header leaked to the endpoint")
	}
}

// TestReceiptNotForgeable: an endpoint's own X-Loxilb-Route never reaches
// the client, whether receipts are off (it would pass for ours) or on (it
// would replace ours).
func TestReceiptNotForgeable(t *testing.T) {
	b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header()["x-loxilb-route"] = []string{"tier=forged ep=9"} // not canonical: relayed as sent
		w.Header().Set(HeaderRoute, "tier=forged ep=9 matched=8/8")
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{}`)
	}))
	t.Cleanup(b.Close)
	p := newStaticPicker(hostPort(b))
	p.receipt = "tier=1.5 ep=0 matched=0/8 reason=no-match"
	for _, tc := range []struct {
		vip  string
		pol  ReceiptPolicy
		want string
	}{
		{"127.0.0.32", ReceiptsOff, ""},
		{"127.0.0.33", ReceiptsOnRequest, p.receipt},
		{"127.0.0.34", ReceiptsAlways, p.receipt},
	} {
		px := startProxy(t, tc.vip, Config{}, Service{Receipts: tc.pol}, p)
		req, _ := http.NewRequest("POST", "http://"+px.addr+"/v1/completions", strings.NewReader(`{}`))
		req.Header.Set(HeaderReceiptRequest, "1")
		resp, err := newClient().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if got := resp.Header.Values(HeaderRoute); len(got) > 1 || resp.Header.Get(HeaderRoute) != tc.want {
			t.Errorf("policy %v: %s = %q, want %q", tc.pol, HeaderRoute, got, tc.want)
		}
	}
}

func TestParseReceiptPolicy(t *testing.T) {
	for _, s := range []string{"off", "on-request", "always"} {
		p, err := ParseReceiptPolicy(s)
		if err != nil || p.String() != s {
			t.Errorf("%q: %v %v", s, p, err)
		}
	}
	if _, err := ParseReceiptPolicy("on"); err == nil {
		t.Error("want an error for an unknown policy")
	}
}

func TestUsageFromJSONResponse(t *testing.T) {
	b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"x","choices":[{"text":"hi"}],"usage":{"prompt_tokens":2048,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":1984}}}`)
	}))
	defer b.Close()
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.31", Config{}, Service{}, p)
	resp, err := newClient().Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{"model":"m"}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	r := p.waitResult(t)
	if !r.HasUsage || !r.HasCachedTokens || r.CachedTokens != 1984 || r.PromptTokens != 2048 {
		t.Errorf("usage not extracted: %+v", r)
	}
	if r.BytesOut != int64(len(body)) || r.BytesIn != int64(len(`{"model":"m"}`)) || r.Streamed {
		t.Errorf("bytes in/out %d/%d streamed=%v", r.BytesIn, r.BytesOut, r.Streamed)
	}
}

// TestSSEChunkByChunk proves streaming is not buffered: the endpoint
// cannot produce its last event until the client has received the first.
func TestSSEChunkByChunk(t *testing.T) {
	firstSeen := make(chan struct{})
	b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		f := w.(http.Flusher)
		io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n")
		f.Flush()
		select {
		case <-firstSeen:
		case <-r.Context().Done():
			return
		}
		io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\n\n")
		f.Flush()
		// The final chunk with usage, split across writes to exercise
		// the line reassembly of the tap.
		io.WriteString(w, `data: {"choices":[],"usage":{"prompt_tokens":64,"prompt_tokens_`)
		f.Flush()
		io.WriteString(w, `details":{"cached_tokens":48}}}`+"\n\n")
		io.WriteString(w, "data: [DONE]\n\n")
	}))
	defer b.Close()
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.32", Config{}, Service{}, p)

	req, _ := http.NewRequest("POST", "http://"+px.addr+"/v1/chat/completions", strings.NewReader(`{"model":"m","stream":true}`))
	resp, err := newClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("Content-Type %q", ct)
	}
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(line, "Hel") {
		t.Fatalf("first line %q", line)
	}
	if got := testutil.ToFloat64(px.m.activeStreams.WithLabelValues("7")); got != 1 {
		t.Errorf("active streams while streaming = %v, want 1", got)
	}
	close(firstSeen)
	rest, err := io.ReadAll(br)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(rest), "lo") || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Errorf("rest of stream %q", rest)
	}
	r := p.waitResult(t)
	if !r.Streamed || !r.HasCachedTokens || r.CachedTokens != 48 || r.PromptTokens != 64 {
		t.Errorf("result %+v", r)
	}
	if got := testutil.ToFloat64(px.m.activeStreams.WithLabelValues("7")); got != 0 {
		t.Errorf("active streams after = %v, want 0", got)
	}
}

func TestInFlightTracking(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan struct{}, 1)
	b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		entered <- struct{}{}
		<-release
	}))
	defer b.Close()
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.33", Config{}, Service{ID: 9}, p)
	done := make(chan error, 1)
	go func() {
		resp, err := newClient().Get("http://" + px.addr + "/x")
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	<-entered
	if got := px.inflight.Count(9, 0); got != 1 {
		t.Errorf("InFlight during request = %d, want 1", got)
	}
	if got := px.inflight.Count(9, 1); got != 0 {
		t.Errorf("InFlight of an idle endpoint = %d", got)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	p.waitResult(t)
	if got := px.inflight.Count(9, 0); got != 0 {
		t.Errorf("InFlight after = %d, want 0", got)
	}
}

// TestMidStreamFailureCutsClient checks that an endpoint dying after the
// status line surfaces as a truncated response, not a clean end.
func TestMidStreamFailureCutsClient(t *testing.T) {
	b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "1000")
		io.WriteString(w, "partial")
		w.(http.Flusher).Flush()
		c, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			c.Close()
		}
	}))
	defer b.Close()
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.34", Config{}, Service{}, p)
	// The status line may still sit in the proxy's write buffer when the
	// connection is cut, so the client sees either a failed request or a
	// failed body read; never a clean end.
	resp, err := newClient().Get("http://" + px.addr + "/x")
	if err == nil {
		_, err = io.ReadAll(resp.Body)
		resp.Body.Close()
	}
	if err == nil {
		t.Error("client read a clean end of a truncated response")
	}
	r := p.waitResult(t)
	if r.Class != ClassProtocol || r.Status != 200 {
		t.Errorf("result %+v, want protocol class after status 200", r)
	}
}

// TestServeOwnedListeners covers Serve binding loopback VIPs itself and
// Update opening and closing listeners as rules come and go.
func TestServeOwnedListeners(t *testing.T) {
	b, _ := echoBackend(t, "b0")
	p := newStaticPicker(hostPort(b))
	a1 := freeAddr(t, "127.0.0.40")
	s, err := New(Config{Services: []Service{{ID: 1, Listen: a1}}}, p, new(InFlightTable), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- s.Serve(ctx) }()
	c := newClient()
	waitUp := func(addr string) *http.Response {
		t.Helper()
		for i := 0; ; i++ {
			resp, err := c.Get("http://" + addr + "/ping")
			if err == nil {
				return resp
			}
			if i > 1000 {
				t.Fatalf("%s never came up: %v", addr, err)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	_ = decodeEcho(t, waitUp(a1.String()))

	a2 := freeAddr(t, "127.0.0.41")
	if err := s.Update(Config{Services: []Service{{ID: 1, Listen: a1}, {ID: 2, Listen: a2}}}); err != nil {
		t.Fatal(err)
	}
	_ = decodeEcho(t, waitUp(a2.String()))
	if got := p.lastReq(t).Service; got != 2 {
		t.Errorf("request on the second VIP routed as service %d", got)
	}

	if err := s.Update(Config{Services: []Service{{ID: 2, Listen: a2}}}); err != nil {
		t.Fatal(err)
	}
	c.CloseIdleConnections()
	if _, err := c.Get("http://" + a1.String() + "/ping"); err == nil {
		t.Error("removed rule's listener still accepts")
	}
	// A bind failure is that rule's alone: the others are applied, and
	// the next Update tries again once the address is free.
	busy, err := net.Listen("tcp", "127.0.0.42:0")
	if err != nil {
		t.Fatal(err)
	}
	held := busy.Addr().(*net.TCPAddr).AddrPort()
	a4 := freeAddr(t, "127.0.0.43")
	bad := Config{Services: []Service{{ID: 2, Listen: a2}, {ID: 3, Listen: held}, {ID: 4, Listen: a4}}}
	err = s.Update(bad)
	var le *ListenError
	if !errors.As(err, &le) || le.ID != 3 || le.Addr != held || le.Reason() != ReasonVIPPortInUse ||
		!errors.Is(err, ErrListen) || !errors.Is(err, syscall.EADDRINUSE) {
		t.Fatalf("Update binding a busy address: %v", err)
	}
	_ = decodeEcho(t, waitUp(a4.String()))
	busy.Close()
	if err := s.Update(bad); err != nil {
		t.Fatalf("Update after the address freed: %v", err)
	}
	_ = decodeEcho(t, waitUp(held.String()))
	cancel()
	if err := <-errc; err != nil {
		t.Fatalf("Serve: %v", err)
	}
}

func TestServeListenerDemuxRejectsUnknownAddress(t *testing.T) {
	// One listener on 127.0.0.1 whose rule is for another address: the
	// connection matches no rule and is closed, and counted.
	ln, err := net.Listen("tcp", "127.0.0.50:0")
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Services: []Service{{ID: 1, Listen: freeAddr(t, "127.0.0.51")}}}, newStaticPicker(), new(InFlightTable), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- s.ServeListener(ctx, ln) }()
	resp, err := newClient().Get("http://" + ln.Addr().String() + "/")
	if err == nil {
		resp.Body.Close()
		t.Error("connection to an address no rule owns was served")
	}
	if got := testutil.ToFloat64(s.m.connRejected.WithLabelValues("no_service")); got < 1 {
		t.Errorf("rejected connections = %v", got)
	}
	cancel()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

func TestConfigValidation(t *testing.T) {
	p := newStaticPicker()
	a := freeAddr(t, "127.0.0.60")
	cases := map[string]Config{
		"duplicate id":    {Services: []Service{{ID: 1, Listen: a}, {ID: 1, Listen: freeAddr(t, "127.0.0.61")}}},
		"duplicate addr":  {Services: []Service{{ID: 1, Listen: a}, {ID: 2, Listen: a}}},
		"no port":         {Services: []Service{{ID: 1}}},
		"tls without key": {Services: []Service{{ID: 1, Listen: a, Security: SecurityTLS}}},
		"bad security":    {Services: []Service{{ID: 1, Listen: a, Security: 3}}},
		"missing cert":    {Services: []Service{{ID: 1, Listen: a, Security: SecurityTLS, CertFile: "/nonexistent", KeyFile: "/nonexistent"}}},
		"negative body":   {MaxBodyBytes: -1},
	}
	for name, cfg := range cases {
		if _, err := New(cfg, p, new(InFlightTable), nil, nil); err == nil {
			t.Errorf("%s: New accepted an invalid config", name)
		}
	}
	if _, err := New(Config{}, nil, new(InFlightTable), nil, nil); err == nil {
		t.Error("New accepted a nil picker")
	}
	if _, err := New(Config{}, p, nil, nil, nil); err == nil {
		t.Error("New accepted a nil in-flight table")
	}
}

func TestMetricsRegistration(t *testing.T) {
	px := startProxy(t, "127.0.0.62", Config{}, Service{}, newStaticPicker())
	if _, err := New(Config{}, newStaticPicker(), new(InFlightTable), nil, px.reg); err == nil {
		t.Error("second proxy on the same registry did not report the collision")
	}
}

// TestClientTimeouts checks that a client sending headers or a body too
// slowly is cut off rather than holding a connection forever.
func TestClientTimeouts(t *testing.T) {
	b, _ := echoBackend(t, "b0")
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.35", Config{ReadHeaderTimeout: 50 * time.Millisecond, BodyReadTimeout: 50 * time.Millisecond}, Service{}, p)

	// Headers never finished: the proxy closes the connection.
	c, err := net.Dial("tcp", px.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	io.WriteString(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
	if _, err := io.ReadAll(c); err != nil {
		t.Errorf("slow headers: %v", err)
	}

	// Body promised but not sent: 400 with an OpenAI-style error.
	c2, err := net.Dial("tcp", px.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	io.WriteString(c2, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\":")
	resp, err := http.ReadResponse(bufio.NewReader(c2), nil)
	if err != nil {
		t.Fatal(err)
	}
	eb := readErrorBody(t, resp)
	if resp.StatusCode != 400 || eb.Code != "bad_request" {
		t.Errorf("slow body: %d %+v", resp.StatusCode, eb)
	}
}

func TestCloseStopsServe(t *testing.T) {
	s, err := New(Config{Services: []Service{{ID: 1, Listen: freeAddr(t, "127.0.0.36")}}}, newStaticPicker(), new(InFlightTable), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { errc <- s.Serve(context.Background()) }()
	for len(s.Addrs()) == 0 {
		time.Sleep(time.Millisecond)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Errorf("Serve after Close: %v", err)
	}
	if err := s.Update(Config{}); err == nil {
		t.Error("Update after Close succeeded")
	}
}

func TestMetricNamesAndLabels(t *testing.T) {
	b, _ := echoBackend(t, "b0")
	p := newStaticPicker(refusedAddr(t), hostPort(b))
	px := startProxy(t, "127.0.0.63", Config{}, Service{ID: 5}, p)
	resp, err := newClient().Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	_ = decodeEcho(t, resp)
	p.waitResult(t)
	mfs, err := px.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][]string{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, l.GetName()+"="+l.GetValue())
			}
			got[mf.GetName()] = append(got[mf.GetName()], strings.Join(ls, ","))
		}
	}
	want := map[string]string{
		"loxilb_ai_requests_total":            "ep_idx=1,service=5,status=200",
		"loxilb_ai_request_duration_seconds":  "service=5",
		"loxilb_ai_upstream_errors_total":     "class=connect,ep_idx=0,service=5",
		"loxilb_proxy_connect_failover_total": "service=5",
		"loxilb_ai_bytes_total":               "direction=in,ep_idx=1,service=5",
	}
	for name, labels := range want {
		if !slices.Contains(got[name], labels) {
			t.Errorf("%s: series %v, want one with %s", name, got[name], labels)
		}
	}
	// Removing the rule drops its series.
	if err := px.Update(Config{}); err != nil {
		t.Fatal(err)
	}
	mfs, _ = px.reg.Gather()
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "service" && l.GetValue() == "5" {
					t.Errorf("%s still has a series for the removed rule", mf.GetName())
				}
			}
		}
	}
}

// TestIdleClientConnectionClosed: a keep-alive client that goes quiet is
// disconnected after IdleTimeout.
func TestIdleClientConnectionClosed(t *testing.T) {
	b, _ := echoBackend(t, "b0")
	px := startProxy(t, "127.0.0.37", Config{IdleTimeout: 50 * time.Millisecond}, Service{}, newStaticPicker(hostPort(b)))
	c, err := net.Dial("tcp", px.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	io.WriteString(c, "GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	_ = decodeEcho(t, resp)
	if resp.Close {
		t.Fatal("proxy did not keep the connection alive")
	}
	// Nothing more is sent; the proxy must close its side.
	if rest, err := io.ReadAll(br); err != nil || len(rest) != 0 {
		t.Errorf("idle connection: read %q, %v; want a clean close", rest, err)
	}
}

// TestErrorBodyShape: error bodies carry every OpenAI error field,
// param included, so OpenAI clients parse them.
func TestErrorBodyShape(t *testing.T) {
	rec := httptest.NewRecorder()
	err := fmt.Errorf("%w: the model name is 300 bytes", ErrBadRequest)
	writeError(rec, classify(err), err)
	var body struct {
		Error map[string]json.RawMessage `json:"error"`
	}
	if rec.Code != 400 || json.Unmarshal(rec.Body.Bytes(), &body) != nil {
		t.Fatalf("%d %s", rec.Code, rec.Body)
	}
	for _, k := range []string{"message", "type", "param", "code"} {
		if _, ok := body.Error[k]; !ok {
			t.Errorf("error body lacks %q: %s", k, rec.Body)
		}
	}
}

// TestFlowErrorsMapped: the errors of flows that run their own legs go
// through the same mapping as the proxy's: status, code, Retry-After
// (the flow's value, rounded up to whole seconds), and a broken leg keeps
// the upstream_error code its clients know.
func TestFlowErrorsMapped(t *testing.T) {
	leg := func(err error) error { return &LegError{Leg: "decode", Addr: "127.0.0.1:1", Err: err} }
	cases := []struct {
		err        error
		status     int
		code       string
		retryAfter string
		class      ErrorClass
	}{
		{fmt.Errorf("%w: ep 1", ErrQueueFull), 429, "pd_queue_full", "2", ClassUnavailable},
		{fmt.Errorf("%w: 9 requests", ErrTotalCap), 429, "pd_queue_full", "2", ClassUnavailable},
		{fmt.Errorf("%w: ep 1", ErrParkTimeout), 503, "pd_admission_timeout", "2", ClassUnavailable},
		{fmt.Errorf("%w: no field", ErrParamsMissing), 502, "pd_params_missing", "", ClassProtocol},
		{fmt.Errorf("%w: not an object", ErrParamsMalformed), 502, "pd_params_malformed", "", ClassProtocol},
		{leg(fmt.Errorf("%w: answered 500", ErrUpstreamStatus)), 502, "upstream_error", "", ClassProtocol},
		{leg(fmt.Errorf("%w: EOF", ErrUpstreamProtocol)), 502, "upstream_error", "", ClassProtocol},
		{fmt.Errorf("%w: EOF", ErrUpstreamProtocol), 502, "upstream_protocol_error", "", ClassProtocol},
		{leg(fmt.Errorf("%w: refused", ErrUpstreamConnect)), 502, "upstream_connect_error", "", ClassConnect},
		{leg(fmt.Errorf("%w: stalled", ErrUpstreamTimeout)), 504, "upstream_timeout", "", ClassTimeout},
	}
	for _, c := range cases {
		rec := httptest.NewRecorder()
		v := WriteError(rec, c.err, 1500*time.Millisecond)
		var body struct {
			Error struct{ Code, Message string } `json:"error"`
		}
		_ = json.Unmarshal(rec.Body.Bytes(), &body)
		if v.Status != c.status || rec.Code != c.status || v.Class != c.class || body.Error.Code != c.code ||
			rec.Header().Get("Retry-After") != c.retryAfter || v.RetryAfter != (c.retryAfter != "") {
			t.Errorf("%v: verdict %+v, answered %d code %q Retry-After %q", c.err, v, rec.Code, body.Error.Code, rec.Header().Get("Retry-After"))
		}
		if body.Error.Message != c.err.Error() {
			t.Errorf("message %q, want %q", body.Error.Message, c.err.Error())
		}
	}
	// A client gone gets nothing written.
	rec := httptest.NewRecorder()
	if v := WriteError(rec, fmt.Errorf("%w: left", ErrClientCanceled), time.Second); v.Status != StatusClientClosed || rec.Body.Len() != 0 {
		t.Errorf("client gone: %+v, wrote %q", v, rec.Body.String())
	}
}
