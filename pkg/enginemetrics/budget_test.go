package enginemetrics

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/testbed/wait"
)

func TestParseServerInfoBudget(t *testing.T) {
	for body, want := range map[string]int{
		// The scheduler's effective cap per DP rank, summed.
		`{"max_running_requests":null,"dp_size":2,"internal_states":[{"effective_max_running_requests_per_dp":128},{"effective_max_running_requests_per_dp":128}]}`: 256,
		// It wins over the server argument it was derived from.
		`{"max_running_requests":300,"internal_states":[{"effective_max_running_requests_per_dp":52}]}`: 52,
		// Older builds: the server argument only.
		`{"max_running_requests":48,"internal_states":[{"last_gen_throughput":1.5}]}`: 48,
		`{"max_running_requests":2}`: 2,
	} {
		n, found, err := ParseServerInfoBudget([]byte(body))
		if err != nil || !found || n != want {
			t.Errorf("%s: %d %v %v, want %d", body, n, found, err, want)
		}
	}
	// Not published: no budget, no error (it is then observed).
	for _, body := range []string{`{"max_running_requests":null}`, `{"version":"0.4"}`, `{"internal_states":[]}`} {
		if n, found, err := ParseServerInfoBudget([]byte(body)); found || err != nil {
			t.Errorf("%s: %d %v %v, want not found", body, n, found, err)
		}
	}
	// Hostile or broken values are refused, naming the field.
	for body, field := range map[string]string{
		`{"max_running_requests":-4}`:                                        "max_running_requests",
		`{"max_running_requests":0}`:                                         "max_running_requests",
		`{"max_running_requests":1e300}`:                                     "max_running_requests",
		`{"max_running_requests":1048577}`:                                   "max_running_requests",
		`{"internal_states":[{"effective_max_running_requests_per_dp":-1}]}`: "internal_states[0]",
		`{"internal_states":[{"effective_max_running_requests_per_dp":1000000},{"effective_max_running_requests_per_dp":1000000}]}`: "sum of effective",
	} {
		_, found, err := ParseServerInfoBudget([]byte(body))
		if !errors.Is(err, errBadValue) || found || !strings.Contains(err.Error(), field) {
			t.Errorf("%s: found=%v err=%v, want a bad value naming %s", body, found, err, field)
		}
	}
	for _, body := range []string{`[1,2]`, `{"max_running_requests":"many"}`, `<html>`, ``} {
		if _, found, err := ParseServerInfoBudget([]byte(body)); err == nil || errors.Is(err, errBadValue) || found {
			t.Errorf("%q: found=%v err=%v, want malformed", body, found, err)
		}
	}
}

// A NaN, infinite, negative or absurd running/waiting gauge makes the
// whole sample a bad value (neither load nor a budget); other metrics of
// the page may be large.
func TestParseRefusesBadValues(t *testing.T) {
	for _, text := range []string{
		"vllm:num_requests_running NaN\nvllm:num_requests_waiting 0\n",
		"vllm:num_requests_running +Inf\nvllm:num_requests_waiting 0\n",
		"vllm:num_requests_running 3\nvllm:num_requests_waiting -1\n",
		"vllm:num_requests_running 2e6\nvllm:num_requests_waiting 0\n",
		"vllm:num_requests_running{engine=\"0\"} 600000\nvllm:num_requests_running{engine=\"1\"} 600000\n",
		"vllm:num_requests_running{engine=\"0\"} 5\nvllm:num_requests_running{engine=\"1\"} -3\n",
		"vllm:num_requests_running 1\nvllm:kv_cache_usage_perc NaN\n",
	} {
		if _, err := Parse("vllm", []byte(text)); !errors.Is(err, errBadValue) {
			t.Errorf("%q: %v, want a bad value", text, err)
		}
	}
	m, err := Parse("vllm", []byte("process_virtual_memory_bytes 4.2e9\nvllm:num_requests_running 3\nvllm:num_requests_waiting 1\n"))
	if err != nil || m.Running != 3 || m.Waiting != 1 {
		t.Fatalf("%+v %v", m, err)
	}
}

// fakeEngine serves an engine's /metrics and server info; tests change
// what it says between scrapes.
type fakeEngine struct {
	srv     *httptest.Server
	mu      sync.Mutex
	metrics string
	info    string // "" serves 404
}

func newFakeEngine(t *testing.T) *fakeEngine {
	f := &fakeEngine{}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		defer f.mu.Unlock()
		switch {
		case r.URL.Path == "/metrics":
			_, _ = w.Write([]byte(f.metrics))
		case r.URL.Path == "/get_server_info" && f.info != "":
			_, _ = w.Write([]byte(f.info))
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeEngine) say(metrics, info string) {
	f.mu.Lock()
	f.metrics, f.info = metrics, info
	f.mu.Unlock()
}

func (f *fakeEngine) rule(engine string) *lbrule.Rule {
	ap := netip.MustParseAddrPort(f.srv.Listener.Addr().String())
	return &lbrule.Rule{Service: lbrule.ServiceArgs{Mode: 4, KVEngine: engine},
		Endpoints: []lbrule.Endpoint{{IP: ap.Addr().String(), Port: int(ap.Port())}}}
}

func newTestScraper(t *testing.T, rule *lbrule.Rule) (*Scraper, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	s, err := New(Config{}, nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Reconcile(context.Background(), []control.Service{{ID: 3, Rule: rule}}); err != nil {
		t.Fatal(err)
	}
	return s, reg
}

func expectSlots(t *testing.T, s *Scraper, n int, src string) {
	t.Helper()
	got, gotSrc, ok := s.LearnedSlots(3, 0)
	if got != n || gotSrc != src || ok != (n > 0) {
		t.Fatalf("learned %d (%s, %v), want %d (%s)", got, gotSrc, ok, n, src)
	}
}

// SGLang publishes its cap: it is the budget at the first scrape, a
// hostile value is refused and counted, and a new target forgets it.
func TestScraperLearnsServerInfoBudget(t *testing.T) {
	eng := newFakeEngine(t)
	eng.say("sglang:num_running_reqs 0\nsglang:num_queue_reqs 0\n",
		`{"max_running_requests":null,"internal_states":[{"effective_max_running_requests_per_dp":6},{"effective_max_running_requests_per_dp":6}]}`)
	s, _ := newTestScraper(t, eng.rule("sglang"))
	ctx := context.Background()
	expectSlots(t, s, 0, "")
	s.scrapeAll(ctx)
	expectSlots(t, s, 12, BudgetServerInfo)

	// An engine that now claims a negative cap loses its budget at the
	// next read of its server info.
	eng.say("sglang:num_running_reqs 0\nsglang:num_queue_reqs 0\n", `{"max_running_requests":-5}`)
	for range serverInfoEvery {
		s.scrapeAll(ctx)
	}
	expectSlots(t, s, 0, "")
	if v := testutil.ToFloat64(s.budgetRejected.WithLabelValues(budgetBadValue)); v != 1 {
		t.Fatalf("budget rejected{bad_value} = %v, want 1", v)
	}
	eng.say("sglang:num_running_reqs 0\nsglang:num_queue_reqs 0\n", `{"max_running_requests":`)
	for range serverInfoEvery {
		s.scrapeAll(ctx)
	}
	if v := testutil.ToFloat64(s.budgetRejected.WithLabelValues(budgetMalformed)); v != 1 {
		t.Fatalf("budget rejected{malformed} = %v, want 1", v)
	}

	// A budget belongs to its target: another rule on the endpoint index
	// starts from nothing.
	eng.say("sglang:num_running_reqs 0\nsglang:num_queue_reqs 0\n", `{"max_running_requests":4}`)
	for range serverInfoEvery {
		s.scrapeAll(ctx)
	}
	expectSlots(t, s, 4, BudgetServerInfo)
	moved := eng.rule("sglang")
	moved.Endpoints[0].IP = "127.0.0.2"
	if err := s.Reconcile(ctx, []control.Service{{ID: 3, Rule: moved}}); err != nil {
		t.Fatal(err)
	}
	expectSlots(t, s, 0, "")
}

// vllmStep returns a function that makes the fake vLLM engine report the
// given running and waiting gauges and scrapes it once.
func vllmStep(eng *fakeEngine, s *Scraper) func(running, waiting string) {
	return func(running, waiting string) {
		eng.say("vllm:num_requests_running "+running+"\nvllm:num_requests_waiting "+waiting+"\n", "")
		s.scrapeAll(context.Background())
	}
}

// vLLM publishes no cap: the budget is the most requests seen running,
// once the engine was seen queueing at that peak in consecutive scrapes;
// bad gauges teach nothing.
func TestScraperObservesBudget(t *testing.T) {
	eng := newFakeEngine(t)
	s, reg := newTestScraper(t, eng.rule("vllm"))
	step := vllmStep(eng, s)
	step("3", "0")
	expectSlots(t, s, 0, "") // busy, but nothing queued yet
	step("3", "4")
	expectSlots(t, s, 0, "") // one sample may be an arrival not yet scheduled
	step("3", "4")
	expectSlots(t, s, 3, BudgetObserved)
	step("5", "0") // running never exceeds the budget: it is at least 5
	expectSlots(t, s, 5, BudgetObserved)
	step("NaN", "1")
	step("900000000", "1")
	step("-7", "1")
	expectSlots(t, s, 5, BudgetObserved)
	if v := testutil.ToFloat64(s.budgetRejected.WithLabelValues(budgetBadValue)); v != 3 {
		t.Fatalf("budget rejected{bad_value} = %v, want 3", v)
	}
	if n, err := testutil.GatherAndCount(reg, "loxilb_gateway_engine_scrape_errors_total"); err != nil || n != 1 {
		t.Fatalf("scrape errors series: %d %v", n, err)
	}
}

// An engine of two sequences shows one running and one waiting in the
// instant between a request's arrival and its scheduling, scrape after
// scrape apart: those samples must not teach a budget of one, which would
// halve the endpoint behind the gateway's queue.
func TestScraperIgnoresTransientQueue(t *testing.T) {
	eng := newFakeEngine(t)
	s, _ := newTestScraper(t, eng.rule("vllm"))
	step := vllmStep(eng, s)
	for range 3 {
		step("1", "1")
		expectSlots(t, s, 0, "")
		step("1", "0")
	}
	step("2", "3")
	step("2", "3")
	expectSlots(t, s, 2, BudgetObserved)
}

// Requests waiting beside fewer running than the engine was seen running
// are requests not yet scheduled by an engine short of its budget (for up
// to a step; a busy machine stretches the instant), not a queue: however
// often consecutive samples land there, they must not teach the peak as
// a budget the engine is far from.
func TestScraperIgnoresQueueBelowPeak(t *testing.T) {
	eng := newFakeEngine(t)
	s, _ := newTestScraper(t, eng.rule("vllm"))
	step := vllmStep(eng, s)
	step("5", "0")
	for range 3 {
		step("3", "1")
	}
	expectSlots(t, s, 0, "")
	step("5", "2")
	step("5", "1")
	expectSlots(t, s, 5, BudgetObserved)
}

// An engine queues in bursts that scrapes a second apart rarely see twice
// in a row: while its budget is unknown and this node has more requests
// open there than it was seen running, the scraper samples it again
// within a probe gap and learns the budget from the burst. Once learned,
// nothing is probed.
func TestScraperProbesWhileLearning(t *testing.T) {
	eng := newFakeEngine(t)
	eng.say("vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n", "")
	var open atomic.Int64
	open.Store(3)
	s, err := New(Config{Interval: time.Hour, SelfInFlight: func(uint32, int) int { return int(open.Load()) }}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Reconcile(context.Background(), []control.Service{{ID: 3, Rule: eng.rule("vllm")}}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	wait.Eventually(t, "a budget learned from probes", func() bool {
		n, _, _ := s.LearnedSlots(3, 0)
		return n == 2
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if p := s.dueProbes(time.Now().Add(time.Hour)); len(p) != 0 {
		t.Fatalf("probes after the budget was learned: %v", p)
	}
}

// probedVLLM is a scraper of one emulated vLLM endpoint (service 3,
// endpoint 0) whose open requests on this node are *open, and the step
// that sets the engine's gauges and scrapes it once.
func probedVLLM(t *testing.T) (*Scraper, func(running, waiting string), *atomic.Int64) {
	t.Helper()
	eng := newFakeEngine(t)
	open := new(atomic.Int64)
	s, err := New(Config{SelfInFlight: func(uint32, int) int { return int(open.Load()) }}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Reconcile(context.Background(), []control.Service{{ID: 3, Rule: eng.rule("vllm")}}); err != nil {
		t.Fatal(err)
	}
	return s, vllmStep(eng, s), open
}

// Probes are taken only where the engine may be queueing at a new peak
// or a queue awaits confirmation, never twice within a gap.
func TestDueProbes(t *testing.T) {
	s, step, open := probedVLLM(t)
	now := time.Now()
	if p := s.dueProbes(now); len(p) != 0 {
		t.Fatalf("probed before the first scrape: %v", p)
	}
	step("2", "0")
	open.Store(2) // no more open than the engine runs: it is not queueing
	if p := s.dueProbes(now.Add(time.Second)); len(p) != 0 {
		t.Fatalf("probed an engine running all it has: %v", p)
	}
	open.Store(3)
	if p := s.dueProbes(now.Add(time.Second)); len(p) != 1 {
		t.Fatalf("not probed with more open than seen running: %v", p)
	}
	if p := s.dueProbes(now.Add(time.Second)); len(p) != 0 {
		t.Fatalf("probed while a probe is under way: %v", p)
	}
	s.probeDone(epKey{3, 0}, s.targets[epKey{3, 0}])
	if p := s.dueProbes(now.Add(time.Second + probeGap/2)); len(p) != 0 {
		t.Fatalf("probed twice within a gap: %v", p)
	}
	open.Store(0)
	step("2", "1") // queueing at the peak: confirm it soon
	if p := s.dueProbes(time.Now().Add(probeGap)); len(p) != 1 {
		t.Fatalf("a queue at the peak not confirmed: %v", p)
	}
}

// TestProbesStopOnABlindGauge: an engine whose running gauge stays at 0
// while this node has requests open there teaches no budget, so it is not
// probed every probeGap for as long as it has work; a sample that sees
// something running resumes the probes.
func TestProbesStopOnABlindGauge(t *testing.T) {
	s, step, open := probedVLLM(t)
	if !s.learning() {
		t.Fatal("an endpoint not scraped yet does not count as learning")
	}
	step("0", "0") // idle: nothing open, not blind
	open.Store(3)
	for i := 1; i < blindSamples; i++ {
		step("0", "0")
		if p := s.dueProbes(time.Now().Add(time.Second)); len(p) != 1 {
			t.Fatalf("after %d blind samples: probes %v, want 1", i, p)
		}
		s.probeDone(epKey{3, 0}, s.targets[epKey{3, 0}])
	}
	step("0", "0")
	if p := s.dueProbes(time.Now().Add(time.Second)); len(p) != 0 {
		t.Fatalf("still probed after %d samples that saw nothing running: %v", blindSamples, p)
	}
	if s.learning() {
		t.Fatal("the probe loop keeps its fast tick for an endpoint it no longer probes")
	}
	step("1", "0")
	if !s.learning() {
		t.Fatal("an endpoint seen running with no budget yet does not count as learning")
	}
	if p := s.dueProbes(time.Now().Add(time.Second)); len(p) != 1 {
		t.Fatalf("not probed again once something ran: %v", p)
	}
	s.probeDone(epKey{3, 0}, s.targets[epKey{3, 0}])
	for range queuedSamples {
		step("1", "2") // queueing at its peak: the budget is learned
	}
	if _, _, ok := s.LearnedSlots(3, 0); !ok {
		t.Fatal("no budget learned from a queue at the peak")
	}
	if s.learning() {
		t.Fatal("still learning with every budget known")
	}
}
