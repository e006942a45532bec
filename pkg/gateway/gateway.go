package gateway

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/blockhash"
	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/dispatch"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/outlier"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/pkg/selector"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

// Tokenizers finds the staged tokenizer of a served model
// (*tokenizer.Registry).
type Tokenizers interface {
	// Get returns the model's tokenizer. It is called with any name a
	// client sends, so it must not keep state for names it has no
	// tokenizer for.
	Get(model string) (*tokenizer.Tokenizer, error)
	// Pin names the models the rules serve, which may keep state (a
	// status row saying why their tokenizer is missing).
	Pin(models []string)
	// SoleModel returns the model of the only staged tokenizer, ok=false
	// when none or several are staged. Called for requests that name no
	// model; must be cheap (cached).
	SoleModel() (string, bool)
}

// Inventory is what the gateway needs of kvindex: the router's view plus
// speculative entries for the endpoint just chosen.
type Inventory interface {
	router.Inventory
	StoreSpeculative(service uint32, ep int, keys []uint64, ttl time.Duration)
}

// HealthView reports endpoint health (*health.Prober).
type HealthView interface {
	Healthy(service uint32, ep int) bool
}

// EngineMetrics supplies scraped engine load for an endpoint; ok=false when
// none is known.
type EngineMetrics interface {
	Metrics(service uint32, ep int) (selector.EngineMetrics, bool)
}

// OtherNodesLoad tells the load other gateway nodes put on an endpoint:
// the engine's running+waiting at the last fresh scrape less this node's
// in-flight count then (ok false without a fresh sample). Config.ClusterLoad
// uses it.
type OtherNodesLoad interface {
	Others(service uint32, ep int) (int, bool)
}

// EngineSignals are what the engines say of themselves, read from their
// /metrics on a timer outside the request path (pkg/enginemetrics: its
// Scraper is every one of them). Each is optional: a nil field is a signal
// the gateway does without. They are given at construction, so the
// gateway learns no source after it serves.
type EngineSignals struct {
	// Load is each endpoint's running/waiting requests and KV usage, read
	// by gpu-aware selection, the router's load blend and P/D's Tier 1.5.
	Load EngineMetrics
	// Ranks is the per data-parallel rank running/waiting of engines that
	// label their gauges with the rank (rank choice, rankload.go).
	Ranks RankMetrics
	// Budgets is each endpoint's learned concurrent-sequence budget, the
	// prefill admission queue's slots under PrefillAuto (budget.go).
	Budgets SlotLearner
	// Others is the other gateway nodes' load on an endpoint, required by
	// ClusterLoad.
	Others OtherNodesLoad
}

// Config holds process-wide gateway settings.
type Config struct {
	// Seed is LLB_KV_NONE_HASH_SEED, the vLLM none-hash seed.
	Seed string
	// SpeculativeTTL is how long a routed request's blocks count as cached
	// on the chosen endpoint before the engine's own events confirm them.
	// 0 disables speculative entries. Default 5s.
	SpeculativeTTL time.Duration
	// CoalesceWait bounds how long a request waits for an earlier request
	// that is still computing the prompt prefix it was routed for (see
	// coalesce.go), LOXILB_KV_COALESCE_WAIT_MS. 0 means the default, 3s;
	// negative disables coalescing.
	CoalesceWait time.Duration
	// Engine is the engines' own load signals; see EngineSignals.
	Engine EngineSignals
	// ClusterTieBreak is how long a request that leads a new prefill waits,
	// when another gateway node may rank before this one (Config.Peers),
	// for another node's announcement of the same blocks before it is
	// forwarded (tiebreak.go), LOXILB_KV_CLUSTER_TIEBREAK_MS. 0: no wait.
	ClusterTieBreak time.Duration
	// PrefillSlots is how many requests per endpoint the gateway forwards
	// before their first byte comes back; more wait in the gateway,
	// shortest predicted prefill first (see prefillq.go),
	// LOXILB_KV_PREFILL_SLOTS. PrefillAuto (the daemon's default) uses
	// each endpoint's concurrent-sequence budget as learned from the
	// engines (Engine.Budgets; budget.go); N > 0 is a fixed budget; 0
	// forwards every request at once.
	PrefillSlots int
	// PrefillQueueWait bounds a request's wait for a prefill slot; then it
	// is forwarded anyway, LOXILB_KV_PREFILL_QUEUE_MS. 0 means the default.
	PrefillQueueWait time.Duration
	// MaxModelNameBytes bounds the model name a mode-4 request may carry
	// (--proxy-max-model-name); a longer one gets 400. 0 means
	// DefaultMaxModelNameBytes.
	MaxModelNameBytes int
	// MaxPromptBytes bounds the prompt text tokenized for one request
	// (--tokenize-max-bytes): a longer prompt string or rendered chat
	// gets 400 before any BPE work. 0 means DefaultMaxPromptBytes.
	MaxPromptBytes int
	// MaxPromptTokens bounds a prompt's tokens (--tokenize-max-tokens):
	// encoding stops and the request gets 400 once it is passed. 0 means
	// the model's context length as staged (Tokenizer.MaxLength), else
	// DefaultMaxPromptTokens.
	MaxPromptTokens int
	// BodyCacheBytes bounds the body cache (--tokenize-body-cache-bytes,
	// bodycache.go): the token ids, rendered prompt and block keys of
	// request bodies seen more than once, so an identical body skips
	// decoding, rendering, tokenizing and hashing. 0 turns it off.
	BodyCacheBytes int64
	// TokenizeConcurrency is how many requests tokenize at once
	// (--tokenize-concurrency); the others wait, for as long as their
	// client does. 0 means GOMAXPROCS.
	TokenizeConcurrency int
	// PD, when not nil, runs the rules with pd_disagg_mode (pkg/dispatch:
	// the engine's prefill/decode flow behind Plan.Dispatch); without it
	// those rules are refused (503).
	PD *dispatch.Dispatcher
	// Outliers, when not nil, is passive health checking: attempts are
	// reported to it and the endpoints it ejected are left out.
	Outliers Outliers
	// KVParityStrict is strict attestation for rules that do not set
	// kvParityStrict (--kv-parity-strict, LOXILB_KV_PARITY_STRICT): an
	// endpoint whose parity verdict is a mismatch gets no Tier-1.5
	// traffic (see attest.go). Off by default, as in loxilb, where
	// verdicts are only reported.
	KVParityStrict bool
	// Parity supplies the verdicts strict attestation acts on; nil turns
	// it off whatever the rules say.
	Parity ParityVerdicts
	// Peers, when not nil, is where this node announces the prefills it
	// leads to the other gateway nodes (*peerprefill.Node; remote.go);
	// nil on a node alone.
	Peers PrefillPeers
	// ClusterLoad blends other gateway nodes' load into each candidate's
	// in-flight count (LOXILB_KV_CLUSTER_ROUTING; on with a shared rule
	// store): in-flight = this node's open, held and queued requests +
	// others, where others = the other nodes' own counts as their latest
	// load snapshots say (PeerLoad) or, without fresh ones from every
	// node, max(0, engine running+waiting at the last scrape − this
	// node's open requests at that scrape) (peerload.go). The engines'
	// gauges are what every node reads alike, the local count is what
	// changed since, so every node ranks endpoints by nearly the same
	// load and its own decisions count at once. Off, a node alone sees
	// max(its in-flight, running+waiting) (selector.Load), which lags its
	// own decisions by up to a scrape interval when the engine's count is
	// the larger. Needs Engine.Others.
	ClusterLoad bool
	// PeerLoad, when not nil, is the other nodes' own in-flight counts
	// (*peerprefill.Node, which the gateway feeds as its LoadSource):
	// ClusterLoad uses them in place of the scraped estimate while every
	// other node's are fresh (peerload.go).
	PeerLoad PeerLoad
}

// Defaults of the request bounds.
const (
	// DefaultMaxModelNameBytes is far longer than served model names
	// ("org/model-size-variant") and short enough to appear in a log
	// line; the tokenizer directory's slugs stop at 255 bytes anyway.
	DefaultMaxModelNameBytes = 256
	// DefaultBodyCacheBytes holds about a hundred 2k-token chat requests
	// (~35 KB each with their ids, keys and rendered prompt).
	DefaultBodyCacheBytes = 4 << 20
	// DefaultMaxPromptBytes is about 250k tokens of English, past the
	// context of most served models. Encoding it costs at most ~0.7 s of
	// one core (a megabyte of one repeated character).
	DefaultMaxPromptBytes = 1 << 20
	// DefaultMaxPromptTokens applies when the staged files do not say the
	// model's context length.
	DefaultMaxPromptTokens = 256 << 10
)

// DefaultPrefillQueueWait is Config.PrefillQueueWait's default: a few long
// prefills on a busy engine, so a long prompt is overtaken for at most that.
const DefaultPrefillQueueWait = 2 * time.Second

// PrefillAuto is Config.PrefillSlots for budgets learned per endpoint.
const PrefillAuto = prefillAuto

// DefaultClusterTieBreak is the daemon's default of Config.ClusterTieBreak:
// a few loopback or LAN datagram latencies on a loaded node, a few percent
// of the prefill of a prefix worth sharing (tiebreak.go).
const DefaultClusterTieBreak = 3 * time.Millisecond

// DefaultCoalesceWait is Config.CoalesceWait's default: longer than a long
// prompt's prefill on a busy engine, short enough that a stuck leader costs
// its followers seconds, not a request timeout.
const DefaultCoalesceWait = 3 * time.Second

// Gateway is the mode-4 service table and proxy.Picker.
type Gateway struct {
	cfg    Config
	tok    Tokenizers
	inv    Inventory
	router *router.Router
	health HealthView
	engine EngineMetrics
	// inflight is the proxy's count of requests sent to each endpoint
	// and not yet finished, shared with it from construction.
	inflight *proxy.InFlightTable
	others   OtherNodesLoad // ClusterLoad's source; nil when off
	logger   *slog.Logger
	m        *metrics
	table    atomic.Pointer[map[uint32]*service]
	mu       sync.Mutex // serializes Reconcile
	keyPool  sync.Pool
	// idPool holds token-id buffers for Pick, which is done with a
	// request's ids when it returns: a 2k-token chat's ids are ~11 KB of
	// garbage per request otherwise.
	idPool sync.Pool
	// bodies skips the pipeline for a body seen before (nil: off).
	bodies  *bodyCache
	leaders leaders
	remote  remoteLeaders // the other nodes' announced prefills (remote.go)
	prefill prefillGate
	work    prefillWork // outstanding prefill tokens per endpoint
	ranks   rankLoad    // per data-parallel rank: requests in flight, recent placements
	// rankEngine is the engines' per-rank gauges (Config.Engine.Ranks).
	rankEngine RankMetrics
	// tokSlots bounds concurrent tokenization (TokenizeConcurrency).
	tokSlots chan struct{}
	// Clients can repeat these conditions at will: log them rate-limited.
	unknownLog, rejectLog logLimiter
}

var _ proxy.Picker = (*Gateway)(nil)

// service is one mode-4 rule's routing state.
type service struct {
	id     uint32
	rule   *lbrule.Rule
	label  string
	hasher *blockhash.Hasher // nil unless KV-exact
	sel    selector.Selector
	// observe is the passive health check of Pick's plans (nil: none).
	observe func(proxy.Endpoint, outlier.Outcome)
	addrs   []string       // endpoint dial addresses, by index
	selKey  string         // the settings the selector was built from
	key     keySpec        // how requests are keyed for the hashing selectors
	rank    *rankTargeting // nil unless requests can name a data-parallel rank
	// draining marks, by index, the endpoints in maintenance: they get no
	// new request (every tier, the fallback selector, failover); requests
	// already sent to them run to their end. nil when none is.
	draining []bool
}

// isDraining reports whether endpoint i is in maintenance.
func (st *service) isDraining(i int) bool { return i < len(st.draining) && st.draining[i] }

// New builds the gateway. health may be nil (every endpoint is healthy).
// inflight is the table the proxy counts its requests in (the same one
// given to proxy.New): it is every candidate's local load, so it is
// required.
func New(cfg Config, tok Tokenizers, inv Inventory, rt *router.Router, health HealthView,
	inflight *proxy.InFlightTable, logger *slog.Logger, reg prometheus.Registerer) (*Gateway, error) {
	if tok == nil || inv == nil || rt == nil || inflight == nil {
		return nil, errors.New("gateway: tokenizers, inventory, router and in-flight table are required")
	}
	if cfg.ClusterLoad && cfg.Engine.Others == nil {
		return nil, errors.New("gateway: ClusterLoad needs the other nodes' load (Config.Engine.Others)")
	}
	if logger == nil {
		logger = slog.Default()
	}
	if cfg.SpeculativeTTL == 0 {
		cfg.SpeculativeTTL = 5 * time.Second
	}
	if cfg.CoalesceWait == 0 {
		cfg.CoalesceWait = DefaultCoalesceWait
	}
	if cfg.PrefillQueueWait <= 0 {
		cfg.PrefillQueueWait = DefaultPrefillQueueWait
	}
	if cfg.MaxModelNameBytes <= 0 {
		cfg.MaxModelNameBytes = DefaultMaxModelNameBytes
	}
	if cfg.MaxPromptBytes <= 0 {
		cfg.MaxPromptBytes = DefaultMaxPromptBytes
	}
	if cfg.TokenizeConcurrency <= 0 {
		cfg.TokenizeConcurrency = runtime.GOMAXPROCS(0)
	}
	m, err := newMetrics(reg)
	if err != nil {
		return nil, err
	}
	g := &Gateway{cfg: cfg, tok: tok, inv: inv, router: rt, health: health, engine: cfg.Engine.Load, rankEngine: cfg.Engine.Ranks,
		inflight: inflight, logger: logger, m: m,
		tokSlots:   make(chan struct{}, cfg.TokenizeConcurrency),
		unknownLog: logLimiter{every: logEvery}, rejectLog: logLimiter{every: logEvery}}
	g.prefill.slots = max(cfg.PrefillSlots, PrefillAuto)
	g.prefill.learner = cfg.Engine.Budgets
	if cfg.ClusterLoad {
		g.others = cfg.Engine.Others
	}
	collectors := []prometheus.Collector{&g.prefill, slotsCollector{g}}
	if cfg.BodyCacheBytes > 0 {
		g.bodies = newBodyCache(cfg.BodyCacheBytes)
		collectors = append(collectors, g.bodies.collectors...)
	}
	if reg != nil {
		for _, c := range collectors {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	empty := map[uint32]*service{}
	g.table.Store(&empty)
	g.keyPool.New = func() any { b := make([]uint64, 0, 512); return &b }
	g.idPool.New = func() any { return new([]uint32) }
	return g, nil
}

// Name implements control.Reconciler.
func (g *Gateway) Name() string { return "gateway" }

// Reconcile implements control.Reconciler: it rebuilds the mode-4 routing
// table (the proxy's listeners are reconcilers.Listeners'). Selectors survive
// when a rule's selector settings and endpoints are unchanged, so
// round-robin positions and persistence tables are not reset by unrelated
// rule changes. Rules are applied one by one: a rule whose routing cannot
// be built is reported as a control.RuleError and the others are served.
func (g *Gateway) Reconcile(_ context.Context, services []control.Service) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	old := *g.table.Load()
	next := make(map[uint32]*service)
	var models []string
	var errs []error
	for _, cs := range services {
		r := cs.Rule
		if r.Service.Mode != lbrule.ModeFullProxy {
			continue
		}
		if r.Service.ModelName != "" {
			models = append(models, r.Service.ModelName)
		}
		st, err := g.buildService(cs, old[cs.ID])
		if err != nil {
			errs = append(errs, &control.RuleError{ID: cs.ID, Reason: control.ReasonStageFailed, Err: fmt.Errorf("rule %d (%s): %w", cs.ID, r.Key(), err)})
			continue
		}
		next[cs.ID] = st
	}
	g.table.Store(&next)
	g.tok.Pin(models)
	g.forgetPD(old, next)
	for id := range old {
		if _, ok := next[id]; !ok {
			g.router.Forget(id)
			g.m.forget(old[id].label)
			g.leaders.forget(id)
			g.work.forget(id)
			g.ranks.forget(id)
			if g.cfg.Outliers != nil {
				g.cfg.Outliers.Forget(id)
			}
		}
	}
	return errors.Join(errs...)
}

func (g *Gateway) buildService(cs control.Service, prev *service) (*service, error) {
	r := cs.Rule
	st := &service{id: cs.ID, rule: r, label: strconv.FormatUint(uint64(cs.ID), 10)}
	// Built once: every Pick of a role-less pool hands out the same one.
	st.observe = g.observer(st, len(r.Endpoints))
	for i, ep := range r.Endpoints {
		st.addrs = append(st.addrs, net.JoinHostPort(ep.IP, strconv.Itoa(ep.Port)))
		if cs.EndpointDraining(i) {
			if st.draining == nil {
				st.draining = make([]bool, len(r.Endpoints))
			}
			st.draining[i] = true
		}
	}
	if r.Service.KVExactMode == lbrule.KVExactSingle || r.Service.KVExactMode == lbrule.KVExactPD {
		h, err := blockhash.New(blockhash.Config{Algo: blockhash.Algo(r.Service.KVHashAlgo), BlockSize: r.Service.KVBlockSize, Seed: g.cfg.Seed})
		if err != nil {
			return nil, fmt.Errorf("block hasher: %w", err)
		}
		st.hasher = h
		if !r.Service.PDDisagg {
			st.rank = newRankTargeting(r.Engine(), r.Service.KVDpRankCount)
		}
	}
	st.key = keySpecFor(r)
	var opts selector.Options
	if lbrule.IsHashSel(r.Service.Sel) {
		opts.MeanLoadFactor, opts.VirtualNodes = r.ChwblMeanLoadFactor(), r.ChwblReplication()
	}
	st.selKey = fmt.Sprintf("%d/%d/%d/%v", r.Service.Sel, opts.MeanLoadFactor, opts.VirtualNodes, st.addrs)
	if prev != nil && prev.selKey == st.selKey {
		st.sel = prev.sel
		return st, nil
	}
	sel, err := selector.New(r.Service.Sel, opts)
	if err != nil {
		return nil, fmt.Errorf("selector: %w", err)
	}
	st.sel = sel
	return st, nil
}

func (g *Gateway) lookup(id uint32) *service { return (*g.table.Load())[id] }
