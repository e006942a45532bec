//go:build linux

package ebpf

import (
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

// BenchmarkProgramManyFlows measures a conntrack hit (rewrite, stack
// forwarding) when the flow's entry is cold: 60,000 flows are open
// and each BPF_PROG_TEST_RUN sends one packet of a flow taken in a shuffled
// order, so between two packets of a flow the others' entries (and the
// syscall's own memory) pass through the caches. Everything else the hit
// touches (prefilter, counters, epoch, service statistics) is shared by all
// flows and stays warm: the figure isolates the conntrack lookup and the
// entry's value. (With FIB forwarding the cached results would expire
// between two visits of a flow: a pass takes longer than their lifetime.) The kernel's run time of each single run includes two
// clock reads; it is the same for any build, so compare builds within one
// machine state.
func BenchmarkProgramManyFlows(b *testing.B) {
	f, vip := benchDataplane(b, "lbflows", func(netip.Addr) dataplane.Endpoint { return ep(backend1, 8080) })
	if f == nil {
		return
	}
	d := f.d
	const flows = 60000
	acks := make([][]byte, flows)
	for i := range flows {
		port := uint16(2000 + i)
		if v, _, err := d.objs.TcLb.Test(tcp(client, port, vip, 80, fSYN).build()); err != nil || v != actOK {
			b.Fatalf("SYN %d: verdict %d %v", i, v, err)
		}
		acks[i] = tcp(client, port, vip, 80, fACK).build()
	}
	run := func(pkt []byte) uint64 {
		v, dur, err := d.objs.TcLb.Benchmark(pkt, 1, nil)
		if err != nil || v != actOK {
			b.Fatalf("verdict %d err %v counters %v", v, err, f.counters())
		}
		return uint64(dur.Nanoseconds())
	}
	before := f.counters()["ct_hit_orig"]
	order := make([]int, flows)
	for i := range order {
		order[i] = i
	}
	var perPass []float64
	for range 5 {
		rand.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
		var sum uint64
		for _, i := range order {
			sum += run(acks[i])
		}
		perPass = append(perPass, float64(sum)/flows)
	}
	if n := f.counters()["ct_hit_orig"] - before; n != 5*flows {
		b.Fatalf("%d of %d packets were conntrack hits", n, 5*flows)
	}
	slices.Sort(perPass)
	b.ReportMetric(perPass[len(perPass)/2], "ns/pkt")
}
