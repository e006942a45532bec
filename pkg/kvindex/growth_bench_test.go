package kvindex

import (
	"math/bits"
	"os"
	"runtime"
	"runtime/debug"
	rtmetrics "runtime/metrics"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// latHist is a log-linear latency histogram: 64 sub-buckets per power of
// two of nanoseconds (under 1.6% error), so a multi-million-sample run
// needs no sample buffer.
type latHist struct {
	counts [64 * 64]uint64
	n      uint64
	max    time.Duration
}

func (h *latHist) add(d time.Duration) {
	v := uint64(max(d, 0))
	h.n++
	h.max = max(h.max, d)
	h.counts[latBucket(v)]++
}

func latBucket(v uint64) int {
	if v < 64 {
		return int(v)
	}
	b := bits.Len64(v) // 7..64
	return (b-6)*64 + int((v>>(b-7))&63)
}

// latValue is the lower bound of bucket i.
func latValue(i int) time.Duration {
	if i < 64 {
		return time.Duration(i)
	}
	b := i/64 + 6
	return time.Duration((uint64(64) | uint64(i%64)) << (b - 7))
}

func (h *latHist) quantile(q float64) time.Duration {
	want := uint64(q * float64(h.n))
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if c > 0 && seen > want {
			return latValue(i)
		}
	}
	return h.max
}

func threadCPU() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts); err != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}

// maxGCPause reads the largest stop-the-world pause the runtime recorded
// (GC pauses are not lock holds, but they delay every goroutine alike, so
// they are reported next to the lock figures to tell the two apart).
func maxGCPause() time.Duration {
	s := []rtmetrics.Sample{{Name: "/sched/pauses/total/gc:seconds"}}
	rtmetrics.Read(s)
	if s[0].Value.Kind() != rtmetrics.KindFloat64Histogram {
		return 0
	}
	h := s[0].Value.Float64Histogram()
	for i := len(h.Counts) - 1; i >= 0; i-- {
		if h.Counts[i] > 0 {
			return time.Duration(h.Buckets[i+1] * 1e9)
		}
	}
	return 0
}

// BenchmarkGrowthFill fills one endpoint of one service to
// KVINDEX_GROWTH_KEYS keys (default 10M) in BlockStored-sized batches of
// KVINDEX_GROWTH_BATCH keys (default 64), alternating between data-parallel
// ranks 0 and 1 (so the endpoint's rank table grows to half the keys),
// while another goroutine runs lookups of a 32-block request that both
// ranks hold: PrefixMatch, or with KVINDEX_GROWTH_READ=rank
// RankPrefixMatch (the second lookup of a rank-targeted routing decision).
// One kind per run: a reader alternating both would, where one kind waits
// for the writer lock, keep the writer out while it runs the other. With
// KVINDEX_GROWTH_GAP_US=n the reader sleeps a random 0..n µs between
// lookups, so lookups arrive at times unrelated to the writer's, as
// routing decisions do: a back-to-back reader is delayed at most once per
// hold, so its percentiles depend on how many holds there are rather than
// how long they last. It reports:
//
//   - worst-store-ms: the longest single Store call of ≤128 keys (one
//     critical section, plus whatever the writer does outside it);
//   - worst-store-cpu-ms: the thread CPU time of that kind of call, which
//     excludes time the OS ran something else and GC stop-the-world time;
//   - pm-p50/p99/p999-ns and pm-max-ms: PrefixMatch latency during the fill,
//     what a routing decision waits for (the reader-visible lock hold);
//     rpm-... instead when the reader runs RankPrefixMatch;
//   - gc-max-pause-ms: the largest GC stop-the-world pause of the run;
//   - floor-max-ms and floor-max-cpu-ms: the noise floor, the longest time
//     a fixed piece of work the size of one Store took on this machine
//     during the run (see below);
//   - hold-max-ms and hold-max-cpu-ms, with -tags kvindex_lockstat only:
//     the longest write hold of the query lock measured inside the
//     critical section, in wall and thread CPU time; hold-quiet-max-cpu-ms
//     and holds-quiet-over-1ms the same over holds during which the
//     holder was not switched out involuntarily (on a virtual machine a
//     hold that lost its CPU to the host still counts that time as CPU
//     time, and is then usually preempted at the guest's next tick);
//     hold-faults, the page faults taken under the lock.
//
// Run with -benchtime=1x; each run is one fill.
func BenchmarkGrowthFill(b *testing.B) {
	total := 10_000_000
	if v, err := strconv.Atoi(os.Getenv("KVINDEX_GROWTH_KEYS")); err == nil && v > 0 {
		total = v
	}
	batchLen := 64
	if v, err := strconv.Atoi(os.Getenv("KVINDEX_GROWTH_BATCH")); err == nil && v > 0 {
		batchLen = v
	}
	rankReader := os.Getenv("KVINDEX_GROWTH_READ") == "rank"
	gap, _ := strconv.Atoi(os.Getenv("KVINDEX_GROWTH_GAP_US"))
	lat := "pm-"
	if rankReader {
		lat = "rpm-"
	}
	for b.Loop() {
		runtime.GC()
		debug.FreeOSMemory()
		ix, _ := newIndex(b, Config{MaxBlocksPerEndpoint: 2 * total})
		req := make([]uint64, 32)
		for i := range req {
			req[i] = splitmix(uint64(i) + 1<<62)
		}
		ix.Store(1, 0, 0, req)
		ix.Store(1, 0, 1, req)
		var stop atomic.Bool
		var wg sync.WaitGroup
		var h latHist
		wg.Add(1)
		go func() {
			defer wg.Done()
			out := make([]int, 2)
			eps := []int{0, 1}
			want := [2]int{len(req), 0}
			if rankReader {
				want[1] = len(req)
			}
			rng := uint64(1)
			for !stop.Load() {
				if gap > 0 {
					rng = splitmix(rng)
					time.Sleep(time.Duration(rng%uint64(gap)) * time.Microsecond)
				}
				t0 := time.Now()
				if rankReader {
					ix.RankPrefixMatch(1, 0, req, out)
				} else {
					ix.PrefixMatch(1, req, eps, out)
				}
				h.add(time.Since(t0))
				if [2]int(out) != want {
					panic("prefix lost during growth")
				}
			}
		}()
		// The noise floor: a goroutine locked to its own thread repeats a
		// fixed piece of work the size of one 64-key Store (256 dependent
		// random reads of a 128 MiB array) and records its longest wall
		// and thread CPU time. On a shared or virtualised machine the CPU
		// clock also counts time the host took the virtual CPU away, so a
		// hold is only as long as it exceeds this floor.
		var floorWall, floorCPU time.Duration
		floorSamples := make([]time.Duration, 0, 1<<20)
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			arr := make([]uint64, 16<<20)
			for i := range arr {
				arr[i] = splitmix(uint64(i))
			}
			x := uint64(1)
			for !stop.Load() {
				c0, t0 := threadCPU(), time.Now()
				for j := 0; j < 256; j++ {
					x = arr[(x^uint64(j))&(16<<20-1)]
				}
				c := threadCPU() - c0
				floorWall, floorCPU = max(floorWall, time.Since(t0)), max(floorCPU, c)
				if len(floorSamples) < cap(floorSamples) {
					floorSamples = append(floorSamples, c)
				}
				time.Sleep(100 * time.Microsecond)
			}
			arr[0] = x
		}()
		runtime.LockOSThread()
		var worstWall, worstCPU time.Duration
		batch := make([]uint64, batchLen)
		for n := 0; n < total; n += len(batch) {
			for i := range batch {
				batch[i] = splitmix(uint64(n + i))
			}
			c0, t0 := threadCPU(), time.Now()
			ix.Store(1, 0, n/len(batch)%2, batch)
			wall, cpu := time.Since(t0), threadCPU()-c0
			worstWall = max(worstWall, wall)
			worstCPU = max(worstCPU, cpu)
		}
		runtime.UnlockOSThread()
		stop.Store(true)
		wg.Wait()
		if got := ix.Len(1, 0); got < total {
			b.Fatalf("Len = %d, want ≥ %d", got, total)
		}
		if hs, ok := ix.lookup(1).lockHolds(); ok {
			b.ReportMetric(float64(hs.wall)/1e6, "hold-max-ms")
			b.ReportMetric(float64(hs.cpu)/1e6, "hold-max-cpu-ms")
			b.ReportMetric(float64(hs.holds), "holds")
			b.ReportMetric(float64(hs.over1ms), "holds-over-1ms-cpu")
			b.ReportMetric(float64(hs.quietCPU)/1e6, "hold-quiet-max-cpu-ms")
			b.ReportMetric(float64(hs.quietOver1ms), "holds-quiet-over-1ms")
			b.ReportMetric(float64(hs.faults), "hold-faults")
			longest, quiet := ix.lookup(1).longestHoldSite()
			b.Logf("longest hold taken in %s; longest quiet hold in %s", longest, quiet)
			hs := ix.lookup(1).holdCPUSamples()
			slices.Sort(hs)
			slices.Sort(floorSamples)
			q := func(v []time.Duration, f float64) float64 {
				if len(v) == 0 {
					return 0
				}
				return float64(v[int(f*float64(len(v)-1))]) / 1e3
			}
			b.ReportMetric(q(hs, 0.5), "hold-cpu-p50-us")
			b.ReportMetric(q(hs, 0.99), "hold-cpu-p99-us")
			b.ReportMetric(q(hs, 0.999), "hold-cpu-p999-us")
			b.ReportMetric(q(hs, 0.9999), "hold-cpu-p9999-us")
			b.ReportMetric(q(floorSamples, 0.5), "floor-cpu-p50-us")
			b.ReportMetric(q(floorSamples, 0.999), "floor-cpu-p999-us")
			b.ReportMetric(q(floorSamples, 0.9999), "floor-cpu-p9999-us")
		}
		b.ReportMetric(float64(floorWall)/1e6, "floor-max-ms")
		b.ReportMetric(float64(floorCPU)/1e6, "floor-max-cpu-ms")
		b.ReportMetric(float64(worstWall)/1e6, "worst-store-ms")
		b.ReportMetric(float64(worstCPU)/1e6, "worst-store-cpu-ms")
		b.ReportMetric(float64(h.quantile(0.5)), lat+"p50-ns")
		b.ReportMetric(float64(h.quantile(0.99)), lat+"p99-ns")
		b.ReportMetric(float64(h.quantile(0.999)), lat+"p999-ns")
		b.ReportMetric(float64(h.max)/1e6, lat+"max-ms")
		b.ReportMetric(float64(h.n), lat+"lookups")
		b.ReportMetric(float64(maxGCPause())/1e6, "gc-max-pause-ms")
	}
}

func splitmix(x uint64) uint64 {
	x += 0x9E3779B97F4A7C15
	x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
	x = (x ^ (x >> 27)) * 0x94D049BB133111EB
	return x ^ (x >> 31)
}
