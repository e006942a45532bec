//go:build linux

package ebpf

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/dataplanetest"
)

// svcTally sends packets through tc_lb and adds up what the service's
// totals must show: every packet forwarded as a flow's, in bytes as the
// program sees them (the whole frame).
type svcTally struct {
	f           *fixture
	pkts, bytes uint64
}

// send runs p through tc_lb, wants verdict, and counts it when counted.
func (s *svcTally) send(p pkt, verdict uint32, counted bool) netip.Addr {
	s.f.t.Helper()
	b := p.build()
	v, out, err := s.f.d.objs.TcLb.Test(b)
	if err != nil || v != verdict {
		s.f.t.Fatalf("%+v: verdict %d, want %d (err %v)", p, v, verdict, err)
	}
	if counted {
		s.pkts++
		s.bytes += uint64(len(b))
	}
	return decode(out).dst
}

// totals runs a GC pass and returns what Stats reports for service id.
func (s *svcTally) totals(id uint32) dataplane.ServiceStats {
	s.f.t.Helper()
	s.f.d.GC()
	st, err := s.f.d.Stats(context.Background())
	if err != nil {
		s.f.t.Fatal(err)
	}
	return st.Services[id]
}

func (s *svcTally) want(id uint32, when string) {
	s.f.t.Helper()
	if got := s.totals(id); got.Packets != s.pkts || got.Bytes != s.bytes || got.Evicted != 0 {
		s.f.t.Fatalf("%s: service %d reports %d packets, %d bytes, %d evicted; want %d packets, %d bytes, none evicted",
			when, id, got.Packets, got.Bytes, got.Evicted, s.pkts, s.bytes)
	}
}

// age moves the last-seen time of the entries of port's flow back by d, as
// if the flow had been idle that long.
func (f *fixture) age(port uint16, d time.Duration) {
	f.t.Helper()
	for k, v := range f.ct() {
		if k.Sport != nbo16(port) && k.Dport != nbo16(port) {
			continue
		}
		v.LastSeen -= uint32(d >> ctTimeShift)
		if err := f.d.objs.LbConntrack.Update(k, v, 0); err != nil {
			f.t.Fatal(err)
		}
	}
}

// A service's packets and bytes are summed from its conntrack entries by
// the GC; nothing is lost when flows end, whichever way: closed and aged
// out by the GC, a closed tuple reused by a new connection, a flow of a
// removed endpoint dropped on its next packet (the program folds the last
// two), or the service's last flows collected. An entry lost without
// either (an LRU eviction) is counted, and the totals never go back.
func TestServiceTotalsAfterFlowsEnd(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbtotals") {
		return
	}
	fixtureNet(t)
	d := newTestDP(t, Config{GCInterval: time.Hour})
	f := &fixture{t: t, d: d}
	s := &svcTally{f: f}
	vip := vipN(50)
	const id = 50
	svc := dataplane.Service{ID: id, VIP: vip, Port: 80}
	f.upsert(svc, ep(backend1, 8080), ep(backend2, 8080))
	idx := d.services[id].idx

	// Four flows, round robin: 0 and 2 on backend1, 1 and 3 on backend2;
	// each a handshake and a request and an answer.
	be := map[uint16]netip.Addr{}
	for i := range uint16(4) {
		port := 50000 + i
		be[port] = s.send(tcp(client, port, vip, 80, fSYN), actRedirect, true)
		s.send(tcp(be[port], 8080, client, port, fSYN|fACK), actRedirect, true)
		s.send(tcp(client, port, vip, 80, fACK), actRedirect, true)
		s.send(tcp(client, port, vip, 80, fACK), actRedirect, true)
		s.send(tcp(be[port], 8080, client, port, fACK), actRedirect, true)
	}
	if be[50000] != backend1 || be[50002] != backend1 || be[50001] != backend2 {
		t.Fatalf("round robin: %v", be)
	}
	if st, _ := d.Stats(context.Background()); st.Services[id].Flows != 4 {
		t.Fatalf("flows %d, want 4 (counted at once, not by the GC)", st.Services[id].Flows)
	}
	s.want(id, "four live flows")

	// Flow 0 closes and ages out: the GC removes it and keeps its counts.
	s.send(tcp(client, 50000, vip, 80, fRST|fACK), actRedirect, true)
	if n := d.GC(); n != 0 {
		t.Fatalf("GC removed %d entries of a flow closed just now", n)
	}
	f.age(50000, (ctFINSecs+1)*time.Second)
	if n := d.GC(); n != 2 {
		t.Fatalf("GC removed %d entries of the closed idle flow, want 2", n)
	}
	s.want(id, "flow 0 removed by the GC")

	// Flow 1 closes and its tuple is reused at once: the program removes
	// the closed entries and folds their counts.
	s.send(tcp(client, 50001, vip, 80, fRST|fACK), actRedirect, true)
	s.send(tcp(client, 50001, vip, 80, fSYN), actRedirect, true)
	s.want(id, "flow 1's tuple reused")

	// backend1 goes: flow 2 is stale, dropped with a RST on its next
	// packet, and its counts stay the service's.
	f.upsert(svc, ep(backend2, 8080))
	s.send(tcp(client, 50002, vip, 80, fACK), actRedirect, false)
	s.want(id, "flow 2's endpoint removed")

	// An entry lost without being folded (an LRU eviction) is counted; the
	// totals do not go back.
	var lost lbCtKey
	for k, v := range f.ct() {
		if k.Sport == nbo16(50003) && v.Flags&ctReply == 0 {
			lost = k
		}
	}
	if err := d.objs.LbConntrack.Delete(lost); err != nil {
		t.Fatal(err)
	}
	if got := s.totals(id); got.Evicted != 1 || got.Packets != s.pkts || got.Bytes != s.bytes {
		t.Fatalf("after an eviction: %+v, want 1 evicted and the totals held at %d packets, %d bytes", got, s.pkts, s.bytes)
	}

	// Deleted and re-created on the same index: the new service starts at
	// zero, and the old one's entries left in the table are not its.
	if err := d.DeleteService(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	f.upsert(svc, ep(backend2, 8080))
	if d.services[id].idx != idx {
		t.Fatalf("the service came back on index %d, not %d", d.services[id].idx, idx)
	}
	s.pkts, s.bytes = 0, 0
	s.want(id, "re-created")
	s.send(tcp(client, 51000, vip, 80, fSYN), actRedirect, true)
	s.send(tcp(backend2, 8080, client, 51000, fSYN|fACK), actRedirect, true)
	s.want(id, "a flow of the re-created service")
}

// An epoch's cell half always moves; the service generation (high half)
// only when the index passes to another service, and both wrap.
func TestNextEpoch(t *testing.T) {
	for _, c := range []struct {
		e          uint32
		newService bool
		want       uint32
	}{
		{0, false, 1},
		{0, true, 1<<16 | 1},
		{3<<16 | 7, false, 3<<16 | 8},
		{3<<16 | 0xffff, false, 3 << 16},
		{3<<16 | 7, true, 4<<16 | 8},
		{0xffff_ffff, true, 0},
	} {
		if got := nextEpoch(c.e, c.newService); got != c.want {
			t.Errorf("nextEpoch(%#x, %v) = %#x, want %#x", c.e, c.newService, got, c.want)
		}
	}
}
