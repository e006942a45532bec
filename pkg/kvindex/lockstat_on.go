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
// pauses, so comparing the two tells a long hold from a noisy machine.
// On a virtual machine it does include time the host took the virtual CPU
// away; the guest then usually preempts the thread at its next tick, so
// holds during which the thread was switched out involuntarily are also
// reported apart ("quiet" holds are those without), with the page faults
// taken under the lock. A measuring build only (go test -tags
// kvindex_lockstat): the clock and rusage reads cost a few microseconds
// per hold.
type lockStat struct {
	t0, c0      time.Duration
	wall, cpu   time.Duration
	holds       int64
	epoch       time.Time
	initialized bool
	pc, maxPC   uintptr // caller of lockQ: current hold, longest (CPU) hold
	over1ms     int64   // holds of more than 1 ms thread CPU time
	samples     []time.Duration

	ru0          unix.Rusage // at lockQ
	quietCPU     time.Duration
	quietOver1ms int64
	quietPC      uintptr
	faults       int64 // minor and major page faults taken under the lock
}

// holdStats summarises the query-lock holds of one service.
type holdStats struct {
	wall, cpu    time.Duration // longest hold, wall and thread CPU
	holds        int64
	over1ms      int64         // holds over 1 ms of thread CPU
	quietCPU     time.Duration // longest hold without an involuntary switch
	quietOver1ms int64
	faults       int64
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
	_ = unix.Getrusage(unix.RUSAGE_THREAD, &s.ls.ru0)
	s.ls.t0, s.ls.c0 = time.Since(s.ls.epoch), threadCPUTime()
}

func (s *service) unlockQ() {
	w, c := time.Since(s.ls.epoch)-s.ls.t0, threadCPUTime()-s.ls.c0
	var ru unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_THREAD, &ru)
	s.ls.faults += ru.Minflt - s.ls.ru0.Minflt + ru.Majflt - s.ls.ru0.Majflt
	if ru.Nivcsw == s.ls.ru0.Nivcsw {
		if c > s.ls.quietCPU {
			s.ls.quietCPU, s.ls.quietPC = c, s.ls.pc
		}
		if c > time.Millisecond {
			s.ls.quietOver1ms++
		}
	}
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

func (s *service) lockHolds() (holdStats, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return holdStats{
		wall: s.ls.wall, cpu: s.ls.cpu, holds: s.ls.holds, over1ms: s.ls.over1ms,
		quietCPU: s.ls.quietCPU, quietOver1ms: s.ls.quietOver1ms, faults: s.ls.faults,
	}, true
}

// longestHoldSite names the functions that took the lock for the longest
// (CPU) hold and for the longest quiet one.
func (s *service) longestHoldSite() (longest, quiet string) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return funcLine(s.ls.maxPC), funcLine(s.ls.quietPC)
}

func funcLine(pc uintptr) string {
	f := runtime.FuncForPC(pc)
	if f == nil {
		return ""
	}
	file, line := f.FileLine(pc)
	return fmt.Sprintf("%s (%s:%d)", f.Name(), file, line)
}

// holdCPUSamples returns a copy of the thread CPU time of every hold (the
// first two million).
func (s *service) holdCPUSamples() []time.Duration {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return append([]time.Duration(nil), s.ls.samples...)
}
