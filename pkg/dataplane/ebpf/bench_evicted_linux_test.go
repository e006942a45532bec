//go:build linux

package ebpf

import (
	"slices"
	"testing"
)

// evictBytes is walked between two packets of BenchmarkProgramEvicted:
// eight times this machine's L2 (1 MiB per core on the 2-vCPU EPYC it was
// written on) and more pages than the data TLB holds.
const evictBytes = 8 << 20

// BenchmarkProgramEvicted measures tc_lb per packet as it runs live on a
// busy machine: before every BPF_PROG_TEST_RUN of one packet, the
// benchmark reads evictBytes of its own memory, so the lines the program
// touches (conntrack bucket and element, prefilter, counters, epoch,
// statistics, FIB generation) come from the last-level cache or memory,
// and the TLB entries for them are gone. Unlike BenchmarkProgram (all
// warm) and BenchmarkProgramManyFlows (only the flow's entry cold), the
// figure follows the number of distinct lines a packet touches, which is
// what the live bpf_stats figures in testbed/netns pay. Same packets as
// BenchmarkProgram; the median of the runs is reported, so preemptions do
// not count. Between runs on a loaded machine it still moves by about
// 15%: compare builds by alternating their binaries.
func BenchmarkProgramEvicted(b *testing.B) {
	f, vip := benchIdentityFlow(b, "lbevict")
	if f == nil {
		return
	}
	d := f.d
	buf := make([]byte, evictBytes)
	for i := range buf {
		buf[i] = byte(i)
	}
	var sink byte
	const runs = 10000
	for _, c := range []struct {
		name string
		pkt  []byte
	}{
		{"ConntrackHit", tcp(client, 40000, vip, 80, fACK).build()},
		{"NotForVIP", tcp(client, 40000, other, 80, fACK).build()},
	} {
		b.Run(c.name, func(b *testing.B) {
			hits := f.counters()["ct_hit_orig"]
			ns := make([]float64, 0, runs)
			for range runs {
				for i := 0; i < len(buf); i += 64 {
					sink += buf[i]
				}
				v, dur, err := d.objs.TcLb.Benchmark(c.pkt, 1, nil)
				if err != nil || v != actOK {
					b.Fatalf("verdict %d err %v counters %v", v, err, f.counters())
				}
				ns = append(ns, float64(dur.Nanoseconds()))
			}
			if n := f.counters()["ct_hit_orig"] - hits; c.name == "ConntrackHit" && n != runs {
				b.Fatalf("%d of %d runs were conntrack hits", n, runs)
			}
			slices.Sort(ns)
			b.ReportMetric(ns[len(ns)/2], "ns/pkt")
		})
	}
	if sink == 42 {
		b.Log("") // keeps the eviction reads from being optimised away
	}
}
