//go:build linux

package ebpf

import (
	"net/netip"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/dataplanetest"
)

// TestHitCountersOutliveTheirService checks the hit counters the program
// keeps in the service statistics (ct_hit_orig, ct_hit_reply, fib_cached):
// they count per packet like the other counters, stay put when the service
// is deleted and its index passes to another service, and the new service
// starts with empty statistics.
func TestHitCountersOutliveTheirService(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbhits") {
		return
	}
	fixtureNet(t)
	f := &fixture{t: t, d: newTestDP(t, Config{})}
	vip, be := vipN(9), netip.MustParseAddr("172.31.1.12") // a known neighbour: the FIB result is cacheable
	f.upsert(dataplane.Service{ID: 9, VIP: vip, Port: 80, Mode: dataplane.ModeDNAT}, ep(be, 8080))
	out := func(p pkt) *pkt {
		p.ttl, p.dstMAC, p.srcMAC = 63, []byte{0x02, 0, 0, 0, 0x01, 0x0c}, macOf(t, "lbt0")
		return &p
	}
	f.run(step{name: "SYN", in: tcp(client, 43000, vip, 80, fSYN), verdict: actRedirect,
		out: out(tcp(client, 43000, be, 8080, fSYN)), counters: map[string]uint64{"new_flow": 1, "fwd_redirect": 1}, ct: 2})
	ack := tcp(client, 43000, vip, 80, fACK)
	f.run(step{name: "hit, FIB asked", in: ack, verdict: actRedirect, out: out(tcp(client, 43000, be, 8080, fACK)),
		counters: map[string]uint64{"ct_hit_orig": 1, "fwd_redirect": 1}})
	f.run(step{name: "hit, FIB cached", in: ack, verdict: actRedirect, out: out(tcp(client, 43000, be, 8080, fACK)),
		counters: map[string]uint64{"ct_hit_orig": 1, "fwd_redirect": 1, "fib_cached": 1}})
	f.run(step{name: "reply hit", in: tcp(be, 8080, client, 43000, fACK), verdict: actRedirect,
		out: fwd(tcp(vip, 80, client, 43000, fACK)), counters: map[string]uint64{"ct_hit_reply": 1, "fwd_redirect": 1}})

	want := f.counters()
	for name, n := range map[string]uint64{"ct_hit_orig": 2, "ct_hit_reply": 1, "fib_cached": 1} {
		if want[name] < n {
			t.Fatalf("%s = %d, want at least %d", name, want[name], n)
		}
	}
	st, err := f.d.Stats(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if s := st.Services[9]; s.Packets != 4 || s.Flows != 1 {
		t.Fatalf("service statistics %+v, want 4 packets and 1 flow", s)
	}

	check := func(when string) {
		t.Helper()
		got := f.counters()
		for _, name := range []string{"ct_hit_orig", "ct_hit_reply", "fib_cached", "fwd_redirect"} {
			if got[name] != want[name] {
				t.Errorf("%s: %s = %d, want %d", when, name, got[name], want[name])
			}
		}
	}
	if err := f.d.DeleteService(t.Context(), 9); err != nil {
		t.Fatal(err)
	}
	check("after the delete")
	f.upsert(dataplane.Service{ID: 10, VIP: vipN(10), Port: 80, Mode: dataplane.ModeDNAT}, ep(be, 8080))
	check("after another service took the index")
	if st, err = f.d.Stats(t.Context()); err != nil {
		t.Fatal(err)
	}
	if s := st.Services[10]; s != (dataplane.ServiceStats{}) {
		t.Errorf("the new service inherited statistics: %+v", s)
	}
}
