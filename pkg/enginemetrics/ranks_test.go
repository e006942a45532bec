package enginemetrics

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

// The exposition of an SGLang server with two data-parallel ranks and two
// tensor-parallel workers per rank, labelled as SGLang's schedulers label
// their gauges.
const sglangDPMetrics = `# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 3.0
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="1"} 3.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="2"} 1.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 2.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="2"} 0.0
sglang:token_usage{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 0.5
`

func TestParseRankLoad(t *testing.T) {
	got := parseRankLoad("sglang", []byte(sglangDPMetrics))
	if !got.ok || got.bad != "" || got.running[0] != 3 || got.running[1] != 1 || got.waiting[0] != 2 || got.waiting[1] != 0 {
		t.Fatalf("per-rank load %+v", got)
	}
	// The endpoint's totals still sum every series.
	m, err := Parse("sglang", []byte(sglangDPMetrics))
	if err != nil || m.Running != 7 || m.Waiting != 2 {
		t.Fatalf("endpoint load %+v, %v", m, err)
	}
	cases := []struct {
		name, engine, text string
		ok                 bool
		bad                string
	}{
		{"no rank label", "sglang", "sglang:num_running_reqs{model_name=\"m\"} 4\n", false, ""},
		{"vLLM publishes none per rank here", "vllm", "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 4\n", false, ""},
		{"rank out of range", "sglang", "sglang:num_running_reqs{dp_rank=\"8\"} 1\n", false, rankBadLabel},
		{"rank not a number", "sglang", "sglang:num_running_reqs{dp_rank=\"x\"} 1\n", false, rankBadLabel},
		{"negative value", "sglang", "sglang:num_queue_reqs{dp_rank=\"0\"} -1\n", false, rankBadValue},
		{"NaN", "sglang", "sglang:num_queue_reqs{dp_rank=\"0\"} NaN\n", false, rankBadValue},
		{"huge", "sglang", "sglang:num_running_reqs{dp_rank=\"1\"} 1e12\n", false, rankBadValue},
		{"escaped quote before the label", "sglang", "sglang:num_running_reqs{model_name=\"a\\\"b\",dp_rank=\"1\"} 2\n", true, ""},
		{"unterminated labels", "sglang", "sglang:num_running_reqs{dp_rank=\"1 2\n", false, ""},
		{"unknown engine", "nope", sglangDPMetrics, false, ""},
	}
	for _, c := range cases {
		got := parseRankLoad(c.engine, []byte(c.text))
		if got.ok != c.ok || got.bad != c.bad {
			t.Errorf("%s: %+v, want ok=%v bad=%q", c.name, got, c.ok, c.bad)
		}
	}
}

func TestLabelValue(t *testing.T) {
	for _, c := range []struct {
		line, label, want string
		has               bool
	}{
		{`a{b="1",dp_rank="3"} 1`, "dp_rank", "3", true},
		{`a{ dp_rank="0" } 1`, "dp_rank", "0", true},
		{`a{x="dp_rank=\"5\"",dp_rank="2"} 1`, "dp_rank", "2", true},
		{`a 1`, "dp_rank", "", false},
		{`a{b=1} 1`, "b", "", false},
		{`a{b="1"`, "b", "1", true},
		{`a{b="1`, "b", "", false},
		{`a{} 1`, "b", "", false},
	} {
		got, has := labelValue([]byte(c.line), c.label)
		if got != c.want || has != c.has {
			t.Errorf("labelValue(%q, %q) = %q, %v; want %q, %v", c.line, c.label, got, has, c.want, c.has)
		}
	}
}

// The scraper keeps an SGLang endpoint's per-rank gauges next to its
// totals, and refuses (and counts) a rank label out of range without
// losing the totals.
func TestScraperRankMetrics(t *testing.T) {
	body := sglangDPMetrics
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte(body)) }))
	defer srv.Close()
	ap := netip.MustParseAddrPort(srv.Listener.Addr().String())
	s, err := New(Config{MaxAge: time.Hour}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	rule := &lbrule.Rule{Service: lbrule.ServiceArgs{Mode: 4, KVEngine: "sglang"}, Endpoints: []lbrule.Endpoint{{IP: ap.Addr().String(), Port: int(ap.Port())}}}
	if err := s.Reconcile(context.Background(), []control.Service{{ID: 3, Rule: rule}}); err != nil {
		t.Fatal(err)
	}
	s.scrapeAll(context.Background())
	run, wait := make([]int, 2), make([]int, 2)
	if !s.RankMetrics(3, 0, run, wait) || run[0] != 3 || run[1] != 1 || wait[0] != 2 || wait[1] != 0 {
		t.Fatalf("per-rank %v %v", run, wait)
	}
	body = "sglang:num_running_reqs{dp_rank=\"9\"} 1\n"
	s.scrapeAll(context.Background())
	if s.RankMetrics(3, 0, run, wait) {
		t.Fatal("per-rank gauges kept from a sample whose rank label is out of range")
	}
	if m, ok := s.Metrics(3, 0); !ok || m.Running != 1 {
		t.Fatalf("endpoint totals lost with the per-rank gauges: %+v %v", m, ok)
	}
	if n := testutil.ToFloat64(s.errs.WithLabelValues("3", "0", rankBadLabel)); n != 1 {
		t.Fatalf("%v bad rank labels counted, want 1", n)
	}
	if s.RankMetrics(4, 0, run, wait) {
		t.Fatal("per-rank gauges of an unknown endpoint")
	}
}
