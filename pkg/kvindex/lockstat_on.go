//go:build kvindex_lockstat

package kvindex

import (
	"fmt"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// lockStat measures, inside the critical section, how long writers hold
// the query lock: wall time and the holding thread's CPU time. The CPU
// time excludes moments the OS ran another thread and stop-the-world GC
// pauses, so comparing the two tells a long hold from a noisy machine. A
// measuring build only (go test -tags kvindex_lockstat): the clock reads
// cost about a microsecond per hold.
type lockStat struct {
	t0, c0      time.Duration
	wall, cpu   time.Duration
	holds       int64
	epoch       time.Time
	initialized bool
	pc, maxPC   uintptr // caller of lockQ: current hold, longest (CPU) hold
	over1ms     int64   // holds of more than 1 ms thread CPU time
	samples     []time.Duration
}

func threadCPUTime() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts); err != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}

func (s *service) lockQ() {
	s.mu.Lock()
	if !s.ls.initialized {
		s.ls.epoch, s.ls.initialized = time.Now(), true
	}
	s.ls.pc, _, _, _ = runtime.Caller(1)
	s.ls.t0, s.ls.c0 = time.Since(s.ls.epoch), threadCPUTime()
}

func (s *service) unlockQ() {
	w, c := time.Since(s.ls.epoch)-s.ls.t0, threadCPUTime()-s.ls.c0
	if c > s.ls.cpu {
		s.ls.maxPC = s.ls.pc
	}
	if c > time.Millisecond {
		s.ls.over1ms++
	}
	if s.ls.samples == nil {
		s.ls.samples = make([]time.Duration, 0, 1<<21)
	}
	if len(s.ls.samples) < cap(s.ls.samples) {
		s.ls.samples = append(s.ls.samples, c)
	}
	s.ls.wall, s.ls.cpu = max(s.ls.wall, w), max(s.ls.cpu, c)
	s.ls.holds++
	s.mu.Unlock()
}

func (s *service) lockHolds() (wall, cpu time.Duration, holds, over1ms int64, ok bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.ls.wall, s.ls.cpu, s.ls.holds, s.ls.over1ms, true
}

// longestHoldSite names the function that took the lock for the longest
// (CPU) hold.
func (s *service) longestHoldSite() string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	f := runtime.FuncForPC(s.ls.maxPC)
	if f == nil {
		return ""
	}
	file, line := f.FileLine(s.ls.maxPC)
	return fmt.Sprintf("%s (%s:%d)", f.Name(), file, line)
}

// holdCPUSamples returns a copy of the thread CPU time of every hold (the
// first two million).
func (s *service) holdCPUSamples() []time.Duration {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return append([]time.Duration(nil), s.ls.samples...)
}
