package dispatch

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// proxied is a fleet's dispatcher behind the real mode-4 proxy, the way
// the daemon runs P/D requests: the Picker's plan carries the flow
// (Plan.Dispatch), a FirstByte hook and Done, and the legs go over the
// proxy's upstream (Request.Legs).
type proxied struct {
	url        string
	reg        *prometheus.Registry
	firstBytes atomic.Int32
	done       chan proxy.Result
}

func newProxied(t *testing.T, f *fleet) *proxied {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxied{url: "http://" + ln.Addr().String(), reg: prometheus.NewRegistry(), done: make(chan proxy.Result, 1)}
	picker := proxy.PickerFunc(func(context.Context, *proxy.Request) (proxy.Plan, error) {
		return proxy.Plan{
			FirstByte: func() { p.firstBytes.Add(1) },
			Done:      func(res proxy.Result) { p.done <- res },
			Dispatch: func(ctx context.Context, w http.ResponseWriter, r *proxy.Request) proxy.Result {
				return f.d.Serve(ctx, w, &Request{Pool: f.pool, Method: r.Method, Path: r.Path,
					Header: r.Header, Body: r.Body, Legs: r.Legs})
			},
		}, nil
	})
	svc := proxy.Service{ID: f.pool.Service, Listen: ln.Addr().(*net.TCPAddr).AddrPort()}
	s, err := proxy.New(proxy.Config{Services: []proxy.Service{svc}}, picker, new(proxy.InFlightTable), slog.New(slog.NewTextHandler(io.Discard, nil)), p.reg)
	if err != nil {
		ln.Close()
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- s.ServeListener(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-errc; err != nil {
			t.Errorf("ServeListener: %v", err)
		}
	})
	return p
}

// post sends one request through the proxy and returns the answer with
// the Result the proxy handed to Done.
func (p *proxied) post(t *testing.T, path string, body any) (reply, proxy.Result) {
	t.Helper()
	b, _ := json.Marshal(body)
	client := &http.Client{Timeout: 30 * time.Second}
	resp, err := client.Post(p.url+path, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	rb, rerr := io.ReadAll(resp.Body)
	resp.Body.Close()
	select {
	case res := <-p.done:
		return reply{status: resp.StatusCode, header: resp.Header, body: rb, err: rerr}, res
	case <-time.After(30 * time.Second): // a hang, not a timing assumption
		t.Fatal("Done was not called")
	}
	return reply{}, proxy.Result{}
}

// TestProxiedLegsFeedUsageAndFirstByte: a P/D response relayed by the
// proxy calls the plan's FirstByte once and reports the decode engine's
// usage block in Result and in loxilb_ai_usage_reported_total under the
// decode endpoint, as a single-endpoint response does, for every engine's
// flow, streamed and not. The prefill leg's usage is not counted.
func TestProxiedLegsFeedUsageAndFirstByte(t *testing.T) {
	for _, engine := range []string{enginesim.EngineVLLM, enginesim.EngineSGLang, enginesim.EngineTRTLLM} {
		t.Run(engine, func(t *testing.T) {
			f := newFleet(t, fleetOpts{engine: engine, nPrefill: 1, nDec: 1})
			p := newProxied(t, f)
			decode := strconv.Itoa(f.pool.Decode[0].Idx)
			for i, c := range flowCases {
				body := bodyFor(c, prompt(fmt.Sprintf("proxied-%s-%d", engine, i), 8), 12)
				before := p.firstBytes.Load()
				r, res := p.post(t, c.path, body)
				if r.status != http.StatusOK || r.err != nil {
					t.Fatalf("%s: status %d err %v: %s", c.name, r.status, r.err, r.body)
				}
				if n := p.firstBytes.Load() - before; n != 1 {
					t.Fatalf("%s: FirstByte called %d times, want 1", c.name, n)
				}
				if !res.HasUsage || res.PromptTokens == 0 || res.Endpoint != f.pool.Decode[0].Idx {
					t.Fatalf("%s: Result carries no decode usage: %+v", c.name, res)
				}
			}
			if got := metricSum(t, p.reg, "loxilb_ai_usage_reported_total", "ep_idx", decode); got != float64(len(flowCases)) {
				t.Fatalf("usage reported under the decode endpoint %v times, want %d", got, len(flowCases))
			}
			if got := metricSum(t, p.reg, "loxilb_ai_usage_reported_total"); got != float64(len(flowCases)) {
				t.Fatalf("usage reported %v times in all, want %d (the prefill leg's is not counted)", got, len(flowCases))
			}
		})
	}
}

// TestProxiedFlowErrorIsNoFirstByte: an error the flow answers itself
// (the decode engine reset the leg before any byte) is the proxy's answer,
// not an endpoint's: FirstByte is not called and no usage is reported.
func TestProxiedFlowErrorIsNoFirstByte(t *testing.T) {
	f := newFleet(t, fleetOpts{engine: enginesim.EngineVLLM, nPrefill: 1, nDec: 1,
		decodeFaults: enginesim.Faults{ResetRequests: -1}})
	p := newProxied(t, f)
	r, res := p.post(t, "/v1/completions", bodyFor(flowCases[0], prompt("reset", 4), 4))
	if r.status != http.StatusBadGateway {
		t.Fatalf("status %d, want 502: %s", r.status, r.body)
	}
	if n := p.firstBytes.Load(); n != 0 {
		t.Fatalf("FirstByte called %d times for the proxy's own error answer", n)
	}
	if res.HasUsage || metricSum(t, p.reg, "loxilb_ai_usage_reported_total") != 0 {
		t.Fatalf("usage reported for an error answer: %+v", res)
	}
}
