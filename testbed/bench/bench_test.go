package bench

import (
	"context"
	"encoding/xml"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestWorkloadsAreDeterministic(t *testing.T) {
	a := DefaultWorkloads(7, DefaultFleet())
	b := DefaultWorkloads(7, DefaultFleet())
	c := DefaultWorkloads(8, DefaultFleet())
	for i := range a {
		if !reflect.DeepEqual(a[i].Trace(), b[i].Trace()) {
			t.Errorf("%s: same seed, different trace", a[i].Name)
		}
		if reflect.DeepEqual(a[i].Trace(), c[i].Trace()) {
			t.Errorf("%s: seed 7 and seed 8 gave the same trace", a[i].Name)
		}
		if a[i].Requests() == 0 {
			t.Errorf("%s: no requests", a[i].Name)
		}
	}
}

func TestSharedPrefixShape(t *testing.T) {
	w := SharedPrefix("x", 1, SharedPrefixSpec{Groups: 3, PerGroup: 4, SystemTokens: 64, QuestionTokens: 16, OutputTokens: 1, RatePerSec: 100})
	if w.Requests() != 12 {
		t.Fatalf("requests %d, want 12", w.Requests())
	}
	sys := map[int][]uint32{}
	for _, r := range w.Trace() {
		if len(r.Tokens) != 80 {
			t.Fatalf("prompt length %d, want 80", len(r.Tokens))
		}
		if s, ok := sys[r.Group]; ok && !reflect.DeepEqual(s, r.Tokens[:64]) {
			t.Fatalf("group %d does not share its system prompt", r.Group)
		}
		sys[r.Group] = r.Tokens[:64]
	}
}

func TestMultiTurnHistoryGrows(t *testing.T) {
	w := MultiTurn("x", 1, MultiTurnSpec{Users: 2, Turns: 3, SystemTokens: 32, QuestionTokens: 8, AnswerTokens: 4, OutputTokens: 1, Interval: time.Second})
	for _, s := range w.Streams {
		for k := 1; k < len(s.Reqs); k++ {
			prev, cur := s.Reqs[k-1].Tokens, s.Reqs[k].Tokens
			if len(cur) != len(prev)+12 || !reflect.DeepEqual(cur[:len(prev)], prev) {
				t.Fatalf("turn %d does not extend turn %d", k, k-1)
			}
			if s.Offsets[k] <= s.Offsets[k-1] {
				t.Fatalf("turn %d scheduled before turn %d", k, k-1)
			}
		}
	}
}

func TestMultiTurnLongIsTheDefaultChatWithLongerSessions(t *testing.T) {
	var short, long *Workload
	ws := DefaultWorkloads(7, DefaultFleet())
	for i := range ws {
		switch ws[i].Name {
		case WMultiTurn:
			short = &ws[i]
		case WMultiTurnLong:
			long = &ws[i]
		}
	}
	if short == nil || long == nil {
		t.Fatalf("default suite lacks %s or %s", WMultiTurn, WMultiTurnLong)
	}
	for k, v := range short.Params {
		want := v
		if k == "turns" {
			want = 16
		}
		if long.Params[k] != want {
			t.Errorf("%s: %s = %v, want %v", WMultiTurnLong, k, long.Params[k], want)
		}
	}
	if long.Requests() != 16*16 || !long.HasTurns() {
		t.Errorf("%s: %d requests, turns %v", WMultiTurnLong, long.Requests(), long.HasTurns())
	}
	if b := UpperBound(long.Trace(), DefaultFleet()); b.FleetLRU != b.Unbounded || b.LaterTurns != 16*15 {
		t.Errorf("%s: bound %v of unbounded %v (histories must fit the fleet), %d later turns", WMultiTurnLong, b.FleetLRU, b.Unbounded, b.LaterTurns)
	}
}

func TestLaterTurns(t *testing.T) {
	w := MultiTurn("x", 1, MultiTurnSpec{Users: 3, Turns: 4, SystemTokens: 32, QuestionTokens: 16, AnswerTokens: 16, OutputTokens: 1, Interval: time.Second})
	for _, s := range w.Streams {
		for k, r := range s.Reqs {
			if r.Turn != k {
				t.Fatalf("request %d of a session has turn %d", k, r.Turn)
			}
		}
	}
	f := FleetConfig{Engines: 1, BlockSize: 16, CapacityBlocks: 1000, PrefillUsPerToken: 1000, TimeScale: 1}
	b := UpperBound(w.Trace(), f)
	if b.LaterTurns != 9 || b.TTFTFloorLaterTurnsMs == nil {
		t.Fatalf("later turns %d, floor %v; want 9 and a floor", b.LaterTurns, b.TTFTFloorLaterTurnsMs)
	}
	// A later turn recomputes its last partial block and the new turn.
	if b.TTFTFloorLaterTurnsMs.P99 >= b.TTFTFloorMs.P99 {
		t.Errorf("later-turn floor %v not below the overall floor %v", b.TTFTFloorLaterTurnsMs, b.TTFTFloorMs)
	}
	sp := SharedPrefix("y", 1, SharedPrefixSpec{Groups: 2, PerGroup: 2, SystemTokens: 32, QuestionTokens: 8, OutputTokens: 1, RatePerSec: 10})
	if sp.HasTurns() || UpperBound(sp.Trace(), f).TTFTFloorLaterTurnsMs != nil {
		t.Error("a workload without sessions reports later turns")
	}

	// summarize splits TTFT by turn; the overall percentiles keep every
	// request.
	var samples []sample
	for i := 0; i < 10; i++ {
		turn, ttft := 1, time.Duration(10+i)*time.Millisecond
		if i < 2 {
			turn, ttft = 0, time.Second
		}
		samples = append(samples, sample{group: i % 2, turn: turn, ttft: ttft, e2e: ttft})
	}
	ar := summarize(ArmRR, samples, nil, nil, time.Second, 0)
	if ar.TTFTms.P90 != 1000 || ar.TTFTLaterTurnsMs == nil || ar.TTFTLaterTurnsMs.P90 != 19 {
		t.Fatalf("overall p90 %v, later turns %v; want 1000 and p90 19", ar.TTFTms.P90, ar.TTFTLaterTurnsMs)
	}
	a2 := ar
	a2.TTFTLaterTurnsMs = &Percentiles{P90: 30}
	a3 := ar
	a3.TTFTLaterTurnsMs = &Percentiles{P90: 20}
	m := medianRun([]ArmResult{ar, a2, a3})
	if m.TTFTLaterTurnsMs.P90 != 20 || len(m.TTFTLaterTurnsP90Runs) != 3 {
		t.Errorf("median later-turn p90 %v runs %v; want 20 over 3", m.TTFTLaterTurnsMs.P90, m.TTFTLaterTurnsP90Runs)
	}
	var sb strings.Builder
	rep := &Report{Suite: Suite{Fleet: f}, Workloads: []WorkloadResult{{Workload: w, Requests: w.Requests(), Bound: b, Arms: []ArmResult{m}}}}
	rep.WriteTable(&sb)
	if !strings.Contains(sb.String(), "later-turn p90") {
		t.Errorf("table lacks the later-turn column:\n%s", sb.String())
	}
}

func TestUpperBound(t *testing.T) {
	g := newTokenGen(1, 1)
	a, other := g.tokens(64), g.tokens(64) // 4 blocks of 16 each
	q := func() []uint32 { return g.tokens(8) }
	trace := []Req{{Tokens: concat(a, q())}, {Tokens: concat(other, q())}, {Tokens: concat(a, q())}}
	f := FleetConfig{Engines: 1, BlockSize: 16, CapacityBlocks: 4, PrefillUsPerToken: 1000, DecodeUsPerToken: 0, TimeScale: 1}
	// Unbounded: the third request hits a's 4 blocks: 64 of 216 tokens.
	b := UpperBound(trace, f)
	if got, want := b.Unbounded, 64.0/216; got != want {
		t.Errorf("unbounded %v, want %v", got, want)
	}
	// Room for 4 blocks only: b evicts a, so nothing hits, and the TTFT
	// floor is every prompt's full prefill (72 tokens x 1 ms).
	if b.FleetLRU != 0 || b.TTFTFloorMs.P50 != 72 {
		t.Errorf("4-block LRU %v, floor %v; want 0 and 72 ms", b.FleetLRU, b.TTFTFloorMs)
	}
	// A block-aligned repeat stops one block short (the last token is
	// always computed).
	trace = []Req{{Tokens: a}, {Tokens: a}}
	if got, want := UpperBound(trace, f).Unbounded, 48.0/128; got != want {
		t.Errorf("aligned repeat %v, want %v", got, want)
	}
}

func TestChartIsWellFormedSVG(t *testing.T) {
	w := &WorkloadResult{Workload: Workload{Name: "w", Title: "t <&>", Description: "d"}, Bound: Bound{FleetLRU: .8, Unbounded: .9},
		Arms: []ArmResult{{Arm: "rr", Label: "round robin", HitRatio: .2, TTFTms: Percentiles{P50: 10, P90: 90, P99: 200}},
			{Arm: "kv", Label: "KV", HitRatio: .75, TTFTms: Percentiles{P50: 5, P90: 20, P99: 40}}}}
	svg := Chart(w, DefaultFleet())
	dec := xml.NewDecoder(strings.NewReader(svg))
	for {
		if _, err := dec.Token(); err != nil {
			if err.Error() == "EOF" {
				break
			}
			t.Fatalf("invalid SVG: %v\n%s", err, svg)
		}
	}
	for _, want := range []string{"round robin", "upper bound", "TTFT"} {
		if !strings.Contains(svg, want) {
			t.Errorf("chart lacks %q", want)
		}
	}
}

// TestTinySuite runs the whole harness (real daemon process, emulated
// engines, proxy, rules per arm, report files) on a workload of seconds.
func TestTinySuite(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the daemon")
	}
	ctx := context.Background()
	wd, _ := os.Getwd()
	root, err := FindRepoRoot(wd)
	if err != nil {
		t.Fatal(err)
	}
	bins, err := BuildBinaries(ctx, root, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	s := TinySuite(3, 79)
	rep, err := Run(ctx, s, Options{Bin: bins, TokenizerDir: DefaultTokenizerDir(root), UseLoxicmd: true})
	if err != nil {
		t.Fatal(err)
	}
	var sb strings.Builder
	rep.WriteTable(&sb)
	t.Log("\n" + sb.String())
	if len(rep.Workloads) != len(s.Workloads) {
		t.Fatalf("%d workload results, want %d", len(rep.Workloads), len(s.Workloads))
	}
	for _, w := range rep.Workloads {
		if len(w.Arms) != len(s.Arms) {
			t.Fatalf("%s: %d arms, want %d", w.Workload.Name, len(w.Arms), len(s.Arms))
		}
		for _, a := range w.Arms {
			if a.Errors != 0 || a.Requests != w.Requests {
				t.Errorf("%s/%s: %d errors of %d requests (first: %s)", w.Workload.Name, a.Arm, a.Errors, a.Requests, a.FirstError)
			}
			sum := 0
			for _, n := range a.PerEndpoint {
				sum += n
			}
			if sum != w.Requests {
				t.Errorf("%s/%s: engines counted %d requests, want %d", w.Workload.Name, a.Arm, sum, w.Requests)
			}
			if a.HitRatio < 0 || a.HitRatio > 1 || a.TTFTms.P50 <= 0 {
				t.Errorf("%s/%s: implausible hit ratio %v or TTFT %v", w.Workload.Name, a.Arm, a.HitRatio, a.TTFTms)
			}
		}
		kv, rr := w.Arm(ArmKV.Name), w.Arm(ArmRR.Name)
		// The KV arm reports each endpoint's prefill budget: learned from
		// the engines (observed) or not yet (none), never configured.
		if len(kv.PrefillBudgets) != len(kv.PerEndpoint) || rr.PrefillBudgets != nil {
			t.Errorf("%s: prefill budgets kv %q rr %q", w.Workload.Name, kv.PrefillBudgets, rr.PrefillBudgets)
		}
		for _, b := range kv.PrefillBudgets {
			if b != "0 none" && !strings.HasSuffix(b, " observed") {
				t.Errorf("%s: prefill budget %q, want learned or none", w.Workload.Name, b)
			}
		}
		if kv.Tiers["tier1.5"] == 0 {
			t.Errorf("%s: the KV-exact arm made no Tier-1.5 decision: %v", w.Workload.Name, kv.Tiers)
		}
		if got := kv.TTFTLaterTurnsMs != nil && rr.TTFTLaterTurnsMs != nil; got != (w.Workload.Name == WMultiTurn) {
			t.Errorf("%s: later-turn TTFT reported %v", w.Workload.Name, got)
		}
		if w.Workload.Name == WShared100 && kv.HitRatio < rr.HitRatio {
			t.Errorf("%s: KV-exact hit ratio %.3f below round robin %.3f", w.Workload.Name, kv.HitRatio, rr.HitRatio)
		}
	}
	dir := t.TempDir()
	if err := rep.WriteFiles(dir); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"report.json", WShared100 + ".svg", WMultiTurn + ".svg"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Error(err)
		}
	}
}

// TestTinySuiteRestartAfterSubscribe empties the engines after each arm's
// daemon has subscribed and replayed their event buffers (which hold the
// previous arm's batches): the inventory must follow the restart, so the
// KV-exact arm does as well as after a clean start. With the llmbench seed
// a stale inventory (the event path before it told a restart from a
// replayed duplicate) gave 0.706 and 1.50 endpoints per group here,
// against 0.784 and 1.00.
func TestTinySuiteRestartAfterSubscribe(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the daemon")
	}
	ctx := context.Background()
	wd, _ := os.Getwd()
	root, err := FindRepoRoot(wd)
	if err != nil {
		t.Fatal(err)
	}
	bins, err := BuildBinaries(ctx, root, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	s := TinySuite(20261129, 79)
	s.Workloads = s.Workloads[:1] // shared-prefix-100
	kv := map[bool]*ArmResult{}
	for _, late := range []bool{false, true} {
		rep, err := Run(ctx, s, Options{Bin: bins, TokenizerDir: DefaultTokenizerDir(root), RestartAfterSubscribe: late})
		if err != nil {
			t.Fatal(err)
		}
		kv[late] = rep.Workloads[0].Arm(ArmKV.Name)
		if kv[late].Errors != 0 {
			t.Fatalf("late restart %v: %d errors (first: %s)", late, kv[late].Errors, kv[late].FirstError)
		}
	}
	clean, late := kv[false], kv[true]
	t.Logf("KV arm: clean start %.3f (%.2f endpoints per group), restart after subscribe %.3f (%.2f)",
		clean.HitRatio, clean.EndpointsPerGroup, late.HitRatio, late.EndpointsPerGroup)
	if late.HitRatio < clean.HitRatio-0.03 || late.EndpointsPerGroup > clean.EndpointsPerGroup+0.25 {
		t.Errorf("restart after subscribe: hit ratio %.3f, %.2f endpoints per group; clean start %.3f, %.2f",
			late.HitRatio, late.EndpointsPerGroup, clean.HitRatio, clean.EndpointsPerGroup)
	}
}
