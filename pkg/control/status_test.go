package control

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/store"
)

// flaky is a stage that cannot apply the rules on the ports in fail
// (as if another process held them) and applies every other rule.
type flaky struct {
	mu       sync.Mutex
	fail     map[int]bool // by VIP port
	degraded bool         // report the failures as degraded
	applied  map[uint32]bool
	calls    int
}

func (f *flaky) Name() string { return "flaky" }
func (f *flaky) Reconcile(_ context.Context, services []Service) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	f.applied = map[uint32]bool{}
	var errs []error
	for _, s := range services {
		if f.fail[s.Rule.Service.Port] {
			errs = append(errs, &RuleError{ID: s.ID, Reason: "VIP_PORT_IN_USE", Degraded: f.degraded,
				Err: fmt.Errorf("listen on %s:%d: address already in use", s.Rule.Service.ExternalIP, s.Rule.Service.Port)})
			continue
		}
		f.applied[s.ID] = true
	}
	return errors.Join(errs...)
}

func (f *flaky) set(port int, failing bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fail[port] = failing
}

func (f *flaky) isApplied(id uint32) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.applied[id]
}

func ruleOn(port int) string {
	return strings.Replace(body, `"port":2090`, fmt.Sprintf(`"port":%d`, port), 1)
}

var noSeed = lbrule.Settings{}

// storeRules creates the rules through a controller whose stage accepts
// everything, then closes the store, as a daemon that stops.
func storeRules(t *testing.T, dir string, settings lbrule.Settings, bodies ...string) {
	t.Helper()
	st, err := store.OpenBolt(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	c := New(st, settings, nil)
	for _, b := range bodies {
		if _, _, err := c.Create(context.Background(), []byte(b)); err != nil {
			t.Fatal(err)
		}
	}
}

func statusOf(t *testing.T, c *Controller, id uint32) RuleStatus {
	t.Helper()
	s, ok := c.Get(id)
	if !ok {
		t.Fatalf("rule %d is not listed", id)
	}
	return s.Status
}

// TestLoadAppliesRulesIndependently: a restart with N good rules and one
// that a stage cannot apply serves the N; the bad one is kept, listed as
// failed with the stage's reason, counted, and retried.
func TestLoadAppliesRulesIndependently(t *testing.T) {
	dir := t.TempDir()
	storeRules(t, dir, noSeed, ruleOn(3001), ruleOn(3002), ruleOn(3003))
	st, err := store.OpenBolt(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	reg := prometheus.NewRegistry()
	c := New(st, noSeed, nil)
	if err := c.RegisterMetrics(reg); err != nil {
		t.Fatal(err)
	}
	f := &flaky{fail: map[int]bool{3002: true}}
	c.AddReconciler(f)
	err = c.Load(context.Background())
	if err == nil || !strings.Contains(err.Error(), "rule 2") || strings.Contains(err.Error(), "rule 1 ") {
		t.Fatalf("load error should name rule 2 only: %v", err)
	}
	if !f.isApplied(1) || !f.isApplied(3) || f.isApplied(2) {
		t.Fatalf("stage applied %v", f.applied)
	}
	if got := c.List(); len(got) != 3 {
		t.Fatalf("listed %d rules, want 3", len(got))
	}
	for _, id := range []uint32{1, 3} {
		if s := statusOf(t, c, id); s.State != StateApplied || s.Reason != "" || !s.NextRetry.IsZero() {
			t.Fatalf("rule %d: %+v", id, s)
		}
	}
	s := statusOf(t, c, 2)
	if s.State != StateFailed || s.Reason != "VIP_PORT_IN_USE" || s.Attempts != 1 || s.NextRetry.IsZero() ||
		!strings.Contains(s.Message, "flaky: listen on 127.0.0.10:3002") {
		t.Fatalf("rule 2: %+v", s)
	}
	if v := testutil.ToFloat64(c.m.rules.WithLabelValues(StateFailed)); v != 1 {
		t.Fatalf("loxilb_rules{status=failed} = %v", v)
	}
	if v := testutil.ToFloat64(c.m.rules.WithLabelValues(StateApplied)); v != 2 {
		t.Fatalf("loxilb_rules{status=applied} = %v", v)
	}
	if v := testutil.ToFloat64(c.m.failures.WithLabelValues("VIP_PORT_IN_USE")); v != 1 {
		t.Fatalf("loxilb_rule_apply_failures_total = %v", v)
	}

	// Another rule's create is not refused because rule 2 still fails,
	// and rule 2 keeps its retry schedule.
	if _, created, err := c.Create(context.Background(), []byte(ruleOn(3004))); err != nil || !created {
		t.Fatalf("create beside a failed rule: %v %v", created, err)
	}
	if s2 := statusOf(t, c, 2); s2.Attempts != 1 || !s2.NextRetry.Equal(s.NextRetry) {
		t.Fatalf("an early attempt moved the schedule: %+v, was %+v", s2, s)
	}
	// Its own create fails, and is rolled back.
	f.set(3005, true)
	if _, _, err := c.Create(context.Background(), []byte(ruleOn(3005))); !errors.Is(err, ErrApply) || reasonOf(err, "") != "VIP_PORT_IN_USE" {
		t.Fatalf("create on a held port: %v", err)
	}
	if n := len(c.List()); n != 4 {
		t.Fatalf("rolled-back rule kept: %d rules", n)
	}
	// A failed rule can be deleted.
	if err := c.Delete(context.Background(), lbrule.Key{IP: "127.0.0.10", Port: 3002, Proto: "tcp"}); err != nil {
		t.Fatal(err)
	}
	if v := testutil.ToFloat64(c.m.rules.WithLabelValues(StateFailed)); v != 0 {
		t.Fatalf("loxilb_rules{status=failed} = %v after delete", v)
	}
}

// TestRetryBringsRuleBack: once the port frees, Run applies the rule
// without any API call, after attempts spaced by the backoff.
func TestRetryBringsRuleBack(t *testing.T) {
	dir := t.TempDir()
	storeRules(t, dir, noSeed, ruleOn(3001), ruleOn(3002))
	st, err := store.OpenBolt(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	c := New(st, noSeed, nil, WithRetry(time.Millisecond, 4*time.Millisecond))
	f := &flaky{fail: map[int]bool{3002: true}}
	c.AddReconciler(f)
	_ = c.Load(context.Background())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- c.Run(ctx) }()
	defer func() { cancel(); <-done }()

	for statusOf(t, c, 2).Attempts < 4 {
		time.Sleep(time.Millisecond)
	}
	if s := statusOf(t, c, 2); s.State != StateFailed {
		t.Fatalf("still held: %+v", s)
	}
	f.set(3002, false)
	for statusOf(t, c, 2).State != StateApplied {
		time.Sleep(time.Millisecond)
	}
	if !f.isApplied(1) || !f.isApplied(2) {
		t.Fatalf("stage applied %v", f.applied)
	}
	if s := statusOf(t, c, 2); !s.NextRetry.IsZero() || s.Attempts != 0 {
		t.Fatalf("applied rule still scheduled: %+v", s)
	}
}

func TestBackoffDoublesToCap(t *testing.T) {
	c := New(nil, noSeed, nil)
	want := []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second, 30 * time.Second, 30 * time.Second}
	for i, w := range want {
		if got := c.backoff(i + 1); got != w {
			t.Fatalf("attempt %d: %v, want %v", i+1, got, w)
		}
	}
}

// TestDegradedRuleIsAccepted: a side stage's failure leaves the rule
// serving: the create succeeds and the rule is degraded, retried.
func TestDegradedRuleIsAccepted(t *testing.T) {
	c, _, st := newCtl(t, t.TempDir())
	defer st.Close()
	c.AddReconciler(&flaky{fail: map[int]bool{2090: true}, degraded: true})
	svc, created, err := c.Create(context.Background(), []byte(body))
	if err != nil || !created {
		t.Fatalf("create: %v", err)
	}
	if svc.Status.State != StateDegraded || svc.Status.Reason != "VIP_PORT_IN_USE" || svc.Status.NextRetry.IsZero() {
		t.Fatalf("status %+v", svc.Status)
	}
}

const vllmBody = `{"serviceArguments":{"externalIP":"127.0.0.20","port":2095,"protocol":"tcp","mode":4,"sel":0,"kvExactMode":3,"kvEngineType":"vllm","kvZmqPort":5557,"kvDpRankCount":1,"kvBlockSize":16,"name":"vllm"},
"endpoints":[{"endpointIP":"127.0.0.21","targetPort":30000,"weight":1}]}`

// TestInvalidStoredRuleIsListedAndDeletable: a vLLM rule stored under a
// seed and loaded without it is kept, listed failed with the seed's
// reason code, never handed to a stage, blocks a second rule on its
// VIP:port (409 rather than stored twice), and can be deleted.
func TestInvalidStoredRuleIsListedAndDeletable(t *testing.T) {
	dir := t.TempDir()
	seeded := lbrule.Settings{VLLMSeed: "42"}
	storeRules(t, dir, seeded, body, vllmBody)
	st, err := store.OpenBolt(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	c := New(st, noSeed, nil)
	f := &flaky{fail: map[int]bool{}}
	c.AddReconciler(f)
	if err := c.Load(context.Background()); err == nil || !strings.Contains(err.Error(), lbrule.ReasonSeedUnset) {
		t.Fatalf("load: %v", err)
	}
	if !f.isApplied(1) || f.isApplied(2) {
		t.Fatalf("stage applied %v", f.applied)
	}
	s := statusOf(t, c, 2)
	if s.State != StateFailed || s.Reason != lbrule.ReasonSeedUnset || !s.NextRetry.IsZero() {
		t.Fatalf("invalid rule: %+v", s)
	}
	if got := c.List(); len(got) != 2 || got[1].Rule.Service.ExternalIP != "127.0.0.20" {
		t.Fatalf("list: %+v", got)
	}
	// The same VIP:port as another engine: a conflict, not a second copy.
	sg := strings.Replace(strings.Replace(vllmBody, `"vllm"`, `"sglang"`, 1), `,"kvZmqPort":5557`, `,"kvZmqPort":5557`, 1)
	var re *lbrule.RuleError
	if _, _, err := c.Create(context.Background(), []byte(sg)); !errors.As(err, &re) || !errors.Is(err, lbrule.ErrConflict) {
		t.Fatalf("re-create on the invalid rule's VIP:port: %v", err)
	}
	marked := strings.Replace(sg, `"name":"vllm"`, `"name":"vllm","block":3`, 1)
	if _, _, err := c.Create(context.Background(), []byte(marked)); !errors.As(err, &re) || re.Reason != ReasonDuplicate {
		t.Fatalf("another mark on the invalid rule's VIP:port: %v", err)
	}
	recs, _ := st.List()
	if len(recs) != 2 {
		t.Fatalf("store holds %d records", len(recs))
	}
	if err := c.Delete(context.Background(), lbrule.Key{IP: "127.0.0.20", Port: 2095, Proto: "tcp"}); err != nil {
		t.Fatalf("delete the invalid rule: %v", err)
	}
	if recs, _ := st.List(); len(recs) != 1 || len(c.List()) != 1 {
		t.Fatalf("after delete: %d records, %d rules", len(recs), len(c.List()))
	}
}

// TestStoredDuplicateIsFailed: a store written by a build that let a
// VIP:port be stored twice loads the first copy and lists the second as
// failed RULE_DUPLICATE; deleting the key removes both.
func TestStoredDuplicateIsFailed(t *testing.T) {
	dir := t.TempDir()
	storeRules(t, dir, noSeed, body)
	st, err := store.OpenBolt(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	recs, _ := st.List()
	dup := recs[0]
	dup.ID = 7
	if err := st.Put(dup); err != nil {
		t.Fatal(err)
	}
	c := New(st, noSeed, nil)
	f := &flaky{fail: map[int]bool{}}
	c.AddReconciler(f)
	_ = c.Load(context.Background())
	if !f.isApplied(1) || f.isApplied(7) {
		t.Fatalf("stage applied %v", f.applied)
	}
	if s := statusOf(t, c, 7); s.State != StateFailed || s.Reason != ReasonDuplicate || !s.NextRetry.IsZero() {
		t.Fatalf("duplicate: %+v", s)
	}
	if err := c.Delete(context.Background(), lbrule.Key{IP: "127.0.0.10", Port: 2090, Proto: "tcp"}); err != nil {
		t.Fatal(err)
	}
	if recs, _ := st.List(); len(recs) != 0 || len(c.List()) != 0 {
		t.Fatalf("after delete: %d records, %d rules", len(recs), len(c.List()))
	}
}

func TestSplitRuleErrors(t *testing.T) {
	a := &RuleError{ID: 1, Reason: "A", Err: errors.New("a")}
	b := &RuleError{ID: 2, Reason: "B", Err: errors.New("b")}
	plain := errors.New("plain")
	rules, rest := splitRuleErrors(fmt.Errorf("stage: %w", errors.Join(a, b)))
	if len(rules) != 2 || rest != nil {
		t.Fatalf("wrapped join: %v %v", rules, rest)
	}
	rules, rest = splitRuleErrors(errors.Join(a, plain))
	if len(rules) != 1 || !errors.Is(rest, plain) {
		t.Fatalf("mixed: %v %v", rules, rest)
	}
	if rules, rest = splitRuleErrors(nil); rules != nil || rest != nil {
		t.Fatal("nil")
	}
}

// TestStageWideFailure: a stage that fails without naming a rule leaves
// every rule degraded STAGE_FAILED and retried; once it fails, later
// creates are not held back by it.
func TestStageWideFailure(t *testing.T) {
	dir := t.TempDir()
	storeRules(t, dir, noSeed, ruleOn(3001))
	st, err := store.OpenBolt(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	c := New(st, noSeed, nil)
	c.AddReconciler(&recorder{fail: true})
	_ = c.Load(context.Background())
	if s := statusOf(t, c, 1); s.State != StateDegraded || s.Reason != ReasonStageFailed || s.NextRetry.IsZero() ||
		!strings.HasPrefix(s.Message, "recorder: ") {
		t.Fatalf("status %+v", s)
	}
	svc, created, err := c.Create(context.Background(), []byte(ruleOn(3002)))
	if err != nil || !created || svc.Status.State != StateDegraded {
		t.Fatalf("create while a stage fails: %v %v %+v", created, err, svc.Status)
	}
}
