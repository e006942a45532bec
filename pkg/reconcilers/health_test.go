package reconcilers

import (
	"context"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/health"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

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
	if err := (&Health{Prober: cp}).Reconcile(context.Background(), []control.Service{{ID: 1, Rule: p}}); err != nil {
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
