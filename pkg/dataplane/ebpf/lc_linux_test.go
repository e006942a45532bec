//go:build linux

package ebpf

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/dataplanetest"
)

// lcCounts returns the least-connection count of every cell of service id.
func (f *fixture) lcCounts(id uint32) []int64 {
	f.t.Helper()
	idx := f.d.services[id].idx
	out := make([]int64, maxEPs)
	for c := range out {
		if err := f.d.objs.LbActiveConns.Lookup(uint32(idx)*maxEPs+uint32(c), &out[c]); err != nil {
			f.t.Fatal(err)
		}
	}
	return out
}

func (f *fixture) requireZeroCounts(id uint32, when string) {
	f.t.Helper()
	for c, n := range f.lcCounts(id) {
		if n != 0 {
			f.t.Fatalf("%s: least-connection cell %d holds %d (all: %v)", when, c, n, f.lcCounts(id)[:4])
		}
	}
}

// open starts a flow from client:sport and returns the endpoint chosen.
func (f *fixture) open(vip netip.Addr, sport uint16) netip.Addr {
	f.t.Helper()
	v, out, err := f.d.objs.TcLb.Test(tcp(client, sport, vip, 80, fSYN).build())
	if err != nil || v != actRedirect {
		f.t.Fatalf("SYN from port %d: verdict %d err %v", sport, v, err)
	}
	return decode(out).dst
}

// closeFlow sends the client's RST of a flow; it returns the verdict.
func (f *fixture) closeFlow(vip netip.Addr, sport uint16) uint32 {
	f.t.Helper()
	v, _, err := f.d.objs.TcLb.Test(tcp(client, sport, vip, 80, fRST|fACK).build())
	if err != nil {
		f.t.Fatal(err)
	}
	return v
}

// The least-connection counts return to zero once every flow has ended,
// whatever happened to the endpoint set meanwhile (an endpoint removed, one
// replaced, the rule re-applied), and later flows spread evenly.
func TestLeastConnCountsSurviveEndpointChanges(t *testing.T) {
	if !dataplanetest.Isolated(t, "lblc") {
		return
	}
	fixtureNet(t)
	d := newTestDP(t, Config{GCInterval: time.Hour})
	f := &fixture{t: t, d: d}
	vip := vipN(40)
	b3 := netip.MustParseAddr("172.31.1.12")
	b4 := netip.MustParseAddr("172.31.1.13")
	svc := dataplane.Service{ID: 40, VIP: vip, Port: 80, Sel: dataplane.SelLeastConn}
	f.upsert(svc, ep(backend1, 80), ep(backend2, 80), ep(b3, 80))

	// Two flows on each endpoint.
	flows := map[uint16]netip.Addr{}
	for p := range uint16(6) {
		flows[41000+p] = f.open(vip, 41000+p)
	}
	byEP := map[netip.Addr]int{}
	for _, a := range flows {
		byEP[a]++
	}
	if byEP[backend1] != 2 || byEP[backend2] != 2 || byEP[b3] != 2 {
		t.Fatalf("least-conn over 6 flows: %v", byEP)
	}

	// Remove the first endpoint (the others move up a position), re-apply
	// the same rule, then replace the last endpoint.
	f.upsert(svc, ep(backend2, 80), ep(b3, 80))
	f.upsert(svc, ep(backend2, 80), ep(b3, 80))
	f.upsert(svc, ep(backend2, 80), ep(b4, 80))

	before := f.counters()
	for p, a := range flows {
		v := f.closeFlow(vip, p)
		if a == backend2 && v != actRedirect {
			t.Errorf("RST of a flow to a remaining endpoint: verdict %d, want forwarded", v)
		}
		if a != backend2 && v != actShot {
			t.Errorf("RST of a flow to a removed endpoint %v: verdict %d, want dropped", a, v)
		}
	}
	if n := f.counters()["flow_stale"] - before["flow_stale"]; n != 4 {
		t.Errorf("flow_stale moved by %d, want 4 (the flows of the two removed endpoints)", n)
	}
	f.requireZeroCounts(40, "every flow closed")

	// Later traffic is not skewed: two endpoints, two flows each.
	byEP = map[netip.Addr]int{}
	for p := range uint16(4) {
		byEP[f.open(vip, 42000+p)]++
	}
	if byEP[backend2] != 2 || byEP[b4] != 2 {
		t.Fatalf("least-conn after the changes: %v, want 2 on each endpoint", byEP)
	}
	for p := range uint16(4) {
		f.closeFlow(vip, 42000+p)
	}
	f.requireZeroCounts(40, "the later flows closed")

	// A flow that idles out (no FIN/RST) is released by the GC, also when
	// the rule was re-applied meanwhile; a flow whose service is deleted
	// and re-created never touches the new service's counts.
	f.upsert(dataplane.Service{ID: 40, VIP: vip, Port: 80, Sel: dataplane.SelLeastConn, InactiveTimeout: time.Second}, ep(backend2, 80), ep(b4, 80))
	f.open(vip, 43000)
	f.upsert(dataplane.Service{ID: 40, VIP: vip, Port: 80, Sel: dataplane.SelLeastConn, InactiveTimeout: time.Second}, ep(backend2, 80), ep(b4, 80))
	time.Sleep(1100 * time.Millisecond) // the timeout under test; bpf_ktime_get_coarse_ns has no fake clock
	if n := d.GC(); n < 2 {
		t.Fatalf("GC removed %d entries, want at least the idle flow's 2", n)
	}
	f.requireZeroCounts(40, "idle flow collected")

	f.open(vip, 43001)
	if err := d.DeleteService(context.Background(), 40); err != nil {
		t.Fatal(err)
	}
	f.upsert(svc, ep(backend2, 80), ep(b4, 80))
	if v := f.closeFlow(vip, 43001); v != actShot {
		t.Errorf("RST of a flow of the deleted service: verdict %d, want dropped (not ours any more)", v)
	}
	f.requireZeroCounts(40, "flow of the deleted service closed")
}

// A service's flows go lazily when it is deleted: the GC drops them (stale)
// without waiting for their timeout, and deleting does not walk conntrack.
func TestDeletedServiceFlowsCollected(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbstale") {
		return
	}
	fixtureNet(t)
	d := newTestDP(t, Config{GCInterval: time.Hour})
	f := &fixture{t: t, d: d}
	vip := vipN(41)
	f.upsert(dataplane.Service{ID: 41, VIP: vip, Port: 80}, ep(backend1, 80))
	for p := range uint16(3) {
		f.open(vip, 44000+p)
	}
	if err := d.DeleteService(context.Background(), 41); err != nil {
		t.Fatal(err)
	}
	if n := d.GC(); n != 6 {
		t.Fatalf("GC removed %d entries of the deleted service, want 6", n)
	}
	if n := len(f.ct()); n != 0 {
		t.Fatalf("%d conntrack entries left", n)
	}
}

// CheckService refuses, without changing anything, what UpsertService
// would: a taken frontend, a full table, a one-arm endpoint with no route.
func TestCheckService(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbcheck") {
		return
	}
	fixtureNet(t)
	d := newTestDP(t, Config{GCInterval: time.Hour})
	f := &fixture{t: t, d: d}
	ctx := context.Background()
	one := []dataplane.Endpoint{ep(backend1, 80)}
	f.upsert(dataplane.Service{ID: 1, VIP: vipN(1), Port: 80}, one...)
	if err := d.CheckService(ctx, dataplane.Service{VIP: vipN(1), Port: 80, Proto: "tcp"}, one); !errors.Is(err, dataplane.ErrConflict) {
		t.Fatalf("taken frontend: %v", err)
	}
	if err := d.CheckService(ctx, dataplane.Service{ID: 1, VIP: vipN(1), Port: 80, Proto: "tcp"}, one); err != nil {
		t.Fatalf("update of the holder: %v", err)
	}
	far := []dataplane.Endpoint{ep(netip.MustParseAddr("172.29.250.9"), 80)}
	if err := d.CheckService(ctx, dataplane.Service{VIP: vipN(2), Port: 80, Proto: "tcp", Mode: dataplane.ModeOneArm}, far); !errors.Is(err, dataplane.ErrUnroutable) {
		t.Fatalf("one-arm endpoint without a route: %v", err)
	}
	for id := uint32(2); id <= dataplane.MaxServices; id++ {
		f.upsert(dataplane.Service{ID: id, VIP: netip.AddrFrom4([4]byte{172, 31, 10 + byte(id>>8), byte(id)}), Port: 80}, one...)
	}
	if err := d.CheckService(ctx, dataplane.Service{VIP: vipN(3), Port: 80, Proto: "tcp"}, one); !errors.Is(err, dataplane.ErrCapacity) {
		t.Fatalf("full table: %v", err)
	}
	if err := d.UpsertService(ctx, dataplane.Service{ID: 999, VIP: vipN(3), Port: 80, Proto: "tcp"}, one); !errors.Is(err, dataplane.ErrCapacity) {
		t.Fatalf("upsert into the full table: %v", err)
	}
}

// When the host's ephemeral range reaches into the one-arm SNAT ports,
// starting the data plane reserves them; with the default range it leaves
// the reserved list alone.
func TestSNATPortsReserved(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbports") {
		return
	}
	d := newTestDP(t, Config{GCInterval: time.Hour})
	d.Close()
	if b, _ := os.ReadFile(sysctlReservedPorts); strings.TrimSpace(string(b)) != "" {
		t.Fatalf("default range: reserved ports %q, want none", b)
	}
	if err := os.WriteFile(sysctlPortRange, []byte("20000 65000"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(sysctlReservedPorts, []byte("8080"), 0o644); err != nil {
		t.Fatal(err)
	}
	newTestDP(t, Config{GCInterval: time.Hour})
	newTestDP(t, Config{GCInterval: time.Hour}) // a second start adds nothing
	b, _ := os.ReadFile(sysctlReservedPorts)
	if got := strings.TrimSpace(string(b)); got != "8080,61000-65535" {
		t.Fatalf("reserved ports %q, want 8080,61000-65535", got)
	}
}
