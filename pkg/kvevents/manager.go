package kvevents

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/blockhash"
	"github.com/loxilb-llm/loxilb/pkg/engine"
)

// Sink receives inventory updates. (*kvindex.Index) implements it.
//
// Contract: safe for concurrent use. Calls for one (service, ep, rank) come
// from one goroutine, in event order; different ranks of one endpoint are
// written concurrently. keys is only valid during the call (the caller
// reuses the slice), so an implementation that keeps keys must copy them.
// ClearRank must leave other ranks' blocks in place.
type Sink interface {
	Store(service uint32, ep int, rank int, keys []uint64)
	Remove(service uint32, ep int, rank int, keys []uint64)
	ClearRank(service uint32, ep int, rank int)
	ClearEndpoint(service uint32, ep int)
}

// Engine names accepted in Spec.Engine, as pkg/engine spells them.
const (
	EngineVLLM   = string(engine.VLLM)
	EngineSGLang = string(engine.SGLang)
	EngineTRTLLM = string(engine.TRTLLM)
)

// MaxRanks is the largest publisher count per endpoint (kvDpRankCount): the
// documented rule limit, and what the inventory's per-rank masks hold.
const MaxRanks = engine.MaxDPRanks

// DefaultReplayPortOffset is the default of LLB_KV_REPLAY_PORT_OFFSET: a
// publisher on port P answers replay requests on P+1000.
const DefaultReplayPortOffset = engine.DefaultReplayPortOffset

// Spec is one desired subscription: the KV event feed of one endpoint of
// one rule. Specs are compared with ==; any change restarts the
// subscription with an empty inventory.
type Spec struct {
	// Service is the rule number (service_id in the API).
	Service uint32
	// ServiceName is the rule name, shown in logs and parity reports (metrics
	// use the decimal Service so they join with every other stage's).
	ServiceName string
	// EPIdx is the endpoint's index in the rule (ep_idx in the API).
	EPIdx int
	// Engine is "vllm", "sglang" or "trtllm".
	Engine string
	// Host is the endpoint IP.
	Host string
	// TargetPort is the serving port (TensorRT-LLM drains events there).
	TargetPort int
	// ZmqPort is the publisher port of rank 0 (vLLM, SGLang).
	ZmqPort int
	// Ranks is the number of publishers (SGLang DP ranks at ZmqPort+rank);
	// 0 means 1.
	Ranks int
	// HashAlgo is the rule's kvHashAlgo; empty means the engine default.
	HashAlgo string
	// BlockSize is the rule's kvBlockSize.
	BlockSize int
	// Seed is the vLLM NONE_HASH seed (LLB_KV_NONE_HASH_SEED).
	Seed string
	// ReplayEndpoint overrides the replay endpoint of rank 0
	// ("tcp://host:port"); rank r uses port+r. Empty means
	// ZmqPort+rank+Config.ReplayPortOffset on Host.
	ReplayEndpoint string
}

func (s Spec) key() subKey { return subKey{s.Service, s.EPIdx} }

func (s Spec) ranks() int {
	if s.Ranks <= 0 || s.Engine == EngineTRTLLM {
		return 1
	}
	return s.Ranks
}

// algo is the effective hash contract.
func (s Spec) algo() blockhash.Algo {
	if s.HashAlgo != "" {
		return blockhash.Algo(s.HashAlgo)
	}
	switch s.Engine {
	case EngineSGLang:
		return blockhash.SHA256SGLang
	case EngineTRTLLM:
		return blockhash.BlockHashTRTLLM
	default:
		return blockhash.SHA256CBOR
	}
}

// serviceLabel is the metric label of the subscription's service: the
// numeric rule id, as on every other per-service metric, so dashboards can
// join them (loxilb_service_info maps it to the rule name).
func (s Spec) serviceLabel() string {
	return strconv.FormatUint(uint64(s.Service), 10)
}

// ErrBadSpec wraps every reason Sync refuses a Spec.
var ErrBadSpec = errors.New("invalid KV event subscription")

func (s Spec) validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: service %d ep %d: %s", ErrBadSpec, s.Service, s.EPIdx, fmt.Sprintf(format, args...))
	}
	if net.ParseIP(s.Host) == nil {
		return bad("host %q is not an IP address", s.Host)
	}
	if s.EPIdx < 0 {
		return bad("negative endpoint index %d", s.EPIdx)
	}
	if s.BlockSize < 1 || s.BlockSize > blockhash.MaxBlockSize {
		return bad("block size %d out of range", s.BlockSize)
	}
	switch s.Engine {
	case EngineVLLM, EngineSGLang:
		if s.Ranks < 0 || s.Ranks > MaxRanks {
			return bad("rank count %d out of range", s.Ranks)
		}
		if s.ZmqPort < 1 || s.ZmqPort+s.ranks()-1 > 65535 {
			return bad("zmq port %d with %d ranks leaves 1..65535", s.ZmqPort, s.ranks())
		}
		if s.ReplayEndpoint != "" {
			if _, _, err := splitTCP(s.ReplayEndpoint); err != nil {
				return bad("replay endpoint: %v", err)
			}
		}
	case EngineTRTLLM:
		if s.TargetPort < 1 || s.TargetPort > 65535 {
			return bad("target port %d out of range", s.TargetPort)
		}
	default:
		return bad("engine %q has no KV event feed (want vllm, sglang or trtllm)", s.Engine)
	}
	return nil
}

// splitTCP parses "tcp://host:port".
func splitTCP(ep string) (string, int, error) {
	rest, ok := strings.CutPrefix(ep, "tcp://")
	if !ok {
		return "", 0, fmt.Errorf("%q is not a tcp:// endpoint", ep)
	}
	host, ps, err := net.SplitHostPort(rest)
	if err != nil {
		return "", 0, fmt.Errorf("%q: %w", ep, err)
	}
	p, err := strconv.Atoi(ps)
	if err != nil || p < 1 || p > 65535 {
		return "", 0, fmt.Errorf("%q: bad port", ep)
	}
	return host, p, nil
}

func tcpEndpoint(host string, port int) string {
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(port))
}

// Config holds process-wide settings, read by the daemon from flags and the
// environment. Zero fields take the documented defaults, except
// ReplayPortOffset, where 0 disables replay (set DefaultReplayPortOffset
// for the usual layout).
type Config struct {
	// ReplayPortOffset is LLB_KV_REPLAY_PORT_OFFSET: the replay ROUTER of
	// a publisher on port P is at P+offset. 0 disables replay unless a
	// Spec names a ReplayEndpoint.
	ReplayPortOffset int
	// ReplayMaxBatches bounds the batches one replay exchange may return
	// (LOXILB_KV_REPLAY_MAX_BATCHES, default 65536; vLLM buffers 10000).
	ReplayMaxBatches int
	// ReplayTimeout bounds one replay exchange (default 2s).
	ReplayTimeout time.Duration
	// ReconnectMin and ReconnectMax bound the redial backoff (500ms, 5s).
	ReconnectMin, ReconnectMax time.Duration
	// DialTimeout bounds one TCP connect (default 2s).
	DialTimeout time.Duration
	// GapKeepWindow is the largest unrecoverable gap (in batches) after
	// which the publisher's blocks are kept rather than cleared (default 64).
	GapKeepWindow uint64
	// Media, when set, lists the only media whose events are applied
	// (exact names, e.g. ["GPU"] to ignore offloaded copies). Empty means
	// every known medium: GPU copies at full weight and offloaded ones
	// (CPU, LMCache, disk) on the CPU tier when the sink is a TierSink.
	// Events without a medium are always applied, as GPU.
	Media []string
	// TRTPollMin and TRTPollMax bound the adaptive drain interval
	// (LOXILB_KV_TRTLLM_POLL_MIN_MS / _MAX_MS; default 5ms and 20ms).
	TRTPollMin, TRTPollMax time.Duration
	// TRTAdmissionRetry is the wait after a failed /server_info check
	// (default 5s); TRTAdmissionRecheck the wait after a refusal (60s).
	TRTAdmissionRetry, TRTAdmissionRecheck time.Duration
	// TRTHTTPTimeout bounds one HTTP exchange (default 30s).
	TRTHTTPTimeout time.Duration
	// MaxMessageBytes caps one ZMQ message, all frames together
	// (LOXILB_KV_MAX_MESSAGE_BYTES, default 16 MiB). A peer announcing
	// more is dropped before anything is sized from the announcement.
	MaxMessageBytes int
	// MaxMessageFrames caps the frames of one ZMQ message (default 16).
	MaxMessageFrames int
	// MaxBatchEvents, MaxBatchHashes and MaxBatchTokens cap one decoded
	// batch: its events, and its block hashes and token ids over all
	// events (defaults 65536, 1<<20, 1<<22). A batch over a cap is
	// refused whole, before its elements are decoded.
	MaxBatchEvents, MaxBatchHashes, MaxBatchTokens int
	// TRTMaxBody caps one drain body (default MaxMessageBytes).
	TRTMaxBody int64
	// TRTMaxHeaderBytes caps the response headers of one TensorRT-LLM
	// exchange (default 64 KiB); it applies to the private client only.
	TRTMaxHeaderBytes int
	// TRTMaxChain caps the engine-hash -> key map per rank (default 1<<20).
	TRTMaxChain int
	// QuarantineVerifyBlocks is how many consecutive blocks of a
	// quarantined endpoint must verify before it leaves quarantine
	// (LOXILB_KV_QUARANTINE_VERIFY_BLOCKS, default 64).
	QuarantineVerifyBlocks int
	// ParityMaxDigests caps the digests kept per endpoint for attesting
	// child blocks (default 16384).
	ParityMaxDigests int
	// HTTPClient is used for TensorRT-LLM; nil means a private client.
	HTTPClient *http.Client

	// Drain elects the node that drains each TensorRT-LLM endpoint when
	// several nodes share a rule store; nil means this node drains every
	// endpoint itself (one node).
	Drain DrainOwnership
	// RelayURL is this node's relay stream URL (ServeRelay, as other
	// nodes reach it): its value in the drain elections.
	RelayURL string
	// NodeName names this node on drain requests (NodeHeader); "" sends
	// no header.
	NodeName string
	// RelayToken is the bearer token sent to other nodes' relay streams
	// (the nodes of a cluster share their API token); "" sends none.
	RelayToken string
	// RelayClient reads other nodes' relay streams; nil means a private
	// client without an overall timeout.
	RelayClient *http.Client
	// RelayHeartbeat is the idle interval after which an owner sends a
	// heartbeat frame (default 1s); a follower drops a stream silent for
	// five of them.
	RelayHeartbeat time.Duration
	// RelayBufferFrames and RelayBufferBytes bound the frames an owner
	// keeps per endpoint for followers that reconnect (defaults 1024 and
	// 64 MiB; the newest frame is kept whatever its size).
	RelayBufferFrames, RelayBufferBytes int
}

func (c Config) withDefaults() Config {
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&c.ReplayTimeout, 2*time.Second)
	def(&c.ReconnectMin, 500*time.Millisecond)
	def(&c.ReconnectMax, 5*time.Second)
	def(&c.DialTimeout, 2*time.Second)
	def(&c.TRTPollMin, 5*time.Millisecond)
	def(&c.TRTPollMax, 20*time.Millisecond)
	def(&c.TRTAdmissionRetry, 5*time.Second)
	def(&c.TRTAdmissionRecheck, 60*time.Second)
	def(&c.TRTHTTPTimeout, 30*time.Second)
	def(&c.RelayHeartbeat, DefaultRelayHeartbeat)
	if c.TRTPollMax < c.TRTPollMin {
		c.TRTPollMax = c.TRTPollMin
	}
	if c.ReconnectMax < c.ReconnectMin {
		c.ReconnectMax = c.ReconnectMin
	}
	if c.ReplayPortOffset < 0 {
		c.ReplayPortOffset = 0
	}
	if c.GapKeepWindow == 0 {
		c.GapKeepWindow = 64
	}
	defInt := func(d *int, v int) {
		if *d <= 0 {
			*d = v
		}
	}
	defInt(&c.MaxMessageBytes, DefaultMaxMessageBytes)
	defInt(&c.MaxMessageFrames, DefaultMaxMessageFrames)
	defInt(&c.MaxBatchEvents, DefaultMaxBatchEvents)
	defInt(&c.MaxBatchHashes, DefaultMaxBatchHashes)
	defInt(&c.MaxBatchTokens, DefaultMaxBatchTokens)
	defInt(&c.TRTMaxHeaderBytes, DefaultTRTMaxHeaderB)
	defInt(&c.QuarantineVerifyBlocks, DefaultQuarantineVerifyBlocks)
	defInt(&c.ReplayMaxBatches, DefaultReplayMaxBatches)
	defInt(&c.RelayBufferFrames, DefaultRelayBufferFrames)
	defInt(&c.RelayBufferBytes, DefaultRelayBufferBytes)
	if c.TRTMaxBody <= 0 {
		c.TRTMaxBody = int64(c.MaxMessageBytes)
	}
	if c.TRTMaxChain <= 0 {
		c.TRTMaxChain = 1 << 20
	}
	if c.ParityMaxDigests <= 0 {
		c.ParityMaxDigests = 16384
	}
	if c.HTTPClient == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.MaxResponseHeaderBytes = int64(c.TRTMaxHeaderBytes)
		c.HTTPClient = &http.Client{Timeout: c.TRTHTTPTimeout, Transport: tr}
	}
	if c.RelayClient == nil {
		c.RelayClient = relayClient(&c)
	}
	return c
}

func (c *Config) decodeLimits() DecodeLimits {
	return DecodeLimits{Events: c.MaxBatchEvents, Hashes: c.MaxBatchHashes, Tokens: c.MaxBatchTokens}
}

type subKey struct {
	service uint32
	ep      int
}

// Manager owns every KV event subscription. The control plane calls Sync
// with the desired set; Run drives them until its context ends.
type Manager struct {
	cfg     Config
	sink    Sink
	log     *slog.Logger
	metrics *metrics

	syncMu sync.Mutex // serialises Sync so stop-then-start is atomic per key

	mu     sync.Mutex
	runCtx context.Context
	subs   map[subKey]*subscription
}

// New returns a Manager writing to sink. A nil logger discards logs; a nil
// registerer keeps metrics private.
func New(cfg Config, sink Sink, logger *slog.Logger, reg prometheus.Registerer) *Manager {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	m := &Manager{
		cfg:     cfg.withDefaults(),
		sink:    sink,
		log:     logger.With("component", "kvevents"),
		metrics: newMetrics(reg),
		subs:    make(map[subKey]*subscription),
	}
	c := &m.cfg
	m.log.Info("kv event input limits", "max_message_bytes", c.MaxMessageBytes, "max_message_frames", c.MaxMessageFrames,
		"max_batch_events", c.MaxBatchEvents, "max_batch_hashes", c.MaxBatchHashes, "max_batch_tokens", c.MaxBatchTokens,
		"trtllm_max_body", c.TRTMaxBody, "trtllm_max_header_bytes", c.TRTMaxHeaderBytes,
		"replay_max_batches", c.ReplayMaxBatches, "quarantine_verify_blocks", c.QuarantineVerifyBlocks)
	return m
}

// Run starts the subscriptions Sync asked for and keeps them running until
// ctx ends; then it stops them all and returns nil.
func (m *Manager) Run(ctx context.Context) error {
	m.mu.Lock()
	if m.runCtx != nil {
		m.mu.Unlock()
		return errors.New("kvevents: Run called twice")
	}
	m.runCtx = ctx
	for _, s := range m.subs {
		s.start(ctx)
	}
	m.mu.Unlock()

	<-ctx.Done()

	m.syncMu.Lock()
	defer m.syncMu.Unlock()
	m.mu.Lock()
	subs := make([]*subscription, 0, len(m.subs))
	for _, s := range m.subs {
		subs = append(subs, s)
	}
	m.mu.Unlock()
	for _, s := range subs {
		s.stop()
	}
	return nil
}

// Sync makes the running subscriptions match specs: new ones start, changed
// ones restart from an empty inventory, missing ones stop, and a stopped
// endpoint's inventory is cleared and its metric series deleted. Invalid
// specs are skipped and reported in the returned error (wrapping
// ErrBadSpec); the valid ones are still applied. Safe to call before Run.
func (m *Manager) Sync(specs []Spec) error {
	m.syncMu.Lock()
	defer m.syncMu.Unlock()

	var errs []error
	want := make(map[subKey]Spec, len(specs))
	for _, s := range specs {
		if err := s.validate(); err != nil {
			errs = append(errs, err)
			continue
		}
		if _, dup := want[s.key()]; dup {
			errs = append(errs, fmt.Errorf("%w: service %d ep %d given twice", ErrBadSpec, s.Service, s.EPIdx))
			continue
		}
		want[s.key()] = s
	}

	m.mu.Lock()
	var stopping []*subscription
	for k, s := range m.subs {
		if ns, ok := want[k]; !ok || ns != s.spec {
			stopping = append(stopping, s)
			delete(m.subs, k)
		}
	}
	m.mu.Unlock()

	// Stop (and wait) before starting a replacement, so the old goroutines
	// cannot write into the new inventory after it is cleared.
	for _, s := range stopping {
		s.stop()
		m.sink.ClearEndpoint(s.spec.Service, s.spec.EPIdx)
		s.met.delete()
		m.log.Info("kv event subscription stopped", "service", s.spec.Service, "ep", s.spec.EPIdx, "engine", s.spec.Engine)
	}

	m.mu.Lock()
	defer m.mu.Unlock()
	for k, spec := range want {
		if _, ok := m.subs[k]; ok {
			continue
		}
		s := newSubscription(m, spec)
		m.subs[k] = s
		m.log.Info("kv event subscription added", "service", spec.Service, "ep", spec.EPIdx, "engine", spec.Engine,
			"endpoints", strings.Join(s.endpoints(), ","), "hash_algo", spec.algo(), "block_size", spec.BlockSize)
		if m.runCtx != nil {
			s.start(m.runCtx)
		}
	}
	return errors.Join(errs...)
}

// Status reports one endpoint's subscription state; ok is false when no
// subscription exists for (service, ep).
func (m *Manager) Status(service uint32, ep int) (EndpointStatus, bool) {
	m.mu.Lock()
	s, ok := m.subs[subKey{service, ep}]
	m.mu.Unlock()
	if !ok {
		return EndpointStatus{}, false
	}
	return s.status(), true
}

// ParityOK reports whether the endpoint's parity verdict is ok and it is
// not quarantined: the keys its engine publishes were recomputed from the
// events' tokens and found equal to the gateway's. False when no
// subscription exists for (service, ep). It satisfies router.Attestation,
// so the zero-hit watchdog can tell prompts that were not cached from a
// probable hash mismatch.
func (m *Manager) ParityOK(service uint32, ep int) bool {
	m.mu.Lock()
	s, ok := m.subs[subKey{service, ep}]
	m.mu.Unlock()
	return ok && s.parity.status().Verdict == VerdictOK && !s.quar.active()
}

// ParityVerdict returns the endpoint's parity verdict (VerdictOK,
// VerdictUnverified or a mismatch), "" when no subscription exists for
// (service, ep). Safe for concurrent use; the gateway calls it per
// candidate of a request on rules with strict attestation.
func (m *Manager) ParityVerdict(service uint32, ep int) string {
	m.mu.Lock()
	s, ok := m.subs[subKey{service, ep}]
	m.mu.Unlock()
	if !ok {
		return ""
	}
	return s.parity.status().Verdict
}

// Untrusted reports whether a parity verdict says the endpoint's published
// keys do not follow the rule's hash contract: a block-size, hash-algorithm
// or hash (seed, tokenizer) mismatch. Unverified is not untrusted: an
// engine that publishes no tokens cannot be checked, and is not accused.
func Untrusted(verdict string) bool {
	switch verdict {
	case VerdictHashMismatch, VerdictBlockSizeMismatch, VerdictHashAlgoMismatch:
		return true
	}
	return false
}

// Statuses reports every subscription, ordered by service then endpoint.
func (m *Manager) Statuses() []EndpointStatus {
	m.mu.Lock()
	subs := make([]*subscription, 0, len(m.subs))
	for _, s := range m.subs {
		subs = append(subs, s)
	}
	m.mu.Unlock()
	out := make([]EndpointStatus, 0, len(subs))
	for _, s := range subs {
		out = append(out, s.status())
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Service != out[j].Service {
			return out[i].Service < out[j].Service
		}
		return out[i].EPIdx < out[j].EPIdx
	})
	return out
}

// ParityReport is one endpoint's attestation, for the capabilities API.
type ParityReport struct {
	Service     uint32 `json:"service_id"`
	ServiceName string `json:"service_name,omitempty"`
	EPIdx       int    `json:"ep_idx"`
	Engine      string `json:"engine"`
	HashAlgo    string `json:"hash_algo"`
	BlockSize   int    `json:"block_size"`
	Verdict     string `json:"verdict"`
	Reason      string `json:"reason,omitempty"`
	// Quarantined is true while the endpoint gets no KV-hit credit
	// because its publisher sent blocks that fail attestation;
	// QuarantineReason says why and what lifts it.
	Quarantined      bool   `json:"quarantined,omitempty"`
	QuarantineReason string `json:"quarantine_reason,omitempty"`
}

// Parity reports every endpoint's parity verdict, ordered by service then
// endpoint.
func (m *Manager) Parity() []ParityReport {
	st := m.Statuses()
	out := make([]ParityReport, len(st))
	for i, s := range st {
		out[i] = ParityReport{Service: s.Service, ServiceName: s.ServiceName, EPIdx: s.EPIdx, Engine: s.Engine,
			HashAlgo: s.HashAlgo, BlockSize: s.BlockSize, Verdict: s.Parity.Verdict, Reason: s.Parity.Reason,
			Quarantined: s.Parity.Quarantine.Quarantined, QuarantineReason: s.Parity.Quarantine.Reason}
	}
	return out
}
