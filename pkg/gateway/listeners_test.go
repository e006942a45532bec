package gateway

import (
	"context"
	"errors"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

// reconcileAll applies svcs as the daemon's controller does: the proxy's
// listeners first, then the gateway's routing table.
func reconcileAll(lr *ListenerReconciler, g *Gateway, svcs []control.Service) error {
	ctx := context.Background()
	return errors.Join(lr.Reconcile(ctx, svcs), g.Reconcile(ctx, svcs))
}

// captureTable records the proxy table it is given and fails as told.
type captureTable struct {
	got proxy.Config
	err error
}

func (c *captureTable) Update(cfg proxy.Config) error { c.got = cfg; return c.err }

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
	lr := &ListenerReconciler{Proxy: px}
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

// TestListenerReconcilerTable: the proxy gets one service per mode-4 rule
// with the daemon's knobs and receipt policy and loxilb's 24 h stream cap
// when the rule sets none; other modes get none, and a rule whose TLS
// files the daemon lacks is that rule's 412 while the others are served.
func TestListenerReconcilerTable(t *testing.T) {
	prep := func(r *lbrule.Rule) *lbrule.Rule {
		p, err := lbrule.Prepare(r, lbrule.Settings{VLLMSeed: "1"})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	plain := rule(0, "")
	capped := rule(0, "")
	capped.Service.ExternalIP, capped.Service.MaxStreamDurationSec = "127.0.0.88", 60
	tlsRule := rule(0, "")
	tlsRule.Service.ExternalIP, tlsRule.Service.Security = "127.0.0.89", 1
	l4 := rule(0, "")
	l4.Service.ExternalIP, l4.Service.Mode, l4.Service.KVEngine = "127.0.0.90", 0, ""
	svcs := []control.Service{{ID: 1, Rule: prep(plain)}, {ID: 2, Rule: prep(capped)}, {ID: 3, Rule: prep(tlsRule)}, {ID: 4, Rule: prep(l4)}}

	pt := &captureTable{}
	lr := &ListenerReconciler{Proxy: pt, Config: ListenerConfig{Proxy: proxy.Config{MaxBodyBytes: 1234}, Receipts: proxy.ReceiptsOnRequest}}
	err := lr.Reconcile(context.Background(), svcs)
	res := control.RuleErrors(err)
	if len(res) != 1 || res[0].ID != 3 || res[0].Reason != lbrule.ReasonProxyTLSUnset {
		t.Fatalf("a security-1 rule without the daemon's TLS files: %v", err)
	}
	if pt.got.MaxBodyBytes != 1234 || len(pt.got.Services) != 2 {
		t.Fatalf("proxy table %+v", pt.got)
	}
	s1, s2 := pt.got.Services[0], pt.got.Services[1]
	if s1.ID != 1 || s1.Listen.String() != "127.0.0.77:9000" || s1.Receipts != proxy.ReceiptsOnRequest || s1.MaxStreamDuration != lbrule.MaxStreamDurationSec*time.Second {
		t.Errorf("rule 1 as the proxy's service: %+v", s1)
	}
	if s2.ID != 2 || s2.MaxStreamDuration != time.Minute {
		t.Errorf("rule 2 as the proxy's service: %+v", s2)
	}

	// The gateway routes every mode-4 rule; listeners are not its stage.
	f := newFixture(t)
	if err := f.g.Reconcile(context.Background(), svcs); err != nil {
		t.Fatalf("gateway reconcile: %v", err)
	}
	if f.g.lookup(3) == nil || f.g.lookup(4) != nil {
		t.Error("the gateway's table should hold the mode-4 rules only")
	}

	// A table the proxy refuses as a whole is a stage failure, not a rule's.
	pt.err = errors.New("table refused")
	err = lr.Reconcile(context.Background(), svcs[:1])
	if err == nil || len(control.RuleErrors(err)) != 0 || !strings.Contains(err.Error(), "table refused") {
		t.Fatalf("whole-table failure: %v", err)
	}
}
