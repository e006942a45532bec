package control

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/dataplane/fake"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

var chatKey = lbrule.Key{IP: "127.0.0.10", Port: 2090, Proto: "tcp"}

// A drained endpoint reaches every stage, survives a reopen of the store
// and an update that keeps the endpoint, and goes with the endpoint when an
// update removes it.
func TestDrainPersistsAndFollowsTheEndpoint(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	c, rec, st := newCtl(t, dir)
	if _, _, err := c.Create(ctx, []byte(body)); err != nil {
		t.Fatal(err)
	}
	ds, err := c.SetDrain(ctx, chatKey, "127.0.0.12:30000", true)
	if err != nil || ds.EPIdx != 1 || !ds.Draining || !ds.Changed {
		t.Fatalf("drain: %+v %v", ds, err)
	}
	if len(rec.last) != 1 || rec.last[0].EndpointDraining(0) || !rec.last[0].EndpointDraining(1) {
		t.Fatalf("stages did not see the drain: %+v", rec.last)
	}
	if again, err := c.SetDrain(ctx, chatKey, "127.0.0.12:30000", true); err != nil || again.Changed {
		t.Fatalf("repeated drain: %+v %v", again, err)
	}
	want := "\n# HELP loxilb_endpoint_draining 1 while the endpoint is draining (in maintenance: no new requests or flows, those in flight finish), else 0; one series per endpoint of every rule.\n# TYPE loxilb_endpoint_draining gauge\n" +
		"loxilb_endpoint_draining{ep_idx=\"0\",service=\"1\"} 0\nloxilb_endpoint_draining{ep_idx=\"1\",service=\"1\"} 1\n"
	if err := testutil.CollectAndCompare(ServiceInfoCollector(c), strings.NewReader(want), "loxilb_endpoint_draining"); err != nil {
		t.Fatal(err)
	}
	st.Close()

	c, rec, st = newCtl(t, dir)
	if s, _ := c.Get(1); !s.EndpointDraining(1) || s.EndpointDraining(0) || !rec.last[0].EndpointDraining(1) {
		t.Fatalf("after reopen: %+v", s.Draining)
	}
	// An update that keeps the endpoint keeps its state.
	upd := strings.Replace(body, `"name":"chat"`, `"name":"chat2"`, 1)
	if _, _, err := c.Create(ctx, []byte(upd)); err != nil {
		t.Fatal(err)
	}
	if s, _ := c.Get(1); !s.EndpointDraining(1) {
		t.Fatalf("update lost the drain: %+v", s.Draining)
	}
	// One that removes it forgets it, also in the store.
	gone := strings.Replace(upd, `,{"endpointIP":"127.0.0.12","targetPort":30000,"weight":1}`, `,{"endpointIP":"127.0.0.13","targetPort":30000,"weight":1}`, 1)
	if _, _, err := c.Create(ctx, []byte(gone)); err != nil {
		t.Fatal(err)
	}
	recs, _ := st.List()
	if s, _ := c.Get(1); len(s.Draining) != 0 || len(recs) != 1 || len(recs[0].Draining) != 0 {
		t.Fatalf("removed endpoint still draining: %+v %+v", s.Draining, recs)
	}
	// Undrain is stored too.
	if _, err := c.SetDrain(ctx, chatKey, "127.0.0.13:30000", true); err != nil {
		t.Fatal(err)
	}
	if _, err := c.SetDrain(ctx, chatKey, "127.0.0.13:30000", false); err != nil {
		t.Fatal(err)
	}
	if recs, _ := st.List(); len(recs[0].Draining) != 0 {
		t.Fatalf("undrain not stored: %+v", recs[0].Draining)
	}
}

func TestDrainErrors(t *testing.T) {
	ctx := context.Background()
	c, _, _ := newCtl(t, t.TempDir())
	if _, _, err := c.Create(ctx, []byte(body)); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		k    lbrule.Key
		addr string
		want error
		msg  string
	}{
		{chatKey, "127.0.0.12", lbrule.ErrInvalid, "not IP:PORT"},
		{chatKey, "127.0.0.99:30000", lbrule.ErrNotFound, "127.0.0.11:30000, 127.0.0.12:30000"},
		{lbrule.Key{IP: "127.0.0.10", Port: 2091, Proto: "tcp"}, "127.0.0.12:30000", lbrule.ErrNotFound, "no rule"},
	}
	for _, tc := range cases {
		_, err := c.SetDrain(ctx, tc.k, tc.addr, true)
		if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%v %s: %v, want %v naming %q", tc.k, tc.addr, err, tc.want, tc.msg)
		}
	}
}

// L4: a drained endpoint is unhealthy in the kernel (no new flows) and a
// passing probe does not bring it back; put back in service, it is healthy.
func TestKernelReconcilerDrain(t *testing.T) {
	dp := fake.New()
	k := &KernelReconciler{DP: dp}
	l4 := prepared(t, &lbrule.Rule{Service: lbrule.ServiceArgs{ExternalIP: "127.0.9.9", Port: 80, Protocol: "tcp", Mode: lbrule.ModeFullNAT, Sel: lbrule.SelRR},
		Endpoints: []lbrule.Endpoint{{IP: "127.0.9.10", Port: 8080, Weight: 1}, {IP: "127.0.9.11", Port: 8080, Weight: 1}}})
	ctx := context.Background()
	svc := Service{ID: 1, Rule: l4, Draining: []string{"127.0.9.11:8080"}}
	if err := k.Reconcile(ctx, []Service{svc}); err != nil {
		t.Fatal(err)
	}
	healthy := func() []bool {
		_, eps, _ := dp.Service(1)
		var out []bool
		for _, e := range eps {
			out = append(out, e.Healthy)
		}
		return out
	}
	if got := healthy(); !slices.Equal(got, []bool{true, false}) {
		t.Fatalf("drained endpoint in the kernel: %v", got)
	}
	if err := k.SetHealth(ctx, 1, 1, true); err != nil {
		t.Fatal(err)
	}
	if got := healthy(); got[1] {
		t.Fatal("a probe brought a drained endpoint back")
	}
	svc.Draining = nil
	if err := k.Reconcile(ctx, []Service{svc}); err != nil {
		t.Fatal(err)
	}
	if got := healthy(); !slices.Equal(got, []bool{true, true}) {
		t.Fatalf("put back in service: %v", got)
	}
}
