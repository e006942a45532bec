//go:build linux

package ebpf

import (
	"bytes"
	"context"
	"encoding/hex"
	"net"
	"net/netip"
	"os"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/dataplanetest"
)

// TC verdicts.
const (
	actOK       = 0
	actShot     = 2
	actRedirect = 7
)

var (
	client   = netip.MustParseAddr("172.31.2.2")
	client2  = netip.MustParseAddr("172.31.2.3")
	lbAddr   = netip.MustParseAddr("172.31.1.1")
	backend1 = netip.MustParseAddr("172.31.1.10")
	backend2 = netip.MustParseAddr("172.31.1.11")
	other    = netip.MustParseAddr("172.31.1.99")
)

func vipN(n byte) netip.Addr { return netip.AddrFrom4([4]byte{172, 31, 9, n}) }

// fixtureNet gives the namespace routes to the client and backend networks,
// and forwarding, so bpf_fib_lookup succeeds in test runs.
func fixtureNet(t testing.TB) {
	t.Helper()
	for _, args := range [][]string{
		{"link", "add", "lbt0", "type", "veth", "peer", "name", "lbt0p"},
		{"link", "add", "lbt1", "type", "veth", "peer", "name", "lbt1p"},
		{"addr", "add", "172.31.1.1/24", "dev", "lbt0"},
		{"addr", "add", "172.31.2.1/24", "dev", "lbt1"},
		{"link", "set", "lbt0", "up"},
		{"link", "set", "lbt1", "up"},
		{"link", "set", "lbt0p", "up"},
		{"link", "set", "lbt1p", "up"},
		// A known neighbour: packets to it get their MACs from the FIB.
		{"neigh", "replace", "172.31.1.12", "lladdr", "02:00:00:00:01:0c", "dev", "lbt0", "nud", "permanent"},
	} {
		if err := dataplanetest.Run("ip", args...); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644); err != nil {
		t.Fatal(err)
	}
}

func newTestDP(t *testing.T, cfg Config) *Dataplane {
	t.Helper()
	d, err := New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

type fixture struct {
	t *testing.T
	d *Dataplane
}

func (f *fixture) counters() map[string]uint64 {
	st, err := f.d.Stats(context.Background())
	if err != nil {
		f.t.Fatal(err)
	}
	return st.Counters
}

func (f *fixture) ct() map[lbCtKey]lbCtVal {
	out := map[lbCtKey]lbCtVal{}
	var k lbCtKey
	var v lbCtVal
	it := f.d.objs.LbConntrack.Iterate()
	for it.Next(&k, &v) {
		out[k] = v
	}
	if err := it.Err(); err != nil {
		f.t.Fatal(err)
	}
	return out
}

// oneArmSYN sends a SYN to a one-arm service and checks it leaves DNATed to
// be:bport and SNATed to the LB's address with a port of the one-arm range
// (61000-65535, outside the host's ephemeral ports), which it returns.
func (f *fixture) oneArmSYN(syn pkt, be netip.Addr, bport uint16) uint16 {
	f.t.Helper()
	before := len(f.ct())
	v, out, err := f.d.objs.TcLb.Test(syn.build())
	if err != nil || v != actRedirect {
		f.t.Fatalf("one-arm SYN: verdict %d, %v", v, err)
	}
	d := decode(out)
	if d.src != lbAddr || d.dst != be || d.dport != bport || !d.ipOK || !d.l4OK {
		f.t.Fatalf("one-arm SYN left as %+v, want %v -> %v:%d with good checksums", d, lbAddr, be, bport)
	}
	if d.sport < snatLocalPortMin || d.sport > snatLocalPortMax {
		f.t.Fatalf("one-arm SNAT port %d outside %d-%d", d.sport, snatLocalPortMin, snatLocalPortMax)
	}
	if n := len(f.ct()) - before; n != 2 {
		f.t.Fatalf("one-arm SYN added %d conntrack entries, want 2", n)
	}
	return d.sport
}

// flush deletes every conntrack entry of service idx.
func (f *fixture) flush(idx uint16) {
	for k, v := range f.ct() {
		if uint16(v.SvcIdx) == idx {
			f.d.objs.LbConntrack.Delete(k)
		}
	}
}

func (f *fixture) upsert(s dataplane.Service, eps ...dataplane.Endpoint) {
	f.t.Helper()
	if s.Proto == "" {
		s.Proto = "tcp"
	}
	if err := f.d.UpsertService(context.Background(), s, eps); err != nil {
		f.t.Fatal(err)
	}
}

func ep(a netip.Addr, port uint16) dataplane.Endpoint {
	return dataplane.Endpoint{Addr: a, Port: port, Weight: 1, Healthy: true}
}

// step is one packet-fixture: input packet -> verdict, output packet,
// counter deltas and conntrack size delta.
type step struct {
	name     string
	in       pkt
	verdict  uint32
	out      *pkt              // expected output; nil: must equal the input
	counters map[string]uint64 // expected deltas; others must not move
	ct       int               // expected change of conntrack entries
}

func (f *fixture) run(s step) []byte {
	f.t.Helper()
	before, ctBefore := f.counters(), len(f.ct())
	in := s.in.build()
	verdict, out, err := f.d.objs.TcLb.Test(in)
	if err != nil {
		f.t.Fatalf("%s: %v", s.name, err)
	}
	if verdict != s.verdict {
		f.t.Errorf("%s: verdict %d, want %d", s.name, verdict, s.verdict)
	}
	want := in
	if s.out != nil {
		want = s.out.build()
	}
	if !bytes.Equal(out, want) {
		g, w := decode(out), decode(want)
		f.t.Errorf("%s: output packet differs\n got  %+v\n want %+v\n got  %s\n want %s", s.name, g, w, hex.EncodeToString(out), hex.EncodeToString(want))
	}
	if d := decode(out); !d.ipOK || !d.l4OK {
		f.t.Errorf("%s: bad checksum in output: ip ok=%v l4 ok=%v", s.name, d.ipOK, d.l4OK)
	}
	after := f.counters()
	for name, v := range after {
		if _, named := s.counters[name]; !named && name == "pass_not_ipv4" {
			// The program is attached to live links too: IPv6 neighbour
			// discovery the kernel sends on them can land in this window.
			continue
		}
		if delta := v - before[name]; delta != s.counters[name] {
			f.t.Errorf("%s: counter %s moved by %d, want %d", s.name, name, delta, s.counters[name])
		}
	}
	if got := len(f.ct()) - ctBefore; got != s.ct {
		f.t.Errorf("%s: conntrack grew by %d, want %d", s.name, got, s.ct)
	}
	return out
}

func tcp(src netip.Addr, sport uint16, dst netip.Addr, dport uint16, flags uint8) pkt {
	return pkt{src: src, dst: dst, sport: sport, dport: dport, proto: 6, flags: flags, payload: "hello"}
}

func fwd(p pkt) *pkt { p.ttl = 63; return &p }

func TestPacketFixtures(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbfix") {
		return
	}
	fixtureNet(t)
	f := &fixture{t: t, d: newTestDP(t, Config{})}
	newFlow := map[string]uint64{"new_flow": 1, "fwd_redirect": 1}
	hitOrig := map[string]uint64{"ct_hit_orig": 1, "fwd_redirect": 1}
	hitReply := map[string]uint64{"ct_hit_reply": 1, "fwd_redirect": 1}

	t.Run("Mode0DNAT", func(t *testing.T) {
		f.t = t
		vip := vipN(1)
		f.upsert(dataplane.Service{ID: 1, VIP: vip, Port: 80, Mode: dataplane.ModeDNAT, Sel: dataplane.SelRoundRobin}, ep(backend1, 8080), ep(backend2, 8080))
		f.run(step{name: "SYN to VIP", in: tcp(client, 40000, vip, 80, fSYN),
			verdict: actRedirect, out: fwd(tcp(client, 40000, backend1, 8080, fSYN)), counters: newFlow, ct: 2})
		f.run(step{name: "SYN-ACK from backend", in: tcp(backend1, 8080, client, 40000, fSYN|fACK),
			verdict: actRedirect, out: fwd(tcp(vip, 80, client, 40000, fSYN|fACK)), counters: hitReply})
		f.run(step{name: "ACK from client", in: tcp(client, 40000, vip, 80, fACK),
			verdict: actRedirect, out: fwd(tcp(client, 40000, backend1, 8080, fACK)), counters: hitOrig})
		for k, v := range f.ct() {
			if v.State != ctEst {
				t.Errorf("entry %+v state %d, want established", k, v.State)
			}
		}
		f.run(step{name: "rr: next flow to backend 2", in: tcp(client, 40001, vip, 80, fSYN),
			verdict: actRedirect, out: fwd(tcp(client, 40001, backend2, 8080, fSYN)), counters: newFlow, ct: 2})
		f.run(step{name: "rr: wraps to backend 1", in: tcp(client, 40002, vip, 80, fSYN),
			verdict: actRedirect, out: fwd(tcp(client, 40002, backend1, 8080, fSYN)), counters: newFlow, ct: 2})
		mid := tcp(client, 40099, vip, 80, fACK)
		f.run(step{name: "mid-stream packet without conntrack: RST back to the client", in: mid,
			verdict: actRedirect, out: rstTo(mid), counters: map[string]uint64{"drop_not_syn": 1, "rst_sent": 1}})
		f.run(step{name: "a RST without conntrack gets no RST", in: tcp(client, 40099, vip, 80, fRST|fACK),
			verdict: actShot, counters: map[string]uint64{"drop_not_syn": 1}})
		f.run(step{name: "RST closes both directions", in: tcp(client, 40000, vip, 80, fRST|fACK),
			verdict: actRedirect, out: fwd(tcp(client, 40000, backend1, 8080, fRST|fACK)), counters: hitOrig})
		closed := 0
		for _, v := range f.ct() {
			if v.State == ctClosed {
				closed++
			}
		}
		if closed != 2 {
			t.Errorf("%d closed entries after RST, want 2", closed)
		}
		f.run(step{name: "SYN reusing the closed tuple opens a new flow", in: tcp(client, 40000, vip, 80, fSYN),
			verdict: actRedirect, out: fwd(tcp(client, 40000, backend2, 8080, fSYN)),
			counters: map[string]uint64{"new_flow": 1, "fwd_redirect": 1, "flow_reopened": 1}})
		f.d.GC() // packets are summed from the entries by the GC
		st, _ := f.d.Stats(context.Background())
		if s := st.Services[1]; s.Flows != 4 || s.Packets != 7 {
			t.Errorf("service counters %+v, want 4 flows and 7 packets (the dropped one is not the service's)", s)
		}
	})

	t.Run("NotOurs", func(t *testing.T) {
		f.t = t
		f.run(step{name: "non-VIP TCP", in: tcp(client, 1234, other, 80, fSYN), verdict: actOK, counters: map[string]uint64{"pass_no_service": 1}})
		f.run(step{name: "VIP, other port", in: tcp(client, 1234, vipN(1), 81, fSYN), verdict: actOK, counters: map[string]uint64{"pass_no_service": 1}})
		icmp := tcp(client, 0, other, 0, 0)
		icmp.proto = 1
		in := icmp.build()
		v, _, err := f.d.objs.TcLb.Test(in)
		if err != nil || v != actOK {
			t.Errorf("ICMP: verdict %d err %v", v, err)
		}
		arp := make([]byte, 60)
		arp[12], arp[13] = 0x08, 0x06
		if v, _, err := f.d.objs.TcLb.Test(arp); err != nil || v != actOK {
			t.Errorf("ARP: verdict %d err %v", v, err)
		}
		short := tcp(client, 1, vipN(1), 80, fSYN).build()[:14+20+10]
		if v, _, err := f.d.objs.TcLb.Test(short); err != nil || v != actShot {
			t.Errorf("truncated TCP header: verdict %d err %v", v, err)
		}
		badIHL := tcp(client, 1, vipN(1), 80, fSYN).build()
		badIHL[14] = 0x44
		if v, _, err := f.d.objs.TcLb.Test(badIHL); err != nil || v != actShot {
			t.Errorf("IHL 4: verdict %d err %v", v, err)
		}
		frag := tcp(client, 1, vipN(1), 80, fSYN)
		frag.fragOff = 0x2000
		f.run(step{name: "fragment", in: frag, verdict: actOK, counters: map[string]uint64{"pass_fragment": 1}})
		c := f.counters()
		if c["pass_not_l4"] == 0 || c["pass_not_ipv4"] == 0 || c["drop_malformed"] == 0 {
			t.Errorf("counters %v", c)
		}
	})

	t.Run("Mode2FullNAT", func(t *testing.T) {
		f.t = t
		vip := vipN(2)
		f.upsert(dataplane.Service{ID: 2, VIP: vip, Port: 443, Mode: dataplane.ModeFullNAT, Sel: dataplane.SelHash}, ep(backend1, 8443))
		f.run(step{name: "SYN: SNAT to the VIP, client port kept", in: tcp(client, 41000, vip, 443, fSYN),
			verdict: actRedirect, out: fwd(tcp(vip, 41000, backend1, 8443, fSYN)), counters: newFlow, ct: 2})
		f.run(step{name: "reply restored", in: tcp(backend1, 8443, vip, 41000, fSYN|fACK),
			verdict: actRedirect, out: fwd(tcp(vip, 443, client, 41000, fSYN|fACK)), counters: hitReply})
		// client2:41000 would map to the reply tuple of client:41000 (same
		// SNAT address, endpoint and port), so a fresh port is allocated.
		in := tcp(client2, 41000, vip, 443, fSYN)
		before := len(f.ct())
		v, out, err := f.d.objs.TcLb.Test(in.build())
		if err != nil || v != actRedirect {
			t.Fatalf("colliding SYN: verdict %d err %v", v, err)
		}
		d := decode(out)
		if d.src != vip || d.dst != backend1 || d.dport != 8443 || d.sport == 41000 || d.sport < 32768 || d.sport >= 61000 || !d.ipOK || !d.l4OK {
			t.Fatalf("colliding SYN: got %+v, want src %v with a port from 32768-60999", d, vip)
		}
		if n := len(f.ct()) - before; n != 2 {
			t.Fatalf("conntrack grew by %d, want 2", n)
		}
		f.run(step{name: "reply to the allocated port", in: tcp(backend1, 8443, vip, d.sport, fSYN|fACK),
			verdict: actRedirect, out: fwd(tcp(vip, 443, client2, 41000, fSYN|fACK)), counters: hitReply})
	})

	t.Run("Mode1OneArm", func(t *testing.T) {
		f.t = t
		vip := vipN(3)
		f.upsert(dataplane.Service{ID: 3, VIP: vip, Port: 80, Mode: dataplane.ModeOneArm, Sel: dataplane.SelRoundRobin}, ep(backend2, 80))
		port := f.oneArmSYN(tcp(client, 42000, vip, 80, fSYN), backend2, 80)
		f.run(step{name: "reply", in: tcp(backend2, 80, lbAddr, port, fSYN|fACK),
			verdict: actRedirect, out: fwd(tcp(vip, 80, client, 42000, fSYN|fACK)), counters: hitReply})
	})

	t.Run("Mode3DSR", func(t *testing.T) {
		f.t = t
		vip := vipN(4)
		f.upsert(dataplane.Service{ID: 4, VIP: vip, Port: 80, Mode: dataplane.ModeDSR, Sel: dataplane.SelHash}, ep(backend1, 80))
		f.run(step{name: "SYN: no rewrite, redirected toward the endpoint", in: tcp(client, 43000, vip, 80, fSYN),
			verdict: actRedirect, out: fwd(tcp(client, 43000, vip, 80, fSYN)), counters: newFlow, ct: 1})
		f.run(step{name: "next packet sticks", in: tcp(client, 43000, vip, 80, fACK),
			verdict: actRedirect, out: fwd(tcp(client, 43000, vip, 80, fACK)), counters: hitOrig})
	})

	t.Run("Mode5HostOneArm", func(t *testing.T) {
		f.t = t
		f.upsert(dataplane.Service{ID: 12, VIP: netip.IPv4Unspecified(), Port: 9000, Mode: dataplane.ModeHostOneArm, Sel: dataplane.SelRoundRobin}, ep(backend1, 80))
		local := netip.MustParseAddr("172.31.2.1") // an address of this host
		port := f.oneArmSYN(tcp(client, 42500, local, 9000, fSYN), backend1, 80)
		f.run(step{name: "reply", in: tcp(backend1, 80, lbAddr, port, fSYN|fACK),
			verdict: actRedirect, out: fwd(tcp(local, 9000, client, 42500, fSYN|fACK)), counters: hitReply})
		f.run(step{name: "same port, not a local address", in: tcp(client, 42501, other, 9000, fSYN),
			verdict: actOK, counters: map[string]uint64{"pass_no_service": 1}})
	})

	t.Run("SCTPDSR", func(t *testing.T) {
		f.t = t
		vip := vipN(13)
		f.upsert(dataplane.Service{ID: 13, VIP: vip, Port: 38412, Proto: "sctp", Mode: dataplane.ModeDSR, Sel: dataplane.SelHash}, ep(backend2, 38412))
		in := pkt{src: client, dst: vip, sport: 5000, dport: 38412, proto: 132, payload: "init"}
		out := in
		out.ttl = 63
		f.run(step{name: "SCTP to a DSR VIP: untouched but TTL", in: in, verdict: actRedirect, out: &out, counters: newFlow, ct: 1})
	})

	t.Run("RemovedEndpointFlowsFlushed", func(t *testing.T) {
		f.t = t
		vip := vipN(14)
		svc := dataplane.Service{ID: 14, VIP: vip, Port: 80, Sel: dataplane.SelRoundRobin}
		f.upsert(svc, ep(backend1, 80), ep(backend2, 80))
		f.run(step{name: "flow 1", in: tcp(client, 43500, vip, 80, fSYN), verdict: actRedirect, out: fwd(tcp(client, 43500, backend1, 80, fSYN)), counters: newFlow, ct: 2})
		f.run(step{name: "flow 2", in: tcp(client, 43501, vip, 80, fSYN), verdict: actRedirect, out: fwd(tcp(client, 43501, backend2, 80, fSYN)), counters: newFlow, ct: 2})
		before := len(f.ct())
		f.upsert(svc, ep(backend2, 80))
		if n := before - len(f.ct()); n != 0 {
			t.Fatalf("the update walked conntrack: %d entries removed; stale entries go lazily", n)
		}
		f.run(step{name: "flow 2 continues", in: tcp(client, 43501, vip, 80, fACK), verdict: actRedirect, out: fwd(tcp(client, 43501, backend2, 80, fACK)), counters: hitOrig})
		stale := tcp(client, 43500, vip, 80, fACK)
		f.run(step{name: "flow 1 is stale: its entries go, the client gets a RST", in: stale, verdict: actRedirect, out: rstTo(stale),
			counters: map[string]uint64{"flow_stale": 1, "drop_not_syn": 1, "rst_sent": 1}, ct: -2})
	})

	t.Run("KnownNeighbourMACs", func(t *testing.T) {
		f.t = t
		vip := vipN(15)
		backend3 := netip.MustParseAddr("172.31.1.12")
		lbt0, err := net.InterfaceByName("lbt0")
		if err != nil {
			t.Fatal(err)
		}
		f.upsert(dataplane.Service{ID: 15, VIP: vip, Port: 80}, ep(backend3, 8080))
		want := fwd(tcp(client, 44500, backend3, 8080, fSYN))
		want.dstMAC = []byte{0x02, 0, 0, 0, 0x01, 0x0c}
		want.srcMAC = lbt0.HardwareAddr
		f.run(step{name: "SYN: MACs of the egress device and the neighbour", in: tcp(client, 44500, vip, 80, fSYN),
			verdict: actRedirect, out: want, counters: newFlow, ct: 2})
	})

	t.Run("UDP", func(t *testing.T) {
		f.t = t
		vip := vipN(5)
		f.upsert(dataplane.Service{ID: 5, VIP: vip, Port: 53, Proto: "udp", Mode: dataplane.ModeDNAT, Sel: dataplane.SelRoundRobin}, ep(backend1, 5353))
		u := func(src netip.Addr, sport uint16, dst netip.Addr, dport uint16, nocsum bool) pkt {
			return pkt{src: src, dst: dst, sport: sport, dport: dport, proto: 17, payload: "query", noUDPCsum: nocsum}
		}
		f.run(step{name: "datagram", in: u(client, 5000, vip, 53, false), verdict: actRedirect, out: fwd(u(client, 5000, backend1, 5353, false)), counters: newFlow, ct: 2})
		f.run(step{name: "zero checksum stays zero", in: u(client, 5001, vip, 53, true), verdict: actRedirect, out: fwd(u(client, 5001, backend1, 5353, true)), counters: newFlow, ct: 2})
		f.run(step{name: "reply", in: u(backend1, 5353, client, 5000, false), verdict: actRedirect, out: fwd(u(vip, 53, client, 5000, false)), counters: hitReply})
	})

	t.Run("Health", func(t *testing.T) {
		f.t = t
		vip := vipN(6)
		f.upsert(dataplane.Service{ID: 6, VIP: vip, Port: 80, Mode: dataplane.ModeDNAT, Sel: dataplane.SelRoundRobin}, ep(backend1, 80), ep(backend2, 80))
		ctx := context.Background()
		if err := f.d.SetEndpointHealth(ctx, 6, 0, false); err != nil {
			t.Fatal(err)
		}
		for i := range 3 {
			f.run(step{name: "only the healthy endpoint", in: tcp(client, uint16(44000+i), vip, 80, fSYN),
				verdict: actRedirect, out: fwd(tcp(client, uint16(44000+i), backend2, 80, fSYN)), counters: newFlow, ct: 2})
		}
		if err := f.d.SetEndpointHealth(ctx, 6, 1, false); err != nil {
			t.Fatal(err)
		}
		f.run(step{name: "all down", in: tcp(client, 44100, vip, 80, fSYN), verdict: actShot, counters: map[string]uint64{"drop_no_endpoint": 1}})
	})

	t.Run("Selectors", func(t *testing.T) {
		f.t = t
		pick := func(vip netip.Addr, src netip.Addr, sport uint16) netip.Addr {
			t.Helper()
			v, out, err := f.d.objs.TcLb.Test(tcp(src, sport, vip, 80, fSYN).build())
			if err != nil || v != actRedirect {
				t.Fatalf("verdict %d err %v", v, err)
			}
			return decode(out).dst
		}
		eps := []dataplane.Endpoint{ep(backend1, 80), ep(backend2, 80), ep(other, 80)}

		f.upsert(dataplane.Service{ID: 7, VIP: vipN(7), Port: 80, Sel: dataplane.SelPersist}, eps...)
		first := pick(vipN(7), client, 45000)
		for p := range uint16(20) {
			if got := pick(vipN(7), client, 45001+p); got != first {
				t.Fatalf("persist: client moved from %v to %v", first, got)
			}
		}

		f.upsert(dataplane.Service{ID: 8, VIP: vipN(8), Port: 80, Sel: dataplane.SelHash}, eps...)
		hits := map[netip.Addr]int{}
		for p := range uint16(300) {
			hits[pick(vipN(8), client, 46000+p)]++
		}
		for _, e := range eps {
			if hits[e.Addr] < 60 {
				t.Errorf("hash: endpoint %v got %d of 300 flows: %v", e.Addr, hits[e.Addr], hits)
			}
		}

		f.upsert(dataplane.Service{ID: 9, VIP: vipN(9), Port: 80, Sel: dataplane.SelLeastConn}, eps...)
		seen := map[netip.Addr]int{}
		for p := range uint16(6) {
			seen[pick(vipN(9), client, 47000+p)]++
		}
		for _, e := range eps {
			if seen[e.Addr] != 2 {
				t.Errorf("least-conn with open flows: %v, want 2 each", seen)
			}
		}

		w := []dataplane.Endpoint{ep(backend1, 80), ep(backend2, 80)}
		w[0].Weight, w[1].Weight = 3, 1
		f.upsert(dataplane.Service{ID: 10, VIP: vipN(10), Port: 80, Sel: dataplane.SelPriority}, w...)
		wh := map[netip.Addr]int{}
		for p := range uint16(40) {
			wh[pick(vipN(10), client, 48000+p)]++
		}
		if wh[backend1] != 30 || wh[backend2] != 10 {
			t.Errorf("priority 3:1 over 40 flows: %v", wh)
		}

		f.upsert(dataplane.Service{ID: 11, VIP: vipN(11), Port: 80, Sel: dataplane.SelConsistentHash}, eps...)
		before := map[uint16]netip.Addr{}
		for p := range uint16(200) {
			before[p] = pick(vipN(11), client2, 49000+p)
		}
		if err := f.d.SetEndpointHealth(context.Background(), 11, 2, false); err != nil {
			t.Fatal(err)
		}
		f.flush(f.d.services[11].idx)
		moved := 0
		for p := range uint16(200) {
			got := pick(vipN(11), client2, 49000+p)
			if got == other {
				t.Fatal("maglev: down endpoint selected")
			}
			if before[p] != other && got != before[p] {
				moved++
			}
		}
		if moved > 10 {
			t.Errorf("maglev: %d of the surviving flows moved", moved)
		}
	})
}
