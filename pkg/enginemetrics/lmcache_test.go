package enginemetrics

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"sync/atomic"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestLMCacheHitTokens(t *testing.T) {
	for _, c := range []struct {
		text string
		v    float64
		ok   bool
	}{
		{"vllm:num_requests_running 1\n", 0, false},
		{"lmcache:retrieve_hit_rate 1.0\n", 0, false},
		{"lmcache:num_hit_tokens{model=\"a\"} 10\nlmcache:num_hit_tokens{model=\"b\"} 5\n", 15, true},
		{"lmcache:num_hit_tokens_total 7\n", 7, true},
		{"lmcache:num_hit_tokens NaN\n", 0, false},
		{"lmcache:num_hit_tokens -3\n", 0, false},
	} {
		if v, ok := lmcacheHitTokens([]byte(c.text)); v != c.v || ok != c.ok {
			t.Errorf("%q: %v %v, want %v %v", c.text, v, ok, c.v, c.ok)
		}
	}
}

// TestScraperLMCacheDeltas: the per-endpoint metric grows by the counter's
// deltas (not its first value, and by the whole value after a restart),
// and the stale retrieve_hit_rate gauge moves nothing.
func TestScraperLMCacheDeltas(t *testing.T) {
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nlmcache:retrieve_hit_rate 1.0\nlmcache:num_hit_tokens %d\n", hits.Load())
	}))
	defer srv.Close()
	ap := netip.MustParseAddrPort(srv.Listener.Addr().String())
	reg := prometheus.NewRegistry()
	s, err := New(Config{}, nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	rule := &lbrule.Rule{Service: lbrule.ServiceArgs{Mode: 4, KVEngine: "vllm"}, Endpoints: []lbrule.Endpoint{{IP: ap.Addr().String(), Port: int(ap.Port())}}}
	if err := s.Reconcile(context.Background(), []control.Service{{ID: 5, Rule: rule}}); err != nil {
		t.Fatal(err)
	}
	got := func() float64 { return testutil.ToFloat64(s.lmHits.WithLabelValues("5", "0")) }
	for _, step := range []struct {
		counter int64
		want    float64
	}{
		{1000, 0},   // history before the gateway watched
		{1200, 200}, // +200
		{1200, 200}, // no hits
		{50, 250},   // engine restarted: +50
		{80, 280},
	} {
		hits.Store(step.counter)
		s.scrapeAll(context.Background())
		if g := got(); g != step.want {
			t.Fatalf("counter %d: metric %v, want %v", step.counter, g, step.want)
		}
	}
	_ = s.Reconcile(context.Background(), nil)
	if n := testutil.CollectAndCount(s.lmHits); n != 0 {
		t.Fatalf("%d series left after the rule was removed", n)
	}
}
