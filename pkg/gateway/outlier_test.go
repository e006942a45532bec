package gateway

import (
	"context"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/outlier"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
)

func TestPickLeavesEjectedOut(t *testing.T) {
	det, err := outlier.New(outlier.Config{}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	f := newFixtureConfig(t, Config{Seed: "1", Outliers: det}, rule(0, ""))
	// Report five 5xx answers from endpoint 1 through the plans' hook.
	for fails := 0; fails < 5; {
		p, err := f.g.Pick(context.Background(), req(prompt))
		if err != nil {
			t.Fatal(err)
		}
		if p.Observe == nil {
			t.Fatal("plan has no Observe hook")
		}
		ep := p.Candidates[0]
		o := outlier.Success
		if ep.Idx == 1 {
			o = outlier.ServerError
			fails++
		}
		p.Observe(ep, o)
	}
	for i := 0; i < 6; i++ {
		p, err := f.g.Pick(context.Background(), req(prompt))
		if err != nil {
			t.Fatal(err)
		}
		rc, _ := router.ParseReceipt(p.Receipt)
		if rc.EP != 0 || len(p.Candidates) != 1 || !strings.HasSuffix(p.Receipt, " ejected=1") {
			t.Fatalf("pick %d after the ejection: receipt %q, candidates %v", i, p.Receipt, p.Candidates)
		}
	}
	if got := testutil.ToFloat64(f.g.m.ejectedSkipped.WithLabelValues("1", "1")); got != 6 {
		t.Errorf("loxilb_gateway_ejected_skipped_total = %v, want 6", got)
	}
	// Removing the rule forgets its records.
	if err := f.g.Reconcile(context.Background(), nil); err != nil {
		t.Fatal(err)
	}
	if det.Ejected(1, outlier.RoleNone, "127.0.0.79:8000") {
		t.Error("ejection survived the rule's removal")
	}
}

// ejectAll claims every endpoint is ejected, as a detector whose cap was
// bypassed by probes taking the others down would look.
type ejectAll struct{}

func (ejectAll) Observe(outlier.Pool, int, string, outlier.Outcome) bool { return false }
func (ejectAll) Ejected(uint32, outlier.Role, string) bool               { return true }
func (ejectAll) Forget(uint32)                                           {}

func TestPickIgnoresEjectionOfEveryEndpoint(t *testing.T) {
	f := newFixtureConfig(t, Config{Seed: "1", Outliers: ejectAll{}}, rule(0, ""))
	p, err := f.g.Pick(context.Background(), req(prompt))
	if err != nil {
		t.Fatalf("every endpoint ejected: %v; want ejection ignored", err)
	}
	if len(p.Candidates) != 2 || strings.Contains(p.Receipt, "ejected=") {
		t.Fatalf("candidates %v, receipt %q", p.Candidates, p.Receipt)
	}
	var _ proxy.Picker = f.g
}
