package gateway

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/engine"
	"github.com/loxilb-llm/loxilb/pkg/kvindex"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
)

func TestAppendFields(t *testing.T) {
	fields := []string{engine.SGLangRankField, engine.SGLangLegacyRankField}
	cases := []struct {
		in, want string
		ok       bool
	}{
		{`{"model":"m","prompt":"hi"}`, `{"model":"m","prompt":"hi","routed_dp_rank":1,"data_parallel_rank":1}`, true},
		{"  {\"prompt\":[1,2]}\n", `  {"prompt":[1,2],"routed_dp_rank":1,"data_parallel_rank":1}`, true},
		{`{ }`, `{ "routed_dp_rank":1,"data_parallel_rank":1}`, true},
		// A client's own rank is overridden: decoders keep the last duplicate.
		{`{"prompt":"x","routed_dp_rank":0}`, `{"prompt":"x","routed_dp_rank":0,"routed_dp_rank":1,"data_parallel_rank":1}`, true},
		{`[1,2]`, ``, false},
		{`{"prompt":"x"`, ``, false},
		{``, ``, false},
		{`}`, ``, false},
	}
	for _, c := range cases {
		got, ok := appendFields([]byte(c.in), fields, 1)
		if ok != c.ok || string(got) != c.want {
			t.Errorf("appendFields(%q) = %q, %v; want %q, %v", c.in, got, ok, c.want, c.ok)
		}
		if ok {
			var m map[string]any
			if err := json.Unmarshal(got, &m); err != nil || m["routed_dp_rank"] != 1.0 {
				t.Errorf("appendFields(%q) = %q: %v %v", c.in, got, m, err)
			}
		}
	}
}

func TestChooseRank(t *testing.T) {
	ix, err := kvindex.New(kvindex.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	keys := []uint64{10, 11, 12, 13}
	// Nothing cached: a stable rank for the prefix, whatever is asked.
	r0 := chooseRankNoLoad(ix, 1, 0, 2, keys)
	for range 5 {
		if r := chooseRankNoLoad(ix, 1, 0, 2, keys); r != r0 {
			t.Fatalf("cold rank changed: %d then %d", r0, r)
		}
	}
	// The rank holding the longer prefix wins when the other would
	// recompute more than the request's own uncached block.
	ix.Store(1, 0, 1, keys[:3])
	ix.Store(1, 0, 0, keys[:1])
	if r := chooseRankNoLoad(ix, 1, 0, 2, keys); r != 1 {
		t.Fatalf("rank %d, want 1 (3 blocks against 1)", r)
	}
	ix.Store(1, 0, 0, keys)
	if r := chooseRankNoLoad(ix, 1, 0, 2, keys); r != 0 {
		t.Fatalf("rank %d, want 0 (4 blocks against 3)", r)
	}
	// Continuations of one shared prefix spread over the ranks.
	ix2, _ := kvindex.New(kvindex.Config{}, nil)
	shared := []uint64{1, 2}
	ix2.Store(1, 0, 0, shared)
	ix2.Store(1, 0, 1, shared)
	seen := map[int]bool{}
	for i := range 64 {
		seen[chooseRankNoLoad(ix2, 1, 0, 2, []uint64{1, 2, uint64(1000 + i*7919)})] = true
	}
	if len(seen) != 2 {
		t.Fatalf("64 continuations of one cached prefix all went to rank(s) %v", seen)
	}
}

// A system prompt cached on one rank only does not pin every new document
// after it to that rank (the sibling rank's cache would stay empty), while
// a session whose history is long against its new turn stays on its rank.
func TestChooseRankSpreadsPastSharedPrompt(t *testing.T) {
	ix, err := kvindex.New(kvindex.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	sys := []uint64{1, 2, 3, 4, 5, 6, 7, 8}
	ix.Store(1, 0, 0, sys) // only rank 0 has seen the system prompt
	doc := func(d int) []uint64 {
		k := append([]uint64(nil), sys...)
		for b := range 90 {
			k = append(k, uint64(1_000_000*(d+1)+b))
		}
		return k
	}
	per := [2]int{}
	for d := range 64 {
		r := chooseRankNoLoad(ix, 1, 0, 2, doc(d))
		per[r]++
		if again := chooseRankNoLoad(ix, 1, 0, 2, doc(d)); again != r {
			t.Fatalf("document %d went to rank %d, then %d", d, r, again)
		}
	}
	if per[0] == 0 || per[1] == 0 {
		t.Fatalf("64 new documents after a system prompt cached on rank 0 only: per rank %v", per)
	}
	// A session on rank 1: 98 cached blocks, 4 new ones.
	session := doc(99)[:98] // 98 blocks
	session = append(session, 7, 7, 7, 7)
	ix.Store(1, 0, 1, session[:98])
	for range 8 {
		if r := chooseRankNoLoad(ix, 1, 0, 2, session); r != 1 {
			t.Fatalf("session left its 98-block history for rank %d", r)
		}
	}
}

func chooseRankNoLoad(inv RankInventory, service uint32, ep, ranks int, keys []uint64) int {
	return chooseRank(inv, service, ep, ranks, keys, nil).rank
}

// place routes keys to a rank of endpoint 0 of service 1 the way Pick
// does, and returns the rank and the function that ends the request.
func place(rl *rankLoad, inv RankInventory, scraped RankMetrics, keys []uint64, now time.Time) (int, func()) {
	var lv rankSnapshot
	rl.snapshot(1, 0, 2, 5*time.Second, now, scraped, &lv)
	ch := chooseRank(inv, 1, 0, 2, keys, &lv)
	return ch.rank, rl.begin(1, 0, ch.rank, keys, ch.best, now)
}

// sessionsHashedTo returns n sessions (a shared 8-block system prompt,
// then 20 blocks of their own) that the hash alone sends to rank want
// when only rank 0 holds the system prompt.
func sessionsHashedTo(t *testing.T, inv RankInventory, sys []uint64, want, n int) [][]uint64 {
	t.Helper()
	var out [][]uint64
	for s := 0; len(out) < n && s < 10000; s++ {
		k := append([]uint64(nil), sys...)
		for b := range 20 {
			k = append(k, uint64(7_000_000*(s+1)+b))
		}
		if chooseRankNoLoad(inv, 1, 0, 2, k) == want {
			out = append(out, k)
		}
	}
	if len(out) < n {
		t.Fatalf("found %d sessions hashed to rank %d", len(out), want)
	}
	return out
}

// Sessions that start together, whose own text is long against the shared
// system prompt, spread over the ranks by load even when the hash would
// put every one of them on the rank holding the system prompt (today's
// rule: 8 of 8 on rank 0, whose cache then holds four sessions' histories
// while rank 1's holds none).
func TestChooseRankSpreadsSessionsByLoad(t *testing.T) {
	ix, err := kvindex.New(kvindex.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	sys := []uint64{1, 2, 3, 4, 5, 6, 7, 8}
	ix.Store(1, 0, 0, sys)
	var rl rankLoad
	now := time.Unix(1000, 0)
	per := [2]int{}
	for _, s := range sessionsHashedTo(t, ix, sys, 0, 8) {
		r, _ := place(&rl, ix, nil, s, now) // each session's first turn is still in flight
		per[r]++
		now = now.Add(time.Millisecond)
	}
	if per != [2]int{4, 4} {
		t.Fatalf("8 sessions starting together, all hashed to rank 0: per rank %v, want [4 4]", per)
	}
	// Once the first turns have ended, the recent placements still
	// balance the next sessions.
	var rl2 rankLoad
	per = [2]int{}
	for _, s := range sessionsHashedTo(t, ix, sys, 0, 6) {
		r, done := place(&rl2, ix, nil, s, now)
		done()
		done() // a second release is harmless
		per[r]++
	}
	if per != [2]int{3, 3} {
		t.Fatalf("6 sessions one after another: per rank %v, want [3 3]", per)
	}
	// A cold engine: no rank holds the system prompt yet, and every
	// session starts with it (today's rule hashes the same first block
	// for all: 8 of 8 on one rank). Sharing a prefix short against their
	// own text, they do not follow one another.
	cold, _ := kvindex.New(kvindex.Config{}, nil)
	var rl3 rankLoad
	per = [2]int{}
	for _, s := range sessionsHashedTo(t, cold, sys, chooseRankNoLoad(cold, 1, 0, 2, sys), 8) {
		r, _ := place(&rl3, cold, nil, s, now)
		per[r]++
	}
	if per != [2]int{4, 4} {
		t.Fatalf("8 sessions starting together on a cold engine: per rank %v, want [4 4]", per)
	}
}

// The engine's own per-rank gauges count too: requests other gateways
// sent to a rank are load this gateway did not route.
func TestChooseRankReadsScrapedRankLoad(t *testing.T) {
	ix, _ := kvindex.New(kvindex.Config{}, nil)
	sys := []uint64{1, 2, 3, 4, 5, 6, 7, 8}
	ix.Store(1, 0, 0, sys)
	var rl rankLoad
	busy := fakeRankMetrics{running: []int{3, 0}, waiting: []int{2, 0}}
	for _, s := range sessionsHashedTo(t, ix, sys, 0, 4) {
		if r, _ := place(&rl, ix, busy, s, time.Unix(1000, 0)); r != 1 {
			t.Fatalf("rank %d with 5 requests on rank 0 and none on rank 1", r)
		}
	}
	loads := rl.ranks(1, 0, 2, 5*time.Second, time.Unix(1000, 0), busy)
	if len(loads) != 2 || loads[1].InFlight != 4 || loads[1].Placed != 4 || loads[0].Running != 3 || loads[0].Waiting != 2 || loads[0].InFlight != 0 {
		t.Fatalf("rank loads %+v", loads)
	}
}

type fakeRankMetrics struct{ running, waiting []int }

func (f fakeRankMetrics) RankMetrics(_ uint32, _ int, running, waiting []int) bool {
	copy(running, f.running)
	copy(waiting, f.waiting)
	return true
}

// Load never pulls a session off a long cached history, and requests that
// extend a prefix placed a moment ago meet on its rank however loaded it
// is: siblings of a new prompt, and a session's next turn sent before the
// engine's events for its previous turn arrived.
func TestChooseRankKeepsHistoryAndSiblingsOverLoad(t *testing.T) {
	ix, _ := kvindex.New(kvindex.Config{}, nil)
	sys := []uint64{1, 2, 3, 4, 5, 6, 7, 8}
	ix.Store(1, 0, 0, sys)
	ix.Store(1, 0, 1, sys)
	var rl rankLoad
	now := time.Unix(1000, 0)
	// A 98-block history on rank 1, which has 6 requests in flight.
	hist := append([]uint64(nil), sys...)
	for b := range 90 {
		hist = append(hist, uint64(5_000_000+b))
	}
	ix.Store(1, 0, 1, hist)
	for range 6 {
		rl.begin(1, 0, 1, []uint64{42}, 0, now)
	}
	turn := append(append([]uint64(nil), hist...), 9, 9, 9, 9)
	if r, _ := place(&rl, ix, nil, turn, now); r != 1 {
		t.Fatalf("a session left its 98-block history on a loaded rank for rank %d", r)
	}
	// A new prompt after the system prompt, and a sibling sharing it.
	first := append(append([]uint64(nil), sys...), 100, 101, 102, 103)
	r1, _ := place(&rl, ix, nil, first, now)
	for i := range 4 {
		sib := append(append([]uint64(nil), sys...), 100, 101, 102, uint64(200+i))
		if r, _ := place(&rl, ix, nil, sib, now.Add(time.Second)); r != r1 {
			t.Fatalf("sibling %d went to rank %d, the prompt it shares to rank %d", i, r, r1)
		}
	}
	// A sibling finds on that rank, once the prompt it followed is
	// computed, the 11 blocks it shares with it, not just the system
	// prompt the engine has reported.
	var sl rankSnapshot
	rl.snapshot(1, 0, 2, 5*time.Second, now.Add(time.Second), nil, &sl)
	sib := append(append([]uint64(nil), sys...), 100, 101, 102, 300)
	if ch := chooseRank(ix, 1, 0, 2, sib, &sl); ch.rank != r1 || ch.best != 8 || ch.held != 11 {
		t.Fatalf("sibling: %+v, want rank %d holding 11 blocks (8 reported)", ch, r1)
	}
	// The first prompt's next turn, its events not yet arrived.
	next := append(append([]uint64(nil), first...), 104, 105)
	if r, _ := place(&rl, ix, nil, next, now.Add(2*time.Second)); r != r1 {
		t.Fatalf("next turn went to rank %d, its previous turn to %d", r, r1)
	}
	// Long after, with the events still missing, load decides again.
	other := 1 - r1
	var lv rankSnapshot
	rl.snapshot(1, 0, 2, 5*time.Second, now.Add(time.Minute), nil, &lv)
	lv.load[r1], lv.load[other] = 10, 0
	if r := chooseRank(ix, 1, 0, 2, next, &lv).rank; r != other {
		t.Fatalf("a placement a minute old still decided the rank (%d)", r)
	}
}

func TestRankLoadForget(t *testing.T) {
	var rl rankLoad
	done := rl.begin(1, 0, 1, []uint64{5}, 0, time.Unix(1, 0))
	rl.begin(2, 0, 1, []uint64{5}, 0, time.Unix(1, 0))
	rl.forget(1)
	done() // the release of a forgotten rule's request touches nothing read
	if got := rl.ranks(1, 0, 2, time.Hour, time.Unix(1, 0), nil); got[1].InFlight != 0 || got[1].Placed != 0 {
		t.Fatalf("forgotten service still has load %+v", got)
	}
	if got := rl.ranks(2, 0, 2, time.Hour, time.Unix(1, 0), nil); got[1].InFlight != 1 {
		t.Fatalf("other service lost its load %+v", got)
	}
	if f := rl.begin(1, 0, 99, []uint64{5}, 0, time.Unix(1, 0)); f == nil {
		t.Fatal("nil release for an out-of-range rank")
	}
}

func TestRankTargetingPerEngine(t *testing.T) {
	if newRankTargeting("sglang", 1) != nil || newRankTargeting("trtllm", 4) != nil || newRankTargeting("llamacpp", 2) != nil {
		t.Fatal("targeting for a single rank or an engine that cannot be told one")
	}
	body := []byte(`{"prompt":"x"}`)
	sg := newRankTargeting("sglang", 2)
	ep, ok := sg.targetEndpoint(proxy.Endpoint{Idx: 3, Addr: "a"}, 1, body)
	if !ok || string(ep.Body) != `{"prompt":"x","routed_dp_rank":1,"data_parallel_rank":1}` || ep.Header != nil || ep.Idx != 3 {
		t.Fatalf("sglang endpoint %+v", ep)
	}
	vl := newRankTargeting("", 2) // the default engine is vLLM
	ep, ok = vl.targetEndpoint(proxy.Endpoint{Idx: 0, Addr: "a"}, 1, body)
	if !ok || ep.Body != nil || ep.Header.Get("X-data-parallel-rank") != "1" {
		t.Fatalf("vllm endpoint %+v", ep)
	}
	if _, ok := sg.targetEndpoint(proxy.Endpoint{}, 0, []byte(`[]`)); ok {
		t.Fatal("a non-object body was rewritten")
	}
}

// A request sent to a data-parallel rank that holds less of its prompt
// than the endpoint's deepest rank (chosen for its load, or seeded) counts
// as outstanding prefill work what that rank must compute: the whole
// prompt here, not the prompt minus the busy rank's prefix. Counted short,
// the endpoint looked lighter than it was to the misses placed by least
// prefill work.
func TestPickCountsTheChosenRanksPrefillWork(t *testing.T) {
	r := rule(3, "Qwen/Qwen3-0.6B")
	r.Service.KVEngine, r.Service.KVDpRankCount = "sglang", 2
	f := newFixture(t, r)
	st := f.g.lookup(1)
	ids, reason, err := f.g.promptTokens(context.Background(), st, "Qwen/Qwen3-0.6B", req(prompt))
	if err != nil || reason != "" {
		t.Fatalf("tokenize: %v %q", err, reason)
	}
	keys := st.hasher.Keys(nil, ids)
	bs := st.hasher.BlockSize()
	if len(keys) < 4 {
		t.Fatalf("%d blocks", len(keys))
	}
	// Rank 0 of endpoint 0 holds the first half and has three requests in
	// flight; rank 1 holds nothing and ties (it lacks no more than the
	// request's own uncached half), so the request goes to rank 1.
	half := len(keys) / 2
	f.ix.Store(1, 0, 0, keys[:half])
	for range 3 {
		f.g.ranks.begin(1, 0, 0, []uint64{42}, 0, time.Now())
	}
	p, err := f.g.Pick(context.Background(), req(prompt))
	if err != nil {
		t.Fatal(err)
	}
	rc, _ := router.ParseReceipt(p.Receipt)
	if rc.EP != 0 || rc.Matched != half || !rc.RankSet || rc.Rank != 1 {
		t.Fatalf("receipt %+v: want endpoint 0, %d blocks matched, rank 1", rc, half)
	}
	if got := f.g.work.outstanding(1, 0); got != int64(len(ids)) {
		t.Fatalf("outstanding prefill work %d tokens on endpoint 0, want the whole %d-token prompt (rank 1 holds none of it; rank 0 holds %d tokens)",
			got, len(ids), half*bs)
	}
	p.FirstByte()
	if got := f.g.work.outstanding(1, 0); got != 0 {
		t.Fatalf("%d tokens outstanding after the first byte", got)
	}
	// On the deepest rank the work is the prompt minus its prefix.
	f.g.ranks.forget(1)
	for range 3 {
		f.g.ranks.begin(1, 0, 1, []uint64{42}, 0, time.Now())
	}
	p, err = f.g.Pick(context.Background(), req(prompt))
	if err != nil {
		t.Fatal(err)
	}
	if rc, _ := router.ParseReceipt(p.Receipt); rc.Rank != 0 {
		t.Fatalf("receipt %+v: want rank 0", rc)
	}
	if got, want := f.g.work.outstanding(1, 0), int64(len(ids)-half*bs); got != want {
		t.Fatalf("outstanding prefill work %d tokens on the deepest rank, want %d", got, want)
	}
	p.Done(proxy.Result{Endpoint: 0, Status: 200})
}
