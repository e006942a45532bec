package selector

import (
	"errors"
	"fmt"
	"math"
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

// Selector numbers, as in loxilb's `sel` rule field (numbered in lbrule).
const (
	SelRR        = lbrule.SelRR
	SelHash      = lbrule.SelHash
	SelPriority  = lbrule.SelPriority
	SelPersist   = lbrule.SelPersist
	SelLeastConn = lbrule.SelLC
	SelN2        = lbrule.SelN2
	SelN3        = lbrule.SelN3
	SelCHWBL     = lbrule.SelCHWBL
	SelGPUAware  = lbrule.SelGPUAware
	SelWRRHash   = lbrule.SelWRRHash
)

// Errors returned by New. Callers (rule validation) branch on them with
// errors.Is to answer 400 rather than 500.
var (
	// ErrNotApplicable marks a selector that exists in loxilb but has no
	// meaning for HTTP inference traffic (n2, n3).
	ErrNotApplicable = errors.New("selector not applicable to LLM HTTP traffic")
	// ErrUnknownSelector marks a sel number outside the known set.
	ErrUnknownSelector = errors.New("unknown selector")
	// ErrInvalidOptions marks out-of-range Options.
	ErrInvalidOptions = errors.New("invalid selector options")
)

// EngineMetrics are the load signals scraped from an inference engine's
// /metrics endpoint. Valid is false when no fresh scrape exists; selectors
// then use only the proxy's own in-flight count.
type EngineMetrics struct {
	Running int     // requests the engine is currently running (decode/prefill batch)
	Waiting int     // requests queued inside the engine
	KVUsage float64 // fraction of the KV cache in use, 0..1
	Valid   bool
}

// Candidate is one endpoint of a rule as seen at selection time.
type Candidate struct {
	Idx      int // endpoint index within the rule; what Pick returns
	Weight   int
	Healthy  bool
	InFlight int // requests the proxy currently has open to this endpoint
	// PrefillTokens is the prefill work outstanding on this endpoint: the
	// uncached prompt tokens of requests the gateway routed to it whose
	// first byte has not come back yet. 0 when the gateway does not track
	// it (prompts not tokenized). The KV router places misses by it.
	PrefillTokens int64
	// Slots is the endpoint's concurrent-sequence budget as the gateway
	// applies it to prefill admission (learned from the engine or
	// configured); 0 when unknown. With InFlight it tells whether the
	// engine has a sequence free for one more request now, which the
	// KV router prefers for a miss.
	Slots   int
	Metrics EngineMetrics
}

// Request carries what a selector may key on.
type Request struct {
	// Key is the routing key: model + prompt prefix, or a session id. It
	// may be empty, in which case hashing selectors use the client address
	// and fall back to round robin without one.
	Key      []byte
	ClientIP netip.Addr
}

// Selector picks one endpoint among candidates. Implementations are safe for
// concurrent use, never retain cands, and return ok=false only when no
// candidate is healthy (or, for priority, none has a usable weight).
type Selector interface {
	Pick(req Request, cands []Candidate) (idx int, ok bool)
}

// UsesKey reports whether s hashes Request.Key. Building a key costs a
// copy of the prompt prefix per request; a selector that never reads one
// (round robin, priority, persist, least connections) need not get one.
// A selector this package does not know is assumed to use it.
func UsesKey(s Selector) bool {
	switch s.(type) {
	case *roundRobin, *priority, *persist, *leastConn:
		return false
	}
	return true
}

// LoadWeights tune Load. The zero value is not useful; use DefaultLoadWeights.
type LoadWeights struct {
	// Queue is the extra cost of one request waiting inside the engine, on
	// top of counting it as in flight: a queued request delays every request
	// behind it, a running one shares the batch.
	Queue float64
	// KV is the cost, in request-equivalents, of a full KV cache: a nearly
	// full cache forces preemption and recomputation.
	KV float64
}

// DefaultLoadWeights are the weights used by the gpu-aware selector and by
// the router's load blend.
var DefaultLoadWeights = LoadWeights{Queue: 1, KV: 4}

// Load expresses an endpoint's load in request-equivalents:
//
//	metrics valid:   max(InFlight, Running+Waiting) + w.Queue*Waiting + w.KV*KVUsage
//	metrics invalid: InFlight
//
// The max avoids counting the proxy's own requests twice (the engine reports
// them as running or waiting) while still seeing load that arrived by other
// paths. KVUsage is clamped to 0..1.
func Load(c Candidate, w LoadWeights) float64 {
	l := float64(c.InFlight)
	if !c.Metrics.Valid {
		return l
	}
	if e := float64(c.Metrics.Running + c.Metrics.Waiting); e > l {
		l = e
	}
	kv := c.Metrics.KVUsage
	if kv < 0 || math.IsNaN(kv) {
		kv = 0
	} else if kv > 1 {
		kv = 1
	}
	return l + w.Queue*float64(max(c.Metrics.Waiting, 0)) + w.KV*kv
}

// Options configure the selectors that take parameters. Zero values select
// the documented defaults.
type Options struct {
	// PersistTimeout is how long a client address stays bound to an
	// endpoint after its last request (sel 3). Default 3h.
	PersistTimeout time.Duration
	// PersistMaxClients bounds the affinity table (sel 3). Default 65536.
	PersistMaxClients int
	// MeanLoadFactor is the bounded-load factor in percent for chwbl and
	// wrr-hash: an endpoint is full at ceil(factor/100 * mean). Default 175,
	// range 100..1000.
	MeanLoadFactor int
	// VirtualNodes is the number of ring points per endpoint (per unit of
	// mean weight for wrr-hash). Default 256, range 1..4096.
	VirtualNodes int
	// LoadWeights tune the gpu-aware cost; zero means DefaultLoadWeights.
	LoadWeights LoadWeights
	// Now is the clock for persist; nil means time.Now.
	Now func() time.Time
}

func (o Options) withDefaults() (Options, error) {
	if o.PersistTimeout == 0 {
		o.PersistTimeout = 3 * time.Hour
	}
	if o.PersistTimeout < 0 {
		return o, fmt.Errorf("%w: PersistTimeout %v is negative", ErrInvalidOptions, o.PersistTimeout)
	}
	if o.PersistMaxClients == 0 {
		o.PersistMaxClients = 65536
	}
	if o.PersistMaxClients < 0 {
		return o, fmt.Errorf("%w: PersistMaxClients %d is negative", ErrInvalidOptions, o.PersistMaxClients)
	}
	if o.MeanLoadFactor == 0 {
		o.MeanLoadFactor = 175
	}
	if o.MeanLoadFactor < 100 || o.MeanLoadFactor > 1000 {
		return o, fmt.Errorf("%w: MeanLoadFactor %d outside 100..1000", ErrInvalidOptions, o.MeanLoadFactor)
	}
	if o.VirtualNodes == 0 {
		o.VirtualNodes = 256
	}
	if o.VirtualNodes < 1 || o.VirtualNodes > 4096 {
		return o, fmt.Errorf("%w: VirtualNodes %d outside 1..4096", ErrInvalidOptions, o.VirtualNodes)
	}
	if o.LoadWeights == (LoadWeights{}) {
		o.LoadWeights = DefaultLoadWeights
	}
	if o.LoadWeights.Queue < 0 || o.LoadWeights.KV < 0 {
		return o, fmt.Errorf("%w: negative LoadWeights %+v", ErrInvalidOptions, o.LoadWeights)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return o, nil
}

// Name returns loxilb's name of a selector number, or "" if unknown.
func Name(sel int) string {
	switch sel {
	case SelRR:
		return "rr"
	case SelHash:
		return "hash"
	case SelPriority:
		return "priority"
	case SelPersist:
		return "persist"
	case SelLeastConn:
		return "lc"
	case SelN2:
		return "n2"
	case SelN3:
		return "n3"
	case SelCHWBL:
		return "chwbl"
	case SelGPUAware:
		return "gpu-aware"
	case SelWRRHash:
		return "wrr-hash"
	}
	return ""
}

// New returns the selector for loxilb's sel number.
func New(sel int, opts Options) (Selector, error) {
	o, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	switch sel {
	case SelRR:
		return &roundRobin{}, nil
	case SelHash:
		return &hashSel{fallback: &roundRobin{}}, nil
	case SelPriority:
		return newPriority(), nil
	case SelPersist:
		return newPersist(o), nil
	case SelLeastConn:
		return &leastConn{}, nil
	case SelN2, SelN3:
		return nil, fmt.Errorf("sel %d (%s): %w (it is an SCTP/GTP-U selector; use rr, hash, persist, lc, chwbl, gpu-aware or wrr-hash)",
			sel, Name(sel), ErrNotApplicable)
	case SelCHWBL:
		return newCHWBL(o, false), nil
	case SelGPUAware:
		return &gpuAware{w: o.LoadWeights}, nil
	case SelWRRHash:
		return newCHWBL(o, true), nil
	}
	return nil, fmt.Errorf("sel %d: %w (valid: 0-4, 8-10)", sel, ErrUnknownSelector)
}

// mix64 is the splitmix64 finaliser; it turns (key hash, endpoint) pairs
// into well-spread rendezvous scores.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// keyHash hashes the request key, else the client address. ok is false when
// the request carries neither.
func keyHash(req Request) (uint64, bool) {
	if len(req.Key) > 0 {
		return xxh3.Hash(req.Key), true
	}
	if req.ClientIP.IsValid() {
		b := req.ClientIP.Unmap().As16()
		return xxh3.Hash(b[:]), true
	}
	return 0, false
}

// Rendezvous returns the Idx of the healthy candidate (passing filter,
// when not nil) with the highest rendezvous (highest-random-weight) score
// mix64(h ^ mix64(Idx+φ)) for the key hash h; ok is false when none
// qualifies. Every caller with the same h and the same qualifying set gets
// the same endpoint, whatever the order of cands; taking an endpoint out
// of the set moves only the keys it won. The KV router places cold
// prefixes with it, the hash and gpu-aware selectors key on it.
func Rendezvous(h uint64, cands []Candidate, filter func(*Candidate) bool) (int, bool) {
	best, bestScore, found := -1, uint64(0), false
	for i := range cands {
		c := &cands[i]
		if !c.Healthy || (filter != nil && !filter(c)) {
			continue
		}
		s := mix64(h ^ mix64(uint64(c.Idx)+0x9e3779b97f4a7c15))
		if !found || s > bestScore {
			best, bestScore, found = c.Idx, s, true
		}
	}
	return best, found
}

func countHealthy(cands []Candidate) int {
	n := 0
	for i := range cands {
		if cands[i].Healthy {
			n++
		}
	}
	return n
}

// roundRobin (sel 0) hands out the k-th healthy candidate for a rotating k.
type roundRobin struct{ next atomic.Uint64 }

func (s *roundRobin) Pick(_ Request, cands []Candidate) (int, bool) {
	n := countHealthy(cands)
	if n == 0 {
		return -1, false
	}
	k := int((s.next.Add(1) - 1) % uint64(n))
	for i := range cands {
		if !cands[i].Healthy {
			continue
		}
		if k == 0 {
			return cands[i].Idx, true
		}
		k--
	}
	return -1, false // unreachable: k < n
}

// hashSel (sel 1) is rendezvous hashing on the key.
type hashSel struct{ fallback *roundRobin }

func (s *hashSel) Pick(req Request, cands []Candidate) (int, bool) {
	h, ok := keyHash(req)
	if !ok {
		return s.fallback.Pick(req, cands)
	}
	return Rendezvous(h, cands, nil)
}

// leastConn (sel 4) picks the fewest in-flight requests; among ties it starts
// scanning at a rotating offset so equal endpoints share the traffic.
type leastConn struct{ next atomic.Uint64 }

func (s *leastConn) Pick(_ Request, cands []Candidate) (int, bool) {
	n := len(cands)
	if n == 0 {
		return -1, false
	}
	off := int((s.next.Add(1) - 1) % uint64(n))
	best := -1
	for j := 0; j < n; j++ {
		c := &cands[(off+j)%n]
		if !c.Healthy {
			continue
		}
		if best < 0 || c.InFlight < cands[best].InFlight {
			best = (off + j) % n
		}
	}
	if best < 0 {
		return -1, false
	}
	return cands[best].Idx, true
}

// gpuAware (sel 9) picks the least Load; ties go to the rendezvous winner of
// the key so equally loaded endpoints keep prefix affinity.
type gpuAware struct{ w LoadWeights }

func (s *gpuAware) Pick(req Request, cands []Candidate) (int, bool) {
	const eps = 1e-9
	minLoad, found := 0.0, false
	for i := range cands {
		if !cands[i].Healthy {
			continue
		}
		if l := Load(cands[i], s.w); !found || l < minLoad {
			minLoad, found = l, true
		}
	}
	if !found {
		return -1, false
	}
	h, _ := keyHash(req)
	return Rendezvous(h, cands, func(c *Candidate) bool { return Load(*c, s.w) <= minLoad+eps })
}
