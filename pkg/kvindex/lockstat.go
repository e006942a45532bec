//go:build !kvindex_lockstat

package kvindex

import "time"

// lockStat is empty in normal builds; kvindex_lockstat builds measure how
// long writers hold the query lock (see lockstat_on.go).
type lockStat struct{}

// lockQ takes the query lock for writing.
func (s *service) lockQ() { s.mu.Lock() }

// unlockQ releases the query lock taken by lockQ.
func (s *service) unlockQ() { s.mu.Unlock() }

// lockHolds reports the longest write hold of the query lock (wall and
// thread CPU time), the number of holds and of holds over 1 ms of CPU
// time; ok is false in normal builds.
func (s *service) lockHolds() (wall, cpu time.Duration, holds, over1ms int64, ok bool) {
	return 0, 0, 0, 0, false
}

// longestHoldSite is empty in normal builds.
func (s *service) longestHoldSite() string { return "" }

// holdCPUSamples is nil in normal builds.
func (s *service) holdCPUSamples() []time.Duration { return nil }
