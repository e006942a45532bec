package dispatch

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/selector"
	"github.com/loxilb-llm/loxilb/testbed/wait"
)

func transfersOf(f *fleet) []uint64 {
	out := make([]uint64, len(f.prefill))
	for i, e := range f.prefill {
		out[i] = e.Stats().PDTransfers
	}
	return out
}

func decodesOf(f *fleet) []uint64 {
	out := make([]uint64, len(f.decode))
	for i, e := range f.decode {
		out[i] = e.Stats().Completed
	}
	return out
}

// whichPrefill posts one request and returns the prefill engine that ran it.
func whichPrefill(t *testing.T, f *fleet, body any, hdr ...string) int {
	t.Helper()
	before := transfersOf(f)
	r := f.post(t, "/v1/completions", body, hdr...)
	if r.status != 200 {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	after := transfersOf(f)
	for i := range after {
		if after[i] != before[i] {
			return i
		}
	}
	t.Fatal("no prefill engine ran the request")
	return -1
}

// TestPrefixHistoryAndDecodeSpread: base P/D (no Tier 1.5). Every repeat
// of a long prefix goes to the prefill worker that took it first, while
// distinct prefixes and the decode legs spread over the workers.
func TestPrefixHistoryAndDecodeSpread(t *testing.T) {
	f := newFleet(t, fleetOpts{engine: "vllm", nPrefill: 3, nDec: 2})
	home := map[int]int{}
	used := map[int]bool{}
	for round := 0; round < 4; round++ {
		for p := 0; p < 6; p++ {
			body := bodyFor(flowCases[0], prompt(fmt.Sprintf("doc-%d", p), 20)+fmt.Sprintf(" question %d?", round), 4)
			got := whichPrefill(t, f, body)
			if round == 0 {
				home[p] = got
				used[got] = true
			} else if got != home[p] {
				t.Fatalf("prefix %d round %d went to prefill %d, its history says %d", p, round, got, home[p])
			}
		}
	}
	if len(used) < 2 {
		t.Fatalf("6 distinct prefixes all started on one prefill worker: %v", home)
	}
	dec := decodesOf(f)
	if dec[0] < 8 || dec[1] < 8 {
		t.Fatalf("decode legs did not spread over 2 workers: %v (24 requests)", dec)
	}
	if got := metricSum(t, f.reg, "loxilb_pd_prefill_tier_total", "tier", TierPrefix); got != 18 {
		t.Fatalf("prefix-tier choices %v, want 18", got)
	}
}

// TestTier15 (kvExactMode 1): with no history the KV scorer decides, and it
// sees only healthy prefill endpoints with their in-flight counts.
func TestTier15(t *testing.T) {
	f := newFleet(t, fleetOpts{engine: "vllm", nPrefill: 3, nDec: 1})
	f.pool.Prefill[0].Healthy = false
	var seen [][]selector.Candidate
	var mu sync.Mutex
	f.kv = func(c []selector.Candidate) (int, string, bool) {
		mu.Lock()
		seen = append(seen, append([]selector.Candidate(nil), c...))
		mu.Unlock()
		return 2, "tier=tier1.5 ep=2", true
	}
	// Distinct prompts, so the history tier never answers first.
	for i := 0; i < 4; i++ {
		if got := whichPrefill(t, f, bodyFor(flowCases[0], prompt(fmt.Sprintf("kv-%d", i), 10), 2)); got != 2 {
			t.Fatalf("request %d went to prefill %d, Tier 1.5 said 2", i, got)
		}
	}
	for _, c := range seen {
		if len(c) != 2 || c[0].Idx != 1 || c[1].Idx != 2 {
			t.Fatalf("Tier 1.5 candidates %+v, want healthy prefill endpoints 1 and 2", c)
		}
	}
	// A scorer miss falls through to least loaded.
	f.kv = func([]selector.Candidate) (int, string, bool) { return -1, "", false }
	whichPrefill(t, f, bodyFor(flowCases[0], prompt("miss", 10), 2))
	if got := metricSum(t, f.reg, "loxilb_pd_prefill_tier_total", "tier", TierLeastLoaded); got != 1 {
		t.Fatalf("least-loaded choices %v, want 1", got)
	}
	if got := metricSum(t, f.reg, "loxilb_pd_prefill_tier_total", "tier", TierKV); got != 4 {
		t.Fatalf("tier1.5 choices %v, want 4", got)
	}
}

// TestSessionAffinity: a session keeps its prefill and decode workers
// across unrelated prompts, and leaves an unhealthy one.
func TestSessionAffinity(t *testing.T) {
	f := newFleet(t, fleetOpts{engine: "vllm", nPrefill: 3, nDec: 3})
	first := whichPrefill(t, f, bodyFor(flowCases[0], prompt("s0", 4), 2), "X-Session-Id", "conv-1")
	dec := decodesOf(f)
	for i := 1; i < 5; i++ {
		if got := whichPrefill(t, f, bodyFor(flowCases[0], prompt(fmt.Sprintf("s%d", i), 4), 2), "X-Session-Id", "conv-1"); got != first {
			t.Fatalf("session request %d went to prefill %d, session is on %d", i, got, first)
		}
	}
	after := decodesOf(f)
	moved := 0
	for i := range after {
		if after[i] != dec[i] {
			moved++
		}
	}
	if moved != 1 {
		t.Fatalf("session decode legs used %d workers: %v -> %v", moved, dec, after)
	}
	f.pool.Prefill[first].Healthy = false
	if got := whichPrefill(t, f, bodyFor(flowCases[0], prompt("s9", 4), 2), "X-Session-Id", "conv-1"); got == first {
		t.Fatalf("session stayed on unhealthy prefill %d", first)
	}
	if got := metricSum(t, f.reg, "loxilb_ai_pd_session_hits_total"); got < 4 {
		t.Fatalf("session hits %v", got)
	}
}

// TestNoHealthy: no healthy prefill or decode endpoint is a clean 503.
func TestNoHealthy(t *testing.T) {
	f := newFleet(t, fleetOpts{engine: "sglang", nPrefill: 1, nDec: 1})
	f.pool.Decode[0].Healthy = false
	wantError(t, f.post(t, "/v1/completions", bodyFor(flowCases[0], "hi there", 2)), 503, "no_healthy_endpoint", "no healthy decode endpoint")
	f.pool.Prefill[0].Healthy = false
	wantError(t, f.post(t, "/v1/completions", bodyFor(flowCases[0], "hi there", 2)), 503, "no_healthy_endpoint", "no healthy prefill endpoint")
}

// TestBadBody: a body that is not a JSON object is a 400.
func TestBadBody(t *testing.T) {
	f := newFleet(t, fleetOpts{engine: "vllm", nPrefill: 1, nDec: 1})
	wantError(t, f.post(t, "/v1/completions", []int{1, 2}), 400, "bad_request", "JSON object")
}

// gatedPrefill is a prefill endpoint that holds every request until
// release is closed, then answers 500: a busy worker the test frees once it
// has checked what happened meanwhile, instead of waiting for a timeout.
func gatedPrefill(t *testing.T, idx int, release <-chan struct{}) Endpoint {
	t.Helper()
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		http.Error(w, `{"error":{"message":"released"}}`, http.StatusInternalServerError)
	}))
	t.Cleanup(s.Close)
	host, port, _ := net.SplitHostPort(s.Listener.Addr().String())
	p, _ := strconv.Atoi(port)
	return Endpoint{Idx: idx, Host: host, Port: p, Healthy: true}
}

// TestAdmissionBurst: with one slot and a queue of two per endpoint, a
// burst of 12 against a busy prefill worker gets one admission, two
// waiters that time out with 503, and nine immediate 429s, all with
// Retry-After; nothing waits beyond the bound.
func TestAdmissionBurst(t *testing.T) {
	f := newFleet(t, fleetOpts{engine: "vllm", nPrefill: 1, nDec: 1,
		cfg: Config{MaxInflightPerEP: 1, QueueDepthPerEP: 2, MaxPark: 300 * time.Millisecond}})
	release := make(chan struct{})
	f.pool.Prefill = []Endpoint{gatedPrefill(t, 0, release)}
	const n = 12
	type got struct {
		status int
		retry  string
		order  int
	}
	var (
		mu    sync.Mutex
		seq   int
		res   []got
		wg    sync.WaitGroup
		start = make(chan struct{})
	)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			<-start
			r := f.post(t, "/v1/completions", bodyFor(flowCases[0], prompt(fmt.Sprintf("burst-%d", i), 2), 2))
			mu.Lock()
			seq++
			res = append(res, got{r.status, r.header.Get("Retry-After"), seq})
			mu.Unlock()
		}(i)
	}
	close(start)
	// Wait until every request is either shed or parked/admitted, then
	// check the bound while they are still outstanding.
	// Every request but the admitted one is answered while it still holds
	// the slot: nine shed at once, two after their park.
	wait.Eventually(t, "every request but the admitted one to be answered", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(res) == n-1
	})
	if inflight := f.d.InFlight(7, 0); inflight != 1 {
		t.Fatalf("%d legs in flight on a 1-slot endpoint, want the admitted one", inflight)
	}
	close(release)
	wg.Wait()
	count := map[int]int{}
	lastShed, firstOK := 0, 1<<30
	for _, g := range res {
		count[g.status]++
		switch g.status {
		case http.StatusTooManyRequests, http.StatusServiceUnavailable:
			if g.retry == "" {
				t.Fatalf("%d without Retry-After", g.status)
			}
			if g.status == http.StatusTooManyRequests {
				lastShed = max(lastShed, g.order)
			}
		case http.StatusBadGateway:
			firstOK = min(firstOK, g.order)
		}
	}
	if count[429] != 9 || count[503] != 2 || count[502] != 1 {
		t.Fatalf("statuses %v, want nine 429, two 503 and one admitted", count)
	}
	if lastShed > firstOK {
		t.Fatalf("a 429 came after the admitted request finished: shed is not prompt")
	}
	if got := metricSum(t, f.reg, "loxilb_pd_admission_shed_total", "reason", "queue_full"); got != 9 {
		t.Fatalf("queue_full sheds %v", got)
	}
	if got := metricSum(t, f.reg, "loxilb_pd_admission_shed_total", "reason", "park_timeout"); got != 2 {
		t.Fatalf("park_timeout sheds %v", got)
	}
	if got := metricSum(t, f.reg, "loxilb_pd_admission_queued_total"); got != 2 {
		t.Fatalf("queued %v", got)
	}
	if got := metricSum(t, f.reg, "loxilb_ai_pd_requests_total", "outcome", "shed"); got != 11 {
		t.Fatalf("shed outcomes %v, want 11", got)
	}
}

// TestLeastLoadedSpread: with no affinity at all (short, distinct prompts)
// both the prefill and the decode legs rotate over every worker.
func TestLeastLoadedSpread(t *testing.T) {
	f := newFleet(t, fleetOpts{engine: "vllm", nPrefill: 2, nDec: 2})
	for i := 0; i < 8; i++ {
		whichPrefill(t, f, bodyFor(flowCases[0], fmt.Sprintf("hi %d", i), 2))
	}
	pre, dec := transfersOf(f), decodesOf(f)
	if pre[0] != 4 || pre[1] != 4 || dec[0] != 4 || dec[1] != 4 {
		t.Fatalf("prefill %v decode %v, want 4 each", pre, dec)
	}
}

// TestTotalCap: LLB_PD_MAX_TOTAL_INFLIGHT sheds with 429 at once, while
// the admitted request still runs.
func TestTotalCap(t *testing.T) {
	f := newFleet(t, fleetOpts{engine: "trtllm", nPrefill: 1, nDec: 1, cfg: Config{MaxTotalInflight: 1}})
	release := make(chan struct{})
	f.pool.Prefill = []Endpoint{gatedPrefill(t, 0, release)}
	var wg sync.WaitGroup
	statuses := make([]int, 3)
	for i := range statuses {
		wg.Add(1)
		go func() {
			defer wg.Done()
			statuses[i] = f.post(t, "/v1/completions", bodyFor(flowCases[0], fmt.Sprintf("cap %d", i), 2)).status
		}()
	}
	wait.Eventually(t, "two requests shed at the cap", func() bool {
		return metricSum(t, f.reg, "loxilb_pd_admission_shed_total", "reason", "total_cap") == 2
	})
	close(release)
	wg.Wait()
	count := map[int]int{}
	for _, s := range statuses {
		count[s]++
	}
	if count[429] != 2 || count[502] != 1 {
		t.Fatalf("statuses %v, want two 429 and the admitted one answered once released (502)", statuses)
	}
	if got := metricSum(t, f.reg, "loxilb_pd_admission_shed_total", "reason", "total_cap"); got != 2 {
		t.Fatalf("total_cap sheds %v", got)
	}
}
