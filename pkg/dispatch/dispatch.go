package dispatch

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/engine"
	"github.com/loxilb-llm/loxilb/pkg/outlier"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/selector"
)

// Engines with a P/D flow, as pkg/engine spells them.
const (
	EngineVLLM   = string(engine.VLLM)
	EngineSGLang = string(engine.SGLang)
	EngineTRTLLM = string(engine.TRTLLM)
)

// Prefill ladder tiers (loxilb_pd_prefill_tier_total and receipts).
const (
	TierSession     = "session"
	TierPrefix      = "prefix"
	TierKV          = "tier1.5"
	TierLeastLoaded = "least_loaded"
)

// Endpoint is one prefill or decode endpoint of a P/D rule.
type Endpoint struct {
	// Idx is the endpoint's index in the rule; metrics, sessions and
	// in-flight accounting use it.
	Idx int
	// Host is the endpoint IP (what bootstrap_host and remote_host carry),
	// Port its serving port.
	Host string
	Port int
	// NixlPort is the vLLM NIXL side-channel port; 0 means Port.
	NixlPort int
	// Healthy is the probe state; unhealthy endpoints are never chosen.
	Healthy bool
}

// Addr is the dial address.
func (e Endpoint) Addr() string { return net.JoinHostPort(e.Host, strconv.Itoa(e.Port)) }

// Pool is one P/D rule as the dispatcher sees it.
type Pool struct {
	Service uint32
	// Engine is vllm, sglang or trtllm.
	Engine string
	// Scheme is http, or https for security 2.
	Scheme string
	// BootstrapPort is the rule's pdBootstrapPort (0 means 8998).
	BootstrapPort   int
	Prefill, Decode []Endpoint
}

// KVScorer is Tier 1.5 over the prefill inventories: given the healthy
// prefill candidates (InFlight filled by the dispatcher), it returns the
// endpoint holding the longest cached prefix, or ok=false on a miss. It is
// called at most once per request, on the request goroutine.
type KVScorer func(cands []selector.Candidate) (ep int, receipt string, ok bool)

// Request is one client request for a P/D pool.
type Request struct {
	Pool   *Pool
	Method string
	Path   string
	Header http.Header
	// Body is the client's JSON body; it is not modified.
	Body []byte
	// Session is the value of the rule's session header, "" when absent.
	Session string
	// PrefixKeys are the request's chained block keys in prompt order, used
	// by the prefix-history tier; nil lets the dispatcher hash the prompt
	// text in PromptChunkBytes chunks instead.
	PrefixKeys []uint64
	// KV is Tier 1.5 (kvExactMode 1); nil skips the tier (base P/D).
	KV KVScorer
	// Observe, if not nil, is told what every leg showed about its
	// endpoint (passive health checking, the P/D circuit breaker): a
	// gateway failure (connect, reset or timeout before the response),
	// a 5xx answer, or a success once the response headers arrived. Legs
	// the client or the other leg abandoned report nothing.
	Observe func(ep Endpoint, prefill bool, o outlier.Outcome)
	// PrefillRank, when not nil, returns the data-parallel rank of prefill
	// endpoint ep that should serve the prefill leg (the rank holding the
	// prompt's prefix) and the endpoint's rank count; ok false leaves it
	// to the engine. The SGLang flow
	// names it to the prefill server (routed_dp_rank, data_parallel_rank)
	// and to the decode server (disagg_prefill_dp_rank), which must fetch
	// the KV cache from that rank. It is called on the request goroutine
	// for each prefill endpoint tried.
	PrefillRank func(ep int) (rank, ranks int, ok bool)
	// Legs sends the legs: the proxy's upstream for the rule
	// (proxy.Request.Legs, which the proxy sets before Plan.Dispatch
	// runs), with its pooled connections, TLS settings, error classes and
	// in-flight counts. Required by Execute and Serve; flows run outside
	// the proxy use a proxy.Transport.
	Legs http.RoundTripper
}

// Choice is the ladder's decision for one request.
type Choice struct {
	// Prefill is the ordered prefill list: the chosen endpoint first, then
	// the other healthy ones, least loaded first, as connect failover
	// targets.
	Prefill []Endpoint
	// Decode is the chosen decode endpoint; decodeAlt the other healthy
	// ones, least loaded first, for connect failover.
	Decode    Endpoint
	decodeAlt []Endpoint
	Tier      string // how the first prefill endpoint was chosen
	Detail    string // the Tier 1.5 receipt, or the prefix depth
	keys      []uint64
	// parsed is the body as Choose parsed it, reused by Execute (which is
	// given the same body) so a request is parsed once.
	parsed map[string]json.RawMessage
}

// Receipt renders the choice for the X-Loxilb-Route header and logs.
func (c Choice) Receipt() string {
	s := fmt.Sprintf("pd tier=%s prefill=%d decode=%d", c.Tier, c.Prefill[0].Idx, c.Decode.Idx)
	if c.Detail != "" {
		s += " " + c.Detail
	}
	return s
}

// Dispatcher runs the P/D flows. It is safe for concurrent use.
type Dispatcher struct {
	cfg    Config
	logger *slog.Logger
	m      *metrics
	adm    *admission
	sess   *sessions
	trie   *prefixIndex
	now    func() time.Time
	// rrPre and rrDec rotate least-loaded ties, separately so one does not
	// step the other in lockstep.
	rrPre, rrDec atomic.Uint64
	bufs         sync.Pool // relay buffers
	// sidePorts holds the remote_port each vLLM prefill endpoint last
	// reported (sideKey -> int), for diagnostics.
	sidePorts sync.Map
}

type sideKey struct {
	service uint32
	ep      int
}

// SidePort reports the NIXL side-channel port (remote_port) a vLLM prefill
// endpoint put in its last kv_transfer_params; ok is false before any. With
// nixl_port 0 the decode leg is sent to the target port instead, so a
// difference means the rule misses the engine's side channel.
func (d *Dispatcher) SidePort(service uint32, ep int) (int, bool) {
	v, ok := d.sidePorts.Load(sideKey{service, ep})
	if !ok {
		return 0, false
	}
	return v.(int), true
}

// New builds a dispatcher. It owns no connections: every leg goes through
// the proxy's upstream handed in Request.Legs. reg may be nil.
func New(cfg Config, logger *slog.Logger, reg prometheus.Registerer) (*Dispatcher, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("dispatch config: %w", err)
	}
	if logger == nil {
		logger = slog.Default()
	}
	m, err := newMetrics(reg)
	if err != nil {
		return nil, fmt.Errorf("dispatch metrics: %w", err)
	}
	d := &Dispatcher{cfg: cfg, logger: logger, m: m, adm: newAdmission(cfg, m), now: time.Now}
	d.sess = newSessions(cfg.SessionTTL, cfg.SessionMax, func() time.Time { return d.now() })
	d.trie = newPrefixIndex(cfg.TrieMaxKeys)
	d.bufs.New = func() any { b := make([]byte, 32<<10); return &b }
	// Start the tie rotation anywhere, so gateways started together do not
	// all send their first requests to the same endpoints.
	d.rrPre.Store(rand.Uint64())
	d.rrDec.Store(rand.Uint64())
	return d, nil
}

// Config returns the effective configuration.
func (d *Dispatcher) Config() Config { return d.cfg }

// InFlight reports the legs admitted to an endpoint.
func (d *Dispatcher) InFlight(service uint32, ep int) int { return d.adm.inFlight(service, ep) }

// Forget drops a removed rule's sessions, prefix history and slots.
func (d *Dispatcher) Forget(service uint32) {
	d.sess.forget(service)
	d.trie.forget(service)
	d.adm.forget(service)
	d.sidePorts.Range(func(k, _ any) bool {
		if k.(sideKey).service == service {
			d.sidePorts.Delete(k)
		}
		return true
	})
	d.m.sessionsActive.Set(float64(d.sess.len()))
	d.m.trieKeys.Set(float64(d.trie.keys()))
}

// Choose runs the prefill ladder and the decode choice:
//
//	prefill: session affinity -> prefix history -> Tier 1.5 (req.KV) -> least loaded
//	decode:  session affinity -> least loaded
//
// Affinity tiers keep their endpoint only while it is healthy and at most
// BalanceAbs legs busier than the least loaded candidate, so a hot session
// or prefix cannot pin one worker while others idle. The prefix tier needs
// at least TrieMinPercent of the request's blocks (and one block).
func (d *Dispatcher) Choose(req *Request) (Choice, error) {
	p := req.Pool
	svc := p.Service
	pre := d.healthy(svc, p.Prefill)
	dec := d.healthy(svc, p.Decode)
	if len(pre) == 0 {
		return Choice{}, fmt.Errorf("%w: rule %d has no healthy prefill endpoint", proxy.ErrUnavailable, svc)
	}
	if len(dec) == 0 {
		return Choice{}, fmt.Errorf("%w: rule %d has no healthy decode endpoint", proxy.ErrUnavailable, svc)
	}
	c := Choice{keys: req.PrefixKeys}
	if c.keys == nil {
		if m, err := parseBody(req.Body); err == nil {
			c.parsed = m
			c.keys = promptKeys(m, d.cfg.PromptChunkBytes)
		}
	}
	label := strconv.FormatUint(uint64(svc), 10)
	chosen, decIdx := -1, -1
	if req.Session != "" {
		if pi, di, ok := d.sess.get(svc, req.Session); ok {
			if d.balanced(pre, pi) {
				chosen, c.Tier = pi, TierSession
			}
			if d.balanced(dec, di) {
				decIdx = di
			}
			if chosen >= 0 || decIdx >= 0 {
				d.m.sessionHits.WithLabelValues(label).Inc()
			}
		}
	}
	if chosen < 0 && len(c.keys) > 0 {
		if ep, depth := d.trie.match(svc, c.keys); depth > 0 && depth*100 >= d.cfg.TrieMinPercent*len(c.keys) && d.balanced(pre, ep) {
			chosen, c.Tier, c.Detail = ep, TierPrefix, fmt.Sprintf("matched=%d/%d", depth, len(c.keys))
		}
	}
	if chosen < 0 && req.KV != nil {
		cands := make([]selector.Candidate, len(pre))
		for i, e := range pre {
			cands[i] = selector.Candidate{Idx: e.ep.Idx, Weight: 1, Healthy: true, InFlight: e.load}
		}
		if ep, receipt, ok := req.KV(cands); ok && indexOf(pre, ep) >= 0 {
			chosen, c.Tier, c.Detail = ep, TierKV, receipt
		}
	}
	if chosen < 0 {
		chosen, c.Tier = leastLoaded(pre, d.rrPre.Add(1)), TierLeastLoaded
	}
	if decIdx < 0 {
		decIdx = leastLoaded(dec, d.rrDec.Add(1))
	}
	d.m.prefillTier.WithLabelValues(label, c.Tier).Inc()
	// Chosen first, then the rest least loaded first (stable by index).
	c.Prefill = append(c.Prefill, pre[indexOf(pre, chosen)].ep)
	for _, e := range byLoad(pre) {
		if e.ep.Idx != chosen {
			c.Prefill = append(c.Prefill, e.ep)
		}
	}
	c.Decode = dec[indexOf(dec, decIdx)].ep
	for _, e := range byLoad(dec) {
		if e.ep.Idx != decIdx {
			c.decodeAlt = append(c.decodeAlt, e.ep)
		}
	}
	return c, nil
}

type loaded struct {
	ep   Endpoint
	load int
}

func (d *Dispatcher) healthy(svc uint32, eps []Endpoint) []loaded {
	out := make([]loaded, 0, len(eps))
	for _, e := range eps {
		if e.Healthy {
			out = append(out, loaded{e, d.adm.inFlight(svc, e.Idx)})
		}
	}
	return out
}

func indexOf(l []loaded, idx int) int {
	for i := range l {
		if l[i].ep.Idx == idx {
			return i
		}
	}
	return -1
}

// balanced reports whether endpoint idx is a healthy candidate within
// BalanceAbs of the least loaded one.
func (d *Dispatcher) balanced(l []loaded, idx int) bool {
	i := indexOf(l, idx)
	if i < 0 {
		return false
	}
	if d.cfg.BalanceAbs < 0 {
		return true
	}
	lo := l[0].load
	for _, e := range l {
		lo = min(lo, e.load)
	}
	return l[i].load-lo <= d.cfg.BalanceAbs
}

// leastLoaded picks the lowest in-flight count; ties rotate with the clock
// so equal endpoints share sequential traffic.
func leastLoaded(l []loaded, rot uint64) int {
	lo := l[0].load
	for _, e := range l {
		lo = min(lo, e.load)
	}
	var ties []int
	for _, e := range l {
		if e.load == lo {
			ties = append(ties, e.ep.Idx)
		}
	}
	return ties[rot%uint64(len(ties))]
}

func byLoad(l []loaded) []loaded {
	out := append([]loaded(nil), l...)
	for i := 1; i < len(out); i++ {
		for j := i; j > 0 && out[j].load < out[j-1].load; j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	return out
}

// Serve chooses endpoints and runs the pool's engine flow, writing the whole
// response to w. It returns the outcome for the proxy's metrics and
// Plan.Done. It never panics on upstream behaviour; a response cut after
// bytes reached the client is reported with Result.Class set and the
// caller should close the client connection.
func (d *Dispatcher) Serve(ctx context.Context, w http.ResponseWriter, req *Request) proxy.Result {
	c, err := d.Choose(req)
	if err != nil {
		return d.fail(w, req, proxy.Result{Endpoint: -1}, err, "unavailable")
	}
	return d.Execute(ctx, w, req, c)
}

// Execute runs the flow for an already made Choice (the gateway chooses at
// pick time so the receipt header can name the endpoints). req.Body must
// be the body the Choice was made for.
func (d *Dispatcher) Execute(ctx context.Context, w http.ResponseWriter, req *Request, c Choice) proxy.Result {
	start := d.now()
	res := proxy.Result{Endpoint: c.Decode.Idx, BytesIn: int64(len(req.Body))}
	label := strconv.FormatUint(uint64(req.Pool.Service), 10)
	if req.Legs == nil {
		return d.fail(w, req, res, errNoLegs, "internal")
	}
	leave, err := d.adm.enter(label)
	if err != nil {
		return d.fail(w, req, res, err, "shed")
	}
	defer leave()
	body, err := c.parsed, error(nil)
	if body == nil {
		body, err = parseBody(req.Body)
	}
	if err == nil && IsGenerate(req.Path) {
		if req.Pool.Engine != EngineSGLang {
			err = fmt.Errorf("%w: /generate is SGLang's native API; this rule's engine is %s", proxy.ErrBadRequest, engineName(req.Pool.Engine))
		} else {
			err = checkGenerate(body)
		}
	}
	if err != nil {
		return d.fail(w, req, res, err, "bad_request")
	}
	x := &exchange{d: d, req: req, c: c, w: w, label: label, res: res, body: body}
	switch req.Pool.Engine {
	case EngineVLLM, "":
		x.runVLLM(ctx)
	case EngineSGLang:
		x.runSGLang(ctx)
	case EngineTRTLLM:
		x.runTRT(ctx)
	default:
		return d.fail(w, req, res, fmt.Errorf("engine %q has no P/D flow", req.Pool.Engine), "internal")
	}
	if x.res.Class == proxy.ClassNone && x.prefillUsed != nil {
		pre := x.prefillUsed.Idx
		d.trie.insert(req.Pool.Service, c.keys, pre)
		if req.Session != "" {
			d.sess.put(req.Pool.Service, req.Session, pre, x.c.Decode.Idx)
		}
		d.m.sessionsActive.Set(float64(d.sess.len()))
		d.m.trieKeys.Set(float64(d.trie.keys()))
	}
	x.res.Duration = d.now().Sub(start)
	d.m.requests.WithLabelValues(label, engineName(req.Pool.Engine), x.outcome()).Inc()
	return x.res
}

func engineName(e string) string {
	if e == "" {
		return EngineVLLM
	}
	return e
}

// fail answers a request that failed before any leg byte was relayed.
func (d *Dispatcher) fail(w http.ResponseWriter, req *Request, res proxy.Result, err error, outcome string) proxy.Result {
	v := proxy.WriteError(w, err, d.cfg.RetryAfter)
	res.Status, res.Class, res.Err = v.Status, v.Class, err
	d.m.requests.WithLabelValues(strconv.FormatUint(uint64(req.Pool.Service), 10), engineName(req.Pool.Engine), outcome).Inc()
	return res
}

// MustAbort reports whether a response was cut after its status line went
// out: the caller must then close the client connection (for example with
// panic(http.ErrAbortHandler)) so the client sees a truncated body rather
// than a clean end.
func MustAbort(res proxy.Result) bool {
	return res.Class != proxy.ClassNone && res.Class != proxy.ClassClientCanceled && res.Status/100 == 2
}
