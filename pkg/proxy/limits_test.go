package proxy

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// rawBackend is an endpoint that reads one request and then runs fn on
// the raw connection, for endpoints no well-behaved server would be.
func rawBackend(t *testing.T, fn func(c net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { ln.Close(); <-done })
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				req, err := http.ReadRequest(br)
				if err != nil {
					return
				}
				_, _ = io.Copy(io.Discard, req.Body)
				fn(c)
			}()
		}
	}()
	return ln.Addr().String()
}

func counter(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, lp := range m.GetLabel() {
				have[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue next
				}
			}
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

// TestBodyGrowsAsBytesArrive: clients declaring a 32 MiB body and sending
// one byte must not make the proxy allocate 32 MiB each.
func TestBodyGrowsAsBytesArrive(t *testing.T) {
	b, _ := echoBackend(t, "b")
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.103", Config{}, Service{}, p)
	const conns = 20
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	for i := 0; i < conns; i++ {
		c, err := net.Dial("tcp", px.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{", DefaultMaxBodyBytes)
	}
	// Every request is now waiting for the rest of its body. The bound
	// is generous (64 KiB chunks add up to 1.25 MiB); the old behaviour
	// held 640 MiB.
	const bound = 64 << 20
	deadline := time.Now().Add(time.Second)
	for time.Now().Before(deadline) {
		var now runtime.MemStats
		runtime.ReadMemStats(&now)
		if grew := int64(now.HeapInuse) - int64(before.HeapInuse); grew > bound {
			t.Fatalf("heap grew by %d MiB for %d one-byte bodies", grew>>20, conns)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got := px.budget.used.Load(); got != conns*bodyChunk {
		t.Errorf("body budget holds %d bytes, want %d", got, conns*bodyChunk)
	}
}

// TestBodyBudgetRefusesWith503: once the bodies in flight hold the whole
// budget, a new body is refused with 503 and Retry-After, counted; the
// held request still completes and the budget is returned.
func TestBodyBudgetRefusesWith503(t *testing.T) {
	b, _ := echoBackend(t, "b")
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.104", Config{MaxBodyBytes: 1 << 20, MaxInflightBodyBytes: 1 << 20}, Service{}, p)

	// A slow client holds the whole budget: 1 MiB declared, all but one
	// byte sent.
	hold, err := net.Dial("tcp", px.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Close()
	fmt.Fprintf(hold, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n", 1<<20)
	if _, err := hold.Write([]byte(strings.Repeat("a", 1<<20-1))); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for px.budget.used.Load() < 1<<20 {
		if time.Now().After(deadline) {
			t.Fatalf("budget holds %d bytes, want the whole 1 MiB", px.budget.used.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}

	resp, err := newClient().Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{"model":"m"}`))
	if err != nil {
		t.Fatal(err)
	}
	eb := readErrorBody(t, resp)
	if resp.StatusCode != http.StatusServiceUnavailable || eb.Code != "proxy_overloaded" || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("got %d %+v Retry-After=%q, want 503 proxy_overloaded with Retry-After", resp.StatusCode, eb, resp.Header.Get("Retry-After"))
	}
	if got := counter(t, px.reg, "loxilb_proxy_conn_rejected_total", map[string]string{"reason": "body_memory"}); got != 1 {
		t.Errorf("body_memory rejections = %v, want 1", got)
	}

	// The held request completes once its body is in.
	if _, err := hold.Write([]byte("a")); err != nil {
		t.Fatal(err)
	}
	hr, err := http.ReadResponse(bufio.NewReader(hold), nil)
	if err != nil {
		t.Fatal(err)
	}
	hr.Body.Close()
	if hr.StatusCode != http.StatusOK {
		t.Fatalf("held request: %d", hr.StatusCode)
	}
	p.waitResult(t) // the refused request never reached the picker
	for deadline := time.Now().Add(5 * time.Second); px.budget.used.Load() != 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("budget holds %d bytes after every request ended", px.budget.used.Load())
		}
	}
	resp, err = newClient().Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{"model":"m"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("after the budget freed: %d", resp.StatusCode)
	}
}

// TestEndlessResponseHeaderIs502: an endpoint that never ends its header
// block costs the proxy at most MaxResponseHeaderBytes, and the client a
// 502.
func TestEndlessResponseHeaderIs502(t *testing.T) {
	wrote := make(chan int64, 1)
	addr := rawBackend(t, func(c net.Conn) {
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nX-Endless: ")
		chunk := []byte(strings.Repeat("a", 64<<10))
		var n int64
		// Bounded: the old behaviour read all of it.
		for n < 64<<20 {
			w, err := c.Write(chunk)
			n += int64(w)
			if err != nil {
				break
			}
		}
		wrote <- n
	})
	p := newStaticPicker(addr)
	px := startProxy(t, "127.0.0.105", Config{MaxResponseHeaderBytes: 64 << 10}, Service{}, p)
	resp, err := newClient().Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	eb := readErrorBody(t, resp)
	if resp.StatusCode != http.StatusBadGateway || eb.Code != "upstream_protocol_error" {
		t.Fatalf("got %d %+v, want 502 upstream_protocol_error", resp.StatusCode, eb)
	}
	if !strings.Contains(eb.Message, "headers too large") {
		t.Errorf("message %q does not say what was wrong", eb.Message)
	}
	// The proxy hung up: the endpoint could not push much more than the
	// limit plus socket buffers.
	if n := <-wrote; n >= 64<<20 {
		t.Errorf("endpoint pushed %d MiB of header; the proxy kept reading", n>>20)
	}
	if got := counter(t, px.reg, "loxilb_proxy_upstream_limit_total", map[string]string{"limit": "response_header_bytes"}); got != 1 {
		t.Errorf("response_header_bytes = %v, want 1", got)
	}
}

// TestSilentEndpointTimesOut: no headers within ResponseHeaderTimeout is a
// 504, counted.
func TestSilentEndpointTimesOut(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	addr := rawBackend(t, func(c net.Conn) { <-release })
	p := newStaticPicker(addr)
	px := startProxy(t, "127.0.0.106", Config{ResponseHeaderTimeout: 200 * time.Millisecond}, Service{}, p)
	start := time.Now()
	resp, err := newClient().Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusGatewayTimeout {
		t.Fatalf("status %d, want 504", resp.StatusCode)
	}
	if el := time.Since(start); el > 5*time.Second {
		t.Errorf("504 after %v", el)
	}
	if got := counter(t, px.reg, "loxilb_proxy_upstream_limit_total", map[string]string{"limit": "response_header_timeout"}); got != 1 {
		t.Errorf("response_header_timeout = %v, want 1", got)
	}
}

// TestHeadersThenSilenceIs504: an endpoint that sends headers and then
// nothing holds neither the client nor the connection: no body byte
// within ResponseHeaderTimeout is a clean 504 (the status line was not
// sent yet).
func TestHeadersThenSilenceIs504(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	addr := rawBackend(t, func(c net.Conn) {
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 10\r\n\r\n")
		<-release
	})
	p := newStaticPicker(addr)
	px := startProxy(t, "127.0.0.107", Config{ResponseHeaderTimeout: 200 * time.Millisecond}, Service{}, p)
	cl := newClient()
	cl.Timeout = 10 * time.Second // the old behaviour hung here
	resp, err := cl.Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusGatewayTimeout {
		t.Fatalf("status %d, want 504", resp.StatusCode)
	}
}

// TestStalledStreamIsCut: a stream silent for StreamIdleTimeout after its
// first event is cut (the client sees a truncated body), counted.
func TestStalledStreamIsCut(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	addr := rawBackend(t, func(c net.Conn) {
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
		ev := "data: {\"x\":1}\n\n"
		fmt.Fprintf(c, "%x\r\n%s\r\n", len(ev), ev)
		<-release
	})
	p := newStaticPicker(addr)
	px := startProxy(t, "127.0.0.108", Config{StreamIdleTimeout: 200 * time.Millisecond}, Service{}, p)
	cl := newClient()
	cl.Timeout = 10 * time.Second // the old behaviour hung here
	resp, err := cl.Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("read %q, err %v; want the first event then a cut", body, err)
	}
	if !strings.Contains(string(body), `data: {"x":1}`) {
		t.Errorf("first event missing: %q", body)
	}
	r := p.waitResult(t)
	if r.Class != ClassTimeout {
		t.Errorf("result class %q, want timeout", r.Class)
	}
	if got := counter(t, px.reg, "loxilb_proxy_upstream_limit_total", map[string]string{"limit": "stream_idle"}); got != 1 {
		t.Errorf("stream_idle = %v, want 1", got)
	}
}

// TestConnectionCapPerListener: connections beyond MaxConnsPerListener are
// closed at accept and counted; a freed slot is usable again.
func TestConnectionCapPerListener(t *testing.T) {
	b, _ := echoBackend(t, "b")
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.109", Config{MaxConnsPerListener: 3}, Service{}, p)
	var held []net.Conn
	for i := 0; i < 3; i++ {
		c, err := net.Dial("tcp", px.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		held = append(held, c)
		roundTripRaw(t, c)
	}
	extra, err := net.Dial("tcp", px.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	_ = extra.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, _ = io.WriteString(extra, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	if n, err := extra.Read(make([]byte, 1)); err == nil || isTimeout(err) {
		t.Fatalf("connection over the cap: read %d bytes, err %v; want it closed", n, err)
	}
	if got := counter(t, px.reg, "loxilb_proxy_conn_rejected_total", map[string]string{"reason": "conn_limit"}); got < 1 {
		t.Errorf("conn_limit rejections = %v", got)
	}
	held[0].Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		c, err := net.Dial("tcp", px.addr)
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(2 * time.Second))
		_, _ = io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		c.Close()
		if err == nil {
			resp.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a freed slot was not reusable: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func roundTripRaw(t *testing.T, c net.Conn) {
	t.Helper()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
}

// TestHalfClosedClientGetsTheResponse: a client that shuts down its
// sending side after the request still reads; it must get the endpoint's
// answer, not an empty 200.
func TestHalfClosedClientGetsTheResponse(t *testing.T) {
	b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		time.Sleep(200 * time.Millisecond) // the client's FIN arrives meanwhile
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"answer":42}`)
	}))
	defer b.Close()
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.110", Config{}, Service{}, p)
	c, err := net.Dial("tcp", px.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	body := `{"model":"m"}`
	fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("no response: %v", err)
	}
	got, err := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || err != nil || string(got) != `{"answer":42}` {
		t.Fatalf("got %d %q (%v), want 200 with the endpoint's body", resp.StatusCode, got, err)
	}
	if r := p.waitResult(t); r.Status != http.StatusOK || r.Class != ClassNone {
		t.Errorf("result %+v", r)
	}
}

// TestResetClientFreesEndpoint: a client whose connection resets while
// the endpoint works is gone; the endpoint's request is cancelled.
func TestResetClientFreesEndpoint(t *testing.T) {
	entered := make(chan struct{})
	sawCancel := make(chan struct{})
	b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		close(entered)
		<-r.Context().Done()
		close(sawCancel)
	}))
	defer b.Close()
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.111", Config{}, Service{}, p)
	c, err := net.Dial("tcp", px.addr)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
	<-entered
	_ = c.(*net.TCPConn).SetLinger(0)
	c.Close() // RST
	select {
	case <-sawCancel:
	case <-time.After(10 * time.Second):
		t.Fatal("the endpoint's request was not cancelled")
	}
	if r := p.waitResult(t); r.Status != StatusClientClosed {
		t.Errorf("result %+v, want 499", r)
	}
}

// TestEndpointClosingMidBodyCutsClient: bytes already relayed reach the
// client, then the connection is cut; never a clean or empty reply.
func TestEndpointClosingMidBodyCutsClient(t *testing.T) {
	addr := rawBackend(t, func(c net.Conn) {
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"partial\":")
	})
	p := newStaticPicker(addr)
	px := startProxy(t, "127.0.0.112", Config{}, Service{}, p)
	resp, err := newClient().Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatalf("no response at all (an empty reply): %v", err)
	}
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || !errors.Is(err, io.ErrUnexpectedEOF) || string(got) != `{"partial":` {
		t.Fatalf("got %d %q err %v; want 200, the partial body, then a cut", resp.StatusCode, got, err)
	}
	if r := p.waitResult(t); r.Class != ClassProtocol {
		t.Errorf("result class %q, want protocol", r.Class)
	}
}

// TestEndpointClosingBeforeBodyIs502: an endpoint that sends headers and
// closes before any body byte gives the client a clean 502.
func TestEndpointClosingBeforeBodyIs502(t *testing.T) {
	addr := rawBackend(t, func(c net.Conn) {
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Engine: secret\r\nContent-Length: 100\r\n\r\n")
	})
	p := newStaticPicker(addr)
	px := startProxy(t, "127.0.0.113", Config{}, Service{}, p)
	resp, err := newClient().Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatalf("no response at all (an empty reply): %v", err)
	}
	eb := readErrorBody(t, resp)
	if resp.StatusCode != http.StatusBadGateway || eb.Code != "upstream_protocol_error" {
		t.Fatalf("got %d %+v, want 502", resp.StatusCode, eb)
	}
	if resp.Header.Get("X-Engine") != "" {
		t.Errorf("the error carries the failed response's headers")
	}
}

// TestCanceledRequestIsNotAnEmpty200: a request that ends without writing
// anything (its client is gone) is cut, never answered with net/http's
// default empty 200.
func TestCanceledRequestIsNotAnEmpty200(t *testing.T) {
	p := newStaticPicker()
	p.err = fmt.Errorf("%w: gone", ErrClientCanceled)
	px := startProxy(t, "127.0.0.114", Config{}, Service{}, p)
	resp, err := newClient().Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{}`))
	if err == nil {
		resp.Body.Close()
		t.Fatalf("got %d, want the connection cut", resp.StatusCode)
	}
}

func TestLimitMetricsRegistered(t *testing.T) {
	px := startProxy(t, "127.0.0.115", Config{}, Service{}, newStaticPicker())
	px.m.upstreamLimit.WithLabelValues("7", "0", "stream_idle").Inc()
	if n := testutil.CollectAndCount(px.m.upstreamLimit); n != 1 {
		t.Fatalf("upstream limit series = %d", n)
	}
}

// TestTruncatedBodyIsRejected: a client that declares more than it sends
// and closes its side is not forwarded with a short body.
func TestTruncatedBodyIsRejected(t *testing.T) {
	for _, declared := range []int{100, 200 << 10} {
		b, _ := echoBackend(t, "b")
		p := newStaticPicker(hostPort(b))
		px := startProxy(t, "127.0.0.116", Config{}, Service{}, p)
		c, err := net.Dial("tcp", px.addr)
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{\"model\":", declared)
		_ = c.(*net.TCPConn).CloseWrite()
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode != http.StatusBadRequest {
				t.Errorf("declared %d: status %d, want 400", declared, resp.StatusCode)
			}
		}
		c.Close()
		p.mu.Lock()
		n := len(p.reqs)
		p.mu.Unlock()
		if n != 0 {
			t.Errorf("declared %d: a truncated body reached the picker", declared)
		}
	}
}

// TestEndpointStatusZeroIs502: "000" parses as a status line; relaying it
// made the handler panic (WriteHeader rejects it).
func TestEndpointStatusZeroIs502(t *testing.T) {
	addr := rawBackend(t, func(c net.Conn) {
		_, _ = io.WriteString(c, "HTTP/1.1 000 Zero\r\nContent-Length: 2\r\n\r\n{}")
	})
	p := newStaticPicker(addr)
	px := startProxy(t, "127.0.0.117", Config{}, Service{}, p)
	resp, err := newClient().Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatalf("no response: %v", err)
	}
	eb := readErrorBody(t, resp)
	if resp.StatusCode != http.StatusBadGateway || eb.Code != "upstream_protocol_error" {
		t.Fatalf("got %d %+v, want 502", resp.StatusCode, eb)
	}
}

// TestStreamCutAtMaxDuration: an event stream that keeps sending past the
// service's MaxStreamDuration is cut after the event in hand (the client
// sees a truncated body), counted as stream_duration.
func TestStreamCutAtMaxDuration(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	addr := rawBackend(t, func(c net.Conn) {
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
		ev := "data: {\"x\":1}\n\n"
		for {
			if _, err := fmt.Fprintf(c, "%x\r\n%s\r\n", len(ev), ev); err != nil {
				return
			}
			select {
			case <-release:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	})
	p := newStaticPicker(addr)
	px := startProxy(t, "127.0.0.150", Config{}, Service{MaxStreamDuration: 100 * time.Millisecond}, p)
	cl := newClient()
	cl.Timeout = 30 * time.Second // without the cap the stream never ends
	resp, err := cl.Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("read %d bytes, err %v; want events then a cut", len(body), err)
	}
	if !strings.Contains(string(body), `data: {"x":1}`) {
		t.Errorf("no event relayed: %q", body)
	}
	if r := p.waitResult(t); r.Class != ClassTimeout {
		t.Errorf("result class %q, want timeout", r.Class)
	}
	if got := counter(t, px.reg, "loxilb_proxy_upstream_limit_total", map[string]string{"limit": "stream_duration"}); got != 1 {
		t.Errorf("stream_duration = %v, want 1", got)
	}
}
