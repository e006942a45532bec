package gateway

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

// verdicts is a fixed parity verdict per endpoint index.
type verdicts map[int]string

func (v verdicts) ParityVerdict(_ uint32, ep int) string { return v[ep] }

// promptKeys returns the block keys the gateway computes for body on
// service 1.
func promptKeys(t *testing.T, f fixture, body string) []uint64 {
	t.Helper()
	st := f.g.lookup(1)
	tok, err := f.g.tok.Get("Qwen/Qwen3-0.6B")
	if err != nil {
		t.Fatal(err)
	}
	rt, err := tok.EncodeRequestWith(st.rule.Engine(), "/v1/completions", []byte(body), tokenizer.RequestOptions{MaxPromptBytes: 1 << 20, MaxPromptTokens: 1 << 16})
	if err != nil {
		t.Fatal(err)
	}
	keys := st.hasher.Keys(nil, rt.IDs)
	if len(keys) < 4 {
		t.Fatalf("prompt has %d blocks", len(keys))
	}
	return keys
}

// pickN picks n requests for body and returns their receipts, releasing
// each plan as a finished request would.
func pickN(t *testing.T, f fixture, body string, n int) []router.Receipt {
	t.Helper()
	var out []router.Receipt
	for i := 0; i < n; i++ {
		p, err := f.g.Pick(context.Background(), req(body))
		if err != nil {
			t.Fatal(err)
		}
		rc, err := router.ParseReceipt(p.Receipt)
		if err != nil {
			t.Fatal(err)
		}
		if p.FirstByte != nil { // nil when the request was not tokenized
			p.FirstByte()
			p.Done(proxy.Result{Endpoint: rc.EP, Status: 200})
		}
		out = append(out, rc)
	}
	return out
}

// TestStrictAttestation: endpoint 1 holds the whole prompt but its parity
// verdict is hash_mismatch. Without strict attestation it gets every
// request by Tier 1.5; with it (the daemon's default or the rule's
// kvParityStrict, the rule winning) it gets none, the trusted partial
// match on endpoint 0 does, and the skip is counted and visible.
func TestStrictAttestation(t *testing.T) {
	on, off := true, false
	for _, tc := range []struct {
		name     string
		daemon   bool
		rule     *bool
		strictOn bool
	}{
		{"off", false, nil, false},
		{"daemon default", true, nil, true},
		{"rule on", false, &on, true},
		{"rule off beats the daemon", true, &off, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := rule(3, "Qwen/Qwen3-0.6B")
			r.Service.KVParityStrict = tc.rule
			f := newFixtureConfig(t, Config{Seed: "1", KVParityStrict: tc.daemon, Parity: verdicts{0: "ok", 1: "hash_mismatch"}}, r)
			keys := promptKeys(t, f, prompt)
			f.ix.Store(1, 1, 0, keys)
			f.ix.Store(1, 0, 0, keys[:2])
			want := 1
			if tc.strictOn {
				want = 0
			}
			for _, rc := range pickN(t, f, prompt, 6) {
				if rc.Tier != router.TierKV || rc.EP != want {
					t.Fatalf("receipt %+v, want a Tier-1.5 hit on endpoint %d", rc, want)
				}
			}
			skipped := testutil.ToFloat64(f.g.m.untrustedSkipped.WithLabelValues("1", "1", "hash_mismatch"))
			verdict, excluded := f.g.KVTrust(1, 1)
			if verdict != "hash_mismatch" || excluded != tc.strictOn || (skipped == 6) != tc.strictOn {
				t.Errorf("KVTrust %q %v, skipped %v", verdict, excluded, skipped)
			}
			if _, excluded := f.g.KVTrust(1, 0); excluded {
				t.Error("the ok endpoint is excluded")
			}
		})
	}
}

// TestStrictAttestationMissReason: when only the mismatched endpoint holds
// the prompt, strict attestation makes it a miss counted as
// parity_untrusted, and the receipt names the endpoint left out.
func TestStrictAttestationMissReason(t *testing.T) {
	f := newFixtureConfig(t, Config{Seed: "1", KVParityStrict: true, Parity: verdicts{1: "block_size_mismatch"}}, rule(3, "Qwen/Qwen3-0.6B"))
	f.ix.Store(1, 1, 0, promptKeys(t, f, prompt))
	p, err := f.g.Pick(context.Background(), req(prompt))
	if err != nil {
		t.Fatal(err)
	}
	rc, _ := router.ParseReceipt(p.Receipt)
	if rc.Tier != router.TierFallback || rc.Reason != router.ReasonParityUntrusted {
		t.Fatalf("receipt %q", p.Receipt)
	}
	if want := " untrusted=1"; len(p.Receipt) < len(want) || p.Receipt[len(p.Receipt)-len(want):] != want {
		t.Errorf("receipt %q does not name the untrusted endpoint", p.Receipt)
	}
	if v := gathered(t, f.reg, "loxilb_pd_kv_tier15_miss_reason_total", "reason", "parity_untrusted"); v != 1 {
		t.Errorf("parity_untrusted misses: %v", v)
	}
}

// gathered returns the value of the counter name whose label has value.
func gathered(t *testing.T, reg *prometheus.Registry, name, label, value string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == label && lp.GetValue() == value {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// TestDrainedEndpointGetsNothing: a draining endpoint gets no request,
// neither by Tier 1.5 (it holds the prompt) nor as a failover target.
func TestDrainedEndpointGetsNothing(t *testing.T) {
	f := newFixture(t, rule(3, "Qwen/Qwen3-0.6B"))
	f.ix.Store(1, 1, 0, promptKeys(t, f, prompt))
	if rc := pickN(t, f, prompt, 1)[0]; rc.EP != 1 || rc.Tier != router.TierKV {
		t.Fatalf("before the drain: %+v", rc)
	}
	r, _ := lbrule.Prepare(rule(3, "Qwen/Qwen3-0.6B"), lbrule.Settings{VLLMSeed: "1"})
	if err := f.g.Reconcile(context.Background(), []control.Service{{ID: 1, Rule: r, Draining: []string{"127.0.0.79:8000"}}}); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 6; i++ {
		p, err := f.g.Pick(context.Background(), req(prompt))
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range p.Candidates {
			if c.Idx == 1 {
				t.Fatalf("draining endpoint among the candidates: %+v (%s)", p.Candidates, p.Receipt)
			}
		}
		if p.FirstByte != nil {
			p.FirstByte()
		}
	}
}

// TestModelLessRequests: a request that names no model is tokenized for
// the rule's model_name, else for the only staged tokenizer; with several
// staged it skips Tier 1.5 (no_model).
func TestModelLessRequests(t *testing.T) {
	noModel := `{"prompt":"` + prompt[len(`{"model":"Qwen/Qwen3-0.6B","prompt":"`):]
	check := func(t *testing.T, f fixture, wantTokenized bool) {
		t.Helper()
		rc := pickN(t, f, noModel, 1)[0]
		if tokenized := rc.Total > 0 && rc.Reason != ReasonNoModel; tokenized != wantTokenized {
			t.Fatalf("receipt %+v, tokenized %v, want %v", rc, tokenized, wantTokenized)
		}
		if wantTokenized {
			// The keys are those of the model's own requests: a request
			// naming the model follows it by Tier 1.5.
			if rc2 := pickN(t, f, prompt, 1)[0]; rc2.Tier != router.TierKV || rc2.EP != rc.EP {
				t.Fatalf("same prompt with the model: %+v after %+v", rc2, rc)
			}
		}
	}
	t.Run("rule model_name", func(t *testing.T) {
		check(t, newFixture(t, rule(3, "Qwen/Qwen3-0.6B")), true)
	})
	t.Run("several staged", func(t *testing.T) {
		f := newFixture(t, rule(3, ""))
		check(t, f, false)
		if v := testutil.ToFloat64(f.g.m.missC.WithLabelValues("1", ReasonNoModel)); v != 1 {
			t.Errorf("no_model misses: %v", v)
		}
	})
	t.Run("only one staged", func(t *testing.T) {
		dir := t.TempDir()
		src := filepath.Join("..", "..", "testdata", "tokenizers", "Qwen__Qwen3-0.6B")
		if err := os.MkdirAll(filepath.Join(dir, "Qwen__Qwen3-0.6B"), 0o755); err != nil {
			t.Fatal(err)
		}
		for _, name := range []string{"tokenizer.json", "tokenizer_config.json"} {
			b, err := os.ReadFile(filepath.Join(src, name))
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, "Qwen__Qwen3-0.6B", name), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		f := newFixtureDir(t, dir, Config{Seed: "1"}, rule(3, ""))
		check(t, f, true)
		if v := testutil.ToFloat64(f.g.m.modelImplied.WithLabelValues("1")); v != 1 {
			t.Errorf("implied model not counted: %v", v)
		}
	})
}

// newFixtureDir is newFixtureConfig over another tokenizer directory.
func newFixtureDir(t testing.TB, dir string, cfg Config, rules ...*lbrule.Rule) fixture {
	t.Helper()
	return newFixtureAt(t, dir, cfg, rules...)
}

// TestDrainedPDEndpoints: a draining prefill or decode endpoint is left out
// of its role's pool (the dispatcher never chooses an unhealthy one).
func TestDrainedPDEndpoints(t *testing.T) {
	r := &lbrule.Rule{Service: lbrule.ServiceArgs{ExternalIP: "127.0.0.77", Port: 9000, Protocol: "tcp", Mode: 4, KVEngine: "vllm", PDDisagg: true},
		Endpoints: []lbrule.Endpoint{{IP: "127.0.0.78", Port: 8000, Weight: 1, Role: lbrule.RolePrefill}, {IP: "127.0.0.79", Port: 8000, Weight: 1, Role: lbrule.RolePrefill},
			{IP: "127.0.0.80", Port: 8000, Weight: 1, Role: lbrule.RoleDecode}, {IP: "127.0.0.81", Port: 8000, Weight: 1, Role: lbrule.RoleDecode}}}
	f := newFixture(t)
	p, err := lbrule.Prepare(r, lbrule.Settings{VLLMSeed: "1"})
	if err != nil {
		t.Fatal(err)
	}
	if err := f.g.Reconcile(context.Background(), []control.Service{{ID: 1, Rule: p, Draining: []string{"127.0.0.79:8000", "127.0.0.80:8000"}}}); err != nil {
		t.Fatal(err)
	}
	pool := f.g.pdPool(f.g.lookup(1))
	got := map[int]bool{}
	for _, e := range append(pool.Prefill, pool.Decode...) {
		got[e.Idx] = e.Healthy
	}
	if want := map[int]bool{0: true, 1: false, 2: false, 3: true}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("pool health %v, want %v", got, want)
	}
}
