//go:build linux

// Conntrack garbage collection: expired entries and flows of removed
// services are dropped here, off the request path.

package ebpf

import (
	"time"

	"golang.org/x/sys/unix"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

func (d *Dataplane) gcLoop() {
	defer close(d.gcDone)
	t := time.NewTicker(d.cfg.GCInterval)
	defer t.Stop()
	for {
		select {
		case <-d.gcStop:
			return
		case <-t.C:
			d.GC()
		}
	}
}

func monotonicNow() uint64 {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts) // the clock of bpf_ktime_get_coarse_ns
	return uint64(ts.Nano())
}

// ctTick is a conntrack entry's clock (CT_TIME_SHIFT in bpf/consts.h):
// CLOCK_MONOTONIC in units of 2^20 ns, truncated to 32 bits.
func ctTick(ns uint64) uint32 { return uint32(ns >> ctTimeShift) }

// ctIdle is how long ago an entry stamped last was last seen at now (both
// ctTick values). The difference is taken modulo 2^32 as a signed number,
// so a stamp written after now was read counts as idle 0; the clock wraps
// every ~52 days, far beyond the longest timeout (MaxInactivity).
func ctIdle(now, last uint32) time.Duration {
	d := int32(now - last)
	if d <= 0 {
		return 0
	}
	return time.Duration(int64(d) << ctTimeShift)
}

// ctTimeout is how long an entry may stay idle in its state; est is its
// service's inactivity timeout (for established flows).
func ctTimeout(state uint8, est time.Duration) time.Duration {
	switch state {
	case ctEst:
		return est
	case ctNew:
		return min(ctSYNSecs*time.Second, est)
	default:
		return min(ctFINSecs*time.Second, est)
	}
}

// peerKey is the key of the other direction's entry (see ct_forget in lb.c).
func peerKey(k *lbCtKey, v *lbCtVal) lbCtKey {
	p := lbCtKey{Proto: k.Proto, Saddr: k.Daddr, Sport: k.Dport, Daddr: k.Saddr, Dport: k.Sport}
	if v.Flags&ctXlateDst != 0 {
		p.Saddr, p.Sport = v.NewDaddr, v.NewDport
	}
	if v.Flags&ctXlateSrc != 0 {
		p.Daddr, p.Dport = v.NewSaddr, v.NewSport
	}
	return p
}

// GC removes expired and stale conntrack entries: an entry goes when it and
// its peer are both idle past their state's timeout (one quiet direction
// must not break a flow), or at once when its endpoint cell has a new epoch
// (endpoint or service removed). It returns the number removed. It runs
// every GCInterval without holding the data plane's lock, so rule changes
// never wait for a walk of the table; tests call it directly.
func (d *Dataplane) GC() int {
	d.gcMu.Lock()
	defer d.gcMu.Unlock()
	d.mu.Lock()
	ct, epochs, conns := d.objs.LbConntrack, d.objs.LbEpEpoch, d.objs.LbActiveConns
	closed := d.closed
	// An entry's inactivity timeout is its service's, current one (entries
	// keep only the service index): entries of a removed service are
	// stale by their epoch and go first.
	timeouts := make(map[uint8]time.Duration, len(d.services))
	idxs := make([]uint16, 0, len(d.services))
	for _, st := range d.services {
		timeouts[uint8(st.idx)] = dataplane.InactivityFor(st.svc)
		idxs = append(idxs, st.idx)
	}
	gens := d.idxGen
	d.mu.Unlock()
	if ct == nil || epochs == nil || closed {
		return 0
	}
	before, err := d.readProgramStats(idxs)
	if err != nil {
		d.log.Warn("conntrack GC", "err", err)
	}
	sums := new(svcSums)
	timeoutOf := func(k *lbCtKey, v *lbCtVal) time.Duration {
		est, ok := timeouts[v.SvcIdx]
		if !ok {
			est = dataplane.InactivityFor(dataplane.Service{Proto: protoName(k.Proto)})
		}
		return ctTimeout(v.State, est)
	}
	now := ctTick(monotonicNow())
	epochOf := map[uint32]uint32{}
	// epoch reports whether the entry is stale and whether it is of the
	// service now at its index (same service generation; an unreadable
	// epoch counts as current).
	epoch := func(v *lbCtVal) (stale, same bool) {
		key := uint32(v.SvcIdx)*maxEPs + uint32(v.Cell)
		e, ok := epochOf[key]
		if !ok {
			if err := epochs.Lookup(key, &e); err != nil {
				return false, true
			}
			epochOf[key] = e
		}
		return e != v.Epoch, e>>epochSvcShift == v.Epoch>>epochSvcShift
	}
	stale := func(v *lbCtVal) bool {
		s, _ := epoch(v)
		return s
	}
	var k lbCtKey
	var v lbCtVal
	total := 0
	expired := map[lbCtKey]lbCtVal{}
	// Stale entries; counted when removed if still of their service.
	type deadEntry struct {
		k     lbCtKey
		v     lbCtVal
		count bool
	}
	var dead []deadEntry
	live := map[lbCtKey]bool{}
	it := ct.Iterate()
	for it.Next(&k, &v) {
		total++
		isStale, same := epoch(&v)
		if same {
			sums.live[v.SvcIdx].add(&v)
		}
		switch {
		case isStale:
			dead = append(dead, deadEntry{k, v, same})
		case ctIdle(now, v.LastSeen) > timeoutOf(&k, &v):
			expired[k] = v
		default:
			live[k] = true
		}
	}
	if err := it.Err(); err != nil {
		d.log.Warn("conntrack GC", "err", err)
	}
	removed := 0
	for _, e := range dead {
		if ct.Delete(e.k) == nil {
			removed++
			if e.count {
				sums.gone[e.v.SvcIdx].add(&e.v)
			}
		}
	}
	for k, v := range expired {
		if v.Flags&ctDSR == 0 && live[peerKey(&k, &v)] {
			continue
		}
		if err := ct.Delete(k); err != nil {
			continue
		}
		removed++
		sums.gone[v.SvcIdx].add(&v)
		if v.Flags&ctLCHeld != 0 && !stale(&v) {
			// Read-modify-write races with the program's atomic adds; the
			// window is tiny and the count only steers least-connection.
			key := uint32(v.SvcIdx)*maxEPs + uint32(v.Cell)
			var n int64
			if conns.Lookup(key, &n) == nil && n > 0 {
				conns.Put(key, n-1)
			}
		}
	}
	after, err := d.readProgramStats(idxs)
	if err != nil {
		d.log.Warn("conntrack GC", "err", err)
	}
	d.mu.Lock()
	d.ctEntries = total - removed
	for _, idx := range idxs {
		// An index that changed hands meanwhile: its sums are of the
		// previous service.
		if before == nil || after == nil || d.closed || d.idxGen[idx] != gens[idx] {
			continue
		}
		if err := d.commitSums(idx, before[idx], after[idx], sums); err != nil {
			d.log.Warn("conntrack GC: store service totals", "idx", idx, "err", err)
		}
	}
	d.mu.Unlock()
	return removed
}
