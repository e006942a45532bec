package enginemetrics

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/selector"
)

// Learned prefill budgets.
//
// The gateway's prefill admission queue needs each endpoint's
// concurrent-sequence budget: the number of requests the engine runs at
// once before it queues the rest first come, first served. An operator
// rarely knows it (SGLang sizes it from GPU memory unless
// --max-running-requests is given; vLLM's --max-num-seqs is not published
// anywhere the gateway can read), so the scraper learns it per endpoint
// from what the engines expose:
//
//   - SGLang: /get_server_info (or /server_info). Its internal_states list
//     has one entry per data-parallel rank with the scheduler's effective
//     cap, effective_max_running_requests_per_dp; the endpoint's budget is
//     their sum. Older builds without internal_states give the top-level
//     max_running_requests (a server argument, null unless set). Source
//     "server_info".
//   - vLLM, TensorRT-LLM, llama.cpp: none publishes its budget (vLLM's
//     vllm:cache_config_info carries the cache configuration, not
//     max_num_seqs), so the budget is observed: once the engine has been
//     seen queueing at its peak (waiting > 0 while as many requests run
//     as were ever seen running) in two consecutive samples, the most
//     requests seen running at once. Running never exceeds the budget, so
//     the value is a lower bound that only grows towards it: the engine
//     also runs the sequences that are past their first byte, which the
//     gateway's queue does not hold back, and the queue's bounded wait
//     (PrefillQueueWait) forwards over a low estimate. Source "observed".
//     An engine queues only in bursts, which scrapes a second apart
//     rarely catch twice in a row (at the load of the routing suite a
//     vLLM fleet learned nothing in a run), so while a budget is unknown
//     the scraper also samples an endpoint whenever this node has more
//     requests open there than the engine was ever seen running (it may
//     be queueing now) and right after a sample that saw it queueing
//     (probe.go).
//
// Until a budget is known the queue admits every request at once, as it
// did when it was off, so learning never costs a request anything. Engine
// values are checked before use: a NaN, negative or absurd (> 2^20) gauge
// or cap is refused and counted, so a hostile engine cannot set a budget
// that starves or floods it. Budgets are forgotten when the scrape target
// of an endpoint changes (another address, engine or rule).

// Sources of a learned budget, as LearnedSlots names them (the gateway's
// loxilb_kv_prefill_slots "source" label and the inventory API's
// prefill_slots.source show them as they are).
const (
	BudgetServerInfo = "server_info" // the engine's published cap
	BudgetObserved   = "observed"    // peak running once queueing was seen
)

// maxEngineCount bounds every count an engine reports (running, waiting,
// a sequence cap): far above any real engine, low enough that no budget
// read from an engine can make the queue meaningless.
const maxEngineCount = 1 << 20

// serverInfoEvery is how many scrapes pass between reads of an SGLang
// endpoint's server info, so an engine restarted with another cap on the
// same address is followed.
const serverInfoEvery = 30

// maxServerInfoBytes bounds a server-info body (the server arguments are
// a few kilobytes).
const maxServerInfoBytes = 1 << 20

// Reasons of loxilb_kv_prefill_budget_rejected_total.
const (
	budgetBadValue  = "bad_value" // NaN, infinite, negative or > 2^20
	budgetMalformed = "malformed" // server info that is not the expected JSON
)

// errBadValue marks an engine count outside 0..2^20.
var errBadValue = errors.New("engine value out of range")

// checkCount refuses an engine-reported count that is not a finite number
// within 0..maxEngineCount.
func checkCount(name string, v float64) error {
	if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 || v > maxEngineCount {
		return fmt.Errorf("%w: %s = %v (want 0..%d)", errBadValue, name, v, maxEngineCount)
	}
	return nil
}

// learnedBudget is one endpoint's learning state.
type learnedBudget struct {
	info        int  // from server info; 0 when none
	infoTried   bool // server info was read at least once
	infoScrapes int  // scrapes since it was last read
	peak        int  // most requests seen running at once
	saturated   int  // consecutive samples queueing at the peak
	queued      bool // saturated for queuedSamples samples in a row at least once
	blind       int  // consecutive samples with nothing running while this node had requests open there
	// sampledAt is when the endpoint was last sampled or probed, probing
	// whether a probe of it is under way (probe.go).
	sampledAt time.Time
	probing   bool
}

// queuedSamples is how many consecutive samples must see the engine
// queueing at its peak before it counts as having queued: a real queue
// persists from one sample to the next, the instant between a request's
// arrival and its scheduling (or between a sequence's end and the next
// one's start) does not.
const queuedSamples = 2

// blindSamples is how many consecutive samples may show nothing running
// while this node has requests open at the endpoint before probing it
// stops (probe.go): an engine whose gauge never counts what it runs (one
// publishing only its waiting gauge) would otherwise be sampled every
// probeGap for as long as it has work, without ever teaching a budget.
// A regular scrape that sees something running resumes the probes.
const blindSamples = 3

// observe folds one metrics sample in. A sample shows queueing at the
// budget when requests wait while as many run as were ever seen running:
// an engine at its budget runs exactly that many, so waiting requests
// beside fewer running ones are a request not yet scheduled, or a freed
// sequence not yet refilled, and prove no budget (on a busy machine a
// scrape lands in that instant often enough to teach a budget one short).
func (b *learnedBudget) observe(m selector.EngineMetrics, busy bool, now time.Time) {
	b.peak = max(b.peak, m.Running)
	switch {
	case m.Running > 0:
		b.blind = 0
	case busy:
		b.blind++
	}
	if m.Waiting > 0 && m.Running > 0 && m.Running >= b.peak {
		b.saturated++
	} else {
		b.saturated = 0
	}
	if b.saturated >= queuedSamples {
		b.queued = true
	}
	b.infoScrapes++
	b.sampledAt = now
}

func (b *learnedBudget) slots() (int, string, bool) {
	switch {
	case b.info > 0:
		return b.info, BudgetServerInfo, true
	case b.queued && b.peak > 0:
		return b.peak, BudgetObserved, true
	}
	return 0, "", false
}

// wantsInfo tells whether this scrape should (re)read the server info.
func (b *learnedBudget) wantsInfo(engine string) bool {
	return engine == "sglang" && (!b.infoTried || b.infoScrapes >= serverInfoEvery)
}

// LearnedSlots returns the endpoint's concurrent-sequence budget and its
// source (BudgetServerInfo, BudgetObserved); ok is false while none is
// known.
func (s *Scraper) LearnedSlots(service uint32, ep int) (slots int, source string, ok bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	b := s.budgets[epKey{service, ep}]
	if b == nil {
		return 0, "", false
	}
	return b.slots()
}

// learn folds a good metrics sample of target t into k's budget and reads
// the server info when due. It runs on the scrape goroutine of k.
func (s *Scraper) learn(ctx context.Context, k epKey, t scrapeTarget, m selector.EngineMetrics) {
	s.mu.Lock()
	if s.targets[k] != t {
		s.mu.Unlock()
		return
	}
	b := s.budgets[k]
	if b == nil {
		b = &learnedBudget{}
		s.budgets[k] = b
	}
	b.observe(m, s.self(k) > 0, time.Now())
	want := b.wantsInfo(t.engine)
	s.mu.Unlock()
	if !want {
		return
	}
	n, found, err := s.serverInfoBudget(ctx, t)
	if err != nil {
		reason := budgetMalformed
		if errors.Is(err, errBadValue) {
			reason = budgetBadValue
		}
		s.budgetRejected.WithLabelValues(reason).Inc()
		s.logger.Warn("engine server info refused as a prefill budget", "service", k.service, "ep_idx", k.ep, "reason", reason, "err", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.targets[k] != t || s.budgets[k] != b {
		return
	}
	b.infoTried, b.infoScrapes = true, 0
	switch {
	case err != nil:
		b.info = 0 // what the engine says now is not believable
	case found:
		b.info = n
	}
}

// serverInfoBudget reads an SGLang endpoint's sequence cap. found=false
// when the engine does not publish one (or the page is missing): the
// budget is then observed.
func (s *Scraper) serverInfoBudget(ctx context.Context, t scrapeTarget) (int, bool, error) {
	base := strings.TrimSuffix(t.url, "/metrics")
	for _, path := range []string{"/get_server_info", "/server_info"} {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+path, nil)
		if err != nil {
			return 0, false, nil
		}
		resp, err := s.client.Do(req)
		if err != nil {
			return 0, false, nil // unreachable: the metrics scrape counts it
		}
		body, err := io.ReadAll(io.LimitReader(resp.Body, maxServerInfoBytes+1))
		resp.Body.Close()
		if resp.StatusCode == http.StatusNotFound {
			continue // newer builds serve only /server_info
		}
		if err != nil || resp.StatusCode != http.StatusOK {
			return 0, false, nil
		}
		if len(body) > maxServerInfoBytes {
			return 0, false, fmt.Errorf("%s: body larger than %d bytes", path, maxServerInfoBytes)
		}
		return ParseServerInfoBudget(body)
	}
	return 0, false, nil
}

// ParseServerInfoBudget reads an SGLang server-info body: the sum of the
// data-parallel ranks' effective_max_running_requests_per_dp when present,
// else the top-level max_running_requests. found=false when neither is
// set; an error when the body is not a JSON object or a value is not a
// count within 0..2^20 (a budget of 0 included).
func ParseServerInfoBudget(body []byte) (slots int, found bool, err error) {
	var info struct {
		MaxRunning     *float64 `json:"max_running_requests"`
		InternalStates []struct {
			Effective *float64 `json:"effective_max_running_requests_per_dp"`
		} `json:"internal_states"`
	}
	if err := json.Unmarshal(body, &info); err != nil {
		return 0, false, fmt.Errorf("server info: %v", err)
	}
	sum, ranks := 0.0, 0
	for i, st := range info.InternalStates {
		if st.Effective == nil {
			continue
		}
		if err := checkCount("internal_states["+strconv.Itoa(i)+"].effective_max_running_requests_per_dp", *st.Effective); err != nil {
			return 0, false, err
		}
		sum += *st.Effective
		ranks++
	}
	name := "sum of effective_max_running_requests_per_dp"
	if ranks == 0 {
		if info.MaxRunning == nil {
			return 0, false, nil
		}
		sum, name = *info.MaxRunning, "max_running_requests"
	}
	if err := checkCount(name, sum); err != nil {
		return 0, false, err
	}
	if sum < 1 {
		return 0, false, fmt.Errorf("%w: %s = %v (a budget needs at least one sequence)", errBadValue, name, sum)
	}
	return int(sum), true, nil
}
