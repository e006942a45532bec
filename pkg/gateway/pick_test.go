package gateway

import (
	"context"
	"errors"
	"net/http"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/kvindex"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

type fixture struct {
	g   *Gateway
	ix  *kvindex.Index
	reg *prometheus.Registry
}

func newFixture(t testing.TB, rules ...*lbrule.Rule) fixture {
	t.Helper()
	return newFixtureConfig(t, Config{Seed: "1"}, rules...)
}

// newFixtureConfig builds the fixture with cfg (engine signals included,
// Config.Engine).
func newFixtureConfig(t testing.TB, cfg Config, rules ...*lbrule.Rule) fixture {
	t.Helper()
	return newFixtureAt(t, filepath.Join("..", "..", "testdata", "tokenizers"), cfg, rules...)
}

// newFixtureAt builds the fixture over the tokenizers staged in dir.
func newFixtureAt(t testing.TB, dir string, cfg Config, rules ...*lbrule.Rule) fixture {
	t.Helper()
	reg := prometheus.NewRegistry()
	toks, err := tokenizer.NewRegistry(dir, nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	ix, _ := kvindex.New(kvindex.Config{}, reg)
	rt, err := router.New(router.DefaultConfig(), ix, nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	g, err := New(cfg, toks, ix, rt, nil, new(proxy.InFlightTable), nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	var svcs []control.Service
	for i, r := range rules {
		p, err := lbrule.Prepare(r, lbrule.Settings{VLLMSeed: "1"})
		if err != nil {
			t.Fatal(err)
		}
		svcs = append(svcs, control.Service{ID: uint32(i + 1), Rule: p})
	}
	if err := g.Reconcile(context.Background(), svcs); err != nil {
		t.Fatal(err)
	}
	return fixture{g, ix, reg}
}

func rule(kv int, model string) *lbrule.Rule {
	return &lbrule.Rule{Service: lbrule.ServiceArgs{ExternalIP: "127.0.0.77", Port: 9000, Protocol: "tcp", Mode: 4, KVExactMode: kv, KVEngine: "vllm", ModelName: model},
		Endpoints: []lbrule.Endpoint{{IP: "127.0.0.78", Port: 8000, Weight: 1}, {IP: "127.0.0.79", Port: 8000, Weight: 1}}}
}

func req(body string) *proxy.Request {
	r := &proxy.Request{Service: 1, Method: http.MethodPost, Path: "/v1/completions", Header: http.Header{}, Body: []byte(body)}
	r.Model = proxy.ModelOf(r.Header, r.Body)
	return r
}

var prompt = `{"model":"Qwen/Qwen3-0.6B","prompt":"` + strings.Repeat("The gateway hashes every full block of the prompt. ", 20) + `"}`

func TestPickKVExactStoresSpeculativeAndHits(t *testing.T) {
	f := newFixture(t, rule(3, ""))
	p1, err := f.g.Pick(context.Background(), req(prompt))
	if err != nil {
		t.Fatal(err)
	}
	rc, _ := router.ParseReceipt(p1.Receipt)
	if rc.Tier != router.TierFallback || rc.Total == 0 || len(p1.Candidates) != 2 {
		t.Fatalf("first request: %+v %+v", rc, p1.Candidates)
	}
	p1.FirstByte() // its prefill is done: the sibling need not wait for it
	// The sibling follows the first to its endpoint through the speculative entry.
	p2, _ := f.g.Pick(context.Background(), req(prompt))
	rc2, _ := router.ParseReceipt(p2.Receipt)
	if rc2.Tier != router.TierKV || rc2.EP != rc.EP || rc2.Matched != rc.Total {
		t.Fatalf("sibling: %+v (first %+v)", rc2, rc)
	}
	if p2.Done == nil {
		t.Fatal("KV-exact plans carry the closed-loop check")
	}
	p2.Done(proxy.Result{Endpoint: rc2.EP, Status: 200, HasCachedTokens: true, CachedTokens: 16})
	if v := testutil.ToFloat64(f.g.m.mispredicted.WithLabelValues("1", "0", "over")) + testutil.ToFloat64(f.g.m.mispredicted.WithLabelValues("1", "1", "over")); v != 1 {
		t.Errorf("over-prediction not counted: %v", v)
	}
}

func TestPickMissReasonsAreVisible(t *testing.T) {
	f := newFixture(t, rule(3, ""))
	cases := []struct {
		name, body, path, method, reason string
	}{
		{"no tokenizer staged", `{"model":"acme/unknown-7b","prompt":"hello"}`, "/v1/completions", "POST", router.ReasonNoTokenizer},
		{"lora adapter", `{"model":"Qwen/Qwen3-0.6B","prompt":"hi","lora_request":{"lora_name":"x"}}`, "/v1/completions", "POST", router.ReasonUnhashable},
		{"not inference", ``, "/v1/models", "GET", ReasonNotInference},
		{"no model", `{"prompt":"hello"}`, "/v1/completions", "POST", ReasonNoModel},
	}
	for _, c := range cases {
		r := req(c.body)
		r.Path, r.Method = c.path, c.method
		r.Model = proxy.ModelOf(r.Header, r.Body)
		p, err := f.g.Pick(context.Background(), r)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		rc, _ := router.ParseReceipt(p.Receipt)
		if rc.Tier != router.TierFallback || rc.Reason != c.reason {
			t.Errorf("%s: receipt %+v, want reason %s", c.name, rc, c.reason)
		}
	}
	if v := testutil.ToFloat64(f.g.m.tokMissing.WithLabelValues("1", modelOther, "not_staged")); v != 1 {
		t.Errorf("missing tokenizer not counted: %v", v)
	}
}

func TestPickErrors(t *testing.T) {
	f := newFixture(t, rule(3, "Qwen/Qwen3-0.6B"))
	if _, err := f.g.Pick(context.Background(), req(`{"model": "Qwen/Qwen3-0.6B", "prompt": [1, "x"]}`)); !errors.Is(err, proxy.ErrBadRequest) {
		t.Errorf("malformed prompt: %v", err)
	}
	r := req(prompt)
	r.Service = 9
	if _, err := f.g.Pick(context.Background(), r); !errors.Is(err, proxy.ErrUnavailable) {
		t.Errorf("unknown service: %v", err)
	}
}

func TestPickModeOffUsesSelector(t *testing.T) {
	f := newFixture(t, rule(0, ""))
	seen := map[int]bool{}
	for i := 0; i < 4; i++ {
		p, err := f.g.Pick(context.Background(), req(prompt))
		if err != nil {
			t.Fatal(err)
		}
		rc, _ := router.ParseReceipt(p.Receipt)
		if rc.Reason != router.ReasonModeOff {
			t.Fatalf("%+v", rc)
		}
		seen[rc.EP] = true
	}
	if len(seen) != 2 {
		t.Errorf("round robin should use both endpoints: %v", seen)
	}
}
