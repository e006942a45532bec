package wait

import (
	"sync/atomic"
	"testing"
	"time"
)

// TestEventuallyReturnsOnceTrue: the wait ends as soon as another
// goroutine makes the condition hold.
func TestEventuallyReturnsOnceTrue(t *testing.T) {
	var n atomic.Int32
	go func() {
		for i := 0; i < 3; i++ {
			n.Add(1)
		}
	}()
	calls := 0
	Eventually(t, "three increments", func() bool { calls++; return n.Load() == 3 })
	if calls == 0 {
		t.Fatal("condition never evaluated")
	}
}

// fatalRecorder records Fatalf instead of stopping the test.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (f *fatalRecorder) Helper() {}
func (f *fatalRecorder) Fatalf(format string, args ...any) {
	f.msg = format
	panic(f)
}

// TestEventuallyFailsNamingTheWait: a condition that never holds fails the
// test, naming what was awaited.
func TestEventuallyFailsNamingTheWait(t *testing.T) {
	rec := &fatalRecorder{TB: t}
	defer func() {
		if r := recover(); r != rec || rec.msg == "" {
			t.Fatalf("no failure recorded: %v", r)
		}
	}()
	// The clock jumps past the deadline after the wait began.
	old, calls := now, 0
	now = func() time.Time {
		calls++
		if calls > 1 {
			return old().Add(2 * Timeout)
		}
		return old()
	}
	defer func() { now = old }()
	Eventually(rec, "never", func() bool { return false })
}
