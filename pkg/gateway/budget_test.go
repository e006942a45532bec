package gateway

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/pkg/selector"
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
func TestParseEngineMetricsRefusesBadValues(t *testing.T) {
	for _, text := range []string{
		"vllm:num_requests_running NaN\nvllm:num_requests_waiting 0\n",
		"vllm:num_requests_running +Inf\nvllm:num_requests_waiting 0\n",
		"vllm:num_requests_running 3\nvllm:num_requests_waiting -1\n",
		"vllm:num_requests_running 2e6\nvllm:num_requests_waiting 0\n",
		"vllm:num_requests_running{engine=\"0\"} 600000\nvllm:num_requests_running{engine=\"1\"} 600000\n",
		"vllm:num_requests_running{engine=\"0\"} 5\nvllm:num_requests_running{engine=\"1\"} -3\n",
		"vllm:num_requests_running 1\nvllm:kv_cache_usage_perc NaN\n",
	} {
		if _, err := ParseEngineMetrics("vllm", []byte(text)); !errors.Is(err, errBadValue) {
			t.Errorf("%q: %v, want a bad value", text, err)
		}
	}
	m, err := ParseEngineMetrics("vllm", []byte("process_virtual_memory_bytes 4.2e9\nvllm:num_requests_running 3\nvllm:num_requests_waiting 1\n"))
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
	s, err := NewScraper(ScraperConfig{}, nil, reg)
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
	expectSlots(t, s, 0, BudgetNone)
	s.scrapeAll(ctx)
	expectSlots(t, s, 12, BudgetServerInfo)

	// An engine that now claims a negative cap loses its budget at the
	// next read of its server info.
	eng.say("sglang:num_running_reqs 0\nsglang:num_queue_reqs 0\n", `{"max_running_requests":-5}`)
	for range serverInfoEvery {
		s.scrapeAll(ctx)
	}
	expectSlots(t, s, 0, BudgetNone)
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
	expectSlots(t, s, 0, BudgetNone)
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
// once the engine was seen queueing in consecutive scrapes; bad gauges
// teach nothing.
func TestScraperObservesBudget(t *testing.T) {
	eng := newFakeEngine(t)
	s, reg := newTestScraper(t, eng.rule("vllm"))
	step := vllmStep(eng, s)
	step("3", "0")
	expectSlots(t, s, 0, BudgetNone) // busy, but nothing queued yet
	step("2", "4")
	expectSlots(t, s, 0, BudgetNone) // one sample may be an arrival not yet scheduled
	step("2", "4")
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
		expectSlots(t, s, 0, BudgetNone)
		step("1", "0")
	}
	step("2", "3")
	step("2", "3")
	expectSlots(t, s, 2, BudgetObserved)
}

// fakeLearner hands out budgets set by the test.
type fakeLearner struct {
	mu    sync.Mutex
	slots map[int]int
}

func (f *fakeLearner) Metrics(uint32, int) (selector.EngineMetrics, bool) {
	return selector.EngineMetrics{}, false
}

func (f *fakeLearner) LearnedSlots(_ uint32, ep int) (int, string, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := f.slots[ep]
	return n, BudgetObserved, n > 0
}

func (f *fakeLearner) learn(n int) {
	f.mu.Lock()
	f.slots = map[int]int{0: n, 1: n}
	f.mu.Unlock()
}

// With the daemon's defaults (no LOXILB_KV_PREFILL_SLOTS) requests go
// straight through until a budget is learned, then queue for it.
func TestPickQueuesOnceBudgetLearned(t *testing.T) {
	slots, wait := PrefillAuto, DefaultPrefillQueueWait
	learner := &fakeLearner{}
	f := newFixtureEngine(t, Config{Seed: "1", PrefillSlots: slots, PrefillQueueWait: wait, CoalesceWait: -1}, learner, rule(3, ""))

	// Nothing learned: no regression, both are forwarded at once.
	p1, err := f.g.Pick(context.Background(), req(prompt))
	if err != nil {
		t.Fatal(err)
	}
	p2, err := f.g.Pick(context.Background(), req(prompt))
	if err != nil {
		t.Fatal(err)
	}
	if n, src := f.g.PrefillBudget(1, 0); n != 0 || src != BudgetNone {
		t.Fatalf("budget before learning: %d %s", n, src)
	}
	if f.g.prefill.queues(1, 2) {
		t.Fatal("the router is told requests queue before any budget is known")
	}
	p1.FirstByte()
	p2.FirstByte()
	p1.Done(proxy.Result{Status: 200})
	p2.Done(proxy.Result{Status: 200})

	learner.learn(1)
	p3, err := f.g.Pick(context.Background(), req(prompt))
	if err != nil {
		t.Fatal(err)
	}
	first, _ := router.ParseReceipt(p3.Receipt)
	second := pickAsync(context.Background(), f.g, req(prompt))
	waitUntil(t, "the second request to queue for the learned slot", func() bool {
		select {
		case r := <-second:
			t.Fatalf("forwarded at once (err %v): the default does not queue on a learned budget", r.err)
		default:
		}
		return f.g.prefill.queuedFor(1, first.EP) == 1
	})
	if n, src := f.g.PrefillBudget(1, first.EP); n != 1 || src != BudgetObserved {
		t.Fatalf("budget: %d %s", n, src)
	}
	if !f.g.prefill.queues(1, 2) {
		t.Fatal("a learned budget does not make the router price load shortest-first")
	}
	if got := slotsSeries(t, f.reg); got != `ep_idx=0 service=1 source=observed: 1; ep_idx=1 service=1 source=observed: 1; ` {
		t.Fatalf("loxilb_kv_prefill_slots: %s", got)
	}
	p3.FirstByte()
	r := <-second
	if r.err != nil {
		t.Fatal(r.err)
	}
	ep := string(rune('0' + first.EP))
	if v := testutil.ToFloat64(f.g.m.admitted.WithLabelValues("1", ep, string(admitQueued))); v != 1 {
		t.Fatalf("admitted{queued} = %v", v)
	}
	p3.Done(proxy.Result{Endpoint: first.EP, Status: 200})
	r.plan.Done(proxy.Result{Endpoint: first.EP, Status: 200})
}

// slotsSeries renders loxilb_kv_prefill_slots as "labels: value; ...".
func slotsSeries(t *testing.T, reg *prometheus.Registry) string {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, mf := range mfs {
		if mf.GetName() != "loxilb_kv_prefill_slots" {
			continue
		}
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, l.GetName()+"="+l.GetValue())
			}
			out = append(out, fmt.Sprintf("%s: %v; ", strings.Join(ls, " "), m.GetGauge().GetValue()))
		}
	}
	sort.Strings(out)
	return strings.Join(out, "")
}

// A fixed budget and the off switch are reported as such.
func TestPrefillBudgetSources(t *testing.T) {
	for slots, want := range map[int]string{4: BudgetConfigured, 0: BudgetOff, PrefillAuto: BudgetNone} {
		f := newFixtureEngine(t, Config{Seed: "1", PrefillSlots: slots}, &fakeLearner{}, rule(3, ""))
		if n, src := f.g.PrefillBudget(1, 1); n != max(slots, 0) || src != want {
			t.Errorf("PrefillSlots %d: %d %s, want %s", slots, n, src, want)
		}
		if f.g.prefill.queues(1, 2) != (slots > 0) {
			t.Errorf("PrefillSlots %d: queues %v", slots, !(slots > 0))
		}
	}
}
