package router

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/selector"
)

// fakeInv holds, per service and endpoint, a set of block keys.
type fakeInv struct {
	mu   sync.RWMutex
	sets map[uint32]map[int]map[uint64]bool
}

func newFakeInv() *fakeInv { return &fakeInv{sets: map[uint32]map[int]map[uint64]bool{}} }

func (f *fakeInv) add(svc uint32, ep int, keys ...uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.sets[svc] == nil {
		f.sets[svc] = map[int]map[uint64]bool{}
	}
	if f.sets[svc][ep] == nil {
		f.sets[svc][ep] = map[uint64]bool{}
	}
	for _, k := range keys {
		f.sets[svc][ep][k] = true
	}
}

func (f *fakeInv) PrefixMatch(svc uint32, keys []uint64, eps []int, out []int) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	for i, ep := range eps {
		set := f.sets[svc][ep]
		n := 0
		for _, k := range keys {
			if !set[k] {
				break
			}
			n++
		}
		out[i] = n
	}
}

func (f *fakeInv) Len(svc uint32, ep int) int {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return len(f.sets[svc][ep])
}

var _ Inventory = (*fakeInv)(nil)

// chain returns n block keys of a prompt identified by p.
func chain(p uint64, n int) []uint64 {
	k := make([]uint64, n)
	for i := range k {
		k[i] = p<<32 | uint64(i+1)
	}
	return k
}

func cands(n int) []selector.Candidate {
	c := make([]selector.Candidate, n)
	for i := range c {
		c[i] = selector.Candidate{Idx: i, Weight: 1, Healthy: true}
	}
	return c
}

func newRouter(t testing.TB, cfg Config, inv Inventory) (*Router, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	r, err := New(cfg, inv, slog.New(slog.DiscardHandler), reg)
	if err != nil {
		t.Fatal(err)
	}
	return r, reg
}

func rr(t testing.TB) selector.Selector {
	s, err := selector.New(selector.SelRR, selector.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func boolp(b bool) *bool { return &b }

var mode3 = ServiceView{ID: 7, KVExactMode: 3}

func TestDecideTable(t *testing.T) {
	q := chain(1, 16)
	other := chain(2, 16)
	type tc struct {
		name      string
		cfg       func(*Config)
		svc       ServiceView
		keys      []uint64
		bs        int
		setup     func(*fakeInv)
		cands     func([]selector.Candidate)
		wantEP    int // -2 = any endpoint
		wantTier  string
		wantWhy   string
		wantMatch int
		wantFrom  int
	}
	for _, c := range []tc{
		{name: "hit routes to warm", keys: q, bs: 16,
			setup: func(f *fakeInv) { f.add(7, 2, q[:12]...); f.add(7, 1, q[:3]...) },
			// Equal load (the proxy's default) so overlap alone decides.
			wantEP: 2, wantTier: TierKV, wantWhy: ReasonLongestPrefix, wantMatch: 12, wantFrom: -1},
		{name: "consecutive prefix, not overlap count", keys: q, bs: 16,
			setup:  func(f *fakeInv) { f.add(7, 0, q[1:]...); f.add(7, 3, q[:2]...) },
			wantEP: 3, wantTier: TierKV, wantWhy: ReasonLongestPrefix, wantMatch: 2, wantFrom: -1},
		{name: "below min match falls back", keys: q, bs: 16, cfg: func(c *Config) { c.MinMatchTokens = 64 },
			setup:  func(f *fakeInv) { f.add(7, 2, q[:3]...) },
			wantEP: -2, wantTier: TierFallback, wantWhy: ReasonShallow, wantFrom: -1},
		{name: "min match capped at query blocks", keys: q[:2], bs: 16, cfg: func(c *Config) { c.MinMatchTokens = 4096 },
			setup:  func(f *fakeInv) { f.add(7, 2, q[:2]...) },
			wantEP: 2, wantTier: TierKV, wantWhy: ReasonLongestPrefix, wantMatch: 2, wantFrom: -1},
		{name: "min match off", keys: q, bs: 1, cfg: func(c *Config) { c.MinMatchTokens = 0 },
			setup:  func(f *fakeInv) { f.add(7, 1, q[:1]...) },
			wantEP: 1, wantTier: TierKV, wantWhy: ReasonLongestPrefix, wantMatch: 1, wantFrom: -1},
		{name: "mode off", svc: ServiceView{ID: 7}, keys: q, bs: 16,
			setup:  func(f *fakeInv) { f.add(7, 2, q...) },
			wantEP: -2, wantTier: TierFallback, wantWhy: ReasonModeOff, wantFrom: -1},
		{name: "short prompt", keys: nil, bs: 16,
			wantEP: -2, wantTier: TierFallback, wantWhy: ReasonShortPrompt, wantFrom: -1},
		{name: "bad block size", keys: q, bs: 0,
			wantEP: -2, wantTier: TierFallback, wantWhy: ReasonUnhashable, wantFrom: -1},
		{name: "no match", keys: q, bs: 16,
			setup:  func(f *fakeInv) { f.add(7, 0, other...) },
			wantEP: -2, wantTier: TierFallback, wantWhy: ReasonNoMatch, wantFrom: -1},
		{name: "empty inventory", keys: q, bs: 16,
			wantEP: -2, wantTier: TierFallback, wantWhy: ReasonEmptyInventory, wantFrom: -1},
		{name: "other service's inventory is invisible", keys: q, bs: 16,
			setup:  func(f *fakeInv) { f.add(8, 1, q...) },
			wantEP: -2, wantTier: TierFallback, wantWhy: ReasonEmptyInventory, wantFrom: -1},
		{name: "unhealthy warm endpoint excluded", keys: q, bs: 16,
			setup:  func(f *fakeInv) { f.add(7, 2, q...); f.add(7, 0, q[:4]...) },
			cands:  func(c []selector.Candidate) { c[2].Healthy = false },
			wantEP: 0, wantTier: TierKV, wantWhy: ReasonLongestPrefix, wantMatch: 4, wantFrom: -1},
		{name: "no healthy", keys: q, bs: 16,
			setup: func(f *fakeInv) { f.add(7, 2, q...) },
			cands: func(c []selector.Candidate) {
				for i := range c {
					c[i].Healthy = false
				}
			},
			wantEP: -1, wantTier: TierFallback, wantWhy: ReasonNoHealthy, wantFrom: -1},
		{name: "tie goes to less loaded", keys: q, bs: 16,
			setup:  func(f *fakeInv) { f.add(7, 1, q[:8]...); f.add(7, 3, q[:8]...) },
			cands:  func(c []selector.Candidate) { c[1].InFlight = 1 },
			wantEP: 3, wantTier: TierKV, wantWhy: ReasonLongestPrefix, wantMatch: 8, wantFrom: -1},
		{name: "short match loses to load (blend)", keys: q, bs: 16,
			setup: func(f *fakeInv) { f.add(7, 0, q[:2]...) },
			cands: func(c []selector.Candidate) {
				c[0].InFlight = 5
				c[1].InFlight = 2
				c[2].InFlight = 2
				c[3].InFlight = 2
			},
			wantEP: 1, wantTier: TierSpill, wantWhy: ReasonLoadBlend, wantMatch: 0, wantFrom: 0},
		{name: "pure overlap with zero penalty", keys: q, bs: 16, cfg: func(c *Config) { c.LoadPenalty = 0 },
			setup:  func(f *fakeInv) { f.add(7, 0, q[:2]...) },
			cands:  func(c []selector.Candidate) { c[0].InFlight = 1 },
			wantEP: 0, wantTier: TierKV, wantWhy: ReasonLongestPrefix, wantMatch: 2, wantFrom: -1},
		{name: "engine queue counts as load", keys: q, bs: 16,
			setup: func(f *fakeInv) { f.add(7, 0, q[:4]...); f.add(7, 1, q[:3]...) },
			cands: func(c []selector.Candidate) {
				c[0].Metrics = selector.EngineMetrics{Running: 8, Waiting: 6, Valid: true}
			},
			wantEP: 1, wantTier: TierKV, wantWhy: ReasonLoadBlend, wantMatch: 3, wantFrom: 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			inv := newFakeInv()
			if c.setup != nil {
				c.setup(inv)
			}
			cfg := DefaultConfig()
			cfg.ColdSeedN = 0
			if c.cfg != nil {
				c.cfg(&cfg)
			}
			r, _ := newRouter(t, cfg, inv)
			cs := cands(4)
			if c.cands != nil {
				c.cands(cs)
			}
			svc := c.svc
			if svc == (ServiceView{}) {
				svc = mode3
			}
			d := r.Decide(svc, c.keys, c.bs, cs, rr(t), selector.Request{})
			if (c.wantEP != -2 && d.EP != c.wantEP) || d.Tier != c.wantTier || d.Reason != c.wantWhy || d.From != c.wantFrom {
				t.Fatalf("got %+v, want ep=%d tier=%s reason=%s from=%d", d, c.wantEP, c.wantTier, c.wantWhy, c.wantFrom)
			}
			if c.wantEP == -2 && d.EP < 0 {
				t.Fatalf("fallback chose no endpoint: %+v", d)
			}
			if c.wantTier != TierFallback && d.MatchedBlocks != c.wantMatch {
				t.Fatalf("matched %d, want %d", d.MatchedBlocks, c.wantMatch)
			}
			if d.TotalBlocks != len(c.keys) {
				t.Fatalf("total %d, want %d", d.TotalBlocks, len(c.keys))
			}
		})
	}
}

func TestFallbackUsesRuleSelector(t *testing.T) {
	inv := newFakeInv()
	r, reg := newRouter(t, DefaultConfig(), inv)
	lc, _ := selector.New(selector.SelLeastConn, selector.Options{})
	cs := cands(3)
	cs[0].InFlight, cs[1].InFlight, cs[2].InFlight = 3, 0, 3
	d := r.Decide(mode3, chain(1, 4), 16, cs, lc, selector.Request{})
	if d.EP != 1 || d.Tier != TierFallback {
		t.Fatalf("fallback did not use lc: %+v", d)
	}
	d = r.Fallback(mode3, ReasonNoTokenizer, cs, lc, selector.Request{})
	if d.EP != 1 || d.Reason != ReasonNoTokenizer {
		t.Fatalf("Fallback: %+v", d)
	}
	// nil fallback: least loaded.
	d = r.Decide(mode3, nil, 16, cs, nil, selector.Request{})
	if d.EP != 1 {
		t.Fatalf("nil fallback: %+v", d)
	}
	if got := testutil.ToFloat64(r.m.miss.WithLabelValues("7", ReasonNoTokenizer)); got != 1 {
		t.Errorf("no_tokenizer misses = %v", got)
	}
	if got := testutil.ToFloat64(r.m.miss.WithLabelValues("7", ReasonEmptyInventory)); got != 1 {
		t.Errorf("empty_inventory misses = %v", got)
	}
	if n, err := testutil.GatherAndCount(reg, "loxilb_pd_kv_tier15_decision_seconds"); err != nil || n != 1 {
		t.Errorf("latency series %d %v", n, err)
	}
}

func TestSpillUnderHotPrefix(t *testing.T) {
	q := chain(1, 128) // a 2k-token prefix at block size 16
	inv := newFakeInv()
	inv.add(7, 0, q...)
	inv.add(7, 2, q[:64]...)
	inv.add(7, 1, chain(3, 20)...)
	inv.add(7, 3, chain(4, 20)...)
	cs := cands(4)
	cs[0].InFlight, cs[1].InFlight, cs[2].InFlight, cs[3].InFlight = 10, 1, 1, 1
	// sum 13, n 4: cap = ceil(2*14/4) = 7; endpoint 0 is above it, with
	// 4k tokens of prefill queued: more than the 1k tokens endpoint 2
	// would recompute.
	cs[0].PrefillTokens = 4096
	for _, c := range []struct {
		name    string
		svc     ServiceView
		relief  *bool
		prefill int64 // endpoint 0's outstanding prefill tokens
		want    int
		tier    string
	}{
		{"mode 3 default on", mode3, nil, 4096, 2, TierSpill},
		{"mode 1 default off", ServiceView{ID: 7, KVExactMode: 1}, nil, 4096, 0, TierKV},
		{"forced off", mode3, boolp(false), 4096, 0, TierKV},
		{"forced on in mode 1", ServiceView{ID: 7, KVExactMode: 1}, boolp(true), 4096, 2, TierSpill},
	} {
		cs[0].PrefillTokens = c.prefill
		cfg := DefaultConfig()
		cfg.SpillRelief = c.relief
		cfg.ColdSeedN = 0
		r, _ := newRouter(t, cfg, inv)
		d := r.Decide(c.svc, q, 16, cs, rr(t), selector.Request{})
		if d.EP != c.want || d.Tier != c.tier {
			t.Errorf("%s: %+v, want ep %d tier %s", c.name, d, c.want, c.tier)
		}
		if c.tier == TierSpill && (d.Reason != ReasonOverCap || d.From != 0 || d.MatchedBlocks != 64) {
			t.Errorf("%s: spill receipt %+v", c.name, d)
		}
		if c.tier == TierSpill {
			if got := testutil.ToFloat64(r.m.spills.WithLabelValues("7", "2")); got != 1 {
				t.Errorf("%s: spills{7,2} = %v", c.name, got)
			}
		}
	}
}

func TestSpillMinLoadFloor(t *testing.T) {
	q := chain(1, 16)
	inv := newFakeInv()
	inv.add(7, 0, q...)
	cs := cands(4)
	cs[0].InFlight = 1 // cap = ceil(2*2/4) = 1, so loxilb would spill
	// ... and it is prefilling 1k tokens, so the move would pay.
	cs[0].PrefillTokens = 1024
	for _, c := range []struct {
		floor, want int
	}{{2, 0}, {1, 1}, {0, 1}} {
		cfg := DefaultConfig()
		cfg.SpillMinLoad = c.floor
		cfg.ColdSeedN = 0
		r, _ := newRouter(t, cfg, inv)
		if d := r.Decide(mode3, q, 16, cs, rr(t), selector.Request{}); d.EP != c.want {
			t.Errorf("SpillMinLoad %d: %+v, want ep %d", c.floor, d, c.want)
		}
	}
}

// A burst on one hot prefix, each request with its own 512-token question,
// nothing completing: relief moves requests once the prefill queued on the
// warm endpoint outweighs recomputing the prefix, keeps the load within
// twice the mean, and spilled requests prefer the endpoint that already
// received siblings (modelled by recording its blocks, as the proxy's
// speculative entries do).
func TestHotPrefixBurst(t *testing.T) {
	q := chain(1, 128)
	inv := newFakeInv()
	inv.add(7, 0, q...)
	for ep := 1; ep < 4; ep++ {
		inv.add(7, ep, chain(uint64(10+ep), 32)...)
	}
	cfg := DefaultConfig()
	cfg.ColdSeedN = 0
	r, _ := newRouter(t, cfg, inv)
	cs := cands(4)
	for i := 0; i < 64; i++ {
		keys := append(append([]uint64(nil), q...), chain(uint64(100+i), 32)...)
		d := r.Decide(mode3, keys, 16, cs, rr(t), selector.Request{})
		if d.EP < 0 || d.Tier == TierFallback {
			t.Fatalf("request %d: %+v", i, d)
		}
		cs[d.EP].InFlight++
		cs[d.EP].PrefillTokens += int64((d.TotalBlocks - d.MatchedBlocks) * 16)
		inv.add(7, d.EP, q...)
	}
	maxLoad := 0
	for _, c := range cs {
		maxLoad = max(maxLoad, c.InFlight)
	}
	if cs[0].InFlight < maxLoad || maxLoad > 2*64/4 {
		t.Errorf("warm endpoint should carry the most, at most twice the mean: %+v", cs)
	}
	spills := 0.0
	for ep := 0; ep < 4; ep++ {
		spills += testutil.ToFloat64(r.m.spills.WithLabelValues("7", fmt.Sprint(ep)))
	}
	if spills == 0 {
		t.Error("no spill recorded under a hot prefix")
	}
}

func TestColdSeedEveryNth(t *testing.T) {
	q := chain(1, 16)
	inv := newFakeInv()
	inv.add(7, 0, q...)
	inv.add(7, 0, chain(9, 100)...)
	inv.add(7, 1, chain(8, 100)...)
	inv.add(7, 3, chain(7, 5)...) // cold: 5 < 16 blocks
	// endpoint 2 is empty: the lowest-index cold endpoint.
	cfg := DefaultConfig()
	cfg.ColdSeedN = 4
	r, _ := newRouter(t, cfg, inv)
	cs := cands(4)
	var got []int
	for i := 0; i < 8; i++ {
		d := r.Decide(mode3, q, 16, cs, rr(t), selector.Request{})
		got = append(got, d.EP)
		if d.EP == 2 && (d.Tier != TierColdSeed || d.From != 0 || d.MatchedBlocks != 0) {
			t.Fatalf("seed receipt %+v", d)
		}
	}
	if fmt.Sprint(got) != "[0 0 0 2 0 0 0 2]" {
		t.Fatalf("seeding pattern %v", got)
	}
	// Endpoint 2 warms up; the next cold one is 3. An unhealthy cold
	// endpoint is never seeded.
	inv.add(7, 2, chain(6, 20)...)
	cs[3].Healthy = false
	for i := 0; i < 4; i++ {
		if d := r.Decide(mode3, q, 16, cs, rr(t), selector.Request{}); d.Tier == TierColdSeed {
			t.Fatalf("seeded unhealthy endpoint: %+v", d)
		}
	}
	cs[3].Healthy = true
	got = got[:0]
	for i := 0; i < 4; i++ {
		got = append(got, r.Decide(mode3, q, 16, cs, rr(t), selector.Request{}).EP)
	}
	if fmt.Sprint(got) != "[0 0 0 3]" {
		t.Fatalf("second seeding pattern %v", got)
	}
	if v := testutil.ToFloat64(r.m.seeds.WithLabelValues("7", "2")); v != 2 {
		t.Errorf("cold_seeds{7,2} = %v", v)
	}
	if v := testutil.ToFloat64(r.m.seeds.WithLabelValues("7", "3")); v != 1 {
		t.Errorf("cold_seeds{7,3} = %v", v)
	}
	if v := testutil.ToFloat64(r.m.hits.WithLabelValues("7", "3")); v != 1 {
		t.Errorf("hits{7,3} = %v", v)
	}

	// ColdMinBlocks 0: only empty inventories are cold, so 3 (5 blocks) is not.
	cfg.ColdMinBlocks = 0
	r, _ = newRouter(t, cfg, inv)
	for i := 0; i < 8; i++ {
		if d := r.Decide(mode3, q, 16, cs, rr(t), selector.Request{}); d.Tier == TierColdSeed {
			t.Fatalf("ColdMinBlocks 0 seeded a non-empty endpoint: %+v", d)
		}
	}
}

type countHandler struct {
	mu    sync.Mutex
	warns int
	infos []string
	buf   bytes.Buffer
}

func (h *countHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *countHandler) Handle(_ context.Context, rec slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	switch rec.Level {
	case slog.LevelWarn:
		h.warns++
		h.buf.WriteString(rec.Message)
		rec.Attrs(func(a slog.Attr) bool {
			h.buf.WriteString(" " + a.String())
			return true
		})
	case slog.LevelInfo:
		h.infos = append(h.infos, rec.Message)
	}
	return nil
}
func (h *countHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *countHandler) WithGroup(string) slog.Handler      { return h }

func TestZeroHitWatchdog(t *testing.T) {
	inv := newFakeInv()
	inv.add(7, 0, chain(2, 50)...) // non-empty, never matches
	cfg := DefaultConfig()
	cfg.ZeroHitN = 5
	h := &countHandler{}
	reg := prometheus.NewRegistry()
	r, err := New(cfg, inv, slog.New(h), reg)
	if err != nil {
		t.Fatal(err)
	}
	cs := cands(3)
	miss := func(n int) {
		for i := 0; i < n; i++ {
			if d := r.Decide(mode3, chain(uint64(100+i), 8), 16, cs, rr(t), selector.Request{}); d.Reason != ReasonNoMatch {
				t.Fatalf("want no_match, got %+v", d)
			}
		}
	}
	miss(4)
	if h.warns != 0 || testutil.ToFloat64(r.m.watchdog.WithLabelValues("7", WatchdogParitySuspect)) != 0 {
		t.Fatal("watchdog fired before the run reached ZeroHitN")
	}
	miss(8)
	if h.warns != 1 {
		t.Fatalf("watchdog warned %d times, want once", h.warns)
	}
	if !strings.Contains(h.buf.String(), "zero-hit") {
		t.Errorf("warning text %q", h.buf.String())
	}
	if got := testutil.ToFloat64(r.m.watchdog.WithLabelValues("7", WatchdogParitySuspect)); got != 8 {
		t.Errorf("watchdog counter %v, want 8 (lookups 5..12)", got)
	}
	if r.ZeroHitStreak(7) != 12 {
		t.Errorf("streak %d", r.ZeroHitStreak(7))
	}
	// Another service is unaffected.
	if testutil.ToFloat64(r.m.watchdog.WithLabelValues("8", WatchdogParitySuspect)) != 0 {
		t.Error("watchdog leaked across services")
	}
	// A hit resets the episode; a new run warns again.
	q := chain(2, 8)
	if d := r.Decide(mode3, q, 16, cs, rr(t), selector.Request{}); d.Tier != TierKV {
		t.Fatalf("expected a hit: %+v", d)
	}
	if r.ZeroHitStreak(7) != 0 {
		t.Fatal("hit did not reset the streak")
	}
	miss(5)
	if h.warns != 2 {
		t.Fatalf("second episode warned %d times total, want 2", h.warns)
	}
	// Empty inventories never trip it (a cold fleet is not a parity bug).
	r2, _ := newRouter(t, cfg, newFakeInv())
	for i := 0; i < 20; i++ {
		r2.Decide(mode3, chain(1, 8), 16, cs, rr(t), selector.Request{})
	}
	if r2.ZeroHitStreak(7) != 0 {
		t.Error("empty inventories counted as zero hits")
	}
}

// fakeAtt is an Attestation with a settable verdict per endpoint.
type fakeAtt struct {
	mu sync.Mutex
	ok map[int]bool
}

func (a *fakeAtt) ParityOK(_ uint32, ep int) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.ok[ep]
}

func (a *fakeAtt) set(ep int, ok bool) {
	a.mu.Lock()
	a.ok[ep] = ok
	a.mu.Unlock()
}

func TestZeroHitWatchdogAttestation(t *testing.T) {
	inv := newFakeInv()
	inv.add(7, 0, chain(2, 50)...) // non-empty, never matches the unique prompts below
	inv.add(7, 1, chain(3, 50)...)
	att := &fakeAtt{ok: map[int]bool{0: true, 1: true}} // ep 2 is empty: its verdict must not matter
	cfg := DefaultConfig()
	cfg.ZeroHitN = 5
	h := &countHandler{}
	r, err := New(cfg, inv, slog.New(h), prometheus.NewRegistry(), WithAttestation(att))
	if err != nil {
		t.Fatal(err)
	}
	cs := cands(3)
	next := uint64(1000)
	miss := func(n int) {
		for i := 0; i < n; i++ {
			next += 100
			if d := r.Decide(mode3, chain(next, 8), 16, cs, rr(t), selector.Request{}); d.Reason != ReasonNoMatch {
				t.Fatalf("want no_match, got %+v", d)
			}
		}
	}
	count := func(reason string) float64 { return testutil.ToFloat64(r.m.watchdog.WithLabelValues("7", reason)) }

	// Every non-empty inventory attests parity: unique prompts were simply
	// not cached. No warning, one info line for the episode.
	miss(12)
	if got := count(WatchdogNotCached); got != 8 {
		t.Errorf("not_cached counter %v, want 8 (lookups 5..12)", got)
	}
	if got := count(WatchdogParitySuspect); got != 0 {
		t.Errorf("parity_suspect counter %v with every verdict ok", got)
	}
	if h.warns != 0 {
		t.Fatalf("watchdog warned (%q) although every endpoint attests parity", h.buf.String())
	}
	if len(h.infos) != 1 || !strings.Contains(h.infos[0], "not cached") {
		t.Fatalf("info lines %q, want one saying the prompts were not cached", h.infos)
	}

	// Endpoint 1 loses parity within the same episode: now it is a suspect,
	// warned once, naming the endpoint.
	att.set(1, false)
	miss(3)
	if got := count(WatchdogParitySuspect); got != 3 {
		t.Errorf("parity_suspect counter %v, want 3", got)
	}
	if h.warns != 1 || !strings.Contains(h.buf.String(), "parity_not_ok_eps=[1]") {
		t.Fatalf("warnings %d %q, want one naming ep 1", h.warns, h.buf.String())
	}
	miss(3)
	if h.warns != 1 || count(WatchdogNotCached) != 8 {
		t.Fatalf("warned %d times, not_cached %v; want one warning and no more not_cached", h.warns, count(WatchdogNotCached))
	}
}

func TestMetricsPerServiceAndForget(t *testing.T) {
	q := chain(1, 8)
	inv := newFakeInv()
	inv.add(1, 0, q...)
	inv.add(2, 0, q...)
	cfg := DefaultConfig()
	cfg.ColdSeedN = 0
	r, reg := newRouter(t, cfg, inv)
	cs := cands(2)
	r.Decide(ServiceView{ID: 1, KVExactMode: 3}, q, 16, cs, rr(t), selector.Request{})
	r.Decide(ServiceView{ID: 2, KVExactMode: 3}, q, 16, cs, rr(t), selector.Request{})
	r.Decide(ServiceView{ID: 2, KVExactMode: 3}, q, 16, cs, rr(t), selector.Request{})
	if a, b := testutil.ToFloat64(r.m.hits.WithLabelValues("1", "0")), testutil.ToFloat64(r.m.hits.WithLabelValues("2", "0")); a != 1 || b != 2 {
		t.Fatalf("hits per service %v %v", a, b)
	}
	r.Forget(2)
	n, err := testutil.GatherAndCount(reg, "loxilb_pd_kv_tier15_hits_total")
	if err != nil || n != 1 {
		t.Fatalf("after Forget(2): %d series, %v", n, err)
	}
	// The registry rejects a second router on the same registerer.
	if _, err := New(cfg, inv, nil, reg); err == nil {
		t.Error("duplicate registration accepted")
	}
	if _, err := New(cfg, nil, nil, nil); err == nil {
		t.Error("nil inventory accepted")
	}
	bad := cfg
	bad.MeanLoadFactor = 50
	if _, err := New(bad, inv, nil, nil); !errors.Is(err, ErrConfig) {
		t.Errorf("bad config: %v", err)
	}
}

func TestReceipt(t *testing.T) {
	for _, rc := range []Receipt{
		{Tier: TierKV, EP: 2, Matched: 12, Total: 16, From: -1, Reason: ReasonLongestPrefix},
		{Tier: TierSpill, EP: 0, Matched: 0, Total: 16, From: 2, Reason: ReasonOverCap},
		{Tier: TierFallback, EP: -1, Total: 0, From: -1, Reason: ReasonNoHealthy},
		{Tier: TierKV, EP: 1, Rank: 0, RankSet: true, Matched: 8, Total: 9, From: -1, Reason: ReasonLongestPrefix},
		{Tier: TierKV, EP: 1, Rank: 3, RankSet: true, Matched: 8, Total: 9, From: -1, Reason: ReasonLongestPrefix},
	} {
		s := rc.String()
		got, err := ParseReceipt(s)
		if err != nil || got != rc {
			t.Errorf("round trip %q: %+v %v", s, got, err)
		}
	}
	want := "tier=tier1.5 ep=2 matched=12/16 reason=longest_prefix"
	d := Decision{EP: 2, Tier: TierKV, MatchedBlocks: 12, TotalBlocks: 16, BlockSize: 16, From: -1, Reason: ReasonLongestPrefix}
	if s := d.Receipt().String(); s != want {
		t.Errorf("header %q, want %q", s, want)
	}
	if d.PredictedCachedTokens() != 192 {
		t.Errorf("predicted %d", d.PredictedCachedTokens())
	}
	for _, bad := range []string{"", "tier=x", "tier=x ep=1 matched=3 reason=y", "tier=x ep=a matched=1/2 reason=y", "tier=x ep=1 rank=z matched=1/2 reason=y", "garbage"} {
		if _, err := ParseReceipt(bad); err == nil {
			t.Errorf("ParseReceipt(%q) accepted", bad)
		}
	}
	var buf bytes.Buffer
	slog.New(slog.NewTextHandler(&buf, nil)).Info("routed", "route", d.Receipt())
	if !strings.Contains(buf.String(), "route.tier=tier1.5") || !strings.Contains(buf.String(), "route.matched_blocks=12") {
		t.Errorf("log line %q", buf.String())
	}
}

func TestConcurrentDecide(t *testing.T) {
	inv := newFakeInv()
	for ep := 0; ep < 8; ep++ {
		inv.add(7, ep, chain(uint64(ep), 32)...)
	}
	r, _ := newRouter(t, DefaultConfig(), inv)
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cs := cands(8)
			sel := rr(t)
			for i := 0; i < 300; i++ {
				d := r.Decide(ServiceView{ID: uint32(7 + i%2), KVExactMode: 3}, chain(uint64(i%8), 32), 16, cs, sel, selector.Request{})
				if d.EP < 0 {
					t.Error("no endpoint")
					return
				}
			}
		}()
	}
	wg.Wait()
}

func BenchmarkDecide(b *testing.B) {
	const eps, blocks = 64, 128
	inv := newFakeInv()
	q := chain(1, blocks)
	for ep := 0; ep < eps; ep++ {
		inv.add(7, ep, q[:ep*blocks/eps]...)
		inv.add(7, ep, chain(uint64(100+ep), 64)...)
	}
	cfg := DefaultConfig()
	r, _ := newRouter(b, cfg, inv)
	cs := cands(eps)
	for i := range cs {
		cs[i].InFlight = i % 5
		cs[i].Metrics = selector.EngineMetrics{Running: i % 4, Waiting: i % 2, KVUsage: 0.4, Valid: true}
	}
	sel := rr(b)
	b.ReportAllocs()
	for b.Loop() {
		r.Decide(mode3, q, 16, cs, sel, selector.Request{})
	}
}

// fixedInv answers from precomputed per-endpoint match depths, so the
// benchmark below measures the router alone.
type fixedInv struct{ match, size []int }

func (f *fixedInv) PrefixMatch(_ uint32, _ []uint64, eps []int, out []int) {
	for i, ep := range eps {
		out[i] = f.match[ep]
	}
}
func (f *fixedInv) Len(_ uint32, ep int) int { return f.size[ep] }

func BenchmarkDecideRouterOnly(b *testing.B) {
	const eps, blocks = 64, 128
	inv := &fixedInv{match: make([]int, eps), size: make([]int, eps)}
	for ep := 0; ep < eps; ep++ {
		inv.match[ep], inv.size[ep] = ep*blocks/eps, 1000
	}
	r, _ := newRouter(b, DefaultConfig(), inv)
	cs := cands(eps)
	for i := range cs {
		cs[i].InFlight = i % 5
		cs[i].Metrics = selector.EngineMetrics{Running: i % 4, Waiting: i % 2, KVUsage: 0.4, Valid: true}
	}
	q := chain(1, blocks)
	sel := rr(b)
	b.ReportAllocs()
	for b.Loop() {
		r.Decide(mode3, q, 16, cs, sel, selector.Request{})
	}
}

// specInv models an inventory whose matches are all speculative: the
// gateway's own guesses, never confirmed by engine events.
type specInv struct {
	*fakeInv
	real *fakeInv
}

func (s specInv) PrefixMatchConfirmed(svc uint32, keys []uint64, eps []int, out []int) {
	s.real.PrefixMatch(svc, keys, eps, out)
}

func (s specInv) Len(svc uint32, ep int) int { return s.real.Len(svc, ep) }

func TestWatchdogIgnoresSpeculativeHits(t *testing.T) {
	q := chain(1, 8)
	guesses, real := newFakeInv(), newFakeInv()
	guesses.add(7, 0, q...)           // the gateway routed this prefix to ep 0 a moment ago
	real.add(7, 0, chain(900, 20)...) // the engine published keys the gateway never computes
	cfg := DefaultConfig()
	cfg.ZeroHitN = 3
	h := &countHandler{}
	r, err := New(cfg, specInv{guesses, real}, slog.New(h), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 5; i++ {
		if d := r.Decide(mode3, q, 16, cands(2), rr(t), selector.Request{}); d.EP != 0 || d.Tier != TierKV {
			t.Fatalf("speculative hit should still route to ep 0: %+v", d)
		}
	}
	if h.warns != 1 || r.ZeroHitStreak(7) != 5 {
		t.Fatalf("watchdog: %d warnings, streak %d; want 1 and 5", h.warns, r.ZeroHitStreak(7))
	}
	// A confirmed match resets the episode.
	real.add(7, 0, q...)
	r.Decide(mode3, q, 16, cands(2), rr(t), selector.Request{})
	if r.ZeroHitStreak(7) != 0 {
		t.Fatalf("confirmed hit did not reset the streak")
	}
}

// A request that matches nothing recomputes its whole prompt wherever it
// goes: it joins the shortest prefill queue, not the rule selector's pick,
// and the selector only breaks ties. Requests that were not tokenized keep
// the rule's selector.
func TestMissGoesToLeastPrefillWork(t *testing.T) {
	q := chain(1, 16)
	inv := newFakeInv()
	inv.add(7, 0, chain(2, 64)...)
	inv.add(7, 2, chain(3, 64)...)
	cfg := DefaultConfig()
	cfg.ColdSeedN = 0
	r, _ := newRouter(t, cfg, inv)
	cs := cands(4)
	// Endpoints 0 and 2 are prefilling documents; 3 a little.
	cs[0].PrefillTokens, cs[2].PrefillTokens, cs[3].PrefillTokens = 6000, 3000, 200
	sel := rr(t)
	for i := 0; i < 3; i++ {
		d := r.Decide(mode3, q, 16, cs, sel, selector.Request{})
		if d.EP != 1 || d.Tier != TierFallback || d.Reason != ReasonNoMatch {
			t.Fatalf("miss %d: %+v, want endpoint 1 (no prefill outstanding)", i, d)
		}
	}
	// Shallow and empty-inventory misses too.
	cfg.MinMatchTokens = 1024
	r2, _ := newRouter(t, cfg, inv)
	q2 := chain(4, 16)
	inv.add(7, 0, q2[:2]...)
	if d := r2.Decide(mode3, q2, 16, cs, sel, selector.Request{}); d.EP != 1 || d.Reason != ReasonShallow {
		t.Fatalf("shallow miss: %+v", d)
	}
	if d := r.Decide(ServiceView{ID: 9, KVExactMode: 3}, q, 16, cs, sel, selector.Request{}); d.EP != 1 || d.Reason != ReasonEmptyInventory {
		t.Fatalf("empty-inventory miss: %+v", d)
	}
	// Equal prefill work, unequal load: the less loaded one.
	cs[3].PrefillTokens, cs[1].InFlight = 0, 2
	if d := r.Decide(mode3, q, 16, cs, sel, selector.Request{}); d.EP != 3 {
		t.Fatalf("tie on work should go to the less loaded endpoint 3: %+v", d)
	}
	// A full tie: the rule's selector rotates among the tied endpoints only.
	cs[1].InFlight = 0
	seen := map[int]int{}
	for i := 0; i < 8; i++ {
		seen[r.Decide(mode3, q, 16, cs, sel, selector.Request{}).EP]++
	}
	if len(seen) != 2 || seen[1] != 4 || seen[3] != 4 {
		t.Fatalf("tied misses should alternate over endpoints 1 and 3: %v", seen)
	}
	// Not tokenized: the rule's selector, whatever the prefill work.
	lc, _ := selector.New(selector.SelLeastConn, selector.Options{})
	cs[0].InFlight, cs[1].InFlight, cs[2].InFlight, cs[3].InFlight = 0, 3, 3, 3
	if d := r.Fallback(mode3, ReasonNoTokenizer, cs, lc, selector.Request{}); d.EP != 0 {
		t.Fatalf("untokenized request should follow the rule's selector: %+v", d)
	}
}

// Outstanding tokens do not say when a miss starts: an endpoint whose
// every sequence is taken by short cached requests queues it, while one
// running a long prefill beside a free sequence starts it at once. With
// the budgets known a miss goes to a free sequence first, by tokens among
// those; when every endpoint is full, or no budget is known, by tokens
// alone.
func TestMissPrefersAFreeSequence(t *testing.T) {
	q := chain(1, 16)
	cfg := DefaultConfig()
	cfg.ColdSeedN = 0
	r, _ := newRouter(t, cfg, newFakeInv())
	cs := cands(3)
	// 0: two short hits in its two sequences; 1: one long prefill, one
	// sequence free; 2: two long prefills.
	cs[0].PrefillTokens, cs[0].InFlight = 120, 2
	cs[1].PrefillTokens, cs[1].InFlight = 1600, 1
	cs[2].PrefillTokens, cs[2].InFlight = 3000, 2
	view := ServiceView{ID: 9, KVExactMode: 3}
	if d := r.Decide(view, q, 16, cs, rr(t), selector.Request{}); d.EP != 0 {
		t.Fatalf("budgets unknown: %+v, want endpoint 0 (least tokens)", d)
	}
	for i := range cs {
		cs[i].Slots = 2
	}
	if d := r.Decide(view, q, 16, cs, rr(t), selector.Request{}); d.EP != 1 {
		t.Fatalf("budgets known: %+v, want endpoint 1 (a free sequence)", d)
	}
	cs[1].InFlight = 2
	if d := r.Decide(view, q, 16, cs, rr(t), selector.Request{}); d.EP != 0 {
		t.Fatalf("all full: %+v, want endpoint 0 (least tokens)", d)
	}
	// A sick endpoint's free sequence is no reason to go there.
	cs[1].InFlight, cs[1].Healthy = 0, false
	if d := r.Decide(view, q, 16, cs, rr(t), selector.Request{}); d.EP != 0 {
		t.Fatalf("free endpoint unhealthy: %+v, want endpoint 0", d)
	}
}

// A one-shot question after a system prompt every endpoint holds: overlap
// cannot choose, so the request goes where the least prefill is queued,
// not to the lowest index the blend's tie-break would pick.
func TestSharedSystemPromptPlacedByPrefillWork(t *testing.T) {
	sys := chain(1, 8)
	q := append(append([]uint64(nil), sys...), chain(2, 60)...)
	inv := newFakeInv()
	for ep := 0; ep < 4; ep++ {
		inv.add(7, ep, sys...)
	}
	cfg := DefaultConfig()
	cfg.ColdSeedN = 0
	r, _ := newRouter(t, cfg, inv)
	cs := cands(4)
	cs[0].PrefillTokens, cs[1].PrefillTokens, cs[3].PrefillTokens = 5000, 2200, 900
	d := r.Decide(mode3, q, 16, cs, rr(t), selector.Request{})
	if d.EP != 2 || d.Tier != TierKV || d.Reason != ReasonLeastPrefill || d.MatchedBlocks != 8 || d.From != -1 {
		t.Fatalf("got %+v, want endpoint 2 (no prefill queued) by least_prefill", d)
	}
}

// A session step with a ~2k-token cached history stays on its holder while
// the holder is only mildly loaded: neither a due cold seed nor spill
// relief throws the history away to prime or relieve an endpoint that
// holds nothing of it. Under real load the move pays and happens, and the
// due seed goes to a request whose cached prefix is short.
func TestLongSessionStaysOnItsHistory(t *testing.T) {
	session := chain(1, 136) // a 2k-token history + a new turn
	short := chain(2, 20)
	inv := newFakeInv()
	inv.add(7, 0, session[:128]...)
	inv.add(7, 1, short[:4]...)
	inv.add(7, 1, chain(9, 100)...)
	// endpoint 2 is empty (cold); endpoint 3 is warm with other prefixes.
	inv.add(7, 3, chain(8, 100)...)
	var r *Router
	cs := cands(4)
	// seedN 0: spill relief alone; 1: a seed is due at every hit.
	for seedN := range 2 {
		cfg := DefaultConfig()
		cfg.ColdSeedN = seedN
		r, _ = newRouter(t, cfg, inv)
		cs = cands(4)
		// The service's typical hit: a 320-token prompt, 64 tokens cached.
		for i := 0; i < 20; i++ {
			r.Decide(mode3, short, 16, cs, rr(t), selector.Request{})
		}
		for _, c := range []struct {
			name     string
			inFlight int
			prefill  int64
		}{
			{"idle holder, seed due", 0, 0},
			{"mildly loaded holder", 2, 256},
			{"mildly loaded holder, engine queueing", 1, 256},
		} {
			cs[0].InFlight, cs[0].PrefillTokens = c.inFlight, c.prefill
			if c.name == "mildly loaded holder, engine queueing" {
				cs[0].Metrics = selector.EngineMetrics{Running: 2, Waiting: 1, Valid: true}
			}
			d := r.Decide(mode3, session, 16, cs, rr(t), selector.Request{})
			if d.EP != 0 || d.Tier != TierKV || d.MatchedBlocks != 128 {
				t.Fatalf("seedN %d, %s: session step moved off its 2k-token history: %+v", seedN, c.name, d)
			}
		}
	}
	// The seed is still due: a request that loses 64 tokens takes it.
	d := r.Decide(mode3, short, 16, cs, rr(t), selector.Request{})
	if d.EP != 2 || d.Tier != TierColdSeed || d.From != 1 {
		t.Fatalf("short request should seed cold endpoint 2: %+v", d)
	}
	// Eight requests ahead on the holder: waiting costs more than the
	// recompute, so relief moves the step.
	cs[0].InFlight, cs[0].Metrics = 8, selector.EngineMetrics{}
	if d := r.Decide(mode3, session, 16, cs, rr(t), selector.Request{}); d.EP == 0 || d.Tier == TierKV {
		t.Fatalf("session step should leave a holder with 8 requests ahead: %+v", d)
	}
}
