package hostile

import "testing"

// TestDaemonBaseline records the idle daemon's footprint, the reference
// the attacks' memory bounds are set against, with the default heap floor
// (the attacks run without it: see startDaemon).
func TestDaemonBaseline(t *testing.T) {
	d := startDaemon(t, nil, "--gc-heap-floor", "67108864")
	requireAlive(t, d)
	requireRSSBelow(t, d, 200)
	if v := metricSum(t, d, "go_goroutines"); v <= 0 {
		t.Fatalf("go_goroutines = %v, want > 0", v)
	}
	t.Logf("idle daemon RSS %d KiB", rssKiB(t, d.PID()))
}
