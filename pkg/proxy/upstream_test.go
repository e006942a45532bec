package proxy

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/wait"
)

func TestUpstreamDropsConnectionClosedWhileIdle(t *testing.T) {
	b, backendConns := echoBackend(t, "b0")
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.100", Config{}, Service{}, p)
	c := newClient()
	post := func() {
		t.Helper()
		resp, err := c.Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		_ = decodeEcho(t, resp)
	}
	post()
	// The endpoint closes its idle keep-alive connection (as engines do
	// after their keep-alive timeout). The proxy must notice before
	// reuse instead of failing the next request.
	b.CloseClientConnections()
	// Engines close idle connections after seconds (uvicorn 5 s): the
	// proxy probes a connection idle that long before reusing it.
	time.Sleep(probeAfterIdle + 50*time.Millisecond)
	post()
	if got := backendConns.Load(); got != 2 {
		t.Errorf("endpoint saw %d connections, want 2 (one redial after its close)", got)
	}
	if got := p.waitResult(t); got.Err != nil {
		t.Errorf("first request: %v", got.Err)
	}
	if got := p.waitResult(t); got.Err != nil || got.Attempts != 1 {
		t.Errorf("request after idle close: %+v", got)
	}
}

func TestUpstreamRetriesFailedWriteOnFreshConnection(t *testing.T) {
	b, _ := echoBackend(t, "b0")
	u := newUpstream(Config{}.withDefaults(), nil)
	defer u.closeIdle(true)
	// A pooled connection that passes the liveness probe but is dead:
	// the request write fails, so nothing reached the endpoint and the
	// request is sent again on a fresh connection.
	dead, peer := net.Pipe()
	peer.Close()
	u.idle[hostPort(b)] = []*pconn{{u: u, addr: hostPort(b), conn: dead, raw: dead,
		br: bufio.NewReader(dead), bw: bufio.NewWriter(dead), idleAt: time.Now()}}
	req, _ := http.NewRequest("POST", "http://"+hostPort(b)+"/v1/completions", strings.NewReader(`{"a":1}`))
	resp, err := u.roundTrip(req, hostPort(b))
	if err != nil {
		t.Fatalf("roundTrip: %v", err)
	}
	e := decodeEcho(t, resp)
	if e.Body != `{"a":1}` {
		t.Errorf("replayed body %q", e.Body)
	}
	if u.dials.Load() != 1 {
		t.Errorf("dials %d, want 1", u.dials.Load())
	}
	if n := len(u.idle[hostPort(b)]); n != 1 {
		t.Errorf("fresh connection not pooled after the body was read: %d idle", n)
	}
}

func TestUpstreamPoolBounded(t *testing.T) {
	release := make(chan struct{})
	var entered sync.WaitGroup
	entered.Add(4)
	b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		entered.Done()
		<-release
	}))
	defer b.Close()
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.101", Config{MaxIdleConnsPerHost: 1}, Service{}, p)
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := newClient().Get("http://" + px.addr + "/")
			if err == nil {
				resp.Body.Close()
			}
		}()
	}
	entered.Wait()
	if got := px.inflight.Count(7, 0); got != 4 {
		t.Errorf("InFlight = %d, want 4", got)
	}
	close(release)
	wg.Wait()
	for range 4 {
		p.waitResult(t)
	}
	up := px.table.Load().list[0].up
	up.mu.Lock()
	n := len(up.idle[hostPort(b)])
	up.mu.Unlock()
	if n != 1 {
		t.Errorf("%d idle connections kept, want MaxIdleConnsPerHost=1", n)
	}
}

// TestClientCancelWhileWaitingForEndpoint: with AbortOnClientClose, a
// client that closes its connection (a FIN, as Go's client does on cancel)
// frees the endpoint at once.
func TestClientCancelWhileWaitingForEndpoint(t *testing.T) {
	entered := make(chan struct{})
	endpointSawCancel := make(chan struct{})
	b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		close(entered)
		<-r.Context().Done()
		close(endpointSawCancel)
	}))
	defer b.Close()
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.102", Config{AbortOnClientClose: true}, Service{}, p)
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", "http://"+px.addr+"/v1/completions", strings.NewReader(`{}`))
	errc := make(chan error, 1)
	go func() {
		resp, err := newClient().Do(req)
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	<-entered
	cancel()
	<-errc
	r := p.waitResult(t)
	if r.Class != ClassClientCanceled || r.Status != StatusClientClosed {
		t.Errorf("result %+v, want client_canceled / 499", r)
	}
	<-endpointSawCancel // the proxy hung up on the endpoint too
	if got := px.inflight.Count(7, 0); got != 0 {
		t.Errorf("InFlight after cancel = %d", got)
	}
}

func TestRelayChunkedTrailersAndHead(t *testing.T) {
	b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "X-Checksum")
		w.Header().Set("Content-Type", "text/plain")
		if r.Method == http.MethodHead {
			w.Header().Set("Content-Length", "5")
			return
		}
		io.WriteString(w, "hello ")
		w.(http.Flusher).Flush()
		io.WriteString(w, "world")
		w.Header().Set("X-Checksum", "abc")
	}))
	defer b.Close()
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.103", Config{}, Service{}, p)
	c := newClient()
	resp, err := c.Get("http://" + px.addr + "/file")
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || string(body) != "hello world" {
		t.Fatalf("body %q err %v", body, err)
	}
	if got := resp.Trailer.Get("X-Checksum"); got != "abc" {
		t.Errorf("trailer %q, want abc", got)
	}
	resp, err = c.Head("http://" + px.addr + "/file")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.ContentLength != 5 {
		t.Errorf("HEAD: %d length %d", resp.StatusCode, resp.ContentLength)
	}
	// Both requests reused one endpoint connection, the HEAD included.
	if d := px.table.Load().list[0].up.dials.Load(); d != 1 {
		t.Errorf("%d endpoint dials, want 1", d)
	}
}

// A request cancelled while the proxy sends it or starts waiting for the
// response headers stops waiting at once, whatever the order of the
// cancellation and the header timeout being armed: the timeout must not
// re-arm a read the cancellation had already stopped (an endpoint that
// never answers would otherwise hold the request for the whole
// ResponseHeaderTimeout). Many rounds, to cover the interleavings.
func TestCancelDuringExchangeStopsTheRead(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	received := make(chan struct{}, 1)
	go func() { // reads each request, never answers
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				if _, err := http.ReadRequest(br); err != nil {
					return
				}
				received <- struct{}{}
				_, _ = io.Copy(io.Discard, br) // until the proxy hangs up
			}()
		}
	}()
	u := newUpstream(Config{DialTimeout: 5 * time.Second, ResponseHeaderTimeout: time.Hour,
		UpstreamIdleTimeout: time.Minute, MaxIdleConnsPerHost: 1}, nil)
	for i := range 300 {
		ctx, cancel := context.WithCancel(context.Background())
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+ln.Addr().String()+"/v1/completions", strings.NewReader(`{}`))
		go func() { <-received; cancel() }()
		done := make(chan error, 1)
		go func() {
			_, err := u.roundTrip(req, ln.Addr().String())
			done <- err
		}()
		select {
		case err := <-done:
			if err == nil {
				t.Fatalf("round %d: a response from an endpoint that never answers", i)
			}
		case <-time.After(30 * time.Second): // a hang guard, not a performance limit
			t.Fatalf("round %d: the read outlived its cancelled request", i)
		}
		cancel()
	}
}

// post sends a small POST through u and reads the echo.
func upstreamPost(t *testing.T, u *upstream, addr string) echoed {
	t.Helper()
	req, _ := http.NewRequest("POST", "http://"+addr+"/v1/completions", strings.NewReader(`{"a":1}`))
	resp, err := u.roundTrip(req, addr)
	if err != nil {
		t.Fatalf("roundTrip: %v", err)
	}
	return decodeEcho(t, resp)
}

// agePool makes every pooled connection to addr look idle for d.
func agePool(u *upstream, addr string, d time.Duration) {
	u.mu.Lock()
	defer u.mu.Unlock()
	for _, pc := range u.idle[addr] {
		pc.idleAt = pc.idleAt.Add(-d)
	}
}

// TestUpstreamProbesOnlyAfterIdle: a connection reused at once costs no
// liveness probe (a system call per request); one idle for
// probeAfterIdle is probed before reuse.
func TestUpstreamProbesOnlyAfterIdle(t *testing.T) {
	b, conns := echoBackend(t, "b0")
	u := newUpstream(Config{}.withDefaults(), nil)
	defer u.closeIdle(true)
	for range 3 {
		upstreamPost(t, u, hostPort(b))
	}
	if got := u.probes.Load(); got != 0 {
		t.Errorf("%d probes for back-to-back reuse, want 0", got)
	}
	agePool(u, hostPort(b), probeAfterIdle)
	upstreamPost(t, u, hostPort(b))
	if got := u.probes.Load(); got != 1 {
		t.Errorf("%d probes after %v idle, want 1", got, probeAfterIdle)
	}
	if got := conns.Load(); got != 1 {
		t.Errorf("%d connections, want 1 reused throughout", got)
	}
}

// TestUpstreamIdleCloseCaughtByProbe: an endpoint that closed a
// connection idle past probeAfterIdle is found out before the request is
// written, so the request goes out once, on a fresh connection.
func TestUpstreamIdleCloseCaughtByProbe(t *testing.T) {
	b, requests := countingBackend(t)
	u := newUpstream(Config{}.withDefaults(), nil)
	defer u.closeIdle(true)
	post := func() {
		t.Helper()
		req, _ := http.NewRequest("POST", b.URL+"/v1/completions", strings.NewReader(`{}`))
		resp, err := u.roundTrip(req, hostPort(b))
		if err != nil {
			t.Fatalf("roundTrip: %v", err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	post()
	b.CloseClientConnections()
	agePool(u, hostPort(b), probeAfterIdle)
	// The endpoint's FIN must have reached the pooled socket for the probe
	// to see it; on loopback it arrives at once.
	deadline := time.Now().Add(5 * time.Second)
	for {
		u.mu.Lock()
		pc := u.idle[hostPort(b)][0]
		u.mu.Unlock()
		if !pc.alive() || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	post()
	if got := requests.Load(); got != 2 {
		t.Errorf("endpoint saw %d requests, want 2 (none sent on the closed connection)", got)
	}
	if got := u.dials.Load(); got != 2 {
		t.Errorf("dials %d, want 2", got)
	}
}

// TestUpstreamEmptyAnswerResentOnceOnlyWhenUnprobed: an endpoint that
// drops the connection without a byte of answer gets the request again on
// a fresh connection only when the first one was reused without a probe
// (its close may have crossed the request); on a fresh connection the
// empty answer is the endpoint's, and final.
func TestUpstreamEmptyAnswerResentOnceOnlyWhenUnprobed(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var requests atomic.Int64
	var drop atomic.Bool // drop every request from now on
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				for {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					_, _ = io.Copy(io.Discard, req.Body)
					requests.Add(1)
					if drop.Load() {
						return
					}
					_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
				}
			}()
		}
	}()
	addr := ln.Addr().String()
	u := newUpstream(Config{}.withDefaults(), nil)
	defer u.closeIdle(true)
	method := "PUT" // replayable: resent once from an unprobed connection
	send := func() error { return sendDrained(u, method, addr) }
	if err := send(); err != nil {
		t.Fatal(err)
	}
	drop.Store(true)
	if err := send(); err == nil {
		t.Fatal("an endpoint that never answers gave no error")
	}
	// 1 answered + the dropped one on the reused connection + once more
	// on a fresh connection, where the second empty answer is final.
	if got := requests.Load(); got != 3 {
		t.Errorf("endpoint saw %d requests, want 3", got)
	}
	if err := send(); err == nil {
		t.Fatal("an endpoint that never answers gave no error")
	}
	if got := requests.Load(); got != 4 {
		t.Errorf("endpoint saw %d requests, want 4 (no resend from a fresh connection)", got)
	}
	// An inference POST the endpoint read and dropped may have started
	// there: it is never sent twice.
	drop.Store(false)
	method = "POST"
	if err := send(); err != nil {
		t.Fatal(err)
	}
	drop.Store(true)
	if err := send(); err == nil {
		t.Fatal("an endpoint that never answers gave no error")
	}
	if got := requests.Load(); got != 6 {
		t.Errorf("endpoint saw %d requests, want 6 (a POST is not resent)", got)
	}
}

// TestUpstreamAwaitSendsWholeRequestsOnly: a request that fits the write
// buffer is sent inside the wait for its answer (flushAwait), one that
// went out in parts the plain way, and both are answered.
func TestUpstreamAwaitSendsWholeRequestsOnly(t *testing.T) {
	b, _ := echoBackend(t, "b0")
	u := newUpstream(Config{}.withDefaults(), nil)
	defer u.closeIdle(true)
	upstreamPost(t, u, hostPort(b))
	upstreamPost(t, u, hostPort(b))
	if got := u.awaits.Load(); got != 2 {
		t.Fatalf("%d requests sent by the wait, want 2", got)
	}
	big := strings.Repeat("x", 100<<10)
	req, _ := http.NewRequest("POST", "http://"+hostPort(b)+"/v1/completions", strings.NewReader(big))
	resp, err := u.roundTrip(req, hostPort(b))
	if err != nil {
		t.Fatalf("roundTrip: %v", err)
	}
	if e := decodeEcho(t, resp); e.Body != big {
		t.Errorf("large body relayed as %d bytes", len(e.Body))
	}
	if got := u.awaits.Load(); got != 2 {
		t.Errorf("a request sent in parts went through the wait (%d)", got)
	}
}

// TestUpstreamAwaitSeesEndpointCloseBeforeRequest: the endpoint closed a
// pooled connection (its FIN already in the socket) and the connection is
// reused within probeAfterIdle, unprobed. The readiness that FIN caused
// came before the wait began; the reset the request draws is what the
// wait must see, so the request fails over at once to a fresh connection
// instead of waiting out the response header timeout.
func TestUpstreamAwaitSeesEndpointCloseBeforeRequest(t *testing.T) {
	b, requests := countingBackend(t)
	u := newUpstream(Config{ResponseHeaderTimeout: time.Minute}.withDefaults(), nil)
	defer u.closeIdle(true)
	send := func() error { return sendDrained(u, "PUT", hostPort(b)) }
	if err := send(); err != nil {
		t.Fatal(err)
	}
	b.CloseClientConnections()
	u.mu.Lock()
	pc := u.idle[hostPort(b)][0]
	u.mu.Unlock()
	wait.Eventually(t, "the endpoint's FIN in the pooled socket", func() bool { return !pc.alive() })
	u.mu.Lock()
	pc.idleAt = time.Now() // reused unprobed
	u.mu.Unlock()
	if err := send(); err != nil {
		t.Fatalf("request after the endpoint's close: %v", err)
	}
	if got := requests.Load(); got != 2 {
		t.Errorf("endpoint saw %d requests, want 2", got)
	}
	if got := u.dials.Load(); got != 2 {
		t.Errorf("dials %d, want 2 (one fresh connection after the close)", got)
	}
}

// TestUpstreamDeadlineLeftInPoolIsCleared: a pooled connection keeps the
// read deadline of its last exchange (it is cleared on reuse, not on
// release). Expired, it must neither fail the liveness probe of a
// connection idle past probeAfterIdle nor a request sent without a
// header bound (a flow's leg).
func TestUpstreamDeadlineLeftInPoolIsCleared(t *testing.T) {
	b, conns := echoBackend(t, "b0")
	u := newUpstream(Config{}.withDefaults(), nil)
	defer u.closeIdle(true)
	// expire sets the pooled connection's deadline in the past, as a
	// header or idle bound left behind does once it runs out.
	expire := func() {
		u.mu.Lock()
		pc := u.idle[hostPort(b)][0]
		u.mu.Unlock()
		pc.setReadDeadline(time.Unix(1, 0))
	}
	upstreamPost(t, u, hostPort(b))
	expire()
	agePool(u, hostPort(b), probeAfterIdle)
	upstreamPost(t, u, hostPort(b))
	if got := u.probes.Load(); got != 1 {
		t.Errorf("%d probes, want 1", got)
	}
	expire()
	req, _ := http.NewRequest("POST", "http://"+hostPort(b)+"/v1/completions", strings.NewReader(`{"a":1}`))
	resp, err := u.sendWithin(context.Background(), hostPort(b), &stdRequest{req: req}, req, false, limits{})
	if err != nil {
		t.Fatalf("request without a header bound: %v", err)
	}
	if e := decodeEcho(t, resp); e.Body != `{"a":1}` {
		t.Errorf("body %q", e.Body)
	}
	if got := conns.Load(); got != 1 {
		t.Errorf("%d connections, want 1 reused throughout", got)
	}
}

// countingBackend answers every request with {} and counts them.
func countingBackend(t *testing.T) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var requests atomic.Int64
	b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		_, _ = w.Write([]byte(`{}`))
	}))
	t.Cleanup(b.Close)
	return b, &requests
}

// sendDrained sends {} with method to addr and reads the answer's body.
func sendDrained(u *upstream, method, addr string) error {
	req, _ := http.NewRequest(method, "http://"+addr+"/v1/completions", strings.NewReader(`{}`))
	resp, err := u.roundTrip(req, addr)
	if err == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	return err
}
