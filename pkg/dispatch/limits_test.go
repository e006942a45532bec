package dispatch

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

// endlessHeaderEndpoint answers every request with a header line that
// never ends, pushing at most 64 MiB; pushed reports what it managed to
// write before the reader hung up.
func endlessHeaderEndpoint(t *testing.T, host string, idx int) (Endpoint, chan int64) {
	t.Helper()
	ln, err := net.Listen("tcp", host+":0")
	if err != nil {
		t.Fatal(err)
	}
	pushed := make(chan int64, 4)
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
				req, err := http.ReadRequest(bufio.NewReader(c))
				if err != nil {
					return
				}
				_, _ = io.Copy(io.Discard, req.Body)
				_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nX-Endless: ")
				chunk := []byte(strings.Repeat("a", 64<<10))
				var n int64
				for n < 64<<20 {
					w, err := c.Write(chunk)
					n += int64(w)
					if err != nil {
						break
					}
				}
				pushed <- n
			}()
		}
	}()
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	p, _ := strconv.Atoi(port)
	return Endpoint{Idx: idx, Host: host, Port: p, Healthy: true}, pushed
}

// TestLegResponseHeaderCap: a prefill or decode endpoint that never ends
// its headers fails the leg with 502 after MaxResponseHeaderBytes, instead
// of Go's 10 MiB default per leg.
func TestLegResponseHeaderCap(t *testing.T) {
	for _, leg := range []string{legPrefill, legDecode} {
		t.Run(leg, func(t *testing.T) {
			f := newFleet(t, fleetOpts{engine: "vllm", nPrefill: 1, nDec: 1, legs: proxy.Config{MaxResponseHeaderBytes: 64 << 10}})
			var pushed chan int64
			if leg == legPrefill {
				f.pool.Prefill[0], pushed = endlessHeaderEndpoint(t, f.pool.Prefill[0].Host, 0)
			} else {
				f.pool.Decode[0], pushed = endlessHeaderEndpoint(t, f.pool.Decode[0].Host, 1)
			}
			r := f.post(t, "/v1/completions", bodyFor(flowCases[0], prompt("headers", 2), 4))
			if r.status != http.StatusBadGateway {
				t.Fatalf("status %d, want 502: %s", r.status, r.body)
			}
			if n := <-pushed; n >= 8<<20 {
				t.Errorf("the endpoint pushed %d MiB of header before the leg gave up", n>>20)
			}
			if got := metricSum(t, f.reg, "loxilb_ai_pd_leg_errors_total", "leg", leg, "class", "protocol"); got != 1 {
				t.Errorf("%s protocol errors = %v, want 1", leg, got)
			}
		})
	}
}

// TestLegStatusZero: an endpoint answering status 000 fails its leg with
// 502; relaying the status would make WriteHeader panic.
func TestLegStatusZero(t *testing.T) {
	for _, leg := range []string{legPrefill, legDecode} {
		t.Run(leg, func(t *testing.T) {
			f := newFleet(t, fleetOpts{engine: "vllm", nPrefill: 1, nDec: 1})
			ep := rawEndpoint(t, f.pool.Prefill[0].Host, "HTTP/1.1 000 Zero\r\nContent-Length: 2\r\n\r\n{}")
			if leg == legPrefill {
				ep.Idx = 0
				f.pool.Prefill[0] = ep
			} else {
				ep.Idx = 1
				f.pool.Decode[0] = ep
			}
			r := f.post(t, "/v1/completions", bodyFor(flowCases[0], prompt("zero", 2), 4))
			if r.status != http.StatusBadGateway {
				t.Fatalf("status %d, want 502: %s", r.status, r.body)
			}
		})
	}
}

// rawEndpoint answers every request with the given bytes and closes.
func rawEndpoint(t *testing.T, host, answer string) Endpoint {
	t.Helper()
	ln, err := net.Listen("tcp", host+":0")
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
				req, err := http.ReadRequest(bufio.NewReader(c))
				if err != nil {
					return
				}
				_, _ = io.Copy(io.Discard, req.Body)
				_, _ = io.WriteString(c, answer)
			}()
		}
	}()
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	p, _ := strconv.Atoi(port)
	return Endpoint{Host: host, Port: p, Healthy: true}
}
