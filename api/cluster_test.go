package api_test

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/cluster"
	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/store"
)

// TestClusterSingleNode: with the embedded store, GET /cluster lists this
// node alone, with no drift; unwired, it is 503.
func TestClusterSingleNode(t *testing.T) {
	st, err := store.OpenBolt(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	m, err := cluster.New(cluster.Config{Self: cluster.Member{Name: "solo", Address: "127.0.0.1:11111", Version: "v"},
		Local: func() map[string]string { return map[string]string{cluster.SettingSeed: cluster.SeedUnset} }}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctl := control.New(st, lbrule.Settings{}, nil)
	for _, tc := range []struct {
		deps api.Deps
		want int
	}{{api.Deps{Rules: ctl, Cluster: m.View}, 200}, {api.Deps{Rules: ctl}, 503}} {
		srv, err := api.New(api.Config{}, tc.deps)
		if err != nil {
			t.Fatal(err)
		}
		ts := httptest.NewServer(srv.Handler())
		resp, err := http.Get(ts.URL + "/netlox/v1/cluster")
		if err != nil {
			t.Fatal(err)
		}
		var v cluster.View
		err = json.NewDecoder(resp.Body).Decode(&v)
		resp.Body.Close()
		ts.Close()
		if resp.StatusCode != tc.want {
			t.Fatalf("status %d, want %d", resp.StatusCode, tc.want)
		}
		if tc.want == 200 && (err != nil || v.Backend != "single" || len(v.Nodes) != 1 || v.Nodes[0].Name != "solo" || !v.Nodes[0].Self || v.Drifted || v.Drift == nil) {
			t.Fatalf("single-node view: %+v %v", v, err)
		}
	}
}
