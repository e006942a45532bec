package api_test

import (
	"net/http/httptest"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/store"
)

// TestDrainRoute: the drain route reads, sets and clears an endpoint's
// maintenance state, shows it in the listing with the in-flight count,
// and answers a malformed or unknown endpoint with 400 or 404.
func TestDrainRoute(t *testing.T) {
	st, err := store.OpenBolt(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	srv, err := api.New(api.Config{}, api.Deps{Rules: control.New(st, lbrule.Settings{}, nil),
		Gatherer: prometheus.NewRegistry(), InFlight: func(uint32, int) int { return 2 },
		KVTrust: func(_ uint32, ep int) (string, bool) { return "hash_mismatch", ep == 1 }})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(ts.Close)
	rule := `{"serviceArguments":{"externalIP":"127.0.0.10","port":2090,"protocol":"tcp","mode":4},
	"endpoints":[{"endpointIP":"127.0.0.11","targetPort":30000,"weight":1},{"endpointIP":"127.0.0.12","targetPort":30000,"weight":1}]}`
	if code, m := do(t, ts, "POST", "/config/loadbalancer", rule); code != 200 {
		t.Fatalf("create: %d %v", code, m)
	}
	path := "/config/loadbalancer/externalipaddress/127.0.0.10/port/2090/protocol/tcp/endpoint/127.0.0.12/port/30000/drain"
	if code, m := do(t, ts, "POST", path, ""); code != 200 || m["draining"] != true || m["changed"] != true || m["ep_idx"] != 1.0 || m["inflight"] != 2.0 {
		t.Fatalf("drain: %d %v", code, m)
	}
	if code, m := do(t, ts, "GET", path, ""); code != 200 || m["draining"] != true || m["changed"] != false {
		t.Fatalf("read: %d %v", code, m)
	}
	_, list := do(t, ts, "GET", "/config/loadbalancer/all", "")
	eps := list["lbAttr"].([]any)[0].(map[string]any)["endpoints"].([]any)
	e0, e1 := eps[0].(map[string]any), eps[1].(map[string]any)
	if e0["draining"] != nil || e1["draining"] != true || e1["kvParity"] != "hash_mismatch" || e1["kvExcluded"] != true || e0["kvExcluded"] != nil {
		t.Fatalf("listing: %v", eps)
	}
	if code, m := do(t, ts, "DELETE", path, ""); code != 200 || m["draining"] != false || m["changed"] != true {
		t.Fatalf("undrain: %d %v", code, m)
	}
	for _, c := range []struct {
		path string
		code int
	}{
		{"/config/loadbalancer/externalipaddress/127.0.0.10/port/2090/protocol/tcp/endpoint/127.0.0.99/port/30000/drain", 404},
		{"/config/loadbalancer/externalipaddress/127.0.0.10/port/2091/protocol/tcp/endpoint/127.0.0.12/port/30000/drain", 404},
		{"/config/loadbalancer/externalipaddress/127.0.0.10/port/2090/protocol/tcp/endpoint/not-an-ip/port/30000/drain", 400},
		{"/config/loadbalancer/externalipaddress/127.0.0.10/port/2090/protocol/tcp/endpoint/127.0.0.12/port/0/drain", 400},
		{"/config/loadbalancer/externalipaddress/127.0.0.10/port/2090/protocol/tcp/endpoint/127.0.0.12/port/30000/drain?block=x", 400},
	} {
		if code, m := do(t, ts, "POST", c.path, ""); code != c.code || m["message"] == nil {
			t.Errorf("%s: %d %v, want %d with a message", c.path, code, m, c.code)
		}
	}
}
