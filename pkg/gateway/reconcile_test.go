package gateway

import (
	"context"
	"errors"
	"net"
	"strconv"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/health"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

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
	f.g.SetProxy(px)
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
	err = f.g.Reconcile(context.Background(), svcs)
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
	if err := f.g.Reconcile(context.Background(), svcs); err != nil {
		t.Fatalf("reconcile after the port freed: %v", err)
	}
}

type captureProber struct{ targets []health.Target }

func (c *captureProber) Set(ts []health.Target) error { c.targets = ts; return nil }

// Octavia's per-endpoint monitorAddress and urlPath steer that endpoint's
// probe; the other endpoints keep the rule's.
func TestHealthReconcileOctaviaEndpointFields(t *testing.T) {
	r := rule(0, "")
	r.Service.ProbeType, r.Service.ProbeReq = "http", "/health"
	r.Endpoints[0].MonitorAddress, r.Endpoints[0].URLPath = "127.0.0.99", "/healthz"
	p, err := lbrule.Prepare(r, lbrule.Settings{VLLMSeed: "1"})
	if err != nil {
		t.Fatal(err)
	}
	cp := &captureProber{}
	if err := (&HealthReconciler{Prober: cp}).Reconcile(context.Background(), []control.Service{{ID: 1, Rule: p}}); err != nil {
		t.Fatal(err)
	}
	if len(cp.targets) != 2 {
		t.Fatalf("targets: %+v", cp.targets)
	}
	if a, q := cp.targets[0].Addr.String(), cp.targets[0].Probe.Request; a != "127.0.0.99" || q != "/healthz" {
		t.Errorf("endpoint 0 probes %s %s, want 127.0.0.99 /healthz", a, q)
	}
	if a, q := cp.targets[1].Addr.String(), cp.targets[1].Probe.Request; a != "127.0.0.79" || q != "/health" {
		t.Errorf("endpoint 1 probes %s %s, want its own address and the rule's /health", a, q)
	}
}
