package health

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// failsafe only guards against a hung test; no assertion depends on speed.
const failsafe = 60 * time.Second

type harness struct {
	p       *Prober
	reg     *prometheus.Registry
	changes chan Change
	cancel  context.CancelFunc
	done    chan error
}

func start(t *testing.T, cfg Config, targets ...Target) *harness {
	t.Helper()
	if cfg.Interval == 0 {
		cfg.Interval = 10 * time.Millisecond
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = time.Second
	}
	reg := prometheus.NewRegistry()
	p, err := New(cfg, nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{p: p, reg: reg, changes: make(chan Change, 64), done: make(chan error, 1)}
	p.Subscribe(func(c Change) { h.changes <- c })
	if err := p.Set(targets); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	go func() { h.done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-h.done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return h
}

func (h *harness) wait(t *testing.T, healthy bool) Change {
	t.Helper()
	select {
	case c := <-h.changes:
		if c.Healthy != healthy {
			t.Fatalf("got change %+v, want healthy=%v", c, healthy)
		}
		return c
	case <-time.After(failsafe):
		t.Fatalf("no change to healthy=%v", healthy)
	}
	return Change{}
}

func (h *harness) failures(svc, ep, reason string) float64 {
	return testutil.ToFloat64(h.p.m.failures.WithLabelValues(svc, ep, reason))
}

func addrPort(t *testing.T, s string) (netip.Addr, uint16) {
	t.Helper()
	s = strings.TrimPrefix(strings.TrimPrefix(s, "http://"), "https://")
	ap, err := netip.ParseAddrPort(s)
	if err != nil {
		t.Fatal(err)
	}
	return ap.Addr(), ap.Port()
}

func TestHTTPDownUp(t *testing.T) {
	var status atomic.Int32
	status.Store(200)
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		if r.URL.Path != "/health" {
			http.NotFound(w, r)
			return
		}
		w.WriteHeader(int(status.Load()))
		io.WriteString(w, "engine ready")
	}))
	defer srv.Close()
	a, port := addrPort(t, srv.URL)
	h := start(t, Config{}, Target{Service: 3, EP: 1, Addr: a, Port: port, Monitor: true,
		Probe: Probe{Type: ProbeHTTP, Request: "health", Response: "ready", Retries: 3}})
	if !h.p.Healthy(3, 1) {
		t.Fatal("targets start healthy")
	}
	status.Store(503)
	c := h.wait(t, false)
	if c.Reason != "status" || c.Service != 3 || c.EP != 1 || h.p.Healthy(3, 1) {
		t.Fatalf("down change %+v", c)
	}
	if n := h.failures("3", "1", "status"); n < 3 {
		t.Errorf("went down after %v failures, want >= 3 (Retries)", n)
	}
	if v := testutil.ToFloat64(h.p.m.healthy.WithLabelValues("3", "1")); v != 0 {
		t.Errorf("healthy gauge %v while down", v)
	}
	status.Store(200)
	h.wait(t, true)
	if !h.p.Healthy(3, 1) || testutil.ToFloat64(h.p.m.healthy.WithLabelValues("3", "1")) != 1 {
		t.Fatal("not healthy after recovery")
	}
	if v := testutil.ToFloat64(h.p.m.changes.WithLabelValues("3", "1")); v != 2 {
		t.Errorf("state changes %v, want 2", v)
	}
}

func TestHTTPBodyMismatch(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "warming up")
	}))
	defer srv.Close()
	a, port := addrPort(t, srv.URL)
	h := start(t, Config{}, Target{Service: 1, EP: 0, Addr: a, Port: port, Monitor: true,
		Probe: Probe{Type: ProbeHTTP, Response: "ready"}})
	if c := h.wait(t, false); c.Reason != "body" || !strings.Contains(c.Err.Error(), "warming up") {
		t.Fatalf("change %+v", c)
	}
}

func TestHTTPSSelfSigned(t *testing.T) {
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "ok")
	}))
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // rejected handshakes are expected
	defer srv.Close()
	a, port := addrPort(t, srv.URL)
	tgt := Target{Service: 1, EP: 0, Addr: a, Port: port, Monitor: true, Probe: Probe{Type: ProbeHTTPS, Response: "ok", Retries: 1}}

	// Default: no verification, so the self-signed endpoint is up.
	h := start(t, Config{}, tgt)
	// A verifying config with the server's CA is also up; with an empty
	// pool the probe fails for a TLS reason.
	pool := x509.NewCertPool()
	pool.AddCert(srv.Certificate())
	h2 := start(t, Config{TLSConfig: &tls.Config{RootCAs: pool}}, tgt)
	h3 := start(t, Config{TLSConfig: &tls.Config{RootCAs: x509.NewCertPool()}}, tgt)
	if c := h3.wait(t, false); c.Reason != "tls" {
		t.Fatalf("verifying probe: %+v", c)
	}
	// By now h and h2 have probed many times; neither may have failed.
	waitProbes(t, h, "1", "0")
	for _, hh := range []*harness{h, h2} {
		select {
		case c := <-hh.changes:
			t.Fatalf("https endpoint changed state: %+v", c)
		default:
		}
		if !hh.p.Healthy(1, 0) {
			t.Fatal("self-signed https endpoint marked down")
		}
	}
}

// waitProbes waits until a few probe intervals have certainly passed by
// watching a second target fail Retries times.
func waitProbes(t *testing.T, h *harness, svc, ep string) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a, port := addrPort(t, ln.Addr().String())
	ln.Close()
	other := Target{Service: 99, EP: 0, Addr: a, Port: port, Monitor: true, Probe: Probe{Type: ProbeTCP, Retries: 5}}
	cur := []Target{other}
	h.p.mu.RLock()
	for _, w := range h.p.workers {
		cur = append(cur, w.t)
	}
	h.p.mu.RUnlock()
	if err := h.p.Set(cur); err != nil {
		t.Fatal(err)
	}
	h.wait(t, false)
}

func TestTCPDownUp(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	go acceptLoop(ln, "")
	a, port := addrPort(t, addr)
	h := start(t, Config{}, Target{Service: 2, EP: 5, Addr: a, Port: port, Monitor: true, Probe: Probe{Type: ProbeTCP}})
	ln.Close()
	if c := h.wait(t, false); c.Reason != "refused" {
		t.Fatalf("down reason %q (%v)", c.Reason, c.Err)
	}
	ln2, err := net.Listen("tcp", addr)
	if err != nil {
		t.Skipf("cannot rebind %s: %v", addr, err)
	}
	defer ln2.Close()
	go acceptLoop(ln2, "")
	h.wait(t, true)
}

func acceptLoop(ln net.Listener, reply string) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			if reply != "" {
				buf := make([]byte, 64)
				c.SetDeadline(time.Now().Add(failsafe))
				if n, _ := c.Read(buf); strings.HasPrefix(string(buf[:n]), "PING") {
					io.WriteString(c, reply)
				}
			}
		}()
	}
}

func TestTCPRequestResponseAndProbePort(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go acceptLoop(ln, "+PONG\r\n")
	a, port := addrPort(t, ln.Addr().String())
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, deadPort := addrPort(t, closed.Addr().String())
	closed.Close()
	h := start(t, Config{},
		// Target port is dead, but probeport points at the live listener.
		Target{Service: 1, EP: 0, Addr: a, Port: deadPort, Monitor: true, Probe: Probe{Type: ProbeTCP, Port: port, Request: "PING\r\n", Response: "PONG"}},
		Target{Service: 1, EP: 1, Addr: a, Port: port, Monitor: true, Probe: Probe{Type: ProbeTCP, Request: "PING\r\n", Response: "NOPE"}},
	)
	c := h.wait(t, false)
	if c.EP != 1 || c.Reason != "body" {
		t.Fatalf("change %+v", c)
	}
	if !h.p.Healthy(1, 0) {
		t.Fatal("probeport target down")
	}
}

func TestUnmonitoredAndRemoval(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a, port := addrPort(t, ln.Addr().String())
	ln.Close() // nothing listens: a probed target would go down
	h := start(t, Config{},
		Target{Service: 1, EP: 0, Addr: a, Port: port, Monitor: false, Probe: Probe{Type: ProbeTCP}},
		Target{Service: 1, EP: 1, Addr: a, Port: port, Monitor: true, Probe: Probe{Type: ProbeNone}},
		Target{Service: 1, EP: 2, Addr: a, Port: port, Monitor: true, Probe: Probe{Type: ProbeTCP}},
	)
	h.wait(t, false)
	if !h.p.Healthy(1, 0) || !h.p.Healthy(1, 1) || !h.p.Healthy(42, 9) {
		t.Fatal("unmonitored or unknown endpoints must be healthy")
	}
	if h.p.Healthy(1, 2) {
		t.Fatal("probed dead endpoint healthy")
	}
	if n, _ := testutil.GatherAndCount(h.reg, "loxilb_endpoint_healthy"); n != 1 {
		t.Errorf("%d healthy series, want 1 (monitored only)", n)
	}
	// Removing the target stops probing and deletes its series.
	if err := h.p.Set(nil); err != nil {
		t.Fatal(err)
	}
	if !h.p.Healthy(1, 2) {
		t.Fatal("removed target still down")
	}
	if n, _ := testutil.GatherAndCount(h.reg, "loxilb_endpoint_healthy", "loxilb_endpoint_probe_failures_total"); n != 0 {
		t.Errorf("%d series left after removal", n)
	}
}

func TestSetKeepsStateAndValidates(t *testing.T) {
	p, err := New(Config{}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	a := netip.MustParseAddr("127.0.0.1")
	ok := Target{Service: 1, EP: 0, Addr: a, Port: 80, Monitor: true, Probe: Probe{Type: ProbeHTTP}}
	for _, tc := range []struct {
		name    string
		targets []Target
		want    error
	}{
		{"udp", []Target{{Service: 1, Addr: a, Port: 1, Monitor: true, Probe: Probe{Type: "udp"}}}, ErrUnsupportedProbe},
		{"bogus", []Target{{Service: 1, Addr: a, Port: 1, Monitor: true, Probe: Probe{Type: "gopher"}}}, ErrInvalidProbe},
		{"dup", []Target{ok, ok}, ErrInvalidProbe},
		{"no addr", []Target{{Service: 1, Port: 1, Monitor: true, Probe: Probe{Type: ProbeTCP}}}, ErrInvalidProbe},
		{"no port", []Target{{Service: 1, Addr: a, Monitor: true, Probe: Probe{Type: ProbeTCP}}}, ErrInvalidProbe},
		{"bad path", []Target{{Service: 1, Addr: a, Port: 1, Monitor: true, Probe: Probe{Type: ProbeHTTP, Request: "/a b"}}}, ErrInvalidProbe},
	} {
		if err := p.Set(tc.targets); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	if err := p.Set([]Target{ok}); err != nil {
		t.Fatal(err)
	}
	// Simulate a down endpoint, then change only the probe path: state kept.
	p.workers[key{1, 0}].healthy.Store(false)
	changed := ok
	changed.Probe.Request = "/healthz"
	if err := p.Set([]Target{changed}); err != nil {
		t.Fatal(err)
	}
	if p.Healthy(1, 0) {
		t.Fatal("state lost on probe change with same address")
	}
	moved := changed
	moved.Port = 81
	if err := p.Set([]Target{moved}); err != nil {
		t.Fatal(err)
	}
	if !p.Healthy(1, 0) {
		t.Fatal("new address must start healthy")
	}
}

func TestProbeFromRule(t *testing.T) {
	p, err := ProbeFromRule("HTTPS", 8443, "/v1/models", "data", 5, 3)
	if err != nil {
		t.Fatal(err)
	}
	if p.Type != ProbeHTTPS || p.Port != 8443 || p.Interval != 5*time.Second || p.Retries != 3 || p.Request != "/v1/models" {
		t.Fatalf("%+v", p)
	}
	if p, _ := ProbeFromRule("", 0, "", "", 0, 0); p.Type != ProbeTCP {
		t.Errorf("empty probetype -> %q, want tcp", p.Type)
	}
	for _, bad := range []struct {
		typ          string
		port, to, rt int
		want         error
	}{
		{"udp", 0, 0, 0, ErrUnsupportedProbe},
		{"sctp", 0, 0, 0, ErrUnsupportedProbe},
		{"smtp", 0, 0, 0, ErrInvalidProbe},
		{"tcp", 70000, 0, 0, ErrInvalidProbe},
		{"tcp", 0, -1, 0, ErrInvalidProbe},
		{"tcp", 0, 0, -2, ErrInvalidProbe},
	} {
		if _, err := ProbeFromRule(bad.typ, bad.port, "", "", bad.to, bad.rt); !errors.Is(err, bad.want) {
			t.Errorf("%+v: %v", bad, err)
		}
	}
	if _, err := ProbeFromRule("udp", 0, "", "", 0, 0); err == nil || !strings.Contains(err.Error(), "use tcp, http, https, ping or none") {
		t.Errorf("udp error should say what to use instead: %v", err)
	}
	if !MonitorEnabled(false, "http") || MonitorEnabled(false, "none") || MonitorEnabled(false, "") || !MonitorEnabled(true, "") {
		t.Error("MonitorEnabled")
	}
}

func TestClassify(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{context.DeadlineExceeded, "timeout"},
		{fmt.Errorf("dial: %w", &probeError{reason: "body", err: io.EOF}), "body"},
		{io.ErrUnexpectedEOF, "reset"},
		{errors.New("weird"), "error"},
		{tls.RecordHeaderError{Msg: "x"}, "tls"},
	} {
		if got := classify(tc.err); got != tc.want {
			t.Errorf("classify(%v) = %q, want %q", tc.err, got, tc.want)
		}
	}
}

func TestRunTwice(t *testing.T) {
	p, _ := New(Config{}, nil, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- p.Run(ctx) }()
	// Wait until the first Run has installed its context.
	for {
		p.mu.RLock()
		running := p.runCtx != nil
		p.mu.RUnlock()
		if running {
			break
		}
		time.Sleep(time.Millisecond)
	}
	if err := p.Run(ctx); err == nil {
		t.Error("second concurrent Run accepted")
	}
	cancel()
	<-done
	if _, err := New(Config{Retries: -1}, nil, nil); !errors.Is(err, ErrInvalidProbe) {
		t.Errorf("negative retries: %v", err)
	}
}

// requirePrivileged skips when not root, unless CI=true, where privileged
// tests must run.
func requirePrivileged(t *testing.T, why string) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("CI=true but not root: %s needs root", why)
	}
	t.Skipf("not root: %s needs root (or an unprivileged ping_group_range)", why)
}

func TestPingLoopback(t *testing.T) {
	var pg pinger
	ctx, cancel := context.WithTimeout(context.Background(), failsafe)
	defer cancel()
	err := pg.echo(ctx, netip.MustParseAddr("127.0.0.1"))
	if errors.Is(err, ErrPingUnavailable) {
		requirePrivileged(t, "ICMP raw socket")
		t.Fatalf("root but ping unavailable: %v", err)
	}
	if err != nil {
		t.Fatalf("ping 127.0.0.1: %v", err)
	}
	// Through the prober, with state transitions on a loopback address.
	h := start(t, Config{}, Target{Service: 1, EP: 0, Addr: netip.MustParseAddr("127.0.0.1"), Port: 1, Monitor: true, Probe: Probe{Type: ProbePing}})
	waitProbes(t, h, "1", "0")
	if !h.p.Healthy(1, 0) || h.failures("1", "0", "timeout") != 0 {
		t.Fatal("ping target not healthy")
	}
}

func TestHTTPTimeoutAndUnsubscribe(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer srv.Close()
	defer close(release)
	a, port := addrPort(t, srv.URL)
	h := start(t, Config{Timeout: 20 * time.Millisecond},
		Target{Service: 4, EP: 0, Addr: a, Port: port, Monitor: true, Probe: Probe{Type: ProbeHTTP}})
	var second atomic.Int32
	unsub := h.p.Subscribe(func(Change) { second.Add(1) })
	unsub()
	if c := h.wait(t, false); c.Reason != "timeout" {
		t.Fatalf("hanging endpoint: %+v", c)
	}
	if second.Load() != 0 {
		t.Error("unsubscribed callback was called")
	}
}

func TestHTTPIPv6Loopback(t *testing.T) {
	ln, err := net.Listen("tcp6", "[::1]:0")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI machines have an IPv6 loopback; this test must run: %v", err)
		}
		t.Skipf("no IPv6 loopback: %v", err)
	}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(500)
	}))
	srv.Listener = ln
	srv.Start()
	defer srv.Close()
	ap := netip.MustParseAddrPort(ln.Addr().String())
	h := start(t, Config{}, Target{Service: 6, EP: 0, Addr: ap.Addr(), Port: ap.Port(), Monitor: true, Probe: Probe{Type: ProbeHTTP}})
	if c := h.wait(t, false); c.Reason != "status" || c.Addr != ap {
		t.Fatalf("ipv6 probe: %+v", c)
	}
}

func TestPingIPv6Loopback(t *testing.T) {
	if ln, err := net.Listen("tcp6", "[::1]:0"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI machines have an IPv6 loopback; this test must run: %v", err)
		}
		t.Skipf("no IPv6 loopback: %v", err)
	} else {
		ln.Close()
	}
	var pg pinger
	ctx, cancel := context.WithTimeout(context.Background(), failsafe)
	defer cancel()
	err := pg.echo(ctx, netip.MustParseAddr("::1"))
	if errors.Is(err, ErrPingUnavailable) {
		requirePrivileged(t, "ICMPv6 raw socket")
		t.Fatalf("root but ping unavailable: %v", err)
	}
	if err != nil {
		t.Fatalf("ping ::1: %v", err)
	}
}
