package kvindex

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// fakeClock is a manually advanced clock.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func newSpecIndex(t *testing.T, cfg Config) (*Index, *fakeClock) {
	t.Helper()
	clk := &fakeClock{t: time.Unix(1_800_000_000, 0)}
	cfg.Now = clk.Now
	ix, _ := newIndex(t, cfg)
	return ix, clk
}

func TestSpeculativeCountsInMatchOnly(t *testing.T) {
	ix, clk := newSpecIndex(t, Config{})
	ix.Store(1, 0, 0, seq(0, 2))
	ix.StoreSpeculative(1, 0, seq(0, 6), 5*time.Second) // 0,1 are real: skipped
	ix.StoreSpeculative(1, 1, seq(0, 4), 2*time.Second)
	if got := match(ix, 1, seq(0, 8), 0, 1, 2); got[0] != 6 || got[1] != 4 || got[2] != 0 {
		t.Fatalf("match = %v", got)
	}
	if ix.Len(1, 0) != 2 || ix.Len(1, 1) != 0 {
		t.Fatalf("Len counts speculative: %d %d", ix.Len(1, 0), ix.Len(1, 1))
	}
	if ix.SpeculativeLen(1, 0) != 4 || ix.SpeculativeLen(1, 1) != 4 {
		t.Fatalf("SpeculativeLen = %d %d", ix.SpeculativeLen(1, 0), ix.SpeculativeLen(1, 1))
	}
	if b, n := ix.Snapshot(1, 1, 0); len(b) != 0 || n != 0 {
		t.Fatalf("Snapshot shows speculative: %v %d", b, n)
	}
	if got := testutil.ToFloat64(ix.m.blocks.WithLabelValues("1", "1")); got != 0 {
		t.Fatalf("gauge counts speculative: %v", got)
	}

	// Lazy expiry: ep 1's entries stop counting at their deadline even
	// before any sweep.
	clk.Advance(2 * time.Second)
	if got := match(ix, 1, seq(0, 8), 0, 1); got[0] != 6 || got[1] != 0 {
		t.Fatalf("after 2s match = %v", got)
	}
	if ix.SpeculativeLen(1, 1) != 4 {
		t.Fatal("entries vanished without a sweep")
	}
	ix.Sweep()
	if ix.SpeculativeLen(1, 1) != 0 || ix.SpeculativeLen(1, 0) != 4 {
		t.Fatalf("after sweep: %d %d", ix.SpeculativeLen(1, 1), ix.SpeculativeLen(1, 0))
	}
	clk.Advance(3 * time.Second)
	if got := match(ix, 1, seq(0, 8), 0); got[0] != 2 {
		t.Fatalf("after 5s match = %v", got)
	}
	ix.Sweep()
	if ix.SpeculativeLen(1, 0) != 0 {
		t.Fatal("sweep left expired entries")
	}
	checkInvariants(t, ix)
}

func TestSpeculativeReplacedByReal(t *testing.T) {
	ix, clk := newSpecIndex(t, Config{})
	ix.StoreSpeculative(1, 0, seq(0, 4), time.Second)
	ix.StoreSpeculative(1, 1, seq(0, 4), time.Second)
	ix.Store(1, 0, 0, seq(0, 3)) // the engine published 3 of the 4 blocks
	if ix.SpeculativeLen(1, 0) != 1 || ix.Len(1, 0) != 3 {
		t.Fatalf("spec %d real %d", ix.SpeculativeLen(1, 0), ix.Len(1, 0))
	}
	if ix.SpeculativeLen(1, 1) != 4 {
		t.Fatal("another endpoint's speculative entries were replaced")
	}
	clk.Advance(time.Hour)
	if got := match(ix, 1, seq(0, 4), 0, 1); got[0] != 3 || got[1] != 0 {
		t.Fatalf("match after expiry = %v", got)
	}
	// A key already held stays real when offered speculatively again.
	ix.StoreSpeculative(1, 0, seq(0, 3), time.Second)
	if ix.SpeculativeLen(1, 0) != 1 {
		t.Fatalf("real keys stored speculatively: %d", ix.SpeculativeLen(1, 0))
	}
}

func TestSpeculativeRefreshAndLimits(t *testing.T) {
	ix, clk := newSpecIndex(t, Config{MaxSpeculativePerEndpoint: 3})
	ix.StoreSpeculative(1, 0, seq(0, 2), time.Second)
	clk.Advance(800 * time.Millisecond)
	ix.StoreSpeculative(1, 0, seq(0, 1), time.Second) // refresh key 0 only
	clk.Advance(400 * time.Millisecond)
	if got := match(ix, 1, seq(0, 2), 0); got[0] != 1 {
		t.Fatalf("refresh: match = %v", got)
	}
	// Cap: 2 entries held (one expired), 3 offered. The expired one is
	// swept to make room; one new entry still does not fit.
	ix.StoreSpeculative(1, 0, seq(10, 13), time.Second)
	if got := ix.SpeculativeLen(1, 0); got != 3 {
		t.Fatalf("SpeculativeLen = %d, want 3", got)
	}
	if got := testutil.ToFloat64(ix.m.specDrops.WithLabelValues("1", "0")); got != 1 {
		t.Fatalf("spec drops = %v, want 1", got)
	}
	ix.StoreSpeculative(1, 0, seq(20, 21), 0) // no ttl: nothing
	ix.StoreSpeculative(1, 0, seq(20, 21), -time.Second)
	ix.StoreSpeculative(1, MaxEndpoints, seq(20, 21), time.Second)
	if got := ix.SpeculativeLen(1, 0); got != 3 {
		t.Fatalf("SpeculativeLen = %d after invalid calls", got)
	}
	// A publisher reset forgets speculative entries too.
	ix.ClearEndpoint(1, 0)
	if ix.SpeculativeLen(1, 0) != 0 {
		t.Fatal("ClearEndpoint kept speculative entries")
	}
	ix.StoreSpeculative(1, 0, seq(0, 2), time.Second)
	ix.ClearRank(1, 0, 0)
	if ix.SpeculativeLen(1, 0) != 2 {
		t.Fatal("ClearRank dropped speculative entries")
	}
	ix.DropService(1)
	if ix.SpeculativeLen(1, 0) != 0 {
		t.Fatal("DropService kept speculative entries")
	}
}

func TestRunSweepsAndStops(t *testing.T) {
	clk := &fakeClock{t: time.Unix(0, 0)}
	ix, _ := newIndex(t, Config{Now: clk.Now, SweepInterval: time.Millisecond})
	ix.StoreSpeculative(1, 0, seq(0, 4), time.Second)
	clk.Advance(2 * time.Second)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ix.Run(ctx) }()
	for ix.SpeculativeLen(1, 0) != 0 {
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run = %v", err)
	}
}

func TestPrefixMatchConfirmedIgnoresSpeculative(t *testing.T) {
	ix, err := New(Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ix.Store(1, 0, 0, []uint64{10, 11})
	ix.StoreSpeculative(1, 0, []uint64{10, 11, 12, 13}, time.Minute)
	ix.StoreSpeculative(1, 1, []uint64{10, 11, 12}, time.Minute)
	out := make([]int, 2)
	ix.PrefixMatch(1, []uint64{10, 11, 12, 13}, []int{0, 1}, out)
	if out[0] != 4 || out[1] != 3 {
		t.Fatalf("with speculative entries: %v", out)
	}
	ix.PrefixMatchConfirmed(1, []uint64{10, 11, 12, 13}, []int{0, 1}, out)
	if out[0] != 2 || out[1] != 0 {
		t.Fatalf("confirmed only: %v", out)
	}
}
