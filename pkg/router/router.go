package router

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/selector"
)

// Inventory is the per-endpoint KV block inventory the router scores
// against. *kvindex.Index satisfies it.
type Inventory interface {
	// PrefixMatch writes to out[i] the number of leading keys (a
	// consecutive prefix, stopping at the first absent key) present in the
	// inventory of endpoint eps[i] of service. len(out) == len(eps). Unknown
	// services or endpoints match 0. Safe for concurrent use; must not
	// retain its arguments.
	PrefixMatch(service uint32, keys []uint64, eps []int, out []int)
	// Len returns the number of blocks held for the endpoint (0 if unknown).
	Len(service uint32, ep int) int
}

// TieredInventory is implemented by inventories that know which blocks an
// endpoint holds only in host memory (*kvindex.Index). PrefixMatchTiered
// is PrefixMatch that also sets cpu[i] to how many of the out[i] matched
// blocks are CPU-only; the router weighs those by Config.TierWeightCPU.
type TieredInventory interface {
	PrefixMatchTiered(service uint32, keys []uint64, eps []int, out, cpu []int)
}

// ConfirmedInventory is implemented by inventories that also hold
// short-lived speculative entries (blocks the gateway expects an endpoint to
// have because it just routed the prefix there). PrefixMatchConfirmed
// ignores them. The zero-hit watchdog uses it: a request that matches only
// speculative entries proves nothing about hash parity, and a fleet whose
// engines publish keys the gateway never computes would otherwise keep
// "hitting" its own guesses and never trip the watchdog.
type ConfirmedInventory interface {
	PrefixMatchConfirmed(service uint32, keys []uint64, eps []int, out []int)
}

// Attestation reports the hash-contract attestation of the endpoints'
// event streams. *kvevents.Manager satisfies it. The zero-hit watchdog
// consults it once a run of misses reaches ZeroHitN: when every non-empty
// inventory comes from a publisher whose keys were recomputed and found
// equal, prompts that match nothing were simply not cached, and blaming
// the block size, hash or tokenizer would send an operator after a fault
// that is not there.
type Attestation interface {
	// ParityOK reports whether the endpoint's parity verdict is ok and it
	// is not quarantined. Unknown endpoints report false. Safe for
	// concurrent use; called only on a zero-hit lookup past ZeroHitN.
	ParityOK(service uint32, ep int) bool
}

// Option configures a Router beyond its Config.
type Option func(*Router)

// WithAttestation lets the zero-hit watchdog tell prompts that were not
// cached (every non-empty inventory attests parity) from a probable hash
// mismatch. Without it every zero-hit run is a parity suspect.
func WithAttestation(a Attestation) Option {
	return func(r *Router) { r.att = a }
}

// Zero-hit watchdog reasons, the values of the reason label of
// loxilb_pd_kv_zero_hit_watchdog_total.
const (
	// WatchdogNotCached: every non-empty inventory's publisher attests hash
	// parity, so the requests' prefixes were simply not cached (unique
	// prompts, or blocks evicted before reuse).
	WatchdogNotCached = "not_cached"
	// WatchdogParitySuspect: some non-empty inventory's parity verdict is
	// not ok (unverified, mismatched or quarantined), so the misses may be
	// a block-size, hash or tokenizer mismatch.
	WatchdogParitySuspect = "parity_suspect"
)

// Tiers of a Decision.
const (
	TierKV       = "tier1.5"   // routed to the endpoint with the best overlap/load score
	TierSpill    = "spill"     // moved off the warmest endpoint because of load
	TierColdSeed = "cold_seed" // diverted to a cold endpoint so it can re-enter the fleet
	TierFallback = "fallback"  // Tier 1.5 declined; the rule's selector chose
)

// Reasons. Hit reasons explain why the chosen endpoint won; miss reasons
// (TierFallback) are also the values of the miss_reason metric.
const (
	ReasonLongestPrefix = "longest_prefix" // best blended score, which is the warmest endpoint
	ReasonLoadBlend     = "load_blend"     // the blend preferred a less loaded, less warm endpoint
	ReasonOverCap       = "over_cap"       // spill relief: the chosen endpoint was above the fleet cap
	ReasonColdSeed      = "cold_seed"
	// ReasonLeastPrefill: every healthy endpoint holds the same prefix (a
	// shared system prompt), so overlap chose nothing and the request went
	// to the least outstanding prefill work, as a miss does.
	ReasonLeastPrefill = "least_prefill"

	ReasonModeOff        = "mode_off"        // rule has kvExactMode 0
	ReasonShortPrompt    = "short_prompt"    // prompt has no full block
	ReasonNoTokenizer    = "no_tokenizer"    // no tokenizer staged for the model (reported by the gateway)
	ReasonUnhashable     = "unhashable"      // request could not be rendered/hashed (reported by the gateway; Decide too when blockSize <= 0)
	ReasonNoHealthy      = "no_healthy"      // no healthy candidate
	ReasonEmptyInventory = "empty_inventory" // every healthy inventory is empty (cold fleet)
	ReasonNoMatch        = "no_match"        // inventories non-empty but nothing matched
	ReasonShallow        = "shallow"         // best match below LLB_KV_MIN_MATCH_TOKENS
	// ReasonParityUntrusted: only endpoints that strict attestation keeps
	// out of Tier 1.5 (ServiceView.Untrusted) hold the prefix, or every
	// healthy endpoint is such an endpoint.
	ReasonParityUntrusted = "parity_untrusted"
)

// ServiceView is what the router needs to know about a rule.
type ServiceView struct {
	ID          uint32 // rule number; labels metrics
	KVExactMode int    // 0 off, 1 P/D (prefill candidates), 3 single pool
	// ShortestFirst says the gateway admits requests to each endpoint
	// shortest predicted prefill first (its prefill queue is on), so a
	// request waits only behind load whose prefill is shorter than its
	// own: a unit of load costs it at most its own uncached tokens.
	ShortestFirst bool
	// Untrusted has bit i set when endpoint index i gets no Tier-1.5
	// traffic: strict attestation found its published keys do not follow
	// the rule's hash contract (a parity mismatch), so its inventory, and
	// the speculative entries the gateway adds for it, prove nothing. Such
	// endpoints are not scored, spilled to or seeded; the fallback
	// selector may still choose them. Endpoint indexes are below
	// lbrule.MaxEndpoints (32).
	Untrusted uint64
}

// untrusted reports whether endpoint idx is kept out of Tier 1.5.
func (v ServiceView) untrusted(idx int) bool {
	return v.Untrusted != 0 && idx >= 0 && idx < 64 && v.Untrusted&(1<<uint(idx)) != 0
}

// Decision is the outcome of Decide.
type Decision struct {
	EP            int // endpoint index, -1 if none is healthy
	Tier          string
	MatchedBlocks int // consecutive prefix blocks cached on EP
	// CPUBlocks is how many of MatchedBlocks EP holds only in host memory
	// (offloaded or LMCache copies), weighed by Config.TierWeightCPU.
	CPUBlocks   int
	TotalBlocks int
	BlockSize   int
	// From is the endpoint the request was moved away from: the warmest
	// one for a spill or load blend, the would-be target for a cold seed;
	// -1 when the request went where the overlap pointed.
	From   int
	Load   float64 // EP's load in request-equivalents at decision time
	Reason string
}

// PredictedCachedTokens is how many prompt tokens the router expects EP to
// serve from cache; compare with the engine's reported cached tokens.
func (d Decision) PredictedCachedTokens() int { return d.MatchedBlocks * d.BlockSize }

// Receipt returns the explainable summary of the decision.
func (d Decision) Receipt() Receipt {
	return Receipt{Tier: d.Tier, EP: d.EP, Matched: d.MatchedBlocks, Total: d.TotalBlocks, From: d.From, Reason: d.Reason}
}

// Router makes Tier-1.5 decisions. It is safe for concurrent use.
type Router struct {
	cfg    Config
	inv    Inventory
	att    Attestation // nil: every zero-hit run is a parity suspect
	logger *slog.Logger
	m      metrics

	mu       sync.RWMutex
	services map[uint32]*serviceState

	scratch sync.Pool
}

// serviceState is the per-rule memory of the decision: the cold-seed tick
// and the zero-hit streak.
type serviceState struct {
	label  string
	tick   atomic.Uint64
	streak atomic.Int64
	// warned holds a bit per watchdog reason already logged in the
	// current zero-hit episode (warnNotCached, warnSuspect).
	warned atomic.Uint32
	// work estimates the median of the prompt tokens a Tier-1.5 hit of
	// the service leaves uncached on its warmest endpoint: the prefill work
	// one more request of load typically represents in the blend.
	work streamMedian
	// prompt and cached estimate the medians of a hit's prompt length and
	// of the prefix its warmest endpoint holds, in tokens: the recompute
	// gates' prices (movecost.go).
	prompt, cached streamMedian
	// seedDue is set by every ColdSeedN-th hit and cleared by the hit that
	// takes the seed: a hit whose move would throw away a long cached
	// prefix leaves it for a later, shorter one.
	seedDue atomic.Bool
}

// workStep is the multiplicative step of the median estimate: each request
// moves it by 1/8 up or down (a streaming median, Frugal-style), so it
// follows a change of workload within a few dozen requests, costs one
// compare-and-swap, and a minority of long misses cannot drag it up the
// way they drag a mean.
const workStep = 1.0 / 8

const (
	warnNotCached uint32 = 1 << iota
	warnSuspect
)

// observeWork folds one request's uncached prompt tokens into the
// blend's work estimate.
func (st *serviceState) observeWork(tokens, blockSize int) {
	// At least one block: the engine always recomputes the last prompt
	// token, and a zero would read as "no sample yet".
	st.work.observe(float64(max(tokens, blockSize, 1)))
}

// penalty returns the tokens one request-equivalent of load is worth for
// this decision. Adaptive: the median estimate or, before the first
// sample, this request's own uncached tokens on its warmest endpoint (the
// best guess of what its neighbours in the queue cost); never below one
// block, so load always counts for something.
func (r *Router) penalty(st *serviceState, uncached, blockSize int) float64 {
	if r.cfg.LoadPenalty != LoadPenaltyAdaptive {
		return float64(r.cfg.LoadPenalty)
	}
	return max(st.work.value(float64(uncached)), float64(blockSize))
}

// LoadPenalty reports the tokens one request-equivalent of load is
// currently worth in the service's blend: the configured value, or with
// the adaptive default the running median of the uncached prompt tokens of
// its recent Tier-1.5 hits on their warmest endpoint (0 before the first
// one; a decision never uses less than one block). For status pages and
// tests.
func (r *Router) LoadPenalty(service uint32) float64 {
	if r.cfg.LoadPenalty != LoadPenaltyAdaptive {
		return float64(r.cfg.LoadPenalty)
	}
	return r.service(service).work.value(0)
}

type scratch struct {
	eps   []int
	pos   []int
	match []int
	cpu   []int     // of match, blocks held on CPU only
	eff   []float64 // match weighted by tier, in blocks
	conf  []int     // confirmed (non-speculative) matches, for the watchdog
	load  []float64
	tied  []selector.Candidate // misses: the candidates with the least outstanding prefill
}

type metrics struct {
	hits      *prometheus.CounterVec
	spills    *prometheus.CounterVec
	seeds     *prometheus.CounterVec
	miss      *prometheus.CounterVec
	watchdog  *prometheus.CounterVec
	latency   *prometheus.HistogramVec
	collected []prometheus.Collector
}

func newMetrics() metrics {
	m := metrics{
		hits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_pd_kv_tier15_hits_total",
			Help: "Requests routed by KV-cache overlap (tiers tier1.5, spill and cold_seed), by final endpoint.",
		}, []string{"service", "ep_idx"}),
		spills: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_pd_kv_tier15_spills_total",
			Help: "Tier-1.5 requests moved off the warmest endpoint because of load, by destination endpoint.",
		}, []string{"service", "ep_idx"}),
		seeds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_pd_kv_tier15_cold_seeds_total",
			Help: "Tier-1.5 hits diverted to a cold endpoint, by destination endpoint.",
		}, []string{"service", "ep_idx"}),
		miss: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_pd_kv_tier15_miss_reason_total",
			Help: "Requests Tier 1.5 declined, by reason; they were routed by the rule's selector.",
		}, []string{"service", "reason"}),
		watchdog: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_pd_kv_zero_hit_watchdog_total",
			Help: "Zero-overlap lookups against non-empty inventories once the run reached LOXILB_KV_ZERO_HIT_N, by reason: not_cached (every such inventory attests hash parity; the prompts were not cached) or parity_suspect (some parity verdict is not ok; a probable block-size, hash or tokenizer mismatch).",
		}, []string{"service", "reason"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "loxilb_pd_kv_tier15_decision_seconds",
			Help:    "Time to score inventories and choose an endpoint (excludes tokenizing and hashing).",
			Buckets: prometheus.ExponentialBuckets(1e-6, 4, 9), // 1µs .. 65ms
		}, []string{"service"}),
	}
	m.collected = []prometheus.Collector{m.hits, m.spills, m.seeds, m.miss, m.watchdog, m.latency}
	return m
}

// New returns a Router scoring against inv. reg may be nil (metrics are
// then kept but not exported).
func New(cfg Config, inv Inventory, logger *slog.Logger, reg prometheus.Registerer, opts ...Option) (*Router, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if inv == nil {
		return nil, errors.New("router: nil inventory")
	}
	if cfg.LoadWeights == (selector.LoadWeights{}) {
		cfg.LoadWeights = selector.DefaultLoadWeights
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	r := &Router{
		cfg:      cfg,
		inv:      inv,
		logger:   logger,
		m:        newMetrics(),
		services: make(map[uint32]*serviceState),
	}
	for _, o := range opts {
		o(r)
	}
	r.scratch.New = func() any { return &scratch{} }
	if reg != nil {
		for _, c := range r.m.collected {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("register router metrics: %w", err)
			}
		}
	}
	return r, nil
}

// Config returns the effective configuration.
func (r *Router) Config() Config { return r.cfg }

func (r *Router) service(id uint32) *serviceState {
	r.mu.RLock()
	st := r.services[id]
	r.mu.RUnlock()
	if st != nil {
		return st
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if st = r.services[id]; st == nil {
		st = &serviceState{label: strconv.FormatUint(uint64(id), 10)}
		r.services[id] = st
	}
	return st
}

// Forget drops a deleted rule's state and metric series, so a later rule
// reusing the number starts clean and co-tenant series are untouched.
func (r *Router) Forget(service uint32) {
	r.mu.Lock()
	delete(r.services, service)
	r.mu.Unlock()
	l := prometheus.Labels{"service": strconv.FormatUint(uint64(service), 10)}
	r.m.hits.DeletePartialMatch(l)
	r.m.spills.DeletePartialMatch(l)
	r.m.seeds.DeletePartialMatch(l)
	r.m.miss.DeletePartialMatch(l)
	r.m.watchdog.DeletePartialMatch(l)
	r.m.latency.DeletePartialMatch(l)
}

// ZeroHitStreak reports the current run of zero-overlap lookups against
// non-empty inventories for a service (status pages, tests).
func (r *Router) ZeroHitStreak(service uint32) int {
	return int(r.service(service).streak.Load())
}

// Fallback records a miss decided before scoring (for example no tokenizer
// for the model, or a body that could not be rendered) and lets the rule's
// selector choose. reason should be one of the Reason constants.
func (r *Router) Fallback(svc ServiceView, reason string, cands []selector.Candidate, fallback selector.Selector, freq selector.Request) Decision {
	return r.fallback(r.service(svc.ID), reason, 0, 0, cands, fallback, freq)
}

func (r *Router) fallback(st *serviceState, reason string, total, blockSize int, cands []selector.Candidate, fallback selector.Selector, freq selector.Request) Decision {
	d := Decision{EP: -1, Tier: TierFallback, TotalBlocks: total, BlockSize: blockSize, From: -1, Reason: reason}
	var ok bool
	if fallback != nil {
		d.EP, ok = fallback.Pick(freq, cands)
	} else {
		d.EP, ok = leastLoaded(cands, r.cfg.LoadWeights)
	}
	if !ok {
		d.EP, d.Reason = -1, ReasonNoHealthy
	} else {
		for i := range cands {
			if cands[i].Idx == d.EP {
				d.Load = selector.Load(cands[i], r.cfg.LoadWeights)
				break
			}
		}
	}
	r.m.miss.WithLabelValues(st.label, d.Reason).Inc()
	return d
}

func leastLoaded(cands []selector.Candidate, w selector.LoadWeights) (int, bool) {
	best, bestLoad := -1, 0.0
	for i := range cands {
		if !cands[i].Healthy {
			continue
		}
		if l := selector.Load(cands[i], w); best < 0 || l < bestLoad {
			best, bestLoad = i, l
		}
	}
	if best < 0 {
		return -1, false
	}
	return cands[best].Idx, true
}

// placeMiss routes a tokenized request that matched nothing usable (no
// full block, empty or non-matching inventories, a shallow match) to the
// healthy candidate with a sequence free (Candidate.Slots), then the
// least outstanding prefill work, then the least load; the rule's selector breaks ties among those. A miss
// recomputes its whole prompt wherever it goes, so its only choice is
// whose queue it joins: the rule's selector alone would send it behind
// the long prefills that cached prefixes concentrate on a few endpoints
// (measured: a 50/50 mix of document questions and one-shot prompts had
// a worse TTFT p99 than round robin), and its own prefill delays every
// request queued behind it there.
func (r *Router) placeMiss(st *serviceState, s *scratch, reason string, keys []uint64, blockSize int, cands []selector.Candidate, fallback selector.Selector, freq selector.Request) Decision {
	total := len(keys)
	ep, load, ok := r.coldPlace(s, cands, keys, 0, int64(total*blockSize), blockSize, fallback, freq)
	if !ok {
		return r.fallback(st, ReasonNoHealthy, total, blockSize, cands, fallback, freq)
	}
	d := Decision{EP: ep, Tier: TierFallback, TotalBlocks: total, BlockSize: blockSize, From: -1, Load: load, Reason: reason}
	r.m.miss.WithLabelValues(st.label, d.Reason).Inc()
	return d
}

// coldPlace places a request whose blocks past the first common ones no
// candidate holds: by rendezvous over the eligible candidates when
// Config.ColdRendezvous is set (rendezvous.go), else, or when none is
// eligible or the request has no block, by leastWork.
func (r *Router) coldPlace(s *scratch, cands []selector.Candidate, keys []uint64, common int, uncached int64, blockSize int, fallback selector.Selector, freq selector.Request) (int, float64, bool) {
	if r.cfg.ColdRendezvous {
		if key, ok := coldKey(keys, common, blockSize); ok {
			if ep, load, ok := r.rendezvousPlace(cands, key, uncached); ok {
				return ep, load, true
			}
		}
	}
	return r.leastWork(s, cands, fallback, freq)
}

// leastWork returns the healthy candidate (its Idx and load) with a
// sequence free for the request, then the least outstanding prefill work,
// then the least load in whole request-equivalents (the KV-pressure term
// would make every load distinct); the rule's selector, when given,
// chooses among ties. ok is false when no candidate is healthy.
//
// A free sequence comes first because outstanding tokens alone do not
// tell when a request starts: an engine whose every sequence is taken by
// short cached requests (each holding its sequence for a decode step
// past its few prefill tokens) queues a miss that an engine running one
// long prefill beside a free sequence starts at once. Tokens still order
// the endpoints that are all free or all full.
func (r *Router) leastWork(s *scratch, cands []selector.Candidate, fallback selector.Selector, freq selector.Request) (int, float64, bool) {
	best := -1
	var bestFull bool
	var bestWork int64
	var bestLoad float64
	s.tied = s.tied[:0]
	for i := range cands {
		c := &cands[i]
		if !c.Healthy {
			continue
		}
		full := seqsFull(c)
		work, load := max(c.PrefillTokens, 0), math.Floor(selector.Load(*c, r.cfg.LoadWeights))
		if best < 0 || bestFull && !full || full == bestFull && (work < bestWork || (work == bestWork && load < bestLoad)) {
			best, bestFull, bestWork, bestLoad = i, full, work, load
			s.tied = s.tied[:0]
		}
		if full == bestFull && work == bestWork && load == bestLoad {
			s.tied = append(s.tied, *c)
		}
	}
	if best < 0 {
		return -1, 0, false
	}
	ep, ok := -1, false
	if fallback != nil && len(s.tied) > 1 {
		ep, ok = fallback.Pick(freq, s.tied)
	}
	if !ok {
		ep = s.tied[0].Idx
	}
	for i := range s.tied {
		if s.tied[i].Idx == ep {
			return ep, selector.Load(s.tied[i], r.cfg.LoadWeights), true
		}
	}
	return s.tied[0].Idx, selector.Load(s.tied[0], r.cfg.LoadWeights), true
}

// seqsFull reports whether every sequence of c's known budget is taken by
// the requests open to it (unknown budget: never full).
func seqsFull(c *selector.Candidate) bool {
	return c.Slots > 0 && c.InFlight >= c.Slots
}

// evenMatch reports whether every healthy candidate holds the same prefix
// of the request.
func (r *Router) evenMatch(s *scratch) bool {
	for i, m := range s.match[1:] {
		if m != s.match[0] || s.eff[i+1] != s.eff[0] {
			return false
		}
	}
	return true
}

// placeEven routes a hit whose prefix every healthy endpoint holds alike
// (typically a shared system prompt before a one-shot question): overlap
// cannot choose, and what the request costs anywhere is its uncached rest,
// so it joins the shortest prefill queue, exactly as a miss does.
func (r *Router) placeEven(st *serviceState, s *scratch, keys []uint64, warm, warmUncached, blockSize int, cands []selector.Candidate, fallback selector.Selector, freq selector.Request) Decision {
	total := len(keys)
	ep, load, _ := r.coldPlace(s, cands, keys, s.match[warm], int64(warmUncached), blockSize, fallback, freq)
	d := Decision{EP: ep, Tier: TierKV, MatchedBlocks: s.match[warm], CPUBlocks: min(max(s.cpu[warm], 0), s.match[warm]), TotalBlocks: total, BlockSize: blockSize,
		From: -1, Load: load, Reason: ReasonLeastPrefill}
	if r.cfg.LoadPenalty == LoadPenaltyAdaptive {
		st.observeWork(warmUncached, blockSize)
	}
	st.observeHit(total, s.match[warm], blockSize)
	r.m.hits.WithLabelValues(st.label, strconv.Itoa(ep)).Inc()
	return d
}

// spillRelief reports whether relief applies to the service.
func (r *Router) spillRelief(svc ServiceView) bool {
	if r.cfg.SpillRelief != nil {
		return *r.cfg.SpillRelief
	}
	return svc.KVExactMode == 3
}

// Decide routes one request.
//
// keys are the request's full-block hashes in prompt order; blockSize is the
// rule's kvBlockSize; cands are the rule's KV candidates (prefill endpoints
// for kvExactMode 1, all endpoints for 3) with health and load; fallback is
// the rule's selector, used with freq on a miss.
//
// The decision, in order:
//
//  1. Overlap. For every healthy candidate, m = the longest consecutive
//     prefix of keys in its inventory. Let best = max m. best == 0 is a
//     miss (no_match, or empty_inventory when every inventory is empty);
//     best < minBlocks is a miss (shallow), where minBlocks =
//     min(ceil(LLB_KV_MIN_MATCH_TOKENS/blockSize), len(keys)), at least 1.
//     A miss goes to the healthy candidate with a sequence free (its
//     open requests below Candidate.Slots, when known), then the least
//     outstanding prefill work (Candidate.PrefillTokens), then the least
//     load; the
//     fallback selector breaks ties (see placeMiss). So does a hit whose
//     prefix every healthy candidate holds alike (reason least_prefill).
//     With ColdRendezvous (several gateway nodes) both instead go to the
//     candidate with the highest rendezvous weight for the request's first
//     blocks past the common prefix, among those whose prefill work is
//     within the request's own uncached tokens of the least and whose load
//     is within the spill cap of step 3 (see rendezvousPlace), so every
//     node sends siblings of a new prefix to the same endpoint.
//
//  2. Blend. Each healthy candidate scores
//
//     score = m'·blockSize − penalty·load
//
//     where m' = m if m >= minBlocks else 0 (a shallow match must not
//     attract traffic), and load = selector.Load (in-flight requests, or the
//     engine's running+waiting requests plus queue and KV-pressure terms
//     when metrics are fresh). Highest score wins; ties go to lower load,
//     then more overlap, then lower index. Both terms are tokens of
//     prefill: a cached token is one token the engine does not compute,
//     and penalty is the prefill work one request of load represents.
//     With LoadPenalty = LoadPenaltyAdaptive (the default) penalty is a
//     running median, per service, of the tokens each Tier-1.5 hit leaves
//     uncached on its warmest endpoint (at least one block; before the
//     first hit, this request's own). So a chat whose hits add ~200 new
//     tokens per turn keeps a 2k-token history until its endpoint is ~10
//     requests busier, while a new conversation that shares only a
//     512-token system prompt goes where the queue is 3 requests shorter
//     instead of piling onto whichever endpoint cached the prompt first.
//     The median rather than the mean: a minority of long misses would
//     otherwise price load so high that groups sharing a 2k-token prefix
//     scatter and duplicate it (measured: 76% of the hit-ratio bound on a
//     full fleet, against 101% with the median). The sample is the warm
//     endpoint's uncached work, not the chosen one's, so moves away from
//     the cache cannot raise the penalty that caused them; fallbacks are
//     not sampled, so a cold start (every request a miss) does not price
//     load at whole prompts. A fixed LoadPenalty replaces the estimate.
//     When the gateway admits shortest prefill first (ServiceView.
//     ShortestFirst), a request waits only behind queued work shorter than
//     its own, so a candidate's penalty is capped at the request's own
//     uncached tokens there: a warm chat turn with little new text stays
//     on its history under load that would move a long cold prompt. The
//     cap applies to the load past the endpoint's sequence budget
//     (Candidate.Slots, when known) only: the requests its sequences run
//     cannot be overtaken and keep the full penalty, so cheap hits of a
//     popular document do not pile onto its endpoint behind long prefills
//     (measured: with the cap on all load, a 2-sequence vLLM fleet's
//     document hits had a TTFT p90 of 132 ms against 91 ms with the queue
//     off).
//
//  3. Spill relief (when enabled). cap = ceil(MeanLoadFactor/100·(L+1)/n),
//     L the summed load of the n healthy candidates. If the winner has at
//     least SpillMinLoad load and load+1 > cap, the request moves to the
//     best-scoring candidate with load+1 <= cap whose move pays: its queue
//     plus the tokens it would recompute cost less than the winner's queue
//     (movePays; queues are prefill tokens outstanding or load priced at
//     the service's median prompt length, see movecost.go). Since the
//     score includes overlap, a second warm endpoint is preferred over a
//     cold one.
//
//  4. Cold seeding. Every ColdSeedN-th hit of the service makes a seed due;
//     the next hit whose move is cheap (it throws away no more cached
//     tokens than the service's median cached prefix) or pays is diverted
//     to the lowest-index healthy candidate whose inventory is below
//     ColdMinBlocks, so a restarted endpoint re-enters a warm fleet without
//     a long session being moved off its history to prime it.
//
// Zero-hit watchdog: every lookup where all healthy inventories miss
// although one is non-empty extends a per-service run; a hit resets it. When
// the run reaches ZeroHitN, loxilb_pd_kv_zero_hit_watchdog_total counts each
// further such lookup (as loxilb does, so rate() stays positive while the
// condition lasts) with a reason: not_cached when every non-empty
// inventory's publisher attests hash parity (the prompts were simply not
// cached; logged once per episode at info), parity_suspect otherwise (a
// probable block-size, hash or tokenizer mismatch; one warning per episode
// naming the endpoints whose verdict is not ok).
func (r *Router) Decide(svc ServiceView, keys []uint64, blockSize int, cands []selector.Candidate, fallback selector.Selector, freq selector.Request) Decision {
	start := time.Now()
	st := r.service(svc.ID)
	d := r.decide(st, svc, keys, blockSize, cands, fallback, freq)
	r.m.latency.WithLabelValues(st.label).Observe(time.Since(start).Seconds())
	return d
}

func (r *Router) decide(st *serviceState, svc ServiceView, keys []uint64, blockSize int, cands []selector.Candidate, fallback selector.Selector, freq selector.Request) Decision {
	total := len(keys)
	switch {
	case svc.KVExactMode == 0:
		return r.fallback(st, ReasonModeOff, total, blockSize, cands, fallback, freq)
	case blockSize <= 0:
		return r.fallback(st, ReasonUnhashable, total, blockSize, cands, fallback, freq)
	}

	s := r.scratch.Get().(*scratch)
	defer r.scratch.Put(s)
	if total == 0 {
		return r.placeMiss(st, s, ReasonShortPrompt, keys, blockSize, cands, fallback, freq)
	}
	excluded := r.gather(s, svc, cands)
	n := len(s.eps)
	if n == 0 {
		if excluded {
			return r.fallback(st, ReasonParityUntrusted, total, blockSize, cands, fallback, freq)
		}
		return r.fallback(st, ReasonNoHealthy, total, blockSize, cands, fallback, freq)
	}
	r.prefixMatch(s, svc.ID, keys)

	// 1. Overlap.
	warm := r.overlap(s, total)
	if warm < 0 {
		return r.placeNoHit(st, s, svc, keys, excluded, total, blockSize, cands, fallback, freq)
	}
	r.confirmHit(st, svc, keys, s)
	minBlocks := r.minBlocks(total, blockSize)
	if s.match[warm] < minBlocks {
		return r.placeMiss(st, s, ReasonShallow, keys, blockSize, cands, fallback, freq)
	}
	warmUncached := (total - s.match[warm]) * blockSize
	if n > 1 && r.evenMatch(s) {
		return r.placeEven(st, s, keys, warm, warmUncached, blockSize, cands, fallback, freq)
	}

	// 2. Blend.
	b := blend{s: s, cands: cands, penalty: r.penalty(st, warmUncached, blockSize), minBlocks: minBlocks,
		total: total, blockSize: blockSize, shortestFirst: svc.ShortestFirst}
	c := b.pick(warm)

	// 3. Spill relief and 4. cold seeding, both priced: a move must cost
	// less than staying (or, for a seed, throw away little).
	mc := newMoveCost(st, s, cands, total, blockSize)
	if r.spillRelief(svc) {
		c = r.relieveSpill(&b, mc, c, warm)
	}
	c = r.seedCold(st, svc.ID, s, mc, c)

	return r.placeHit(st, s, c, warm, warmUncached, total, blockSize)
}

// gather fills the scratch with the healthy candidates Tier 1.5 may use:
// endpoint index, position in cands and load. excluded reports whether a
// healthy candidate was left out as untrusted.
func (r *Router) gather(s *scratch, svc ServiceView, cands []selector.Candidate) (excluded bool) {
	s.eps, s.pos, s.load = s.eps[:0], s.pos[:0], s.load[:0]
	for i := range cands {
		if cands[i].Healthy && svc.untrusted(cands[i].Idx) {
			excluded = true
			continue
		}
		if cands[i].Healthy {
			s.eps = append(s.eps, cands[i].Idx)
			s.pos = append(s.pos, i)
			s.load = append(s.load, selector.Load(cands[i], r.cfg.LoadWeights))
		}
	}
	return excluded
}

// prefixMatch sizes the scratch for the gathered candidates and asks the
// inventory how many leading blocks of keys each holds (and, from a
// tiered inventory, how many of those only in host memory).
func (r *Router) prefixMatch(s *scratch, service uint32, keys []uint64) {
	n := len(s.eps)
	if cap(s.match) < n {
		s.match = make([]int, n)
	}
	s.match = s.match[:n]
	clear(s.match)
	if cap(s.cpu) < n {
		s.cpu, s.eff = make([]int, n), make([]float64, n)
	}
	s.cpu, s.eff = s.cpu[:n], s.eff[:n]
	clear(s.cpu)
	if ti, ok := r.inv.(TieredInventory); ok {
		ti.PrefixMatchTiered(service, keys, s.eps, s.match, s.cpu)
	} else {
		r.inv.PrefixMatch(service, keys, s.eps, s.match)
	}
}

// overlap is step 1: it clamps each match to the request, weighs it by
// tier (a block held only in host memory counts TierWeightCPU of a
// GPU-resident one) and returns the warm position, the one with the most
// weighted overlap (ties: lower load, then lower index); it is what a
// spill or seed displaces. -1 when nothing matched.
func (r *Router) overlap(s *scratch, total int) int {
	warm := -1
	for i := range s.eps {
		s.match[i] = min(max(s.match[i], 0), total)
		c := min(max(s.cpu[i], 0), s.match[i])
		s.eff[i] = float64(s.match[i]-c) + r.cfg.TierWeightCPU*float64(c)
		if s.match[i] == 0 {
			continue
		}
		if warm < 0 || s.eff[i] > s.eff[warm] ||
			(s.eff[i] == s.eff[warm] && (s.load[i] < s.load[warm] || (s.load[i] == s.load[warm] && s.eps[i] < s.eps[warm]))) {
			warm = i
		}
	}
	return warm
}

// placeNoHit places a request no trusted healthy inventory matched: a
// fallback when only an untrusted endpoint holds the prefix, else a miss
// placement, empty_inventory on a cold fleet or no_match (extending the
// zero-hit watchdog's run) when some inventory is non-empty.
func (r *Router) placeNoHit(st *serviceState, s *scratch, svc ServiceView, keys []uint64, excluded bool, total, blockSize int, cands []selector.Candidate, fallback selector.Selector, freq selector.Request) Decision {
	if excluded && r.untrustedMatch(svc, keys, cands) {
		return r.fallback(st, ReasonParityUntrusted, total, blockSize, cands, fallback, freq)
	}
	nonEmpty := false
	for _, ep := range s.eps {
		if r.inv.Len(svc.ID, ep) > 0 {
			nonEmpty = true
			break
		}
	}
	if !nonEmpty {
		return r.placeMiss(st, s, ReasonEmptyInventory, keys, blockSize, cands, fallback, freq)
	}
	r.zeroHit(st, svc, s.eps)
	return r.placeMiss(st, s, ReasonNoMatch, keys, blockSize, cands, fallback, freq)
}

// minBlocks is the shallowest match that counts as a hit:
// ceil(MinMatchTokens/blockSize) blocks, at most the whole request, at
// least one.
func (r *Router) minBlocks(total, blockSize int) int {
	if r.cfg.MinMatchTokens > 0 {
		return min((r.cfg.MinMatchTokens+blockSize-1)/blockSize, total)
	}
	return 1
}

// choice is a hit's placement as the steps refine it: the scratch
// positions it goes to and was moved away from (-1: none), and why.
type choice struct {
	win, from    int
	tier, reason string
}

// blend is step 2's scoring of the gathered candidates of one hit.
type blend struct {
	s                           *scratch
	cands                       []selector.Candidate // by s.pos
	penalty                     float64              // tokens one request of load is worth
	minBlocks, total, blockSize int
	shortestFirst               bool // cap the penalty at the request's own uncached tokens
}

// score is overlap minus priced load, in tokens of prefill; a shallow
// match scores no overlap, so it cannot attract traffic.
func (b *blend) score(i int) float64 {
	s := b.s
	m := s.eff[i]
	if s.match[i] < b.minBlocks {
		m = 0
	}
	p, load := b.penalty, s.load[i]
	if b.shortestFirst {
		own := min(p, float64(max((b.total-s.match[i])*b.blockSize, b.blockSize)))
		if slots := b.cands[s.pos[i]].Slots; slots > 0 {
			// Shortest first overtakes queued work, not the requests
			// the engine's sequences are already running: those keep
			// the full price, the rest cost at most the request's own.
			running := min(load, float64(slots))
			return m*float64(b.blockSize) - p*running - own*(load-running)
		}
		p = own
	}
	return m*float64(b.blockSize) - p*load
}

// better reports whether position i is preferred over j: higher score,
// then lower load, then more overlap, then lower index.
func (b *blend) better(i, j int) bool {
	si, sj := b.score(i), b.score(j)
	if si != sj {
		return si > sj
	}
	s := b.s
	if s.load[i] != s.load[j] {
		return s.load[i] < s.load[j]
	}
	if s.eff[i] != s.eff[j] {
		return s.eff[i] > s.eff[j]
	}
	return s.eps[i] < s.eps[j]
}

// pick returns the best-scoring position: the warm one (longest_prefix)
// or, moved off it by load, a load_blend (spill tier when the winner's
// match is shallow).
func (b *blend) pick(warm int) choice {
	win := 0
	for i := 1; i < len(b.s.eps); i++ {
		if b.better(i, win) {
			win = i
		}
	}
	c := choice{win: win, from: -1, tier: TierKV, reason: ReasonLongestPrefix}
	if win != warm {
		c.from, c.reason = warm, ReasonLoadBlend
		if b.s.match[win] < b.minBlocks {
			c.tier = TierSpill
		}
	}
	return c
}

// relieveSpill is step 3: a winner with at least SpillMinLoad load that
// would exceed the fleet cap moves to the best-scoring candidate under the
// cap whose move pays.
func (r *Router) relieveSpill(b *blend, mc moveCost, c choice, warm int) choice {
	s := b.s
	if s.load[c.win] < float64(r.cfg.SpillMinLoad) {
		return c
	}
	sum := 0.0
	for _, l := range s.load {
		sum += l
	}
	capLoad := math.Ceil(float64(r.cfg.MeanLoadFactor) * (sum + 1) / (100 * float64(len(s.eps))))
	if s.load[c.win]+1 <= capLoad {
		return c
	}
	alt := -1
	for i := range s.eps {
		if s.load[i]+1 <= capLoad && (alt < 0 || b.better(i, alt)) && mc.movePays(c.win, i) {
			alt = i
		}
	}
	if alt < 0 {
		return c
	}
	from := warm
	if alt == warm {
		from = c.win // relief undid a blend move; report what it displaced
	}
	return choice{win: alt, from: from, tier: TierSpill, reason: ReasonOverCap}
}

// seedCold is step 4: every ColdSeedN-th hit makes a seed due, and the
// first due hit whose move is cheap or pays goes to the lowest-index
// candidate whose inventory is below ColdMinBlocks (otherwise a later hit
// takes the seed).
func (r *Router) seedCold(st *serviceState, service uint32, s *scratch, mc moveCost, c choice) choice {
	if r.cfg.ColdSeedN > 0 && st.tick.Add(1)%uint64(r.cfg.ColdSeedN) == 0 {
		st.seedDue.Store(true)
	}
	if !st.seedDue.Load() {
		return c
	}
	floor := max(r.cfg.ColdMinBlocks, 1)
	cold := -1
	for i := range s.eps {
		if i != c.win && (cold < 0 || s.eps[i] < s.eps[cold]) && r.inv.Len(service, s.eps[i]) < floor {
			cold = i
		}
	}
	switch {
	case cold < 0:
		st.seedDue.Store(false) // nothing to seed
	case !mc.seedCheap(st, c.win, cold) && !mc.movePays(c.win, cold):
		// a long history stays; the seed waits for a cheaper request
	case st.seedDue.CompareAndSwap(true, false):
		return choice{win: cold, from: c.win, tier: TierColdSeed, reason: ReasonColdSeed}
	}
	return c
}

// placeHit turns a hit's choice into the Decision, feeds the service's
// estimates and counts it.
func (r *Router) placeHit(st *serviceState, s *scratch, c choice, warm, warmUncached, total, blockSize int) Decision {
	d := Decision{
		EP:            s.eps[c.win],
		Tier:          c.tier,
		MatchedBlocks: s.match[c.win],
		CPUBlocks:     min(max(s.cpu[c.win], 0), s.match[c.win]),
		TotalBlocks:   total,
		BlockSize:     blockSize,
		From:          -1,
		Load:          s.load[c.win],
		Reason:        c.reason,
	}
	if c.from >= 0 {
		d.From = s.eps[c.from]
	}
	if r.cfg.LoadPenalty == LoadPenaltyAdaptive {
		// The warm endpoint's uncached work, not the chosen one's: what the
		// workload demands, independent of where the router sent it, so
		// moves away from the cache cannot feed back into the penalty.
		st.observeWork(warmUncached, blockSize)
	}
	st.observeHit(total, s.match[warm], blockSize)
	ep := strconv.Itoa(d.EP)
	r.m.hits.WithLabelValues(st.label, ep).Inc()
	switch c.tier {
	case TierSpill:
		r.m.spills.WithLabelValues(st.label, ep).Inc()
	case TierColdSeed:
		r.m.seeds.WithLabelValues(st.label, ep).Inc()
	}
	return d
}

// untrustedMatch reports whether an untrusted healthy candidate holds the
// first block: the miss is then strict attestation's doing, and is counted
// as such rather than as a cold or mismatched fleet. Called only on a miss
// with untrusted endpoints present.
func (r *Router) untrustedMatch(svc ServiceView, keys []uint64, cands []selector.Candidate) bool {
	var ep, out [1]int
	for i := range cands {
		if !cands[i].Healthy || !svc.untrusted(cands[i].Idx) {
			continue
		}
		ep[0], out[0] = cands[i].Idx, 0
		r.inv.PrefixMatch(svc.ID, keys[:1], ep[:], out[:])
		if out[0] > 0 {
			return true
		}
	}
	return false
}

// confirmHit resets the zero-hit streak when some endpoint's real (event-fed)
// inventory matched, and counts a zero hit when only speculative entries did.
func (r *Router) confirmHit(st *serviceState, svc ServiceView, keys []uint64, s *scratch) {
	ci, ok := r.inv.(ConfirmedInventory)
	if !ok {
		st.streak.Store(0)
		st.warned.Store(0)
		return
	}
	if cap(s.conf) < len(s.eps) {
		s.conf = make([]int, len(s.eps))
	}
	s.conf = s.conf[:len(s.eps)]
	ci.PrefixMatchConfirmed(svc.ID, keys, s.eps, s.conf)
	for _, m := range s.conf {
		if m > 0 {
			st.streak.Store(0)
			st.warned.Store(0)
			return
		}
	}
	for _, ep := range s.eps {
		if r.inv.Len(svc.ID, ep) > 0 {
			r.zeroHit(st, svc, s.eps)
			return
		}
	}
}

func (r *Router) zeroHit(st *serviceState, svc ServiceView, eps []int) {
	run := st.streak.Add(1)
	if run < int64(r.cfg.ZeroHitN) {
		return
	}
	reason, bit := WatchdogNotCached, warnNotCached
	if r.att == nil || r.unattested(svc.ID, eps, nil) != nil {
		reason, bit = WatchdogParitySuspect, warnSuspect
	}
	r.m.watchdog.WithLabelValues(st.label, reason).Inc()
	if st.warned.Or(bit)&bit != 0 {
		return // this episode already logged this reason
	}
	if reason == WatchdogNotCached {
		r.logger.Info("kv zero-hit watchdog: no request prefix was cached; every non-empty inventory attests hash parity, so the prompts were simply not cached",
			slog.Uint64("service", uint64(svc.ID)),
			slog.Int64("consecutive_lookups", run))
		return
	}
	attrs := []any{slog.Uint64("service", uint64(svc.ID)), slog.Int64("consecutive_lookups", run),
		slog.String("probable_cause", "kvBlockSize/page-size mismatch, hash-algo or seed drift, or tokenizer/chat-template mismatch")}
	if r.att == nil {
		attrs = append(attrs, slog.String("parity", "no attestation available"))
	} else {
		attrs = append(attrs, slog.Any("parity_not_ok_eps", r.unattested(svc.ID, eps, []int{})))
	}
	r.logger.Warn("kv zero-hit watchdog: inventories are non-empty but no request prefix matched", attrs...)
}

// unattested appends to out the endpoints among eps whose inventory is
// non-empty and whose parity verdict is not ok. With a nil out it stops at
// the first such endpoint and returns a non-nil empty slice, so the
// counting path does not allocate. Nil when there is none.
func (r *Router) unattested(service uint32, eps []int, out []int) []int {
	found := false
	for _, ep := range eps {
		if r.inv.Len(service, ep) > 0 && !r.att.ParityOK(service, ep) {
			if out == nil {
				return eps[:0]
			}
			found = true
			out = append(out, ep)
		}
	}
	if !found {
		return nil
	}
	return out
}
