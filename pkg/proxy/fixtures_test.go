package proxy

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/testbed/pki"
)

// staticPicker routes every request to fixed candidates and records what
// it saw and every outcome.
type staticPicker struct {
	mu      sync.Mutex
	cands   []Endpoint
	receipt string
	err     error
	reqs    []Request
	results []Result
	done    chan Result
}

func newStaticPicker(addrs ...string) *staticPicker {
	p := &staticPicker{receipt: "tier=test ep=0", done: make(chan Result, 64)}
	for i, a := range addrs {
		p.cands = append(p.cands, Endpoint{Idx: i, Addr: a})
	}
	return p
}

func (p *staticPicker) Pick(_ context.Context, req *Request) (Plan, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	cp := *req
	cp.Body = append([]byte(nil), req.Body...)
	p.reqs = append(p.reqs, cp)
	if p.err != nil {
		return Plan{}, p.err
	}
	return Plan{
		Candidates: append([]Endpoint(nil), p.cands...),
		Receipt:    p.receipt,
		Done: func(r Result) {
			p.mu.Lock()
			p.results = append(p.results, r)
			p.mu.Unlock()
			select {
			case p.done <- r:
			default:
			}
		},
	}, nil
}

func (p *staticPicker) lastReq(t *testing.T) Request {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.reqs) == 0 {
		t.Fatal("picker saw no request")
	}
	return p.reqs[len(p.reqs)-1]
}

// waitResult returns the next Done outcome. Done runs after the response
// was written, so the client may see the answer first.
func (p *staticPicker) waitResult(t *testing.T) Result {
	t.Helper()
	select {
	case r := <-p.done:
		return r
	case <-time.After(30 * time.Second): // a hang guard, not a performance limit
		t.Fatal("Plan.Done was not called")
		return Result{}
	}
}

// proxyUnderTest is a Server serving a loopback listener it was handed.
type proxyUnderTest struct {
	*Server
	addr   string // host:port clients dial
	reg    *prometheus.Registry
	accept *atomic.Int64
}

type countingListener struct {
	net.Listener
	n *atomic.Int64
}

func (l countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.n.Add(1)
	}
	return c, err
}

// startProxy listens on vip:0, configures one service (ID 7 unless svc
// says otherwise) on that address and serves it through ServeListener.
func startProxy(t *testing.T, vip string, cfg Config, svc Service, picker Picker) *proxyUnderTest {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(vip, "0"))
	if err != nil {
		t.Fatalf("listen on %s: %v", vip, err)
	}
	if svc.ID == 0 {
		svc.ID = 7
	}
	svc.Listen = ln.Addr().(*net.TCPAddr).AddrPort()
	cfg.Services = append(cfg.Services, svc)
	reg := prometheus.NewRegistry()
	s, err := New(cfg, picker, new(InFlightTable), slog.New(slog.NewTextHandler(io.Discard, nil)), reg)
	if err != nil {
		ln.Close()
		t.Fatalf("New: %v", err)
	}
	n := new(atomic.Int64)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- s.ServeListener(ctx, countingListener{ln, n}) }()
	t.Cleanup(func() {
		cancel()
		if err := <-errc; err != nil {
			t.Errorf("ServeListener: %v", err)
		}
	})
	return &proxyUnderTest{Server: s, addr: ln.Addr().String(), reg: reg, accept: n}
}

// freeAddr finds a port currently free on ip, for tests of Serve, which
// binds the configured address itself.
func freeAddr(t *testing.T, ip string) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	ap := ln.Addr().(*net.TCPAddr).AddrPort()
	ln.Close()
	return ap
}

// refusedAddr returns a loopback address nothing listens on.
func refusedAddr(t *testing.T) string {
	t.Helper()
	return freeAddr(t, "127.0.0.1").String()
}

func newClient() *http.Client {
	return &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16, DisableCompression: true}}
}

// testPKI is a throwaway CA and leaf certificates, written as PEM files.
type testPKI struct {
	*pki.CA
	CAFile string
	pool   *x509.CertPool
}

func newPKI(t *testing.T) *testPKI {
	t.Helper()
	ca := pki.New(t)
	return &testPKI{CA: ca, CAFile: ca.File, pool: ca.Pool}
}

// leaf signs a certificate for name, valid for the given IPs.
func (p *testPKI) leaf(t *testing.T, name string, ips ...string) (certFile, keyFile string, pair tls.Certificate) {
	t.Helper()
	return p.Leaf(t, name, ips...)
}

// isClosedConn reports errors a torn-down test server may produce.
func isClosedConn(err error) bool {
	return err == nil || errors.Is(err, net.ErrClosed) || errors.Is(err, http.ErrServerClosed)
}
