//go:build linux

// Service statistics and the hit counters they carry: the program counts a
// conntrack hit only in its service's per-CPU statistics (struct svc_stats
// in bpf/structs.h), so the counters ct_hit_orig, ct_hit_reply and
// fib_cached are the lb_counters slots plus the sums over the services.

package ebpf

import "fmt"

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

// sumSvcStats reads index idx's statistics summed over the CPUs.
func (d *Dataplane) sumSvcStats(idx uint16) (lbSvcStats, error) {
	per := make([]lbSvcStats, d.nCPU)
	var sum lbSvcStats
	if err := d.objs.LbSvcStats.Lookup(uint32(idx), &per); err != nil {
		return sum, err
	}
	for _, v := range per {
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

// retireSvcStats moves index idx's hit counts into lb_counters and zeroes
// its statistics, so the counters stay monotonic when the index passes to
// another service. The program writes those lb_counters slots only if a
// service index had no statistics, which MAX_SERVICES rules out, so the
// read-modify-write here races with nothing; hits of the index between
// the read and the zeroing (a packet already past the epoch check when
// the service went) are lost, at most a few.
func (d *Dataplane) retireSvcStats(idx uint16) error {
	s, err := d.sumSvcStats(idx)
	if err != nil {
		return fmt.Errorf("read service counters: %w", err)
	}
	per := make([]uint64, d.nCPU)
	for _, h := range svcHitCounters {
		n := h.field(&s)
		if n == 0 || len(per) == 0 {
			continue
		}
		if err := d.objs.LbCounters.Lookup(uint32(h.cnt), &per); err != nil {
			return fmt.Errorf("read counter %s: %w", counterNames[h.cnt], err)
		}
		per[0] += n
		if err := d.objs.LbCounters.Put(uint32(h.cnt), per); err != nil {
			return fmt.Errorf("write counter %s: %w", counterNames[h.cnt], err)
		}
	}
	if err := d.objs.LbSvcStats.Put(uint32(idx), make([]lbSvcStats, d.nCPU)); err != nil {
		return fmt.Errorf("reset service counters: %w", err)
	}
	return nil
}
