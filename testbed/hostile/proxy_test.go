package hostile

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Attacks on the mode-4 proxy of the real daemon. Each test uses its own
// loopback range 127.0.84.x so it can run beside the other hostile tests.

// TestProxyBodyFlood: 200 clients declaring a 32 MiB body and sending one
// byte cost the daemon their first 64 KiB buffers, not 32 MiB each; once
// the bodies in flight hold the whole budget, new bodies get 503 with
// Retry-After, and an oversize declaration gets 413; all counted.
func TestProxyBodyFlood(t *testing.T) {
	const vip, port = "127.0.84.10", 28080
	d, base := proxyDaemon(t, "--proxy-max-inflight-body", fmt.Sprint(32<<20))
	ep := proxyBackend(t, "127.0.84.11", proxyOK)
	proxyRule(t, d, vip, port, "127.0.84.11", ep)
	addr := proxyAddr(vip, port)

	const flood = 200
	for i := 0; i < flood; i++ {
		c := proxyDial(t, addr)
		if _, err := fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n{", 32<<20); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 20*time.Second, "every flood request reading its body", func() bool {
		return metricSum(t, d, "loxilb_proxy_body_bytes_inflight") >= flood*64<<10
	})
	// 200 first chunks are 12.5 MiB; the old pre-allocation was 6.4 GiB.
	if got := metricSum(t, d, "loxilb_proxy_body_bytes_inflight"); got > flood*64<<10 {
		t.Errorf("bodies in flight hold %v bytes for %d one-byte bodies", got, flood)
	}
	requireAlive(t, d)
	requireRSSBelow(t, d, base>>10+64)
	t.Logf("RSS idle %d KiB, with %d one-byte bodies held %d KiB", base, flood, rssKiB(t, d.PID()))

	// Six clients push 8 MiB each: the 32 MiB budget (12.5 MiB held) cannot
	// take them all, so some are refused while sending.
	var refused, other atomic.Int64
	var wg sync.WaitGroup
	for i := 0; i < 6; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := net.DialTimeout("tcp", addr, 5*time.Second)
			if err != nil {
				other.Add(1)
				return
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			go func() {
				fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n", 32<<20)
				chunk := []byte(strings.Repeat("a", 1<<20))
				for j := 0; j < 8; j++ {
					if _, err := c.Write(chunk); err != nil {
						return
					}
				}
			}()
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				other.Add(1) // still being read when the deadline came: admitted
				return
			}
			resp.Body.Close()
			if resp.StatusCode == http.StatusServiceUnavailable && resp.Header.Get("Retry-After") != "" {
				refused.Add(1)
			} else {
				t.Errorf("pushing client got %d", resp.StatusCode)
			}
		}()
	}
	wg.Wait()
	t.Logf("RSS after the pushing clients %d KiB", rssKiB(t, d.PID()))
	if refused.Load() == 0 {
		t.Fatalf("no client was refused (%d admitted) though the budget cannot hold them", other.Load())
	}
	if got := metricSum(t, d, "loxilb_proxy_conn_rejected_total", `reason="body_memory"`); got < float64(refused.Load()) {
		t.Errorf("body_memory rejections = %v, clients refused %d", got, refused.Load())
	}

	// An oversize declaration is refused before any byte is read.
	c := proxyDial(t, addr)
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n", 64<<20)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil || resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Fatalf("64 MiB declaration: %v %v, want 413", resp, err)
	}
	if got := metricSum(t, d, "loxilb_ai_requests_total", `status="413"`); got < 1 {
		t.Errorf("413 not counted")
	}
	requireAlive(t, d)
	// The 32 MiB budget plus 200 connections and the runtime's headroom.
	requireRSSBelow(t, d, base>>10+64)
	t.Logf("RSS idle %d KiB, after the flood %d KiB; %d of 6 pushing clients refused", base, rssKiB(t, d.PID()), refused.Load())
}

// TestProxyEndlessResponseHeader: endpoints that never end their header
// line cost at most the 1 MiB header cap each; clients get 502, counted.
func TestProxyEndlessResponseHeader(t *testing.T) {
	const vip, port = "127.0.84.20", 28080
	d, base := proxyDaemon(t)
	ep := proxyBackend(t, "127.0.84.21", func(c net.Conn, _ *http.Request) bool {
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nX-Endless: ")
		chunk := []byte(strings.Repeat("a", 64<<10))
		for n := 0; n < 256<<20; n += len(chunk) { // until the proxy hangs up
			if _, err := c.Write(chunk); err != nil {
				break
			}
		}
		return false
	})
	proxyRule(t, d, vip, port, "127.0.84.21", ep)
	const clients = 20
	var wg sync.WaitGroup
	codes := make([]int, clients)
	for i := 0; i < clients; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			codes[i], _, _ = proxyPost(t, proxyAddr(vip, port), 30*time.Second)
		}()
	}
	wg.Wait()
	for i, code := range codes {
		if code != http.StatusBadGateway {
			t.Errorf("client %d got %d, want 502", i, code)
		}
	}
	if got := metricSum(t, d, "loxilb_proxy_upstream_limit_total", `limit="response_header_bytes"`); got != clients {
		t.Errorf("response_header_bytes = %v, want %d", got, clients)
	}
	requireAlive(t, d)
	// 20 × 1 MiB of header plus read buffers and the garbage collector's
	// slack; unbounded, each endpoint would push 256 MiB.
	requireRSSBelow(t, d, base>>10+96)
	t.Logf("RSS idle %d KiB, after %d endless headers %d KiB", base, clients, rssKiB(t, d.PID()))
}

// TestProxyHangingBackend: an endpoint silent before its headers gets the
// client a 504 after --proxy-response-header-timeout, and a stream that
// stalls after its first event is cut after --proxy-stream-idle-timeout;
// both counted.
func TestProxyHangingBackend(t *testing.T) {
	const port = 28080
	d, _ := proxyDaemon(t, "--proxy-response-header-timeout", "1s", "--proxy-stream-idle-timeout", "1s")
	hold := make(chan struct{}) // released before the backends' cleanup waits for their handlers
	silent := proxyBackend(t, "127.0.84.31", func(net.Conn, *http.Request) bool { <-hold; return false })
	proxyRule(t, d, "127.0.84.30", port, "127.0.84.31", silent)
	stall := proxyBackend(t, "127.0.84.33", func(c net.Conn, _ *http.Request) bool {
		ev := "data: {\"choices\":[{\"text\":\"x\"}]}\n\n"
		fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n", len(ev), ev)
		<-hold
		return false
	})
	proxyRule(t, d, "127.0.84.32", port, "127.0.84.33", stall)
	t.Cleanup(func() { close(hold) })

	start := time.Now()
	code, _, err := proxyPost(t, proxyAddr("127.0.84.30", port), 30*time.Second)
	if el := time.Since(start); err != nil || code != http.StatusGatewayTimeout || el < time.Second || el > 10*time.Second {
		t.Fatalf("silent endpoint: %d %v after %v, want 504 after about 1s", code, err, el)
	}
	if got := metricSum(t, d, "loxilb_proxy_upstream_limit_total", `limit="response_header_timeout"`); got != 1 {
		t.Errorf("response_header_timeout = %v, want 1", got)
	}

	start = time.Now()
	code, body, err := proxyPost(t, proxyAddr("127.0.84.32", port), 30*time.Second)
	el := time.Since(start)
	if code != http.StatusOK || !errors.Is(err, io.ErrUnexpectedEOF) || !strings.Contains(string(body), `"text":"x"`) {
		t.Fatalf("stalled stream: %d %q %v, want the first event then a cut", code, body, err)
	}
	if el < time.Second || el > 10*time.Second {
		t.Errorf("stalled stream cut after %v, want about 1s", el)
	}
	if got := metricSum(t, d, "loxilb_proxy_upstream_limit_total", `limit="stream_idle"`); got != 1 {
		t.Errorf("stream_idle = %v, want 1", got)
	}
	requireAlive(t, d)
}

// TestProxyConnectionCap: a listener holds at most --proxy-max-conns
// client connections; more are closed at accept and counted, and a freed
// slot serves again.
func TestProxyConnectionCap(t *testing.T) {
	const vip, port, limit = "127.0.84.40", 28080, 100
	d, base := proxyDaemon(t, "--proxy-max-conns", fmt.Sprint(limit))
	ep := proxyBackend(t, "127.0.84.41", proxyOK)
	proxyRule(t, d, vip, port, "127.0.84.41", ep)
	addr := proxyAddr(vip, port)
	var held []net.Conn
	for i := 0; i < limit; i++ {
		c := proxyDial(t, addr)
		proxyRoundTrip(t, c)
		held = append(held, c)
	}
	rejected := 0
	for i := 0; i < 20; i++ {
		c := proxyDial(t, addr)
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		_, _ = io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
		n, err := c.Read(make([]byte, 64))
		if err == nil || proxyIsTimeout(err) {
			t.Fatalf("connection %d over the cap: read %d bytes, err %v; want it closed", limit+i+1, n, err)
		}
		rejected++
		c.Close()
	}
	if got := metricSum(t, d, "loxilb_proxy_conn_rejected_total", `reason="conn_limit"`); got < float64(rejected) {
		t.Errorf("conn_limit rejections = %v, want %d", got, rejected)
	}
	held[0].Close()
	waitFor(t, 10*time.Second, "a freed slot to serve again", func() bool {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			return false
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(2 * time.Second))
		_, _ = io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	requireAlive(t, d)
	requireRSSBelow(t, d, base>>10+32)
}

// TestProxyIdleConnectionMemory measures what an idle keep-alive client
// connection costs the daemon, the figure --proxy-max-conns is sized by.
func TestProxyIdleConnectionMemory(t *testing.T) {
	const vip, port, n = "127.0.84.50", 28080, 2000
	d, _ := proxyDaemon(t)
	ep := proxyBackend(t, "127.0.84.51", proxyOK)
	proxyRule(t, d, vip, port, "127.0.84.51", ep)
	addr := proxyAddr(vip, port)
	// Warm up the proxy and its endpoint pool so the figure is per client
	// connection only.
	for i := 0; i < 20; i++ {
		proxyRoundTrip(t, proxyDial(t, addr))
	}
	time.Sleep(200 * time.Millisecond)
	before := rssKiB(t, d.PID())
	for i := 0; i < n; i++ {
		proxyRoundTrip(t, proxyDial(t, addr))
	}
	time.Sleep(500 * time.Millisecond)
	after := rssKiB(t, d.PID())
	per := float64(after-before) / n
	t.Logf("%d idle keep-alive client connections: RSS %d -> %d KiB, %.1f KiB per connection", n, before, after, per)
	if per > 64 {
		t.Errorf("an idle connection costs %.1f KiB", per)
	}
	requireAlive(t, d)
}

// TestProxyHalfClosedClient: a client that shuts down its sending side
// after its request still gets the endpoint's answer, not an empty 200.
func TestProxyHalfClosedClient(t *testing.T) {
	const vip, port = "127.0.84.60", 28080
	d, _ := proxyDaemon(t)
	ep := proxyBackend(t, "127.0.84.61", func(c net.Conn, r *http.Request) bool {
		time.Sleep(300 * time.Millisecond) // the client's FIN reaches the proxy meanwhile
		return proxyOK(c, r)
	})
	proxyRule(t, d, vip, port, "127.0.84.61", ep)
	c := proxyDial(t, proxyAddr(vip, port))
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	body := `{"model":"m","prompt":"hi"}`
	fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("half-closed client got no response: %v", err)
	}
	got, err := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || err != nil || string(got) != `{"ok":true}` {
		t.Fatalf("half-closed client got %d %q (%v), want the endpoint's 200 body", resp.StatusCode, got, err)
	}
	requireAlive(t, d)
}

// TestProxyBackendCutsResponse: an endpoint that closes mid-body gives
// the client the bytes that came and then a cut, never a clean or empty
// reply; one that closes before any body byte, or sends status 000, gives
// a clean 502.
func TestProxyBackendCutsResponse(t *testing.T) {
	const port = 28080
	d, _ := proxyDaemon(t)
	mid := proxyBackend(t, "127.0.84.71", func(c net.Conn, _ *http.Request) bool {
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"partial\":")
		return false
	})
	proxyRule(t, d, "127.0.84.70", port, "127.0.84.71", mid)
	early := proxyBackend(t, "127.0.84.73", func(c net.Conn, _ *http.Request) bool {
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
		return false
	})
	proxyRule(t, d, "127.0.84.72", port, "127.0.84.73", early)
	zero := proxyBackend(t, "127.0.84.75", func(c net.Conn, _ *http.Request) bool {
		_, _ = io.WriteString(c, "HTTP/1.1 000 Zero\r\nContent-Length: 2\r\n\r\n{}")
		return false
	})
	proxyRule(t, d, "127.0.84.74", port, "127.0.84.75", zero)

	code, body, err := proxyPost(t, proxyAddr("127.0.84.70", port), 10*time.Second)
	if code != http.StatusOK || !errors.Is(err, io.ErrUnexpectedEOF) || string(body) != `{"partial":` {
		t.Fatalf("mid-body close: %d %q %v, want 200, the partial body, then a cut", code, body, err)
	}
	code, body, err = proxyPost(t, proxyAddr("127.0.84.72", port), 10*time.Second)
	if code != http.StatusBadGateway || err != nil || !strings.Contains(string(body), "upstream_protocol_error") {
		t.Fatalf("close before the body: %d %q %v, want a clean 502", code, body, err)
	}
	// A status line "000" parses; relaying it would panic in WriteHeader.
	code, body, err = proxyPost(t, proxyAddr("127.0.84.74", port), 10*time.Second)
	if code != http.StatusBadGateway || err != nil {
		t.Fatalf("status 000: %d %q %v, want a clean 502", code, body, err)
	}
	if got := metricSum(t, d, "loxilb_ai_upstream_errors_total", `class="protocol"`); got < 3 {
		t.Errorf("protocol errors = %v, want 3", got)
	}
	requireAlive(t, d)
}

// proxyRoundTrip sends one GET on c and reads the answer, leaving the
// connection open and idle.
func proxyRoundTrip(t *testing.T, c net.Conn) {
	t.Helper()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
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
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("round trip: %d", resp.StatusCode)
	}
}

func proxyIsTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
