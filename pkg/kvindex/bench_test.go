package kvindex

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"
	"time"
)

// BenchmarkApply measures Store/Remove throughput on one goroutine in block
// events per second (one key stored or removed = one block event), against
// an endpoint holding 100k blocks in steady state: every op stores a batch
// of new blocks and removes the same number of old ones.
func BenchmarkApply(b *testing.B) {
	for _, batch := range []int{1, 16} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			ix, _ := newIndex(b, Config{})
			const resident = 100_000
			r := rand.New(rand.NewPCG(1, 2))
			keys := make([]uint64, resident+batch*4096)
			for i := range keys {
				keys[i] = r.Uint64()
			}
			ix.Store(1, 0, 0, keys[:resident])
			head, tail := 0, resident
			for b.Loop() {
				if tail+batch > len(keys) {
					// Wrap: reuse the key stream (the removed keys are gone).
					b.StopTimer()
					ix.ClearEndpoint(1, 0)
					ix.Store(1, 0, 0, keys[:resident])
					head, tail = 0, resident
					b.StartTimer()
				}
				ix.Store(1, 0, 0, keys[tail:tail+batch])
				ix.Remove(1, 0, 0, keys[head:head+batch])
				head += batch
				tail += batch
			}
			b.ReportMetric(float64(2*batch*b.N)/b.Elapsed().Seconds(), "block-events/s")
		})
	}
}

// prefixFixture builds one service with eps endpoints holding perEP blocks
// each. Endpoint i holds the first depth(i) blocks of the request and random
// blocks for the rest.
func prefixFixture(b *testing.B, eps, perEP, reqBlocks int, depth func(i int) int) (*Index, []uint64, []int) {
	ix, _ := newIndex(b, Config{})
	r := rand.New(rand.NewPCG(3, 4))
	req := make([]uint64, reqBlocks)
	for i := range req {
		req[i] = r.Uint64()
	}
	cands := make([]int, eps)
	buf := make([]uint64, 0, perEP)
	for ep := 0; ep < eps; ep++ {
		cands[ep] = ep
		d := depth(ep)
		buf = append(buf[:0], req[:d]...)
		for len(buf) < perEP {
			buf = append(buf, r.Uint64())
		}
		ix.Store(1, ep, 0, buf)
	}
	return ix, req, cands
}

// BenchmarkPrefixMatch queries a 256-block request against 64 endpoints
// holding 100k blocks each and reports the median and 99th percentile of
// single-call latency.
func BenchmarkPrefixMatch(b *testing.B) {
	scenarios := []struct {
		name  string
		depth func(i int) int
	}{
		// Endpoint i holds the first 4*(i+1) blocks; the last holds them all.
		{"staggered", func(i int) int { return 4 * (i + 1) }},
		// Worst case: every endpoint holds the whole request, so no
		// candidate drops out early.
		{"all-full", func(int) int { return 256 }},
		// Cold request: nobody holds block 0.
		{"cold", func(int) int { return 0 }},
	}
	for _, sc := range scenarios {
		b.Run(sc.name, func(b *testing.B) {
			ix, req, cands := prefixFixture(b, 64, 100_000, 256, sc.depth)
			out := make([]int, len(cands))
			ix.PrefixMatch(1, req, cands, out)
			for i, ep := range cands {
				if out[i] != sc.depth(ep) {
					b.Fatalf("ep %d depth %d, want %d", ep, out[i], sc.depth(ep))
				}
			}
			lat := make([]time.Duration, 0, 1<<20)
			for b.Loop() {
				t0 := time.Now()
				ix.PrefixMatch(1, req, cands, out)
				lat = append(lat, time.Since(t0))
			}
			b.StopTimer()
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns")
			b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "p99-ns")
		})
	}
}

// heapInUse returns live heap bytes after a full collection.
func heapInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// BenchmarkBytesPerBlock reports heap bytes per inventoried block for a few
// inventory shapes (distinct blocks per endpoint: the worst case, since
// shared prefixes share table slots).
func BenchmarkBytesPerBlock(b *testing.B) {
	for _, shape := range []struct{ eps, perEP int }{{1, 1_000_000}, {10, 100_000}, {64, 100_000}} {
		b.Run(fmt.Sprintf("eps=%d/blocks=%d", shape.eps, shape.perEP), func(b *testing.B) {
			var per float64
			for b.Loop() {
				per = bytesPerBlock(b, shape.eps, shape.perEP)
			}
			b.ReportMetric(per, "bytes/block")
		})
	}
}

func bytesPerBlock(t testing.TB, eps, perEP int) float64 {
	r := rand.New(rand.NewPCG(5, 6))
	keys := make([]uint64, 4096)
	before := heapInUse()
	ix, err := New(Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for ep := 0; ep < eps; ep++ {
		// Arrive in event-sized batches, as from the ingester.
		for n := 0; n < perEP; n += len(keys) {
			batch := keys[:min(len(keys), perEP-n)]
			for i := range batch {
				batch[i] = r.Uint64()
			}
			ix.Store(1, ep, 0, batch)
		}
	}
	after := heapInUse()
	runtime.KeepAlive(ix)
	return float64(after-before) / float64(eps*perEP)
}

// TestBytesPerBlockSanity guards against a gross memory regression without
// asserting a tight figure (allocator and GC details vary).
func TestBytesPerBlockSanity(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates ~10 MB")
	}
	per := bytesPerBlock(t, 2, 100_000)
	t.Logf("%.1f bytes per block", per)
	if per > 128 {
		t.Fatalf("%.1f bytes per block", per)
	}
}

// BenchmarkClearEndpoint measures a publisher reset of one endpoint in a
// service of 64 endpoints holding 100k blocks each (the bulk clear walks the
// whole service table under the service's write lock).
func BenchmarkClearEndpoint(b *testing.B) {
	ix, _, _ := prefixFixture(b, 64, 100_000, 256, func(int) int { return 0 })
	r := rand.New(rand.NewPCG(8, 9))
	refill := make([]uint64, 100_000)
	for b.Loop() {
		b.StopTimer()
		for i := range refill {
			refill[i] = r.Uint64()
		}
		ix.Store(1, 5, 0, refill)
		b.StartTimer()
		ix.ClearEndpoint(1, 5)
	}
}
