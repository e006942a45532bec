package selector

import (
	"math/rand/v2"
	"net/netip"
	"testing"
)

// TestPickInvariants: over random fleets (fixed seed) every selector picks a
// healthy candidate, and the bounded-load selectors never pick a candidate
// at or above its cap.
func TestPickInvariants(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	sels := map[int]Selector{}
	for _, sel := range []int{0, 1, 2, 3, 4, 8, 9, 10} {
		sels[sel] = mustNew(t, sel, Options{})
	}
	for iter := 0; iter < 2000; iter++ {
		n := 1 + rng.IntN(10)
		c := make([]Candidate, n)
		anyHealthy := false
		for i := range c {
			c[i] = Candidate{Idx: 100 + i, Weight: rng.IntN(4), Healthy: rng.IntN(4) != 0, InFlight: rng.IntN(12)}
			if rng.IntN(2) == 0 {
				c[i].Metrics = EngineMetrics{Running: rng.IntN(8), Waiting: rng.IntN(4), KVUsage: rng.Float64(), Valid: true}
			}
			anyHealthy = anyHealthy || c[i].Healthy
		}
		req := key(rng.IntN(50))
		if rng.IntN(3) == 0 {
			req.Key = nil
		}
		if rng.IntN(2) == 0 {
			req.ClientIP = netip.AddrFrom4([4]byte{127, 0, 0, byte(rng.IntN(256))})
		}
		for sel, s := range sels {
			idx, ok := s.Pick(req, c)
			if ok != anyHealthy {
				t.Fatalf("iter %d sel %d: ok=%v with anyHealthy=%v", iter, sel, ok, anyHealthy)
			}
			if !ok {
				continue
			}
			pos := idx - 100
			if pos < 0 || pos >= n || !c[pos].Healthy {
				t.Fatalf("iter %d sel %d: picked %d (unhealthy or unknown)", iter, sel, idx)
			}
			if (sel == SelCHWBL || sel == SelWRRHash) && (len(req.Key) > 0 || req.ClientIP.IsValid()) {
				ch := s.(*chwbl)
				load, h, sumW := 0, 0, 0
				for _, x := range c {
					if x.Healthy {
						load += x.InFlight
						h++
						sumW += x.Weight
					}
				}
				under := false
				for i := range c {
					under = under || (c[i].Healthy && c[i].InFlight < ch.capFor(&c[i], load, h, sumW) && (sel == SelCHWBL || c[i].Weight > 0 || sumW == 0))
				}
				if under && c[pos].InFlight >= ch.capFor(&c[pos], load, h, sumW) {
					t.Fatalf("iter %d sel %d: picked %d at load %d >= cap %d", iter, sel, idx, c[pos].InFlight, ch.capFor(&c[pos], load, h, sumW))
				}
			}
		}
	}
}
