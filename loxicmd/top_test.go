package main

import (
	"bytes"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

func TestParseExposition(t *testing.T) {
	text := `# HELP loxilb_ai_requests_total x
# TYPE loxilb_ai_requests_total counter
loxilb_ai_requests_total{ep_idx="0",service="1",status="200"} 12
loxilb_service_info{name="a \"b\"\\c",service="1"} 1
loxilb_tokenizer_loaded 2 1700000000000

`
	ss, err := parseExposition(text)
	if err != nil || len(ss) != 3 {
		t.Fatalf("%v %+v", err, ss)
	}
	if ss[0].name != "loxilb_ai_requests_total" || ss[0].labels["status"] != "200" || ss[0].value != 12 {
		t.Errorf("%+v", ss[0])
	}
	if ss[1].labels["name"] != `a "b"\c` || ss[2].value != 2 {
		t.Errorf("%+v %+v", ss[1], ss[2])
	}
	for _, bad := range []string{"loxilb_x", `loxilb_x{a="b" 1`, `loxilb_x{a="b"} y`, `loxilb_x{a=b} 1`} {
		if _, err := parseExposition(bad); err == nil || !strings.Contains(err.Error(), "line 1") {
			t.Errorf("%q: %v", bad, err)
		}
	}
}

func TestHistogramQuantile(t *testing.T) {
	h := func(vals ...float64) []promSeries {
		les := []string{"0.1", "0.5", "1", "+Inf"}
		var out []promSeries
		for i, v := range vals {
			out = append(out, promSeries{name: "h_bucket", labels: map[string]string{"service": "1", "le": les[i]}, value: v})
		}
		return out
	}
	m := map[string]string{"service": "1"}
	// 10 new observations: 5 under 0.1, 5 in (0.1, 0.5].
	q, ok := histogramQuantile(0.5, h(1, 1, 1, 1), h(6, 11, 11, 11), "h", m)
	if !ok || math.Abs(q-0.1) > 1e-9 {
		t.Errorf("p50 = %v %v, want 0.1", q, ok)
	}
	q, _ = histogramQuantile(0.95, h(1, 1, 1, 1), h(6, 11, 11, 11), "h", m)
	if math.Abs(q-0.46) > 1e-9 {
		t.Errorf("p95 = %v, want 0.46", q)
	}
	if _, ok := histogramQuantile(0.95, h(1, 1, 1, 1), h(1, 1, 1, 1), "h", m); ok {
		t.Error("quantile of no new observation")
	}
	if q, _ := histogramQuantile(0.99, nil, h(0, 0, 0, 5), "h", m); q != 1 {
		t.Errorf("all above the last bucket: %v, want its bound 1", q)
	}
}

func TestTopFrame(t *testing.T) {
	rules := api.LBList{LBAttr: []lbrule.Rule{{ServiceID: 1,
		Service:   lbrule.ServiceArgs{Name: "chat", ExternalIP: "127.0.0.10", Port: 80, Protocol: "tcp", Mode: 4, KVExactMode: 3},
		Endpoints: []lbrule.Endpoint{{IP: "127.0.0.11", Port: 8000, State: "active", Draining: true}, {IP: "127.0.0.12", Port: 8000, State: "active"}}}}}
	parse := func(s string) []promSeries {
		ss, err := parseExposition(s)
		if err != nil {
			t.Fatal(err)
		}
		return ss
	}
	t0 := time.Unix(1700000000, 0)
	prev := topSample{at: t0, rules: rules, series: parse(`loxilb_ai_requests_total{ep_idx="0",service="1",status="200"} 10
loxilb_pd_kv_predicted_cached_tokens_total{ep_idx="0",service="1"} 100
loxilb_pd_kv_reported_cached_tokens_total{ep_idx="0",service="1"} 100`)}
	cur := topSample{at: t0.Add(2 * time.Second), rules: rules, series: parse(`loxilb_ai_requests_total{ep_idx="0",service="1",status="200"} 30
loxilb_ai_requests_total{ep_idx="1",service="1",status="503"} 4
loxilb_pd_kv_tier15_hits_total{ep_idx="0",service="1"} 8
loxilb_pd_kv_blocks{ep_idx="0",service="1"} 42
loxilb_kv_parity_verdict{ep_idx="0",service="1",verdict="ok"} 1
loxilb_kv_parity_verdict{ep_idx="0",service="1",verdict="unverified"} 0
loxilb_kv_subscriber_connected{ep_idx="0",service="1"} 1
loxilb_kv_subscriber_connected{ep_idx="1",service="1"} 0
loxilb_endpoint_healthy{ep_idx="1",service="1"} 0
loxilb_pd_kv_predicted_cached_tokens_total{ep_idx="0",service="1"} 300
loxilb_pd_kv_reported_cached_tokens_total{ep_idx="0",service="1"} 250`)}
	f, err := buildTopFrame(prev, cur, "chat")
	if err != nil || len(f.Services) != 1 {
		t.Fatalf("%v %+v", err, f)
	}
	s := f.Services[0]
	if s.ReqRate != 12 || s.Status.S2xx != 10 || s.Status.S5xx != 2 || s.Hits != 4 {
		t.Errorf("service rates %+v", s)
	}
	e0, e1 := s.Endpoints[0], s.Endpoints[1]
	if *e0.Blocks != 42 || e0.Parity != "ok" || e0.Events != "connected" || e0.Predicted != 100 || e0.Reported != 75 {
		t.Errorf("endpoint 0 %+v", e0)
	}
	if e1.Events != "disconnected" || e1.Healthy == nil || *e1.Healthy || e1.Blocks != nil {
		t.Errorf("endpoint 1 %+v", e1)
	}
	var out bytes.Buffer
	printTopFrame(&globalOpts{out: &out}, f)
	for _, want := range []string{"service 1 chat  127.0.0.10:80/tcp  fullproxy", "requests 12.0/s  2xx 10.0  4xx 0.0  5xx 2.0",
		"127.0.0.11:8000", "75%", "down", "active,draining"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("frame lacks %q:\n%s", want, out.String())
		}
	}
	if _, err := buildTopFrame(prev, cur, "other"); err == nil || !strings.Contains(err.Error(), "1 (chat)") {
		t.Errorf("unknown service: %v", err)
	}
	if f, err := buildTopFrame(prev, cur, "1"); err != nil || len(f.Services) != 1 {
		t.Errorf("by id: %v", err)
	}
}

// FuzzParseExposition: any text the metrics endpoint could serve parses or
// fails with an error, never a panic.
func FuzzParseExposition(f *testing.F) {
	f.Add("loxilb_ai_requests_total{ep_idx=\"0\",service=\"1\",status=\"200\"} 12\n# c\nx 1 2\n")
	f.Add(`a{b="\"\\\n"} NaN`)
	f.Add(`a{b="c",} +Inf`)
	f.Fuzz(func(t *testing.T, text string) {
		ss, err := parseExposition(text)
		if err == nil {
			for _, s := range ss {
				if s.name == "" {
					t.Fatalf("empty name from %q", text)
				}
			}
		}
	})
}
