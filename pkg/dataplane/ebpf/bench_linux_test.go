//go:build linux

package ebpf

import (
	"net/netip"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/dataplanetest"
)

// BenchmarkProgram measures tc_lb per packet with BPF_PROG_TEST_RUN: a
// conntrack hit with the full rewrite, and traffic that is not for a VIP
// (conntrack and service miss). Repeated test runs reuse one skb without
// restoring its bytes, so the hit case uses an identity rewrite (the
// endpoint is the VIP itself) and stack forwarding: the packet stays the
// same across runs while every helper of the rewrite still executes. The FIB
// redirect's cost shows in the live bpf_stats figures of testbed/netns.
func BenchmarkProgram(b *testing.B) {
	f, vip := benchIdentityFlow(b, "lbbench")
	if f == nil {
		return
	}
	d := f.d
	for _, c := range []struct {
		name string
		pkt  []byte
		want uint32
	}{
		{"ConntrackHit", tcp(client, 40000, vip, 80, fACK).build(), actOK},
		{"NotForVIP", tcp(client, 40000, other, 80, fACK).build(), actOK},
	} {
		b.Run(c.name, func(b *testing.B) {
			v, dur, err := d.objs.TcLb.Benchmark(c.pkt, 200000, nil)
			if err != nil || v != c.want {
				b.Fatalf("verdict %d err %v counters %v", v, err, f.counters())
			}
			if c.name == "ConntrackHit" && f.counters()["ct_hit_orig"] < 200000 {
				b.Fatalf("not every run was a conntrack hit: %v", f.counters())
			}
			b.ReportMetric(float64(dur.Nanoseconds()), "ns/pkt")
		})
	}
}

// benchDataplane starts a data plane with stack forwarding and service 1
// (round robin, VIP vipN(1) port 80) whose endpoint be picks for the VIP,
// inside a network namespace named after ns. It returns nil when it has
// re-run the benchmark in that namespace instead: the caller returns.
func benchDataplane(b *testing.B, ns string, be func(vip netip.Addr) dataplane.Endpoint) (*fixture, netip.Addr) {
	dataplanetest.RequirePrivileged(b)
	if !dataplanetest.InNetNS() {
		dataplanetest.RunBenchInNetNS(b, dataplanetest.NewNetNS(b, ns))
		return nil, netip.Addr{}
	}
	fixtureNet(b)
	d, err := New(Config{StackForwarding: true}, nil)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { d.Close() })
	f := &fixture{t: &testing.T{}, d: d}
	vip := vipN(1)
	f.upsert(dataplane.Service{ID: 1, VIP: vip, Port: 80, Sel: dataplane.SelRoundRobin}, be(vip))
	return f, vip
}

// benchIdentityFlow is benchDataplane with the VIP as its own endpoint
// (an identity rewrite, so a repeated packet stays the same) and one flow
// opened from client port 40000.
func benchIdentityFlow(b *testing.B, ns string) (*fixture, netip.Addr) {
	f, vip := benchDataplane(b, ns, func(vip netip.Addr) dataplane.Endpoint { return ep(vip, 80) })
	if f == nil {
		return nil, vip
	}
	if v, _, err := f.d.objs.TcLb.Test(tcp(client, 40000, vip, 80, fSYN).build()); err != nil || v != actOK {
		b.Fatalf("SYN: %d %v", v, err)
	}
	return f, vip
}
