package gcfloor

import (
	"runtime"
	"testing"

	"github.com/loxilb-llm/loxilb/testbed/wait"
)

func TestPercent(t *testing.T) {
	const mib = 1 << 20
	for _, c := range []struct {
		scan, floor uint64
		want        int
	}{
		{6 * mib, 64 * mib, 1067},    // a small proxy-only heap: the goal is live+64 MiB
		{64 * mib, 64 * mib, 100},    // the floor equals the default's growth
		{1 << 30, 64 * mib, 100},     // a large heap keeps Go's default
		{0, 64 * mib, 1600},          // before the first cycle: minLive assumed
		{minLive / 2, 8 * mib, 200},  // below minLive counts as minLive
		{6 * mib, 0, DefaultPercent}, // no floor
	} {
		if got := Percent(c.scan, c.floor); got != c.want {
			t.Errorf("Percent(%d, %d) = %d, want %d", c.scan, c.floor, got, c.want)
		}
		// The room the percentage gives is at least floor.
		scan := max(c.scan, minLive)
		if room := scan * uint64(Percent(c.scan, c.floor)) / 100; room < c.floor {
			t.Errorf("scan %d floor %d: room %d under floor", c.scan, c.floor, room)
		}
	}
}

// TestPacerFollowsLiveHeap runs the pacer in this process: after a GC
// cycle the percentage is the one Percent gives for the live heap, a
// grown live heap lowers it, and Stop restores the setting from before.
func TestPacerFollowsLiveHeap(t *testing.T) {
	before := GOGC()
	const floor = 256 << 20
	p := Start(floor)
	defer p.Stop()
	runtime.GC()
	wait.Eventually(t, "the pacer to raise GOGC after a cycle", func() bool {
		return GOGC() > 1000 && p.Current() == GOGC()
	})
	small := GOGC()
	// The runtime's goal is now about floor above the live heap: not
	// floor times anything (its minimum heap scales with GOGC), and at
	// most an eighth off (the pacer's hysteresis).
	runtime.GC()
	if goal, live := Goal(), Live(); goal > live+floor+floor/8 || goal < live+floor-floor/8 {
		t.Errorf("heap goal %d MiB with %d MiB live, want about live + %d MiB", goal>>20, live>>20, floor>>20)
	}

	// 128 MiB more live heap: the floor needs a smaller percentage.
	hold := make([][]byte, 128)
	for i := range hold {
		hold[i] = make([]byte, 1<<20)
	}
	runtime.GC()
	wait.Eventually(t, "the pacer to lower GOGC for a larger live heap", func() bool {
		runtime.GC()
		return GOGC() < small
	})
	if got, want := GOGC(), Percent(Scan(), floor); got > want+want/8 || got < want-want/8 {
		t.Errorf("GOGC %d with %d bytes to scan, want about %d", got, Scan(), want)
	}
	runtime.KeepAlive(hold)

	p.Stop()
	if got := GOGC(); got != before {
		t.Fatalf("after Stop GOGC is %d, want %d as before Start", got, before)
	}
	runtime.GC()
	runtime.GC()
	if got := GOGC(); got != before {
		t.Fatalf("a cycle after Stop set GOGC to %d", got)
	}
}

func TestZeroFloorChangesNothing(t *testing.T) {
	before := GOGC()
	p := Start(0)
	runtime.GC()
	if got := GOGC(); got != before {
		t.Fatalf("GOGC %d with no floor, want %d", got, before)
	}
	p.Stop()
	if got := GOGC(); got != before {
		t.Fatalf("GOGC %d after Stop, want %d", got, before)
	}
}
