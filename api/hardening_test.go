package api_test

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/store"
)

// serveReal runs the server on a real loopback listener (Serve, with its
// timeouts and connection cap), not through httptest's handler.
func serveReal(t *testing.T, cfg api.Config) (addr string, reg *prometheus.Registry) {
	t.Helper()
	st, err := store.OpenBolt(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	reg = prometheus.NewRegistry()
	srv, err := api.New(cfg, api.Deps{Rules: control.New(st, lbrule.Settings{}, nil), Registerer: reg, Gatherer: reg})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = srv.Serve(ctx, ln); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return ln.Addr().String(), reg
}

func rejected(t *testing.T, reg *prometheus.Registry, reason string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "loxilb_api_rejected_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" && l.GetValue() == reason {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// slowPost opens a connection and sends a create request's headers with a
// declared body it never sends, holding the connection as a slow client.
func slowPost(t *testing.T, addr, auth string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	hdr := "POST /netlox/v1/config/loadbalancer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n"
	if auth != "" {
		hdr += "Authorization: " + auth + "\r\n"
	}
	if _, err := io.WriteString(c, hdr+"\r\n{"); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestSlowBodyIsCut: a body that never completes is cut at the read
// timeout with a 408, counted; a well-behaved client meanwhile is served.
func TestSlowBodyIsCut(t *testing.T) {
	addr, reg := serveReal(t, api.Config{ReadTimeout: 500 * time.Millisecond})
	var conns []net.Conn
	for i := 0; i < 50; i++ {
		conns = append(conns, slowPost(t, addr, ""))
	}
	start := time.Now()
	resp, err := http.Get("http://" + addr + "/netlox/v1/version")
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("well-behaved client not served: %v", err)
	}
	resp.Body.Close()
	if d := time.Since(start); d > 400*time.Millisecond {
		t.Fatalf("well-behaved client waited %v", d)
	}
	for i, c := range conns {
		_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("conn %d: not cut: %v", i, err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestTimeout {
			t.Fatalf("conn %d: status %d, want 408", i, resp.StatusCode)
		}
		if _, err := c.Read(make([]byte, 1)); err != io.EOF {
			t.Fatalf("conn %d: still open after the timeout: %v", i, err)
		}
		c.Close()
	}
	if n := rejected(t, reg, "body_timeout"); n != 50 {
		t.Fatalf("body_timeout counted %v, want 50", n)
	}
}

// TestUnauthenticatedBodyNotRead: with a token configured, a request
// without it is answered 401 at once and its connection closed, whatever
// body it declared; the body is never waited for.
func TestUnauthenticatedBodyNotRead(t *testing.T) {
	addr, reg := serveReal(t, api.Config{Token: "s3cret", ReadTimeout: 10 * time.Second})
	for _, auth := range []string{"", "Bearer wrong"} {
		c := slowPost(t, addr, auth)
		start := time.Now()
		_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("auth %q: no answer: %v", auth, err)
		}
		_, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		want := http.StatusUnauthorized
		if auth != "" {
			want = http.StatusForbidden
		}
		if resp.StatusCode != want || !resp.Close {
			t.Fatalf("auth %q: %d (close %v), want %d with Connection: close", auth, resp.StatusCode, resp.Close, want)
		}
		if _, err := br.ReadByte(); err != io.EOF {
			t.Fatalf("auth %q: connection kept open: %v", auth, err)
		}
		if d := time.Since(start); d > 2*time.Second {
			t.Fatalf("auth %q: took %v: the server waited for the body", auth, d)
		}
		c.Close()
	}
	if rejected(t, reg, "unauthorized") != 1 || rejected(t, reg, "forbidden") != 1 {
		t.Fatal("refusals not counted")
	}
}

// TestBodyLimit: a declared body over the limit is refused unread (413);
// an undeclared (chunked) one is cut at the limit (413).
func TestBodyLimit(t *testing.T) {
	addr, reg := serveReal(t, api.Config{MaxBodyBytes: 4096})
	url := "http://" + addr + "/netlox/v1/config/loadbalancer"
	resp, err := http.Post(url, "application/json", strings.NewReader(strings.Repeat(" ", 5000)))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Fatalf("declared: %d, want 413", resp.StatusCode)
	}
	pr, pw := io.Pipe()
	go func() { _, _ = io.WriteString(pw, strings.Repeat(" ", 5000)); pw.Close() }()
	resp, err = http.Post(url, "application/json", pr)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge || !strings.Contains(string(b), "API_BODY_TOO_LARGE") {
		t.Fatalf("chunked: %d %s, want 413", resp.StatusCode, b)
	}
	if n := rejected(t, reg, "body_too_large"); n != 2 {
		t.Fatalf("body_too_large counted %v, want 2", n)
	}
}

// TestConnLimit: connections over the cap are closed at accept and
// counted; once the holders go, new clients are served again.
func TestConnLimit(t *testing.T) {
	addr, reg := serveReal(t, api.Config{MaxConns: 5, ReadHeaderTimeout: 10 * time.Second})
	var held []net.Conn
	for i := 0; i < 5; i++ {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	deadline := time.Now().Add(3 * time.Second)
	for rejected(t, reg, "conn_limit") == 0 && time.Now().Before(deadline) {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			_ = c.SetReadDeadline(time.Now().Add(time.Second))
			_, _ = c.Read(make([]byte, 1))
			c.Close()
		}
	}
	if rejected(t, reg, "conn_limit") == 0 {
		t.Fatal("connection over the cap not refused")
	}
	for _, c := range held {
		c.Close()
	}
	waitOK := time.Now().Add(3 * time.Second)
	for {
		resp, err := http.Get("http://" + addr + "/netlox/v1/version")
		if err == nil {
			resp.Body.Close()
			break
		}
		if time.Now().After(waitOK) {
			t.Fatalf("not served after the holders left: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestSlowHeadersAreCut: a client that never finishes its headers is cut
// at the read-header timeout and counted.
func TestSlowHeadersAreCut(t *testing.T) {
	addr, reg := serveReal(t, api.Config{ReadHeaderTimeout: 300 * time.Millisecond})
	var conns []net.Conn
	for i := 0; i < 20; i++ {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.WriteString(c, "GET /netlox/v1/version HTTP/1.1\r\nHost: x\r\n")
		conns = append(conns, c)
	}
	for i, c := range conns {
		_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
		if _, err := io.ReadAll(c); err != nil {
			t.Fatalf("conn %d not cut: %v", i, err)
		}
		c.Close()
	}
	deadline := time.Now().Add(2 * time.Second)
	for rejected(t, reg, "no_request") < 20 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := rejected(t, reg, "no_request"); n != 20 {
		t.Fatalf("no_request counted %v, want 20", n)
	}
}
