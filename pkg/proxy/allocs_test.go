package proxy

import (
	"bufio"
	"bytes"
	"context"
	"log/slog"
	"net"
	"testing"
)

// The allocation harness drives the proxy with a hand-written keep-alive
// client and backend that allocate nothing per request themselves, so
// testing.AllocsPerRun (which counts every goroutine's allocations) sees
// the proxy's own.

const (
	allocReq = "POST /v1/completions HTTP/1.1\r\nHost: vip\r\nContent-Type: application/json\r\nContent-Length: 45\r\n\r\n" +
		`{"model":"m","prompt":"hello","max_tokens":1}`
	allocResp = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
)

// readMessage reads one HTTP/1.1 message with a Content-Length body from
// br without allocating.
func readMessage(br *bufio.Reader) error {
	n := 0
	for {
		line, err := br.ReadSlice('\n')
		if err != nil {
			return err
		}
		if len(line) <= 2 {
			break
		}
		if v, ok := bytes.CutPrefix(line, []byte("Content-Length: ")); ok {
			n = 0
			for _, c := range bytes.TrimSpace(v) {
				n = n*10 + int(c-'0')
			}
		}
	}
	_, err := br.Discard(n)
	return err
}

// allocBackend answers every request on every connection with allocResp.
func allocBackend(t testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				resp := []byte(allocResp)
				for readMessage(br) == nil {
					if _, err := c.Write(resp); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

// allocPicker hands out the same plan every time without allocating.
type allocPicker struct{ plan Plan }

func (p *allocPicker) Pick(context.Context, *Request) (Plan, error) { return p.plan, nil }

// proxyAllocsPerRequest measures the allocations of one small keep-alive
// POST relayed by the proxy (the picker's own excluded).
func proxyAllocsPerRequest(t testing.TB) float64 {
	backend := allocBackend(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &allocPicker{plan: Plan{Candidates: []Endpoint{{Idx: 0, Addr: backend}}, Receipt: "tier=test"}}
	cfg := Config{Services: []Service{{ID: 1, Listen: ln.Addr().(*net.TCPAddr).AddrPort()}}}
	s, err := New(cfg, p, new(InFlightTable), slog.New(slog.DiscardHandler), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = s.ServeListener(ctx, ln); close(done) }()
	defer func() { cancel(); <-done }()

	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	req := []byte(allocReq)
	one := func() {
		if _, err := c.Write(req); err != nil {
			t.Fatal(err)
		}
		if err := readMessage(br); err != nil {
			t.Fatal(err)
		}
	}
	for range 50 {
		one() // warm pools and the connection
	}
	if b, ok := t.(*testing.B); ok {
		b.ReportAllocs()
		b.ResetTimer()
		for range b.N {
			one()
		}
		return 0
	}
	return testing.AllocsPerRun(500, one)
}

// BenchmarkProxySmallRequest is the allocation harness as a benchmark,
// for -memprofile.
func BenchmarkProxySmallRequest(b *testing.B) { proxyAllocsPerRequest(b) }

// maxProxyAllocs bounds the allocations of one small proxied request.
const maxProxyAllocs = 10

func TestProxySmallRequestAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector drops sync.Pool items at random; `make test-allocs` checks allocations without it")
	}
	got := proxyAllocsPerRequest(t)
	t.Logf("%.1f allocations per proxied small request", got)
	if got > maxProxyAllocs {
		t.Errorf("%.1f allocations per proxied small request, want at most %d", got, maxProxyAllocs)
	}
}
