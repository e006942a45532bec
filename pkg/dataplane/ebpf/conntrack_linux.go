//go:build linux

// Conntrack garbage collection: expired entries and flows of removed
// services are dropped here, off the request path.

package ebpf

import (
	"time"

	"golang.org/x/sys/unix"
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

// ctTimeout is how long an entry may stay idle in its state.
func ctTimeout(v *lbCtVal) time.Duration {
	est := time.Duration(v.TimeoutS) * time.Second
	switch v.State {
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
	d.mu.Unlock()
	if ct == nil || epochs == nil || closed {
		return 0
	}
	now := monotonicNow()
	epochOf := map[uint32]uint32{}
	stale := func(v *lbCtVal) bool {
		key := uint32(v.SvcIdx)*maxEPs + uint32(v.Cell)
		e, ok := epochOf[key]
		if !ok {
			if err := epochs.Lookup(key, &e); err != nil {
				return false
			}
			epochOf[key] = e
		}
		return e != v.Epoch
	}
	var k lbCtKey
	var v lbCtVal
	total := 0
	expired := map[lbCtKey]lbCtVal{}
	var dead []lbCtKey
	live := map[lbCtKey]bool{}
	it := ct.Iterate()
	for it.Next(&k, &v) {
		total++
		switch {
		case stale(&v):
			dead = append(dead, k)
		case now > v.LastSeenNs && time.Duration(now-v.LastSeenNs) > ctTimeout(&v):
			expired[k] = v
		default:
			live[k] = true
		}
	}
	if err := it.Err(); err != nil {
		d.log.Warn("conntrack GC", "err", err)
	}
	removed := 0
	for _, k := range dead {
		if ct.Delete(k) == nil {
			removed++
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
	d.mu.Lock()
	d.ctEntries = total - removed
	d.mu.Unlock()
	return removed
}
