package control

import (
	"context"
	"errors"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/fake"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

func prepared(t *testing.T, r *lbrule.Rule) *lbrule.Rule {
	t.Helper()
	p, err := lbrule.Prepare(r, lbrule.Settings{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestKernelReconciler(t *testing.T) {
	dp := fake.New()
	down := map[int]bool{1: true}
	k := &KernelReconciler{DP: dp, Healthy: func(_ uint32, ep int) bool { return !down[ep] }}
	l4 := prepared(t, &lbrule.Rule{Service: lbrule.ServiceArgs{ExternalIP: "127.0.9.9", Port: 80, Protocol: "tcp", Mode: lbrule.ModeFullNAT, Sel: lbrule.SelRR},
		Endpoints: []lbrule.Endpoint{{IP: "127.0.9.10", Port: 8080, Weight: 1}, {IP: "127.0.9.11", Port: 8080, Weight: 1}}})
	l7 := prepared(t, &lbrule.Rule{Service: lbrule.ServiceArgs{ExternalIP: "127.0.0.9", Port: 80, Protocol: "tcp", Mode: lbrule.ModeFullProxy},
		Endpoints: []lbrule.Endpoint{{IP: "127.0.0.10", Port: 8080, Weight: 1}}})
	ctx := context.Background()
	if err := k.Reconcile(ctx, []Service{{ID: 1, Rule: l4}, {ID: 2, Rule: l7}}); err != nil {
		t.Fatal(err)
	}
	svc, eps, ok := dp.Service(1)
	if !ok || svc.Mode != lbrule.ModeFullNAT || len(eps) != 2 || eps[0].Healthy != true || eps[1].Healthy != false {
		t.Fatalf("installed: %+v %+v %v", svc, eps, ok)
	}
	if _, _, ok := dp.Service(2); ok {
		t.Fatal("mode-4 rule must not be installed in the kernel")
	}
	if err := k.SetHealth(ctx, 1, 1, true); err != nil {
		t.Fatal(err)
	}
	if _, eps, _ := dp.Service(1); !eps[1].Healthy {
		t.Fatal("health change not applied")
	}
	if err := k.Reconcile(ctx, []Service{{ID: 2, Rule: l7}}); err != nil {
		t.Fatal(err)
	}
	if _, _, ok := dp.Service(1); ok {
		t.Fatal("removed rule still installed")
	}
}

func TestKernelUnavailableRefusesL4(t *testing.T) {
	l4 := prepared(t, &lbrule.Rule{Service: lbrule.ServiceArgs{ExternalIP: "127.0.9.9", Port: 80, Protocol: "tcp", Mode: lbrule.ModeDNAT},
		Endpoints: []lbrule.Endpoint{{IP: "127.0.9.10", Port: 8080}}})
	err := KernelUnavailable{Why: "disabled"}.Reconcile(context.Background(), []Service{{ID: 1, Rule: l4}})
	var re *lbrule.RuleError
	if !errors.As(err, &re) || !errors.Is(err, lbrule.ErrPrecondition) || re.Reason != ReasonNoDataplane {
		t.Fatalf("got %v", err)
	}
	err = KernelUnavailable{Why: "no interface", Code: ReasonNoInterfaces}.Reconcile(context.Background(), []Service{{ID: 1, Rule: l4}})
	if !errors.As(err, &re) || !errors.Is(err, lbrule.ErrPrecondition) || re.Reason != ReasonNoInterfaces {
		t.Fatalf("no interfaces: got %v", err)
	}
}

func TestKernelSelector(t *testing.T) {
	for sel, want := range map[int]int{lbrule.SelRR: 0, lbrule.SelHash: 1, lbrule.SelPriority: 2, lbrule.SelPersist: 3, lbrule.SelLC: 4, lbrule.SelCHWBL: 8} {
		if got, ok := KernelSelector(sel); !ok || got != want {
			t.Errorf("sel %d: kernel selector %d %v, want %d", sel, got, ok, want)
		}
	}
	for _, sel := range []int{lbrule.SelN2, lbrule.SelN3, lbrule.SelGPUAware, lbrule.SelWRRHash} {
		if _, ok := KernelSelector(sel); ok {
			t.Errorf("sel %d mapped onto a kernel selector", sel)
		}
	}
	// A chwbl rule of mode 0 is installed with the Maglev selector.
	r := prepared(t, &lbrule.Rule{Service: lbrule.ServiceArgs{ExternalIP: "127.0.9.9", Port: 80, Protocol: "tcp", Mode: lbrule.ModeDNAT, Sel: lbrule.SelCHWBL},
		Endpoints: []lbrule.Endpoint{{IP: "127.0.9.10", Port: 8080, Weight: 1}}})
	svc, _, ok, err := KernelService(1, r, 0)
	if err != nil || !ok || svc.Sel != dataplane.SelConsistentHash {
		t.Fatalf("chwbl rule: %+v %v %v", svc, ok, err)
	}
}

type countingDP struct {
	*fake.Dataplane
	upserts int
}

func (c *countingDP) UpsertService(ctx context.Context, svc dataplane.Service, eps []dataplane.Endpoint) error {
	c.upserts++
	return c.Dataplane.UpsertService(ctx, svc, eps)
}

// A reconcile upserts only the services that changed.
func TestKernelReconcilerIncremental(t *testing.T) {
	dp := &countingDP{Dataplane: fake.New()}
	k := &KernelReconciler{DP: dp}
	rule := func(vip string, port int) *lbrule.Rule {
		return prepared(t, &lbrule.Rule{Service: lbrule.ServiceArgs{ExternalIP: vip, Port: port, Protocol: "tcp", Mode: lbrule.ModeDNAT},
			Endpoints: []lbrule.Endpoint{{IP: "127.0.9.10", Port: 8080, Weight: 1}}})
	}
	ctx := context.Background()
	var svcs []Service
	for i := range 50 {
		svcs = append(svcs, Service{ID: uint32(i + 1), Rule: rule("127.0.9.9", 1000+i)})
	}
	if err := k.Reconcile(ctx, svcs); err != nil || dp.upserts != 50 {
		t.Fatalf("first reconcile: %d upserts, %v", dp.upserts, err)
	}
	svcs = append(svcs, Service{ID: 51, Rule: rule("127.0.9.9", 2000)})
	if err := k.Reconcile(ctx, svcs); err != nil || dp.upserts != 51 {
		t.Fatalf("one rule added: %d upserts in all, want 51: %v", dp.upserts, err)
	}
	svcs[3].Rule = rule("127.0.9.9", 3000)
	if err := k.Reconcile(ctx, svcs[:50]); err != nil || dp.upserts != 52 {
		t.Fatalf("one changed, one removed: %d upserts in all, want 52: %v", dp.upserts, err)
	}
	if _, _, ok := dp.Service(51); ok {
		t.Fatal("removed rule still installed")
	}
	// A removed and re-added rule is installed again.
	if err := k.Reconcile(ctx, svcs); err != nil || dp.upserts != 53 {
		t.Fatalf("re-added: %d upserts in all, want 53: %v", dp.upserts, err)
	}
}
