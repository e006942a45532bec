package api_test

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/store"
)

// TestCapabilityReadyMetric: every capability but the per-endpoint parity
// entries is exported with its readiness and reason code.
func TestCapabilityReadyMetric(t *testing.T) {
	st, err := store.OpenBolt(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	reg := prometheus.NewRegistry()
	caps := func() []api.Capability {
		return []api.Capability{
			{Name: "ebpf_dataplane", ReasonCode: "no_interfaces"},
			{Name: "kv_exact_vllm", Ready: true},
			{Name: "kv_parity:1/0", ReasonCode: "hash_mismatch"},
			{Name: "kv_quarantine:1/0", ReasonCode: "quarantined"},
		}
	}
	if _, err := api.New(api.Config{}, api.Deps{Rules: control.New(st, lbrule.Settings{}, nil), Registerer: reg, Gatherer: reg, Capabilities: caps}); err != nil {
		t.Fatal(err)
	}
	n, err := testutil.GatherAndCount(reg, "loxilb_capability_ready")
	if err != nil || n != 2 {
		t.Fatalf("loxilb_capability_ready series: %d, %v (want 2: parity entries excluded)", n, err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "loxilb_capability_ready" {
			continue
		}
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, l.GetName()+"="+l.GetValue())
			}
			got[strings.Join(ls, ",")] = m.GetGauge().GetValue()
		}
	}
	want := map[string]float64{"capability=ebpf_dataplane,reason_code=no_interfaces": 0, "capability=kv_exact_vllm,reason_code=": 1}
	for k, v := range want {
		if g, ok := got[k]; !ok || g != v {
			t.Errorf("%s = %v (present %v), want %v; all: %v", k, g, ok, v, got)
		}
	}
}
