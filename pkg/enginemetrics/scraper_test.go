package enginemetrics

import (
	"context"
	"math"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

func TestParse(t *testing.T) {
	text := []byte(`# HELP vllm:num_requests_running x
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 3
vllm:num_requests_running{model_name="b"} 1
vllm:num_requests_waiting{model_name="a"} 2.0
vllm:gpu_cache_usage_perc{model_name="a"} 0.5
`)
	m, err := Parse("vllm", text)
	if err != nil || m.Running != 4 || m.Waiting != 2 || m.KVUsage != 0.5 || !m.Valid {
		t.Fatalf("%+v %v", m, err)
	}
	if _, err := Parse("vllm", []byte("go_goroutines 12\n")); err == nil {
		t.Error("a /metrics page without engine gauges must be an error")
	}
	if _, err := Parse("tgi", text); err == nil {
		t.Error("unknown engine accepted")
	}
	m, err = Parse("sglang", []byte("sglang:num_running_reqs{tp_rank=\"0\"} 5\nsglang:num_queue_reqs 1\nsglang:token_usage 0.25\n"))
	if err != nil || m.Running != 5 || m.Waiting != 1 || m.KVUsage != 0.25 {
		t.Fatalf("sglang: %+v %v", m, err)
	}
	// A data-parallel SGLang publishes each gauge per dp_rank: requests
	// add up, KV usage is the ranks' mean (a sum would read 1.4 here).
	m, err = Parse("sglang", []byte(`sglang:num_running_reqs{dp_rank="0"} 2
sglang:num_running_reqs{dp_rank="1"} 3
sglang:num_queue_reqs{dp_rank="0"} 1
sglang:num_queue_reqs{dp_rank="1"} 0
sglang:token_usage{dp_rank="0"} 0.5
sglang:token_usage{dp_rank="1"} 0.9
`))
	if err != nil || m.Running != 5 || m.Waiting != 1 || math.Abs(m.KVUsage-0.7) > 1e-9 {
		t.Fatalf("sglang per rank: %+v %v", m, err)
	}
}

func TestScraperFollowsRules(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte("vllm:num_requests_running 7\nvllm:num_requests_waiting 1\n"))
	}))
	defer srv.Close()
	ap := netip.MustParseAddrPort(srv.Listener.Addr().String())
	s, err := New(Config{Interval: 20 * time.Millisecond}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	rule := &lbrule.Rule{Service: lbrule.ServiceArgs{Mode: 4, KVEngine: "vllm"}, Endpoints: []lbrule.Endpoint{{IP: ap.Addr().String(), Port: int(ap.Port())}}}
	if err := s.Reconcile(context.Background(), []control.Service{{ID: 3, Rule: rule}}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = s.Run(ctx); close(done) }()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if m, ok := s.Metrics(3, 0); ok {
			if m.Running != 7 || m.Waiting != 1 {
				t.Fatalf("%+v", m)
			}
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, ok := s.Metrics(3, 0); !ok {
		t.Fatal("no sample")
	}
	_ = s.Reconcile(context.Background(), nil)
	if _, ok := s.Metrics(3, 0); ok {
		t.Error("sample kept after the rule was removed")
	}
	cancel()
	<-done
}

// Others is the engine's running+waiting less this node's own in-flight
// count when the sample arrived: the load other gateway nodes put there.
func TestScraperOthersSubtractsSelf(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte("vllm:num_requests_running 7\nvllm:num_requests_waiting 1\n"))
	}))
	defer srv.Close()
	ap := netip.MustParseAddrPort(srv.Listener.Addr().String())
	rule := &lbrule.Rule{Service: lbrule.ServiceArgs{Mode: 4, KVEngine: "vllm"}, Endpoints: []lbrule.Endpoint{{IP: ap.Addr().String(), Port: int(ap.Port())}}}
	for _, c := range []struct {
		self, want int
		set        bool
	}{{0, 8, false}, {3, 5, true}, {20, 0, true}} {
		cfg := Config{Interval: time.Hour}
		if c.set {
			self := c.self
			cfg.SelfInFlight = func(service uint32, ep int) int {
				if service == 3 && ep == 0 {
					return self
				}
				return 0
			}
		}
		s, err := New(cfg, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Reconcile(context.Background(), []control.Service{{ID: 3, Rule: rule}}); err != nil {
			t.Fatal(err)
		}
		if _, ok := s.Others(3, 0); ok {
			t.Fatal("others before any sample")
		}
		s.scrapeAll(context.Background())
		if o, ok := s.Others(3, 0); !ok || o != c.want {
			t.Fatalf("self %d: others %d %v, want %d", c.self, o, ok, c.want)
		}
	}
}
