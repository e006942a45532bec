package proxy

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/testbed/wait"
)

// rawConn dials the proxy for tests that write requests by hand.
func rawConn(t *testing.T, addr string) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(60 * time.Second)) // a hang guard, not a performance limit
	return c, bufio.NewReader(c)
}

func readEcho(t *testing.T, br *bufio.Reader, method string) (*http.Response, echoed) {
	t.Helper()
	resp, err := http.ReadResponse(br, &http.Request{Method: method})
	if err != nil {
		t.Fatalf("read response: %v", err)
	}
	defer resp.Body.Close()
	var e echoed
	if resp.StatusCode == 200 && method != http.MethodHead {
		if err := json.NewDecoder(resp.Body).Decode(&e); err != nil {
			t.Fatalf("decode: %v", err)
		}
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp, e
}

func TestLeanPipelinedRequestsAnsweredInOrder(t *testing.T) {
	b, _ := echoBackend(t, "b0")
	px := startProxy(t, "127.0.0.10", Config{}, Service{}, newStaticPicker(hostPort(b)))
	c, br := rawConn(t, px.addr)
	reqs := "POST /first HTTP/1.1\r\nHost: vip\r\nContent-Length: 3\r\n\r\none" +
		"GET /second?q=2 HTTP/1.1\r\nHost: vip\r\n\r\n" +
		"POST /third HTTP/1.1\r\nHost: vip\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nthr\r\n2;ext=1\r\nee\r\n0\r\nX-Trailer: t\r\n\r\n"
	if _, err := io.WriteString(c, reqs); err != nil {
		t.Fatal(err)
	}
	for _, want := range []struct{ path, query, body string }{{"/first", "", "one"}, {"/second", "q=2", ""}, {"/third", "", "three"}} {
		resp, e := readEcho(t, br, "")
		if resp.StatusCode != 200 || e.Path != want.path || e.Query != want.query || e.Body != want.body {
			t.Fatalf("got %d %s?%s %q, want %s?%s %q", resp.StatusCode, e.Path, e.Query, e.Body, want.path, want.query, want.body)
		}
		if want.path == "/third" && e.Header.Get("Content-Length") != "5" {
			t.Errorf("chunked body relayed with Content-Length %q", e.Header.Get("Content-Length"))
		}
	}
}

func TestLeanExpectContinue(t *testing.T) {
	b, _ := echoBackend(t, "b0")
	px := startProxy(t, "127.0.0.10", Config{}, Service{}, newStaticPicker(hostPort(b)))
	c, br := rawConn(t, px.addr)
	if _, err := io.WriteString(c, "POST /v1/completions HTTP/1.1\r\nHost: vip\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	interim, err := http.ReadResponse(br, nil)
	if err != nil || interim.StatusCode != http.StatusContinue {
		t.Fatalf("interim %v %v, want 100 Continue before the body is sent", interim, err)
	}
	if _, err := io.WriteString(c, "{}"); err != nil {
		t.Fatal(err)
	}
	resp, e := readEcho(t, br, "")
	if resp.StatusCode != 200 || e.Body != "{}" || e.Header.Get("Expect") != "" {
		t.Fatalf("status %d body %q expect %q", resp.StatusCode, e.Body, e.Header.Get("Expect"))
	}
}

// TestLeanRefusesSmuggling sends heads that could make the proxy and an
// endpoint disagree on where a request ends: each gets its status, is
// counted, and never reaches the picker or an endpoint.
func TestLeanRefusesSmuggling(t *testing.T) {
	b, _ := echoBackend(t, "b0")
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.10", Config{}, Service{}, p)
	for _, tc := range h1Corpus {
		if tc.verdict != h1Reject {
			continue
		}
		t.Run(tc.name, func(t *testing.T) {
			before := testutil.ToFloat64(px.m.connRejected.WithLabelValues(tc.reason))
			c, br := rawConn(t, px.addr)
			if _, err := io.WriteString(c, tc.raw); err != nil {
				t.Fatal(err)
			}
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatal(err)
			}
			want := http.StatusBadRequest
			if tc.reason == reasonUnsupportedTE {
				want = http.StatusNotImplemented
			}
			if resp.StatusCode != want || !resp.Close {
				t.Errorf("status %d close %v, want %d and the connection closed", resp.StatusCode, resp.Close, want)
			}
			if got := testutil.ToFloat64(px.m.connRejected.WithLabelValues(tc.reason)); got != before+1 {
				t.Errorf("loxilb_proxy_conn_rejected_total{reason=%q} = %v, want %v", tc.reason, got, before+1)
			}
		})
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.reqs) != 0 {
		t.Errorf("the picker saw %d refused requests", len(p.reqs))
	}
}

// TestLeanFallbackToNetHTTP: forms the lean server leaves alone are still
// served, by net/http, on the same connection, and counted.
func TestLeanFallbackToNetHTTP(t *testing.T) {
	b, _ := echoBackend(t, "b0")
	px := startProxy(t, "127.0.0.10", Config{}, Service{}, newStaticPicker(hostPort(b)))
	cases := []struct {
		name, raw, reason, path string
	}{
		{"http10", "GET /old HTTP/1.0\r\nHost: vip\r\n\r\n", fallbackVersion, "/old"},
		{"escaped", "GET /a%20b HTTP/1.1\r\nHost: vip\r\n\r\n", fallbackTarget, "/a b"},
		{"bare-lf", "GET /lf HTTP/1.1\nHost: vip\n\n", fallbackLineEnd, "/lf"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := testutil.ToFloat64(px.m.fallback.WithLabelValues(tc.reason))
			c, br := rawConn(t, px.addr)
			if _, err := io.WriteString(c, tc.raw); err != nil {
				t.Fatal(err)
			}
			resp, e := readEcho(t, br, "")
			if resp.StatusCode != 200 || e.Path != tc.path {
				t.Fatalf("status %d path %q, want 200 %q", resp.StatusCode, e.Path, tc.path)
			}
			if got := testutil.ToFloat64(px.m.fallback.WithLabelValues(tc.reason)); got != before+1 {
				t.Errorf("loxilb_proxy_http1_fallback_total{reason=%q} = %v, want %v", tc.reason, got, before+1)
			}
		})
	}
	// A head larger than the lean read buffer: net/http's own limit applies.
	c, br := rawConn(t, px.addr)
	big := "GET /big HTTP/1.1\r\nHost: vip\r\nX-Big: " + strings.Repeat("a", 3*h1BufSize) + "\r\n\r\n"
	if _, err := io.WriteString(c, big); err != nil {
		t.Fatal(err)
	}
	if resp, e := readEcho(t, br, ""); resp.StatusCode != 200 || e.Path != "/big" {
		t.Fatalf("big head: status %d path %q", resp.StatusCode, e.Path)
	}
}

func TestLeanConnectionCloseAndHead(t *testing.T) {
	b, _ := echoBackend(t, "b0")
	px := startProxy(t, "127.0.0.10", Config{}, Service{}, newStaticPicker(hostPort(b)))
	c, br := rawConn(t, px.addr)
	if _, err := io.WriteString(c, "HEAD /h HTTP/1.1\r\nHost: vip\r\n\r\nGET /c HTTP/1.1\r\nHost: vip\r\nConnection: close\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	resp, _ := readEcho(t, br, http.MethodHead)
	if resp.StatusCode != 200 || resp.Close {
		t.Fatalf("HEAD: status %d close %v", resp.StatusCode, resp.Close)
	}
	resp, e := readEcho(t, br, "")
	if resp.StatusCode != 200 || e.Path != "/c" || !resp.Close {
		t.Fatalf("status %d path %q close %v, want 200 /c and Connection: close", resp.StatusCode, e.Path, resp.Close)
	}
	if _, err := br.ReadByte(); err != io.EOF {
		t.Errorf("connection still open after Connection: close (%v)", err)
	}
}

// TestLeanGracefulShutdown: when the serving context ends, a request in
// flight finishes (with Connection: close), an idle keep-alive connection
// is closed, and ServeListener returns.
func TestLeanGracefulShutdown(t *testing.T) {
	release := make(chan struct{})
	b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-release
		_, _ = io.WriteString(w, "done")
	}))
	t.Cleanup(b.Close)
	ln, err := net.Listen("tcp", "127.0.0.10:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{Services: []Service{{ID: 7, Listen: ln.Addr().(*net.TCPAddr).AddrPort()}}, ShutdownGrace: time.Minute}
	s, err := New(cfg, newStaticPicker(hostPort(b)), new(InFlightTable), slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- s.ServeListener(ctx, ln) }()

	idle, idleBR := rawConn(t, ln.Addr().String())
	_ = idle
	busy, busyBR := rawConn(t, ln.Addr().String())
	if _, err := io.WriteString(busy, "GET /slow HTTP/1.1\r\nHost: vip\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	wait.Eventually(t, "the request in flight", func() bool { return s.dr.active.Load() == 1 })
	cancel()
	if _, err := idleBR.ReadByte(); err != io.EOF {
		t.Errorf("idle connection: %v, want it closed by the shutdown", err)
	}
	close(release)
	resp, err := http.ReadResponse(busyBR, nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || string(body) != "done" || !resp.Close {
		t.Errorf("in-flight request: %d %q close %v, want 200 \"done\" and Connection: close", resp.StatusCode, body, resp.Close)
	}
	if err := <-errc; err != nil {
		t.Errorf("ServeListener: %v", err)
	}
}

// TestLeanTLSFallbackKeepsTLS: a TLS connection handed to net/http after
// the handshake (here an HTTP/1.0 request) is still known to be TLS, so
// a rule that requires TLS serves it.
func TestLeanTLSFallbackKeepsTLS(t *testing.T) {
	pki := newPKI(t)
	cert, key, _ := pki.leaf(t, "vip", "127.0.0.71")
	b, _ := echoBackend(t, "plain")
	px := startProxy(t, "127.0.0.71", Config{}, Service{Security: SecurityTLS, CertFile: cert, KeyFile: key}, newStaticPicker(hostPort(b)))
	c, err := tls.Dial("tcp", px.addr, &tls.Config{RootCAs: pki.pool})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(60 * time.Second)) // a hang guard, not a performance limit
	if _, err := io.WriteString(c, "GET /old HTTP/1.0\r\nHost: vip\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	resp, e := readEcho(t, bufio.NewReader(c), "")
	if resp.StatusCode != 200 || e.Path != "/old" || e.Header.Get("X-Forwarded-Proto") != "https" {
		t.Fatalf("status %d path %q proto %q, want 200 /old https", resp.StatusCode, e.Path, e.Header.Get("X-Forwarded-Proto"))
	}
	if got := testutil.ToFloat64(px.m.fallback.WithLabelValues(fallbackVersion)); got != 1 {
		t.Errorf("fallback{version} = %v, want 1", got)
	}
}

// TestLeanPipelinedThenFallback: an answer is on the wire before a
// pipelined request behind it is handed to net/http.
func TestLeanPipelinedThenFallback(t *testing.T) {
	b, _ := echoBackend(t, "b0")
	px := startProxy(t, "127.0.0.10", Config{}, Service{}, newStaticPicker(hostPort(b)))
	c, br := rawConn(t, px.addr)
	if _, err := io.WriteString(c, "GET /lean HTTP/1.1\r\nHost: vip\r\n\r\nGET /old HTTP/1.0\r\nHost: vip\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"/lean", "/old"} {
		if resp, e := readEcho(t, br, ""); resp.StatusCode != 200 || e.Path != want {
			t.Fatalf("status %d path %q, want 200 %q", resp.StatusCode, e.Path, want)
		}
	}
}

// TestKeepAliveConnectionHoldsNoWriteBufferWhileIdle: between answers a
// keep-alive connection gives its write buffer back to the pool, and the
// next answer on it is whole.
func TestKeepAliveConnectionHoldsNoWriteBufferWhileIdle(t *testing.T) {
	b, _ := echoBackend(t, "b0")
	px := startProxy(t, "127.0.0.161", Config{}, Service{}, newStaticPicker(hostPort(b)))
	c, br := rawConn(t, px.addr)
	for i := range 2 {
		if _, err := io.WriteString(c, "GET /x HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		if e := decodeEcho(t, resp); e.Backend != "b0" || resp.Close {
			t.Fatalf("answer %d: %+v, close %v", i, e, resp.Close)
		}
		var hc *h1Conn
		wait.Eventually(t, "the connection waiting for its next request", func() bool {
			px.h1.mu.Lock()
			defer px.h1.mu.Unlock()
			for k := range px.h1.conns {
				k.mu.Lock()
				idle := k.idle
				k.mu.Unlock()
				if idle {
					hc = k
				}
				return idle
			}
			return false
		})
		if hc.bw != nil { // ordered by the idle flag's lock, set after the answer
			t.Fatalf("after answer %d the idle connection holds a write buffer", i)
		}
	}
}
