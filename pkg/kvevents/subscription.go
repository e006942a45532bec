package kvevents

import (
	"context"
	"fmt"
	"maps"
	"runtime/debug"
	"strconv"
	"sync"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/blockhash"
	"github.com/loxilb-llm/loxilb/pkg/kvindex"
)

// RankStatus is the state of one publisher: one DP rank of a ZMQ engine, or
// the TensorRT-LLM drain (a single entry; attention-DP ranks named in its
// events still reach the Sink as separate ranks).
type RankStatus struct {
	Rank     int    `json:"rank"`
	Endpoint string `json:"endpoint"`
	// ReplayEndpoint is empty when replay is disabled.
	ReplayEndpoint string `json:"replay_endpoint,omitempty"`
	Connected      bool   `json:"connected"`
	// HasSeq is false until the first batch arrives (and after a reset).
	HasSeq  bool   `json:"has_seq"`
	LastSeq uint64 `json:"last_seq"`
	// Degraded is set when events were lost and could not be replayed; it
	// clears when the publisher's cache is reset (AllBlocksCleared or an
	// engine restart), which makes the inventory exact again.
	Degraded       bool   `json:"degraded"`
	DegradedReason string `json:"degraded_reason,omitempty"`
	Batches        uint64 `json:"batches"`
	Gaps           uint64 `json:"seq_gaps"`
	Replays        uint64 `json:"replays"`
	ReplayFailures uint64 `json:"replay_failures"`
	Resets         uint64 `json:"resets"`
	Reconnects     uint64 `json:"reconnects"`
	RecvErrors     uint64 `json:"recv_errors"`
	DecodeErrors   uint64 `json:"decode_errors"`
	// Rejected counts input refused by a limit or for bad framing.
	Rejected uint64 `json:"rejected"`
	// Panics counts recovered subscriber panics.
	Panics    uint64    `json:"panics"`
	LastRecv  time.Time `json:"last_recv,omitzero"`
	LastError string    `json:"last_error,omitempty"`
}

// ParityStatus is the hash-contract attestation of one endpoint.
type ParityStatus struct {
	Verdict string `json:"verdict"`
	Reason  string `json:"reason,omitempty"`
	// Since is when the verdict last changed.
	Since time.Time `json:"since,omitzero"`
	// Block counts by outcome.
	VerifiedBlocks     uint64 `json:"verified_blocks"`
	MismatchedBlocks   uint64 `json:"mismatched_blocks"`
	UnverifiableEvents uint64 `json:"unverifiable_events"`
	// Quarantine is set when the publisher sent blocks that fail
	// attestation (see quarantine.go).
	Quarantine QuarantineStatus `json:"quarantine"`
}

// Admission is a TensorRT-LLM endpoint's /server_info check.
type Admission struct {
	Verdict   string    `json:"verdict"`
	Reason    string    `json:"reason,omitempty"`
	CheckedAt time.Time `json:"checked_at,omitzero"`
}

// EndpointStatus is one subscription's state, ready to be served as JSON.
type EndpointStatus struct {
	Service     uint32 `json:"service_id"`
	ServiceName string `json:"service_name,omitempty"`
	EPIdx       int    `json:"ep_idx"`
	Engine      string `json:"engine"`
	HashAlgo    string `json:"hash_algo"`
	BlockSize   int    `json:"block_size"`
	// Connected is true when every rank is connected.
	Connected bool `json:"connected"`
	// Degraded is true when any rank is degraded.
	Degraded bool `json:"degraded"`

	EventsApplied  uint64 `json:"events_applied"`
	BlocksStored   uint64 `json:"blocks_stored"`
	BlocksRemoved  uint64 `json:"blocks_removed"`
	EventsSkipped  uint64 `json:"events_skipped"`
	UnknownEvents  uint64 `json:"unknown_events"`
	DecodeErrors   uint64 `json:"decode_errors"`
	Gaps           uint64 `json:"seq_gaps"`
	Replays        uint64 `json:"replays"`
	ReplayFailures uint64 `json:"replay_failures"`
	Resets         uint64 `json:"resets"`
	Reconnects     uint64 `json:"reconnects"`
	RecvErrors     uint64 `json:"recv_errors"`
	Rejected       uint64 `json:"rejected"`
	Panics         uint64 `json:"panics"`

	Parity    ParityStatus `json:"parity"`
	Admission *Admission   `json:"admission,omitempty"`
	// Drain says which node drains a TensorRT-LLM endpoint.
	Drain     *DrainStatus `json:"drain,omitempty"`
	LastError string       `json:"last_error,omitempty"`
	Ranks     []RankStatus `json:"ranks"`
}

// rankState is one publisher's mutable state. Fields are guarded by the
// subscription's mu; the goroutine that owns the rank is the only writer of
// the sequence fields, so it may read them without the lock.
type rankState struct {
	st RankStatus
	// replay is the replay endpoint, "" when disabled.
	replay string
	// lastSum is a hash of the last applied payload, used to tell a
	// duplicate from an engine restart when a replay returns the last seq.
	lastSum uint64
	// dups is the duplicate window after a replay: the batches it applied
	// (and, after a reconnect or gap, the one at the last seq before it), in
	// seq order. The SUB may deliver them again (queued while the replay
	// ran, or a reordered batch the replay already filled in); a live batch
	// is a duplicate only if it repeats one of them, seq and bytes, in
	// order. Anything else at or below the last seq is a restart, so a
	// restarted engine's seq 0..N is never mistaken for old batches.
	// dupNext is the first entry a later duplicate may still match.
	dups    []seqSum
	dupNext int
}

// seqSum identifies one applied batch: its seq and a hash of its bytes.
type seqSum struct{ seq, sum uint64 }

// subscription is one endpoint's feed: one goroutine per rank (ZMQ) or one
// poller (TensorRT-LLM).
type subscription struct {
	m    *Manager
	spec Spec
	met  *subMetrics

	parity *parityTracker
	quar   quarantine
	// hub re-serves a TensorRT-LLM endpoint's drained bodies to the
	// other nodes while this node owns it (nil for ZMQ engines).
	hub *relayHub

	mu        sync.Mutex
	st        EndpointStatus // aggregate counters; Ranks filled on read
	ranks     []*rankState
	media     map[string]bool
	cancel    context.CancelFunc
	done      chan struct{}
	started   bool
	lastError string
	// logged is when a repeatable warning (by key) was last logged: a peer
	// that repeats bad input must not flood the log.
	logged map[string]time.Time
}

func newSubscription(m *Manager, spec Spec) *subscription {
	s := &subscription{
		m:    m,
		spec: spec,
		met:  m.metrics.forSub(spec.serviceLabel(), strconv.Itoa(spec.EPIdx)),
		st: EndpointStatus{
			Service: spec.Service, ServiceName: spec.ServiceName, EPIdx: spec.EPIdx, Engine: spec.Engine,
			HashAlgo: string(spec.algo()), BlockSize: spec.BlockSize,
		},
		logged: make(map[string]time.Time),
	}
	if len(m.cfg.Media) > 0 {
		s.media = make(map[string]bool, len(m.cfg.Media))
		for _, md := range m.cfg.Media {
			s.media[md] = true
		}
	}
	s.parity = newParityTracker(spec, m.cfg.ParityMaxDigests, s.onVerdict)
	for r := 0; r < spec.ranks(); r++ {
		rs := &rankState{st: RankStatus{Rank: r}}
		switch spec.Engine {
		case EngineTRTLLM:
			rs.st.Endpoint = "http://" + hostPort(spec.Host, spec.TargetPort) + "/kv_cache_events"
		default:
			rs.st.Endpoint = tcpEndpoint(spec.Host, spec.ZmqPort+r)
			if spec.ReplayEndpoint != "" {
				h, p, _ := splitTCP(spec.ReplayEndpoint)
				rs.replay = tcpEndpoint(h, p+r)
			} else if m.cfg.ReplayPortOffset > 0 && spec.ZmqPort+r+m.cfg.ReplayPortOffset <= 65535 {
				rs.replay = tcpEndpoint(spec.Host, spec.ZmqPort+r+m.cfg.ReplayPortOffset)
			}
			rs.st.ReplayEndpoint = rs.replay
		}
		s.ranks = append(s.ranks, rs)
	}
	if spec.Engine == EngineTRTLLM {
		s.st.Admission = &Admission{Verdict: AdmissionPending}
		s.met.setAdmission(AdmissionPending)
		s.hub = newRelayHub(m.cfg.RelayBufferFrames, m.cfg.RelayBufferBytes)
		s.met.withDrain()
		s.st.Drain = &DrainStatus{Role: DrainElecting}
	}
	return s
}

func (s *subscription) endpoints() []string {
	out := make([]string, len(s.ranks))
	for i, r := range s.ranks {
		out[i] = r.st.Endpoint
	}
	return out
}

func (s *subscription) start(ctx context.Context) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.started {
		return
	}
	s.started = true
	ctx, s.cancel = context.WithCancel(ctx)
	s.done = make(chan struct{})
	var wg sync.WaitGroup
	if s.spec.Engine == EngineTRTLLM {
		wg.Add(1)
		go func() { defer wg.Done(); s.runTRT(ctx, s.ranks[0]) }()
	} else {
		for _, rs := range s.ranks {
			wg.Add(1)
			go func() { defer wg.Done(); s.runZMQ(ctx, rs) }()
		}
	}
	go func() { wg.Wait(); close(s.done) }()
}

// stop cancels the goroutines and waits for them; no Sink call happens
// after stop returns.
func (s *subscription) stop() {
	s.mu.Lock()
	started, cancel, done := s.started, s.cancel, s.done
	s.mu.Unlock()
	if !started {
		return
	}
	cancel()
	<-done
}

func (s *subscription) status() EndpointStatus {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := s.st
	out.Connected = true
	out.Degraded = false
	out.LastError = s.lastError
	out.Ranks = make([]RankStatus, len(s.ranks))
	for i, r := range s.ranks {
		out.Ranks[i] = r.st
		out.Connected = out.Connected && r.st.Connected
		out.Degraded = out.Degraded || r.st.Degraded
	}
	if s.st.Admission != nil {
		a := *s.st.Admission
		out.Admission = &a
	}
	if s.st.Drain != nil {
		d := *s.st.Drain
		d.RelayErrors = maps.Clone(d.RelayErrors)
		d.Followers = s.hub.followers()
		out.Drain = &d
	}
	out.Parity = s.parity.status()
	out.Parity.Quarantine = s.quar.status()
	return out
}

// onVerdict is called by the parity tracker when the verdict changes.
func (s *subscription) onVerdict(old, verdict, reason string) {
	s.met.setParity(verdict)
	l := s.m.log.With("service", s.spec.Service, "ep", s.spec.EPIdx, "engine", s.spec.Engine,
		"hash_algo", s.spec.algo(), "block_size", s.spec.BlockSize)
	if verdict == VerdictOK {
		l.Info("kv hash parity verified", "previous", old, "reason", reason)
		return
	}
	l.Warn("kv hash parity broken: routing will not find this endpoint's cached prefixes",
		"verdict", verdict, "reason", reason, "previous", old)
}

// setConnected records a connection state change of one rank.
func (s *subscription) setConnected(rs *rankState, up bool, reconnect bool) {
	s.mu.Lock()
	rs.st.Connected = up
	if up {
		rs.st.LastError = ""
	}
	if reconnect {
		rs.st.Reconnects++
		s.st.Reconnects++
		s.met.reconn.Inc()
	}
	all := true
	for _, r := range s.ranks {
		all = all && r.st.Connected
	}
	s.mu.Unlock()
	if all {
		s.met.conn.Set(1)
	} else {
		s.met.conn.Set(0)
	}
}

// recvError counts a dial, receive or poll failure.
func (s *subscription) recvError(rs *rankState, err error) {
	s.mu.Lock()
	rs.st.RecvErrors++
	s.st.RecvErrors++
	rs.st.LastError = err.Error()
	s.mu.Unlock()
	s.met.recvErr.Inc()
}

func (s *subscription) decodeError(rs *rankState, err error) {
	s.mu.Lock()
	rs.st.DecodeErrors++
	s.st.DecodeErrors++
	rs.st.LastError = err.Error()
	first := s.st.DecodeErrors == 1
	s.mu.Unlock()
	s.met.decErr.Inc()
	if first {
		s.m.log.Warn("kv event message dropped: cannot decode", "service", s.spec.Service, "ep", s.spec.EPIdx,
			"rank", rs.st.Rank, "err", err)
	}
}

// logEvery is the least interval between two log lines of one kind of
// repeatable bad input from one endpoint.
const logEvery = time.Minute

// warnLimited logs msg at warning level unless a line of the same key was
// logged for this subscription less than logEvery ago.
func (s *subscription) warnLimited(key, msg string, args ...any) {
	now := time.Now()
	s.mu.Lock()
	last, seen := s.logged[key]
	if seen && now.Sub(last) < logEvery {
		s.mu.Unlock()
		return
	}
	s.logged[key] = now
	s.mu.Unlock()
	s.m.log.Warn(msg, append([]any{"service", s.spec.Service, "ep", s.spec.EPIdx}, args...)...)
}

// reject counts input refused by a limit or for bad framing.
func (s *subscription) reject(rs *rankState, reason string, err error) {
	s.mu.Lock()
	rs.st.Rejected++
	s.st.Rejected++
	rs.st.LastError = err.Error()
	s.mu.Unlock()
	s.met.reject[reason].Inc()
	s.warnLimited("reject:"+reason, "kv event input refused", "rank", rs.st.Rank, "endpoint", rs.st.Endpoint,
		"reason", reason, "err", err)
}

// recovered handles a panic of a subscriber goroutine: it is counted and
// logged (once a minute per endpoint), and the publisher's blocks are
// cleared, since the batch it was applying may be half applied.
func (s *subscription) recovered(rs *rankState, sinkRank int, v any) {
	err := fmt.Errorf("subscriber panic: %v", v)
	s.mu.Lock()
	rs.st.Panics++
	s.st.Panics++
	rs.st.LastError = err.Error()
	s.mu.Unlock()
	s.met.panics.Inc()
	s.m.log.Debug("kv subscriber panic stack", "service", s.spec.Service, "ep", s.spec.EPIdx, "stack", string(debug.Stack()))
	s.warnLimited("panic", "kv event subscriber recovered from a panic; connection dropped, publisher's blocks cleared",
		"rank", rs.st.Rank, "endpoint", rs.st.Endpoint, "panic", fmt.Sprint(v))
	s.reset(rs, sinkRank, resetPanic)
}

// countDecodeErrors counts n more undecodable events without logging them.
func (s *subscription) countDecodeErrors(rs *rankState, n uint64) {
	s.mu.Lock()
	rs.st.DecodeErrors += n
	s.st.DecodeErrors += n
	s.mu.Unlock()
	s.met.decErr.Add(float64(n))
}

// reset clears one publisher's blocks (engine restart or lost events).
func (s *subscription) reset(rs *rankState, sinkRank int, reason string) {
	s.m.sink.ClearRank(s.spec.Service, s.spec.EPIdx, sinkRank)
	s.parity.forgetRank()
	s.mu.Lock()
	rs.st.Resets++
	s.st.Resets++
	if reason != resetGap {
		// The engine's cache restarted empty, so the inventory is exact.
		rs.st.Degraded = false
		rs.st.DegradedReason = ""
	}
	s.mu.Unlock()
	s.met.resets[reason].Inc()
	s.updateDegraded()
	s.m.log.Info("kv inventory reset for publisher", "service", s.spec.Service, "ep", s.spec.EPIdx, "rank", sinkRank, "reason", reason)
}

func (s *subscription) setDegraded(rs *rankState, reason string) {
	s.mu.Lock()
	was := rs.st.Degraded
	rs.st.Degraded = true
	rs.st.DegradedReason = reason
	s.mu.Unlock()
	s.updateDegraded()
	if !was {
		s.m.log.Warn("kv inventory degraded: events lost", "service", s.spec.Service, "ep", s.spec.EPIdx,
			"rank", rs.st.Rank, "reason", reason)
	}
}

func (s *subscription) updateDegraded() {
	s.mu.Lock()
	deg := false
	for _, r := range s.ranks {
		deg = deg || r.st.Degraded
	}
	s.mu.Unlock()
	if deg {
		s.met.degr.Set(1)
	} else {
		s.met.degr.Set(0)
	}
}

// applyCounts accumulates one batch's effects so the shared counters are
// touched once per batch, not once per event.
type applyCounts struct {
	events  [4]uint64
	stored  uint64
	removed uint64
	skipped map[string]uint64
}

func (c *applyCounts) skip(reason string, n uint64) {
	if c.skipped == nil {
		c.skipped = make(map[string]uint64, 2)
	}
	c.skipped[reason] += n
}

func (s *subscription) flushCounts(rs *rankState, c *applyCounts, seq uint64, hasSeq bool) {
	s.mu.Lock()
	rs.st.Batches++
	if hasSeq {
		rs.st.LastSeq, rs.st.HasSeq = seq, true
	}
	rs.st.LastRecv = time.Now()
	applied := c.events[KindStored] + c.events[KindRemoved] + c.events[KindCleared]
	s.st.EventsApplied += applied
	s.st.BlocksStored += c.stored
	s.st.BlocksRemoved += c.removed
	s.st.UnknownEvents += c.events[KindUnknown]
	for _, n := range c.skipped {
		s.st.EventsSkipped += n
	}
	s.mu.Unlock()
	for k := KindStored; k <= KindCleared; k++ {
		if c.events[k] > 0 {
			s.met.applied[k].Add(float64(c.events[k]))
		}
	}
	if c.stored > 0 {
		s.met.stored.Add(float64(c.stored))
	}
	if c.removed > 0 {
		s.met.removed.Add(float64(c.removed))
	}
	for r, n := range c.skipped {
		s.met.skipped[r].Add(float64(n))
	}
}

// applyBatch writes one decoded vLLM/SGLang batch to the sink. sinkRank is
// the publisher's rank (from its port), not the rank named in the batch:
// the port is what the rule configured.
func (s *subscription) applyBatch(rs *rankState, b *Batch, c *applyCounts) {
	sink, svc, ep, rank := s.m.sink, s.spec.Service, s.spec.EPIdx, rs.st.Rank
	for i := range b.Events {
		e := &b.Events[i]
		switch e.Kind {
		case KindStored, KindRemoved:
			tier, known := mediumTier(e.Medium)
			if !known || (s.media != nil && len(e.Medium) > 0 && !s.media[string(e.Medium)]) {
				c.skip(skipMedium, 1)
				continue
			}
			ts, tiered := sink.(TierSink)
			if tier != kvindex.TierGPU && !tiered {
				c.skip(skipMedium, 1)
				continue
			}
			// Hybrid models publish one event per KV-cache group; only the
			// full-attention group's blocks are prefix-cache hits.
			if len(e.SpecKind) > 0 {
				if string(e.SpecKind) != "full_attention" {
					c.skip(skipGroup, 1)
					continue
				}
			} else if e.GroupIdx > 0 {
				c.skip(skipGroup, 1)
				continue
			}
			if e.Kind == KindStored {
				if !s.storeAttested(rank, e, tier) {
					c.skip(skipQuarantined, 1)
					continue
				}
				c.stored += uint64(len(e.Hashes))
			} else {
				if tiered {
					ts.RemoveTier(svc, ep, rank, tier, e.Hashes)
				} else {
					sink.Remove(svc, ep, rank, e.Hashes)
				}
				c.removed += uint64(len(e.Hashes))
			}
			c.events[e.Kind]++
		case KindCleared:
			sink.ClearRank(svc, ep, rank)
			c.events[KindCleared]++
			s.mu.Lock()
			rs.st.Degraded, rs.st.DegradedReason = false, ""
			s.mu.Unlock()
			s.updateDegraded()
		default:
			c.events[KindUnknown]++
			c.skip(skipUnknownType, 1)
		}
	}
}

// newDecoder returns a decoder with the configured batch limits.
func (s *subscription) newDecoder(order KeyOrder) *Decoder {
	return NewDecoder(order).WithLimits(s.m.cfg.decodeLimits())
}

// newHasher builds the rule's contract hasher.
func newHasher(spec Spec, algo blockhash.Algo) (*blockhash.Hasher, error) {
	h, err := blockhash.New(blockhash.Config{Algo: algo, BlockSize: spec.BlockSize, Seed: spec.Seed})
	if err != nil {
		return nil, fmt.Errorf("hash contract %s/%d: %w", algo, spec.BlockSize, err)
	}
	return h, nil
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
