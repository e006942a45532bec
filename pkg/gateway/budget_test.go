package gateway

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/pkg/selector"
)

// learnedSource is the source fakeLearner names, as a learner does.
const learnedSource = "observed"

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
	return n, learnedSource, n > 0
}

// signals gives f to the gateway as its load and budget source.
func (f *fakeLearner) signals() EngineSignals { return EngineSignals{Load: f, Budgets: f} }

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
	f := newFixtureConfig(t, Config{Seed: "1", PrefillSlots: slots, PrefillQueueWait: wait, CoalesceWait: -1, Engine: learner.signals()}, rule(3, ""))

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
	if n, src := f.g.PrefillBudget(1, first.EP); n != 1 || src != learnedSource {
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
		f := newFixtureConfig(t, Config{Seed: "1", PrefillSlots: slots, Engine: (&fakeLearner{}).signals()}, rule(3, ""))
		if n, src := f.g.PrefillBudget(1, 1); n != max(slots, 0) || src != want {
			t.Errorf("PrefillSlots %d: %d %s, want %s", slots, n, src, want)
		}
		if f.g.prefill.queues(1, 2) != (slots > 0) {
			t.Errorf("PrefillSlots %d: queues %v", slots, !(slots > 0))
		}
	}
}
