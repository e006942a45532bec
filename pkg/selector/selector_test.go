package selector

import (
	"errors"
	"fmt"
	"math"
	"net/netip"
	"sync"
	"testing"
	"time"
)

func cands(n int) []Candidate {
	c := make([]Candidate, n)
	for i := range c {
		c[i] = Candidate{Idx: i, Weight: 1, Healthy: true}
	}
	return c
}

func mustNew(t testing.TB, sel int, o Options) Selector {
	t.Helper()
	s, err := New(sel, o)
	if err != nil {
		t.Fatalf("New(%d): %v", sel, err)
	}
	return s
}

func key(i int) Request { return Request{Key: fmt.Appendf(nil, "model/prompt-%d", i)} }

func TestNewErrors(t *testing.T) {
	for _, tc := range []struct {
		sel  int
		o    Options
		want error
	}{
		{SelN2, Options{}, ErrNotApplicable},
		{SelN3, Options{}, ErrNotApplicable},
		{7, Options{}, ErrUnknownSelector},
		{11, Options{}, ErrUnknownSelector},
		{-1, Options{}, ErrUnknownSelector},
		{SelCHWBL, Options{MeanLoadFactor: 99}, ErrInvalidOptions},
		{SelCHWBL, Options{VirtualNodes: 5000}, ErrInvalidOptions},
		{SelPersist, Options{PersistTimeout: -time.Second}, ErrInvalidOptions},
	} {
		_, err := New(tc.sel, tc.o)
		if !errors.Is(err, tc.want) {
			t.Errorf("New(%d, %+v) = %v, want %v", tc.sel, tc.o, err, tc.want)
		}
	}
	for _, sel := range []int{0, 1, 2, 3, 4, 8, 9, 10} {
		if _, err := New(sel, Options{}); err != nil {
			t.Errorf("New(%d): %v", sel, err)
		}
		if Name(sel) == "" {
			t.Errorf("Name(%d) empty", sel)
		}
	}
}

func TestNoHealthy(t *testing.T) {
	c := cands(3)
	for i := range c {
		c[i].Healthy = false
	}
	for _, sel := range []int{0, 1, 2, 3, 4, 8, 9, 10} {
		s := mustNew(t, sel, Options{})
		req := key(1)
		req.ClientIP = netip.MustParseAddr("127.0.0.1")
		if idx, ok := s.Pick(req, c); ok {
			t.Errorf("sel %d picked %d with no healthy candidate", sel, idx)
		}
		if _, ok := s.Pick(req, nil); ok {
			t.Errorf("sel %d picked from empty slice", sel)
		}
	}
}

// Every selector must skip unhealthy endpoints and only return Idx values.
func TestUnhealthyNeverPicked(t *testing.T) {
	for _, sel := range []int{0, 1, 2, 3, 4, 8, 9, 10} {
		s := mustNew(t, sel, Options{})
		c := cands(4)
		for i := range c {
			c[i].Idx = 10 + i
		}
		c[2].Healthy = false
		for i := 0; i < 2000; i++ {
			req := key(i)
			req.ClientIP = netip.AddrFrom4([4]byte{127, 0, byte(i >> 8), byte(i)})
			idx, ok := s.Pick(req, c)
			if !ok || idx == 12 || idx < 10 || idx > 13 {
				t.Fatalf("sel %d: pick %d ok=%v", sel, idx, ok)
			}
		}
	}
}

func TestRoundRobinExactlyEven(t *testing.T) {
	s := mustNew(t, SelRR, Options{})
	c := cands(4)
	c[1].Healthy = false
	got := map[int]int{}
	for i := 0; i < 3000; i++ {
		idx, _ := s.Pick(Request{}, c)
		got[idx]++
	}
	want := map[int]int{0: 1000, 2: 1000, 3: 1000}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("rr distribution %v, want %v", got, want)
	}
}

func TestHashStableAndSpread(t *testing.T) {
	s := mustNew(t, SelHash, Options{})
	c := cands(5)
	const n = 20000
	before := make([]int, n)
	counts := map[int]int{}
	for i := 0; i < n; i++ {
		before[i], _ = s.Pick(key(i), c)
		counts[before[i]]++
		if again, _ := s.Pick(key(i), c); again != before[i] {
			t.Fatalf("hash not deterministic for key %d", i)
		}
	}
	for idx, k := range counts {
		if math.Abs(float64(k)-n/5) > 0.1*n/5 {
			t.Errorf("hash ep %d got %d of %d (want ~%d)", idx, k, n, n/5)
		}
	}
	// Removing endpoint 3 only remaps the keys it owned.
	c[3].Healthy = false
	for i := 0; i < n; i++ {
		after, _ := s.Pick(key(i), c)
		if before[i] != 3 && after != before[i] {
			t.Fatalf("key %d moved %d -> %d although its endpoint stayed", i, before[i], after)
		}
	}
	// No key and no client address: falls back to round robin.
	got := map[int]int{}
	c[3].Healthy = true
	for i := 0; i < 50; i++ {
		idx, _ := s.Pick(Request{}, c)
		got[idx]++
	}
	if len(got) != 5 || got[0] != 10 {
		t.Errorf("keyless hash should round robin: %v", got)
	}
}

func TestPriorityWeights(t *testing.T) {
	s := mustNew(t, SelPriority, Options{})
	c := cands(4)
	c[0].Weight, c[1].Weight, c[2].Weight, c[3].Weight = 50, 30, 20, 0
	got := map[int]int{}
	window := map[int]int{}
	for i := 0; i < 1000; i++ {
		idx, ok := s.Pick(Request{}, c)
		if !ok {
			t.Fatal("no pick")
		}
		got[idx]++
		if i < 100 {
			window[idx]++
		}
	}
	if got[0] != 500 || got[1] != 300 || got[2] != 200 || got[3] != 0 {
		t.Fatalf("priority distribution %v, want 500/300/200/0", got)
	}
	if window[0] != 50 || window[1] != 30 || window[2] != 20 {
		t.Fatalf("smooth WRR not exact over one period: %v", window)
	}
	// Weight-0 endpoint is a backup: used only when all weighted ones are down.
	c[0].Healthy, c[1].Healthy, c[2].Healthy = false, false, false
	if idx, ok := s.Pick(Request{}, c); !ok || idx != 3 {
		t.Fatalf("backup not used: %d %v", idx, ok)
	}
}

func TestPersistSticky(t *testing.T) {
	now := time.Unix(1000, 0)
	clock := func() time.Time { return now }
	s := mustNew(t, SelPersist, Options{PersistTimeout: time.Minute, Now: clock, PersistMaxClients: 64}).(*persist)
	c := cands(4)
	ip := netip.MustParseAddr("127.0.0.7")
	first, _ := s.Pick(Request{ClientIP: ip}, c)
	for i := 0; i < 100; i++ {
		now = now.Add(30 * time.Second) // sliding: each use refreshes
		if idx, _ := s.Pick(Request{ClientIP: ip, Key: key(i).Key}, c); idx != first {
			t.Fatalf("persist moved client %d -> %d", first, idx)
		}
	}
	// Endpoint goes down: client moves and sticks to the new one.
	c[first].Healthy = false
	moved, _ := s.Pick(Request{ClientIP: ip}, c)
	if moved == first {
		t.Fatal("persist kept an unhealthy endpoint")
	}
	c[first].Healthy = true
	if idx, _ := s.Pick(Request{ClientIP: ip}, c); idx != moved {
		t.Fatalf("persist did not stick to %d after failover, got %d", moved, idx)
	}
	// After the timeout of silence the binding expires and the client is
	// placed by hash again, i.e. back on its original endpoint.
	now = now.Add(2 * time.Minute)
	if idx, _ := s.Pick(Request{ClientIP: ip}, c); idx != first {
		t.Fatalf("expired binding: got %d, want hash placement %d", idx, first)
	}
	// Clients spread across endpoints and the table stays bounded.
	got := map[int]int{}
	for i := 0; i < 1000; i++ {
		idx, _ := s.Pick(Request{ClientIP: netip.AddrFrom4([4]byte{127, 1, byte(i >> 8), byte(i)})}, c)
		got[idx]++
	}
	if len(got) != 4 {
		t.Errorf("persist placement not spread: %v", got)
	}
	if n := s.clients(); n > 64 {
		t.Errorf("persist table grew to %d > 64", n)
	}
}

func TestLeastConn(t *testing.T) {
	s := mustNew(t, SelLeastConn, Options{})
	c := cands(4)
	c[0].InFlight, c[1].InFlight, c[2].InFlight, c[3].InFlight = 5, 2, 1, 9
	for i := 0; i < 20; i++ {
		if idx, _ := s.Pick(Request{}, c); idx != 2 {
			t.Fatalf("lc picked %d, want 2", idx)
		}
	}
	c[2].Healthy = false
	if idx, _ := s.Pick(Request{}, c); idx != 1 {
		t.Fatalf("lc picked %d, want 1", idx)
	}
	// Simulated: every pick adds one in-flight request; the fleet stays level.
	c = cands(4)
	for i := 0; i < 400; i++ {
		idx, _ := s.Pick(Request{}, c)
		c[idx].InFlight++
	}
	for _, x := range c {
		if x.InFlight != 100 {
			t.Fatalf("lc uneven: %+v", c)
		}
	}
	// Ties rotate rather than always choosing the first.
	c = cands(3)
	got := map[int]int{}
	for i := 0; i < 300; i++ {
		idx, _ := s.Pick(Request{}, c)
		got[idx]++
	}
	if got[0] != 100 || got[1] != 100 || got[2] != 100 {
		t.Errorf("lc ties not rotated: %v", got)
	}
}

func TestCHWBLMinimalRemap(t *testing.T) {
	s := mustNew(t, SelCHWBL, Options{})
	const n = 20000
	c := cands(4)
	before := make([]int, n)
	counts := map[int]int{}
	for i := 0; i < n; i++ {
		before[i], _ = s.Pick(key(i), c)
		counts[before[i]]++
	}
	for idx, k := range counts {
		if math.Abs(float64(k)-n/4) > 0.15*n/4 {
			t.Errorf("chwbl ep %d got %d of %d", idx, k, n)
		}
	}
	// Add a fifth endpoint: moved keys all go to it, about 1/5 of them.
	c5 := cands(5)
	moved := 0
	for i := 0; i < n; i++ {
		after, _ := s.Pick(key(i), c5)
		if after != before[i] {
			moved++
			if after != 4 {
				t.Fatalf("key %d moved %d -> %d, not to the new endpoint", i, before[i], after)
			}
		}
	}
	if f := float64(moved) / n; f < 0.15 || f > 0.25 {
		t.Errorf("adding 1 of 5 endpoints moved %.3f of keys, want ~0.2", f)
	}
	// Remove endpoint 1 (unhealthy): only its keys move.
	c[1].Healthy = false
	moved = 0
	for i := 0; i < n; i++ {
		after, _ := s.Pick(key(i), c)
		if before[i] != 1 && after != before[i] {
			t.Fatalf("key %d moved %d -> %d although its endpoint stayed", i, before[i], after)
		}
		if after != before[i] {
			moved++
		}
	}
	if moved != counts[1] {
		t.Errorf("moved %d keys, want exactly endpoint 1's %d", moved, counts[1])
	}
}

func TestCHWBLBoundedLoad(t *testing.T) {
	for _, tc := range []struct {
		sel    int
		factor int
		n      int
	}{{SelCHWBL, 175, 4}, {SelCHWBL, 125, 8}, {SelWRRHash, 175, 4}, {SelCHWBL, 100, 3}} {
		s := mustNew(t, tc.sel, Options{MeanLoadFactor: tc.factor})
		c := cands(tc.n)
		hot := key(42)
		home, _ := s.Pick(hot, c)
		for i := 1; i <= 200; i++ {
			idx, _ := s.Pick(hot, c)
			total := 0
			for _, x := range c {
				total += x.InFlight
			}
			capNow := (tc.factor*(total+1) + 100*tc.n - 1) / (100 * tc.n)
			if c[idx].InFlight+1 > capNow {
				t.Fatalf("sel %d factor %d: pick %d to ep %d with %d in flight exceeds cap %d", tc.sel, tc.factor, i, idx, c[idx].InFlight, capNow)
			}
			c[idx].InFlight++
		}
		maxL := 0
		for _, x := range c {
			maxL = max(maxL, x.InFlight)
		}
		bound := int(math.Ceil(float64(tc.factor) / 100 * 200 / float64(tc.n)))
		if maxL > bound {
			t.Errorf("sel %d factor %d: max load %d > bound %d (%+v)", tc.sel, tc.factor, maxL, bound, c)
		}
		if c[home].InFlight != maxL {
			t.Errorf("hot key's home %d should be (one of) the most loaded: %+v", home, c)
		}
		// Without load the hot key goes home again.
		for i := range c {
			c[i].InFlight = 0
		}
		if idx, _ := s.Pick(hot, c); idx != home {
			t.Errorf("hot key home changed %d -> %d", home, idx)
		}
	}
}

func TestWRRHashProportional(t *testing.T) {
	s := mustNew(t, SelWRRHash, Options{})
	c := cands(3)
	c[0].Weight, c[1].Weight, c[2].Weight = 1, 2, 3
	const n = 30000
	got := map[int]int{}
	for i := 0; i < n; i++ {
		idx, _ := s.Pick(key(i), c)
		got[idx]++
	}
	for i, w := range []int{1, 2, 3} {
		want := float64(n) * float64(w) / 6
		if math.Abs(float64(got[i])-want) > 0.15*want {
			t.Errorf("wrr-hash ep %d (w=%d) got %d, want ~%.0f", i, w, got[i], want)
		}
	}
	// Weight 0 endpoint is never chosen while others are healthy.
	c[0].Weight = 0
	for i := 0; i < 2000; i++ {
		if idx, _ := s.Pick(key(i), c); idx == 0 {
			t.Fatal("weight-0 endpoint picked by wrr-hash")
		}
	}
}

func TestGPUAware(t *testing.T) {
	s := mustNew(t, SelGPUAware, Options{})
	c := cands(3)
	for i := range c {
		c[i].Metrics = EngineMetrics{Running: 4, Valid: true, KVUsage: 0.3}
	}
	c[0].Metrics.Waiting = 10 // deep engine queue
	c[1].Metrics.KVUsage = 0.99
	for i := 0; i < 100; i++ {
		if idx, _ := s.Pick(key(i), c); idx != 2 {
			t.Fatalf("gpu-aware picked %d, want the unloaded 2", idx)
		}
	}
	// Engine metrics win over the proxy's view: endpoint 2 is busy with
	// traffic that did not come through this proxy.
	c[2].Metrics.Running = 40
	c[0].Metrics.Waiting = 0
	if idx, _ := s.Pick(key(1), c); idx != 0 {
		t.Fatalf("gpu-aware picked %d, want 0", idx)
	}
	// Without metrics it uses in-flight counts.
	c = cands(3)
	c[0].InFlight, c[1].InFlight, c[2].InFlight = 3, 1, 2
	if idx, _ := s.Pick(key(1), c); idx != 1 {
		t.Fatalf("gpu-aware without metrics picked %d, want 1", idx)
	}
	// Equal load: the key decides, so a prefix keeps going to one endpoint.
	c = cands(4)
	first, _ := s.Pick(key(7), c)
	for i := 0; i < 10; i++ {
		if idx, _ := s.Pick(key(7), c); idx != first {
			t.Fatal("gpu-aware tie-break not stable per key")
		}
	}
}

func TestLoad(t *testing.T) {
	w := DefaultLoadWeights
	for _, tc := range []struct {
		c    Candidate
		want float64
	}{
		{Candidate{InFlight: 3}, 3},
		{Candidate{InFlight: 3, Metrics: EngineMetrics{Running: 1, Valid: true}}, 3},
		{Candidate{InFlight: 1, Metrics: EngineMetrics{Running: 4, Waiting: 2, Valid: true}}, 6 + 2},
		{Candidate{Metrics: EngineMetrics{KVUsage: 0.5, Valid: true}}, 2},
		{Candidate{Metrics: EngineMetrics{KVUsage: 7, Valid: true}}, 4},
		{Candidate{Metrics: EngineMetrics{KVUsage: math.NaN(), Valid: true}}, 0},
		{Candidate{InFlight: 2, Metrics: EngineMetrics{Running: 50}}, 2},
	} {
		if got := Load(tc.c, w); got != tc.want {
			t.Errorf("Load(%+v) = %v, want %v", tc.c, got, tc.want)
		}
	}
}

func TestConcurrentPick(t *testing.T) {
	for _, sel := range []int{0, 1, 2, 3, 4, 8, 9, 10} {
		s := mustNew(t, sel, Options{})
		var wg sync.WaitGroup
		for g := 0; g < 4; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c := cands(3 + g) // different layouts force ring rebuilds
				for i := 0; i < 500; i++ {
					req := key(i)
					req.ClientIP = netip.AddrFrom4([4]byte{127, 0, 0, byte(i)})
					if _, ok := s.Pick(req, c); !ok {
						t.Error("no pick")
						return
					}
				}
			}()
		}
		wg.Wait()
	}
}

func BenchmarkPick(b *testing.B) {
	c := cands(64)
	for i := range c {
		c[i].InFlight = i % 7
		c[i].Metrics = EngineMetrics{Running: i % 5, Waiting: i % 3, KVUsage: 0.5, Valid: true}
	}
	req := key(99)
	for _, sel := range []int{0, 1, 2, 4, 8, 9, 10} {
		s := mustNew(b, sel, Options{})
		b.Run(Name(sel), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				s.Pick(req, c)
			}
		})
	}
}

func TestUsesKey(t *testing.T) {
	for sel, want := range map[int]bool{SelRR: false, SelHash: true, SelPriority: false, SelPersist: false,
		SelLeastConn: false, SelCHWBL: true, SelGPUAware: true, SelWRRHash: true} {
		s, err := New(sel, Options{})
		if err != nil {
			t.Fatal(err)
		}
		if got := UsesKey(s); got != want {
			t.Errorf("UsesKey(%s) = %v, want %v", Name(sel), got, want)
		}
	}
}
