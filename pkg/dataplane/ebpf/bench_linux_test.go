//go:build linux

package ebpf

import (
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
	dataplanetest.RequirePrivileged(b)
	if !dataplanetest.InNetNS() {
		dataplanetest.RunBenchInNetNS(b, dataplanetest.NewNetNS(b, "lbbench"))
		return
	}
	fixtureNet(b)
	d, err := New(Config{StackForwarding: true}, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	f := &fixture{t: &testing.T{}, d: d}
	vip := vipN(1)
	f.upsert(dataplane.Service{ID: 1, VIP: vip, Port: 80, Sel: dataplane.SelRoundRobin}, ep(vip, 80))
	if v, _, err := d.objs.TcLb.Test(tcp(client, 40000, vip, 80, fSYN).build()); err != nil || v != actOK {
		b.Fatalf("SYN: %d %v", v, err)
	}
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
