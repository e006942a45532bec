//go:build linux

// Service statistics: a conntrack hit counts its packet and bytes only in
// its own entry, and the GC, which walks the table anyway, sums the
// entries per service. The program counts new flows and, when it removes
// entries itself (a stale flow, a closed tuple reused), folds their counts
// into lb_svc_stats; the GC keeps the counts of the entries it removes in
// lb_svc_gc. A service's reported packets and bytes are therefore
//
//	program-folded (lb_svc_stats) + GC-removed (lb_svc_gc) + live entries,
//
// taken at the GC's last pass (so they lag by up to one GC interval),
// and never go back: the sum is held when it would drop, which only an
// entry lost without being folded makes it do (an LRU eviction, whose
// flow direction's count is lost; or an entry the program removed while
// the pass was walking, which the next pass counts).

package ebpf

import (
	"fmt"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

// flowCounts are packets, bytes and conntrack entries of a service.
type flowCounts struct {
	pkts, bytes, entries uint64
}

func (c *flowCounts) add(v *lbCtVal) {
	c.pkts += v.Pkts
	c.bytes += v.Bytes
	c.entries++
}

// svcSums is one GC pass's per-service sums, by service index: live is
// every entry of the service the pass saw (removed ones included), gone
// the entries the pass removed.
type svcSums struct {
	live, gone [dataplane.MaxServices]flowCounts
}

// programStats sums lb_svc_stats of idx over the CPUs.
func (d *Dataplane) programStats(idx uint16, per []lbSvcStats) (lbSvcStats, error) {
	var out lbSvcStats
	if err := d.objs.LbSvcStats.Lookup(uint32(idx), &per); err != nil {
		return out, err
	}
	for _, v := range per {
		out.Pkts += v.Pkts
		out.Bytes += v.Bytes
		out.Flows += v.Flows
		out.Entries += v.Entries
	}
	return out, nil
}

// readProgramStats reads lb_svc_stats for the indexes in idxs.
func (d *Dataplane) readProgramStats(idxs []uint16) (map[uint16]lbSvcStats, error) {
	per := make([]lbSvcStats, d.nCPU)
	out := make(map[uint16]lbSvcStats, len(idxs))
	for _, idx := range idxs {
		s, err := d.programStats(idx, per)
		if err != nil {
			return nil, fmt.Errorf("read statistics of service index %d: %w", idx, err)
		}
		out[idx] = s
	}
	return out, nil
}

// serviceStats is what Stats reports for the service at idx: its flows as
// the program counts them, its packets and bytes as of the GC's last pass.
func (d *Dataplane) serviceStats(idx uint16) (dataplane.ServiceStats, error) {
	s, err := d.programStats(idx, make([]lbSvcStats, d.nCPU))
	if err != nil {
		return dataplane.ServiceStats{}, err
	}
	var g lbSvcGc
	if err := d.objs.LbSvcGc.Lookup(uint32(idx), &g); err != nil {
		return dataplane.ServiceStats{}, err
	}
	return dataplane.ServiceStats{Packets: g.RepPkts, Bytes: g.RepBytes, Flows: s.Flows, Evicted: g.Evicted}, nil
}

// commitSums stores a GC pass's sums for idx. before and after are
// lb_svc_stats read before and after the walk. Before is what the totals
// use: a fold after that read is of an entry the walk either saw (counted
// in live) or did not (counted at the next pass), never both. The entry
// counts give the evictions: entries the program inserted and did not
// remove, that the GC did not remove and that are not there any more
// (the smaller of the two program counts keeps inserts and removals made
// during the walk from passing for evictions). Called with d.mu held.
func (d *Dataplane) commitSums(idx uint16, before, after lbSvcStats, sums *svcSums) error {
	var g lbSvcGc
	if err := d.objs.LbSvcGc.Lookup(uint32(idx), &g); err != nil {
		return err
	}
	live, gone := sums.live[idx], sums.gone[idx]
	g.RepPkts = max(g.RepPkts, before.Pkts+g.Pkts+live.pkts)
	g.RepBytes = max(g.RepBytes, before.Bytes+g.Bytes+live.bytes)
	inserted := min(int64(before.Entries), int64(after.Entries))
	if lost := inserted - int64(g.Entries) - int64(live.entries); lost > int64(g.Evicted) {
		g.Evicted = uint64(lost)
	}
	g.Pkts += gone.pkts
	g.Bytes += gone.bytes
	g.Entries += gone.entries
	return d.objs.LbSvcGc.Put(uint32(idx), g)
}
