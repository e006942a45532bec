package gcfloor

import (
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
)

// DefaultPercent is Go's own GOGC, the least the pacer sets.
const DefaultPercent = 100

// DefaultFloor is the daemon's default floor: with a few MB live, a
// cycle per 64 MiB of garbage (about 30,000 small proxied requests)
// instead of one per few MB.
const DefaultFloor = 64 << 20

// minLive is the live heap assumed when the runtime reports less (none
// before the first cycle). The runtime never aims under 4 MiB x GOGC/100
// (its minimum heap), so for a smaller live heap the percentage that
// floor needs above 4 MiB is the one that keeps the goal near floor:
// counted from the real live heap it would put the goal at
// 4 MiB x floor/live (256 MiB for 1 MiB live and a 64 MiB floor).
const minLive = 4 << 20

// Percent returns the GOGC percentage that puts the next heap goal
// floor bytes above the live heap, and never below DefaultPercent. scan
// is what the runtime multiplies by GOGC/100 to get that room: the live
// heap plus the goroutine stacks and globals it scans (so a thousand
// idle connections' stacks do not multiply the floor).
func Percent(scan, floor uint64) int {
	scan = max(scan, minLive)
	p := (floor*100 + scan - 1) / scan
	return int(max(p, DefaultPercent))
}

// Pacer sets GOGC after every GC cycle (see the package doc). Stop
// restores the percentage in force when it started.
type Pacer struct {
	floor uint64
	prev  int // GOGC before Start

	mu      sync.Mutex
	stopped bool
	cur     int // the percentage last set
}

// Start begins pacing with the given floor. A floor of 0 does nothing
// but is still a Pacer that Stop accepts.
func Start(floor uint64) *Pacer {
	p := &Pacer{floor: floor, prev: GOGC()}
	p.cur = p.prev
	if floor == 0 {
		p.stopped = true
		return p
	}
	p.adjust()
	p.arm()
	return p
}

// arm schedules adjust for the end of the next GC cycle: the sentinel is
// unreachable at once, so the cycle frees it and the runtime then runs
// its cleanup. A pointer-free object of 16 bytes or more is allocated on
// its own (smaller ones share a block, whose cleanup may never run).
func (p *Pacer) arm() {
	s := new([32]byte)
	runtime.AddCleanup(s, func(p *Pacer) {
		if p.adjust() {
			p.arm()
		}
	}, p)
}

// adjust sets GOGC from the live heap of the cycle that just ended. It
// reports false once the pacer is stopped.
func (p *Pacer) adjust() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped {
		return false
	}
	pct := Percent(Scan(), p.floor)
	// Moved only by more than an eighth: a setting recomputes the
	// runtime's goal under the heap lock, pointless for a small change.
	if d := pct - p.cur; d > p.cur/8 || -d > p.cur/8 {
		debug.SetGCPercent(pct)
		p.cur = pct
	}
	return true
}

// Current returns the percentage the pacer last set.
func (p *Pacer) Current() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cur
}

// Stop ends pacing and restores the GOGC in force before Start.
func (p *Pacer) Stop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped && p.cur == p.prev {
		return
	}
	p.stopped = true
	debug.SetGCPercent(p.prev)
	p.cur = p.prev
}

// GOGC returns the GC percentage in force.
func GOGC() int {
	if v, ok := readUint64("/gc/gogc:percent"); ok {
		return int(v)
	}
	return DefaultPercent
}

// Live returns the heap the last GC cycle marked live.
func Live() uint64 {
	v, _ := readUint64("/gc/heap/live:bytes")
	return v
}

// Scan returns the live heap plus the stacks and globals the collector
// scans: what GOGC/100 multiplies into the room above the live heap.
func Scan() uint64 {
	st, _ := readUint64("/gc/scan/stack:bytes")
	gl, _ := readUint64("/gc/scan/globals:bytes")
	return Live() + st + gl
}

// Goal returns the heap size the runtime aims to collect at.
func Goal() uint64 {
	v, _ := readUint64("/gc/heap/goal:bytes")
	return v
}

func readUint64(name string) (uint64, bool) {
	s := []metrics.Sample{{Name: name}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		return 0, false
	}
	return s[0].Value.Uint64(), true
}
