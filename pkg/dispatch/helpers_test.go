package dispatch

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/outlier"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// netSeq hands every test its own 127.0.N.0/24 so emulators of different
// tests never share an address (SGLang prefill engines of one pool share a
// bootstrap port on distinct hosts, as real hosts do).
var netSeq atomic.Int32

func testNet() int { return 60 + int(netSeq.Add(1)) }

// startEngine runs one emulator with modelled delays off.
func startEngine(t *testing.T, cfg enginesim.Config) *enginesim.Engine {
	t.Helper()
	if !cfg.TimeScaleSet {
		cfg.TimeScale, cfg.TimeScaleSet = 0, true
	}
	if cfg.ZMQPort == 0 {
		cfg.ZMQPort = -1
	}
	e, err := enginesim.New(cfg, enginesim.Deps{})
	if err != nil {
		t.Fatalf("new engine: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	// Closed, not drained: a stalled emulator's graceful shutdown would
	// wait its 2 s grace for connections the test no longer cares about.
	t.Cleanup(func() { _ = e.Close(); cancel(); <-done })
	return e
}

// fleet is a P/D pool of emulators plus a dispatcher served over HTTP.
type fleet struct {
	prefill, decode []*enginesim.Engine
	pool            *Pool
	d               *Dispatcher
	reg             *prometheus.Registry
	srv             *httptest.Server
	// kv, when set, is the Tier 1.5 scorer handed with every request.
	kv      KVScorer
	session string // header carrying the session id
	keys    func(body []byte) []uint64
	// observe, when set, receives every leg's outcome.
	observe func(ep Endpoint, prefill bool, o outlier.Outcome)
	// prefillRank, when set, names prefill ranks (Request.PrefillRank).
	prefillRank func(ep int) (rank, ranks int, ok bool)
}

type fleetOpts struct {
	engine          string
	nPrefill, nDec  int
	cfg             Config
	prefillFaults   enginesim.Faults
	decodeFaults    enginesim.Faults
	bootstrapShared bool
	prefillRanks    int // data-parallel ranks of each prefill engine (0: 1)
	// nixlSide gives vLLM prefill engines a NIXL side channel of their own
	// (as vLLM has), not the HTTP port.
	nixlSide bool
	// legs configures the proxy upstream the legs go through.
	legs proxy.Config
}

// newLegs is the proxy's upstream for a test's legs, as the proxy hands
// it to a flow in proxy.Request.Legs.
func newLegs(t testing.TB, cfg proxy.Config, tc *tls.Config) *proxy.Transport {
	t.Helper()
	tr, err := proxy.NewTransport(cfg, tc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(tr.CloseIdleConnections)
	return tr
}

func newFleet(t *testing.T, o fleetOpts) *fleet {
	t.Helper()
	n := testNet()
	f := &fleet{reg: prometheus.NewRegistry(), session: "X-Session-Id"}
	f.pool = &Pool{Service: 7, Engine: o.engine}
	boot := 0
	for i := 0; i < o.nPrefill; i++ {
		host := fmt.Sprintf("127.0.%d.%d", n, 11+i)
		c := enginesim.Config{Engine: o.engine, Role: enginesim.RolePrefill, Listen: host + ":0", Faults: o.prefillFaults,
			PDTimeout: 5 * time.Second, DPRanks: o.prefillRanks}
		if o.engine == enginesim.EngineSGLang {
			c.BootstrapPort = boot // the first picks a free port, the others share it
		}
		if o.nixlSide {
			c.NIXLSidePort = -1
		}
		e := startEngine(t, c)
		if o.engine == enginesim.EngineSGLang {
			boot = e.BootstrapPort()
		}
		f.prefill = append(f.prefill, e)
		f.pool.Prefill = append(f.pool.Prefill, endpointOf(t, e, i))
	}
	f.pool.BootstrapPort = boot
	for i := 0; i < o.nDec; i++ {
		host := fmt.Sprintf("127.0.%d.%d", n, 101+i)
		e := startEngine(t, enginesim.Config{Engine: o.engine, Role: enginesim.RoleDecode, Listen: host + ":0",
			Faults: o.decodeFaults, PDTimeout: 5 * time.Second})
		f.decode = append(f.decode, e)
		f.pool.Decode = append(f.pool.Decode, endpointOf(t, e, o.nPrefill+i))
	}
	d, err := New(o.cfg, nil, f.reg)
	if err != nil {
		t.Fatal(err)
	}
	legs := newLegs(t, o.legs, nil)
	f.d = d
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		req := &Request{Pool: f.pool, Method: r.Method, Path: r.URL.Path, Header: r.Header, Body: body,
			Session: r.Header.Get(f.session), KV: f.kv, Observe: f.observe, PrefillRank: f.prefillRank, Legs: legs}
		if f.keys != nil {
			req.PrefixKeys = f.keys(body)
		}
		res := d.Serve(r.Context(), w, req)
		w.Header() // nothing else to write
		if MustAbort(res) {
			panic(http.ErrAbortHandler)
		}
	}))
	t.Cleanup(f.srv.Close)
	return f
}

func endpointOf(t *testing.T, e *enginesim.Engine, idx int) Endpoint {
	t.Helper()
	host, port, err := net.SplitHostPort(e.Addr())
	if err != nil {
		t.Fatal(err)
	}
	p, _ := strconv.Atoi(port)
	return Endpoint{Idx: idx, Host: host, Port: p, Healthy: true}
}

// deadEndpoint is an address nothing listens on (a closed listener's port).
func deadEndpoint(t *testing.T, host string, idx int) Endpoint {
	t.Helper()
	ln, err := net.Listen("tcp", host+":0")
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	ln.Close()
	p, _ := strconv.Atoi(port)
	return Endpoint{Idx: idx, Host: host, Port: p, Healthy: true}
}

type reply struct {
	status int
	header http.Header
	body   []byte
	err    error // transport error reading the body (a cut stream)
}

func (f *fleet) post(t *testing.T, path string, body any, hdr ...string) reply {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequest(http.MethodPost, f.srv.URL+path, bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	client := &http.Client{Timeout: 30 * time.Second}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	rb, rerr := io.ReadAll(resp.Body)
	return reply{status: resp.StatusCode, header: resp.Header, body: rb, err: rerr}
}

// text extracts the generated text of a JSON or SSE completion.
func text(t *testing.T, r reply) string {
	t.Helper()
	if strings.HasPrefix(r.header.Get("Content-Type"), "text/event-stream") {
		var sb strings.Builder
		sc := bufio.NewScanner(bytes.NewReader(r.body))
		done := false
		for sc.Scan() {
			line := strings.TrimPrefix(sc.Text(), "data: ")
			if line == "" || line == sc.Text() {
				continue
			}
			if line == "[DONE]" {
				done = true
				continue
			}
			var ch struct {
				Choices []struct {
					Text  string `json:"text"`
					Delta struct {
						Content string `json:"content"`
					} `json:"delta"`
				} `json:"choices"`
			}
			if err := json.Unmarshal([]byte(line), &ch); err != nil {
				t.Fatalf("bad SSE chunk %q: %v", line, err)
			}
			for _, c := range ch.Choices {
				sb.WriteString(c.Text + c.Delta.Content)
			}
		}
		if !done {
			t.Fatalf("stream without [DONE]: %s", r.body)
		}
		return sb.String()
	}
	var obj struct {
		Choices []struct {
			Text    string `json:"text"`
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(r.body, &obj); err != nil || len(obj.Choices) != 1 {
		t.Fatalf("bad completion (%v): %s", err, r.body)
	}
	return obj.Choices[0].Text + obj.Choices[0].Message.Content
}

func counter(t *testing.T, c prometheus.Collector) float64 {
	t.Helper()
	return testutil.ToFloat64(c)
}

// metricSum adds every series of a metric family in the registry.
func metricSum(t *testing.T, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				found := false
				for _, lp := range m.GetLabel() {
					if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
						found = true
					}
				}
				if !found {
					continue next
				}
			}
			switch {
			case m.Counter != nil:
				sum += m.Counter.GetValue()
			case m.Gauge != nil:
				sum += m.Gauge.GetValue()
			case m.Histogram != nil:
				sum += float64(m.Histogram.GetSampleCount())
			}
		}
	}
	return sum
}

// reference is what a role-less engine of the same kind answers: P/D must
// not change the output.
func reference(t *testing.T, engine, path string, body any) string {
	t.Helper()
	e := startEngine(t, enginesim.Config{Engine: engine, Listen: "127.0.0.1:0"})
	b, _ := json.Marshal(body)
	resp, err := http.Post(e.URL()+path, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	rb, _ := io.ReadAll(resp.Body)
	return text(t, reply{status: resp.StatusCode, header: resp.Header, body: rb})
}
