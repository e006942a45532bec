//go:build linux

// Service statistics and the hit counters they carry: the program counts a
// conntrack hit only in its service's per-CPU statistics (struct svc_stats
// in bpf/structs.h), so the counters ct_hit_orig, ct_hit_reply and
// fib_cached are the lb_counters slots plus the sums over the services.

package ebpf

import (
	"fmt"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

// svcHitCounters are the lb_counters slots whose counts the program keeps
// in struct svc_stats, with the field holding each.
var svcHitCounters = [...]struct {
	cnt   lbLbCounter
	field func(*lbSvcStats) uint64
}{
	{lbLbCounterCNT_CT_HIT_ORIG, func(s *lbSvcStats) uint64 { return s.HitOrig }},
	{lbLbCounterCNT_CT_HIT_REPLY, func(s *lbSvcStats) uint64 { return s.HitReply }},
	{lbLbCounterCNT_FIB_CACHED, func(s *lbSvcStats) uint64 { return s.FibCached }},
}

// svcStatsKey is the lb_svc_stats element of service index idx on a CPU.
func svcStatsKey(cpu int, idx uint16) uint32 {
	return uint32(cpu)*dataplane.MaxServices + uint32(idx)
}

// sumSvcStats reads index idx's statistics summed over the CPUs.
func (d *Dataplane) sumSvcStats(idx uint16) (lbSvcStats, error) {
	var sum, v lbSvcStats
	for cpu := range d.nCPU {
		if err := d.objs.LbSvcStats.Lookup(svcStatsKey(cpu, idx), &v); err != nil {
			return sum, err
		}
		sum.Pkts += v.Pkts
		sum.Bytes += v.Bytes
		sum.Flows += v.Flows
		sum.HitOrig += v.HitOrig
		sum.HitReply += v.HitReply
		sum.FibCached += v.FibCached
	}
	return sum, nil
}

// addHits adds the hit counts of s to counters (named as in counterNames).
func addHits(counters map[string]uint64, s *lbSvcStats) {
	for _, h := range svcHitCounters {
		counters[counterNames[h.cnt]] += h.field(s)
	}
}

// sumCounters reads lb_counters summed over its blocks: one per CPU, then
// Go's (see retireSvcStats).
func (d *Dataplane) sumCounters() (lbLbCpuCounters, error) {
	var sum, c lbLbCpuCounters
	for i := range uint32(d.nCPU + 1) {
		if err := d.objs.LbCounters.Lookup(i, &c); err != nil {
			return sum, fmt.Errorf("read the counters of CPU %d: %w", i, err)
		}
		for j, v := range c.N {
			sum.N[j] += v
		}
	}
	return sum, nil
}

// retireSvcStats moves index idx's hit counts into lb_counters and zeroes
// its statistics, so the counters stay monotonic when the index passes to
// another service. The counts go to the last block of lb_counters, which
// no CPU writes (the program counts in the block of its CPU number), so
// the read-modify-write races with nothing; hits of the index between the
// statistics' read and their zeroing (a packet already past the epoch
// check when the service went) are lost, at most a few.
func (d *Dataplane) retireSvcStats(idx uint16) error {
	s, err := d.sumSvcStats(idx)
	if err != nil {
		return fmt.Errorf("read service counters: %w", err)
	}
	if s.HitOrig+s.HitReply+s.FibCached != 0 {
		goBlock := uint32(d.nCPU)
		var c lbLbCpuCounters
		if err := d.objs.LbCounters.Lookup(goBlock, &c); err != nil {
			return fmt.Errorf("read the counters: %w", err)
		}
		for _, h := range svcHitCounters {
			c.N[h.cnt] += h.field(&s)
		}
		if err := d.objs.LbCounters.Put(goBlock, &c); err != nil {
			return fmt.Errorf("write the counters: %w", err)
		}
	}
	for cpu := range d.nCPU {
		if err := d.objs.LbSvcStats.Put(svcStatsKey(cpu, idx), &lbSvcStats{}); err != nil {
			return fmt.Errorf("reset service counters: %w", err)
		}
	}
	return nil
}
