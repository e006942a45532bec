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

// holdStats summarises query-lock holds (kvindex_lockstat builds).
type holdStats struct {
	wall, cpu    time.Duration
	holds        int64
	over1ms      int64
	quietCPU     time.Duration
	quietOver1ms int64
	faults       int64
}

// lockHolds reports the longest write holds of the query lock and their
// counts; ok is false in normal builds.
func (s *service) lockHolds() (h holdStats, ok bool) { return h, false }

// longestHoldSite is empty in normal builds.
func (s *service) longestHoldSite() (longest, quiet string) { return "", "" }

// holdCPUSamples is nil in normal builds.
func (s *service) holdCPUSamples() []time.Duration { return nil }
