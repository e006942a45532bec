// Package wait is the tests' one way to wait for something other goroutines
// make true: poll the condition with a short backoff instead of sleeping a
// fixed time, so a test waits as long as the machine needs and no longer.
// The deadline only ends a broken test; nothing asserts on timing, as the
// machines tests run on are shared and slow.
package wait

import (
	"testing"
	"time"
)

// Timeout bounds one wait.
const Timeout = 30 * time.Second

// now is the clock; tests of this package move it.
var now = time.Now

// Eventually returns once cond holds, polling it every few milliseconds
// (backing off to 50 ms), and fails the test naming what it waited for
// when it still does not hold after Timeout.
func Eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := now().Add(Timeout)
	pause := time.Millisecond
	for !cond() {
		if now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", Timeout, what)
		}
		time.Sleep(pause)
		pause = min(2*pause, 50*time.Millisecond)
	}
}
