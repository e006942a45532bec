package gateway

import (
	"context"
	"errors"
	"net"
	"strconv"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/reconcilers"
)

// reconcileAll applies svcs as the daemon's controller does: the proxy's
// listeners first, then the gateway's routing table.
func reconcileAll(lr *reconcilers.Listeners, g *Gateway, svcs []control.Service) error {
	ctx := context.Background()
	return errors.Join(lr.Reconcile(ctx, svcs), g.Reconcile(ctx, svcs))
}

// TestReconcileHeldPortIsOneRulesFailure: a VIP:port another process
// holds fails its own rule (a control.RuleError with the listen reason)
// while the other rule gets its listener; the next reconcile after the
// port frees opens the missing one.
func TestReconcileHeldPortIsOneRulesFailure(t *testing.T) {
	f := newFixture(t)
	px, err := proxy.New(proxy.Config{}, f.g, f.g.inflight, nil, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	lr := &reconcilers.Listeners{Proxy: px}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = px.Serve(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	<-px.Listening()

	held, err := net.Listen("tcp", "127.0.83.1:0")
	if err != nil {
		t.Fatal(err)
	}
	free, err := net.Listen("tcp", "127.0.83.2:0")
	if err != nil {
		t.Fatal(err)
	}
	freeAddr := free.Addr().String()
	free.Close()
	mk := func(ln string) *lbrule.Rule {
		host, port, _ := net.SplitHostPort(ln)
		r := rule(0, "")
		r.Service.ExternalIP = host
		r.Service.Port, _ = strconv.Atoi(port)
		p, err := lbrule.Prepare(r, lbrule.Settings{VLLMSeed: "1"})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	svcs := []control.Service{{ID: 1, Rule: mk(held.Addr().String())}, {ID: 2, Rule: mk(freeAddr)}}
	if err := f.g.Reconcile(context.Background(), svcs); err != nil {
		t.Fatalf("the gateway's table does not depend on listeners: %v", err)
	}
	err = lr.Reconcile(context.Background(), svcs)
	res := control.RuleErrors(err)
	if len(res) != 1 || res[0].ID != 1 || res[0].Reason != proxy.ReasonVIPPortInUse || !errors.Is(err, proxy.ErrListen) {
		t.Fatalf("reconcile with a held port: %v", err)
	}
	if c, err := net.Dial("tcp", freeAddr); err != nil {
		t.Fatalf("the other rule has no listener: %v", err)
	} else {
		c.Close()
	}
	if f.g.lookup(1) == nil || f.g.lookup(2) == nil {
		t.Fatal("a rule is missing from the table")
	}
	held.Close()
	if err := reconcileAll(lr, f.g, svcs); err != nil {
		t.Fatalf("reconcile after the port freed: %v", err)
	}
}

// TestGatewayTableHoldsModeFourOnly: the gateway routes every mode-4 rule,
// even one whose listener the proxy stage refused; listeners are not its
// stage.
func TestGatewayTableHoldsModeFourOnly(t *testing.T) {
	prep := func(r *lbrule.Rule) *lbrule.Rule {
		p, err := lbrule.Prepare(r, lbrule.Settings{VLLMSeed: "1"})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	tlsRule := rule(0, "")
	tlsRule.Service.ExternalIP, tlsRule.Service.Security = "127.0.0.89", 1
	l4 := rule(0, "")
	l4.Service.ExternalIP, l4.Service.Mode, l4.Service.KVEngine = "127.0.0.90", 0, ""
	svcs := []control.Service{{ID: 1, Rule: prep(rule(0, ""))}, {ID: 3, Rule: prep(tlsRule)}, {ID: 4, Rule: prep(l4)}}
	f := newFixture(t)
	if err := f.g.Reconcile(context.Background(), svcs); err != nil {
		t.Fatalf("gateway reconcile: %v", err)
	}
	if f.g.lookup(3) == nil || f.g.lookup(4) != nil {
		t.Error("the gateway's table should hold the mode-4 rules only")
	}

}
