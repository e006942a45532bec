package kvevents

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// Parity verdicts. They are the values of EndpointStatus.Parity.Verdict and
// of the verdict label of loxilb_kv_parity_verdict.
const (
	VerdictUnverified        = "unverified"
	VerdictOK                = "ok"
	VerdictBlockSizeMismatch = "block_size_mismatch"
	VerdictHashAlgoMismatch  = "hash_algo_mismatch"
	VerdictHashMismatch      = "hash_mismatch"
)

var allVerdicts = []string{VerdictUnverified, VerdictOK, VerdictBlockSizeMismatch, VerdictHashAlgoMismatch, VerdictHashMismatch}

// Admission verdicts of a TensorRT-LLM endpoint (its /server_info check).
const (
	AdmissionPending  = "pending"
	AdmissionAdmitted = "admitted"
	// AdmissionLegacy is an engine whose /server_info does not expose block
	// geometry: admitted, with a warning, on the rule's word.
	AdmissionLegacy  = "admitted_legacy"
	AdmissionRefused = "refused"
)

var allAdmissions = []string{AdmissionPending, AdmissionAdmitted, AdmissionLegacy, AdmissionRefused}

// Skip reasons (label reason of loxilb_kv_events_skipped_total).
const (
	skipUnknownType   = "unknown_type"
	skipMedium        = "medium"
	skipGroup         = "kv_group"
	skipWindow        = "window_size"
	skipUnknownParent = "unknown_parent"
	skipNonPlain      = "non_plain"
	skipBlockSize     = "block_size"
	skipDuplicate     = "duplicate"
	skipUnknownHandle = "unknown_handle"
	skipQuarantined   = "quarantined"
	skipRank          = "rank_out_of_range"
)

var allSkipReasons = []string{skipUnknownType, skipMedium, skipGroup, skipWindow, skipUnknownParent, skipNonPlain, skipBlockSize, skipDuplicate, skipUnknownHandle, skipQuarantined, skipRank}

// Rejection reasons (label reason of loxilb_kv_rejected_total): input
// refused because it breaks a limit or the framing, before it is buffered
// or decoded.
const (
	rejectMessageTooLarge = "message_too_large"
	rejectBadFraming      = "bad_framing"
	rejectBatchLimit      = "batch_limit"
	rejectBodyTooLarge    = "body_too_large"
	rejectReplayTooLong   = "replay_too_long"
)

var allRejectReasons = []string{rejectMessageTooLarge, rejectBadFraming, rejectBatchLimit, rejectBodyTooLarge, rejectReplayTooLong}

// Reset reasons (label reason of loxilb_kv_resets_total).
const (
	resetSeqBackwards = "seq_backwards"
	resetRestart      = "restart_detected"
	resetGap          = "unrecovered_gap"
	resetCreated      = "engine_created"
	resetChainFull    = "chain_map_full"
	resetPanic        = "subscriber_panic"
	resetQuarantine   = "quarantine"
)

// Replay results (label result of loxilb_kv_replays_total).
const (
	replayOK          = "ok"
	replayIncomplete  = "incomplete"
	replayUnavailable = "unavailable"
)

// metrics holds every collector of the package, registered once per Manager
// on the injected registerer.
type metrics struct {
	connected     *prometheus.GaugeVec
	reconnects    *prometheus.CounterVec
	recvErrors    *prometheus.CounterVec
	eventsApplied *prometheus.CounterVec
	blockEvents   *prometheus.CounterVec
	skipped       *prometheus.CounterVec
	decodeErrors  *prometheus.CounterVec
	seqGaps       *prometheus.CounterVec
	replays       *prometheus.CounterVec
	resets        *prometheus.CounterVec
	degraded      *prometheus.GaugeVec
	parity        *prometheus.GaugeVec
	admission     *prometheus.GaugeVec
	rejected      *prometheus.CounterVec
	panics        *prometheus.CounterVec
	quarantined   *prometheus.GaugeVec
	quarantines   *prometheus.CounterVec
	drainOwner    *prometheus.GaugeVec
	ownerChanges  *prometheus.CounterVec
	relayFrames   *prometheus.CounterVec
	relayErrors   *prometheus.CounterVec

	vecs []interface {
		DeletePartialMatch(prometheus.Labels) int
	}
}

func newMetrics(reg prometheus.Registerer) *metrics {
	se := []string{"service", "ep_idx"}
	m := &metrics{
		connected: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "loxilb_kv_subscriber_connected",
			Help: "1 when every KV event source of the endpoint (all ranks) is connected, else 0.",
		}, se),
		reconnects: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_kv_subscriber_reconnect_total",
			Help: "KV event source reconnections after a lost connection.",
		}, se),
		recvErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_kv_subscriber_recv_error_total",
			Help: "Receive, dial or poll errors of KV event sources.",
		}, se),
		eventsApplied: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_kv_events_applied_total",
			Help: "KV events applied to the endpoint inventory, by event type.",
		}, append(se, "type")),
		blockEvents: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_kv_block_events_applied_total",
			Help: "Block keys stored into or removed from the endpoint inventory.",
		}, append(se, "op")),
		skipped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_kv_events_skipped_total",
			Help: "KV events (or blocks) not applied, by reason.",
		}, append(se, "reason")),
		decodeErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_kv_decode_errors_total",
			Help: "KV event messages dropped because they could not be decoded.",
		}, se),
		seqGaps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_kv_seq_gaps_total",
			Help: "Sequence gaps (lost event batches) detected.",
		}, se),
		replays: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_kv_replays_total",
			Help: "Replay requests to the engine's replay endpoint, by result.",
		}, append(se, "result")),
		resets: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_kv_resets_total",
			Help: "Per-publisher inventory resets (engine restart, unrecoverable gap), by reason.",
		}, append(se, "reason")),
		degraded: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "loxilb_kv_subscriber_degraded",
			Help: "1 when the endpoint inventory may diverge from the engine after lost events.",
		}, se),
		parity: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "loxilb_kv_parity_verdict",
			Help: "Hash-contract parity attestation of the endpoint: 1 for the current verdict, 0 for the others.",
		}, append(se, "verdict")),
		admission: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "loxilb_kv_trtllm_admission",
			Help: "TensorRT-LLM /server_info admission verdict: 1 for the current verdict, 0 for the others.",
		}, append(se, "verdict")),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_kv_rejected_total",
			Help: "KV event input refused before it was buffered or decoded (over a size limit, bad framing), by reason.",
		}, append(se, "reason")),
		panics: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_kv_subscriber_panics_total",
			Help: "Panics recovered in a KV event subscriber; the connection is dropped and the publisher's blocks cleared.",
		}, se),
		quarantined: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "loxilb_kv_quarantined",
			Help: "1 while the endpoint's inventory is quarantined: its publisher sent blocks whose keys do not hash from their tokens.",
		}, se),
		quarantines: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_kv_quarantines_total",
			Help: "Times the endpoint's inventory was quarantined after blocks failed attestation.",
		}, se),
		drainOwner: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "loxilb_kv_trtllm_drain_owner",
			Help: "1 while this node drains the TensorRT-LLM endpoint's /kv_cache_events (alone, or as the elected owner among nodes sharing an etcd store), 0 while another node does or none is elected.",
		}, se),
		ownerChanges: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_kv_trtllm_drain_owner_changes_total",
			Help: "Changes of the node that drains the TensorRT-LLM endpoint, as seen by this node.",
		}, se),
		relayFrames: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_kv_trtllm_relay_frames_total",
			Help: "Drain bodies re-served to the other nodes (direction published, owner) or read from the owner's relay stream (direction received, follower).",
		}, append(se, "direction")),
		relayErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_kv_trtllm_relay_errors_total",
			Help: "Relay streams from the drain owner dropped (or frames lost), by reason: connect, bad_status, bad_magic, frame_too_large, truncated, idle_timeout, seq_gap.",
		}, append(se, "reason")),
	}
	cs := []prometheus.Collector{m.connected, m.reconnects, m.recvErrors, m.eventsApplied, m.blockEvents, m.skipped,
		m.decodeErrors, m.seqGaps, m.replays, m.resets, m.degraded, m.parity, m.admission,
		m.rejected, m.panics, m.quarantined, m.quarantines, m.drainOwner, m.ownerChanges, m.relayFrames, m.relayErrors}
	for i, c := range cs {
		if err := reg.Register(c); err != nil {
			// Two Managers on one registerer share the series of the first.
			var are prometheus.AlreadyRegisteredError
			if errors.As(err, &are) {
				cs[i] = are.ExistingCollector
			}
		}
	}
	m.connected = cs[0].(*prometheus.GaugeVec)
	m.reconnects = cs[1].(*prometheus.CounterVec)
	m.recvErrors = cs[2].(*prometheus.CounterVec)
	m.eventsApplied = cs[3].(*prometheus.CounterVec)
	m.blockEvents = cs[4].(*prometheus.CounterVec)
	m.skipped = cs[5].(*prometheus.CounterVec)
	m.decodeErrors = cs[6].(*prometheus.CounterVec)
	m.seqGaps = cs[7].(*prometheus.CounterVec)
	m.replays = cs[8].(*prometheus.CounterVec)
	m.resets = cs[9].(*prometheus.CounterVec)
	m.degraded = cs[10].(*prometheus.GaugeVec)
	m.parity = cs[11].(*prometheus.GaugeVec)
	m.admission = cs[12].(*prometheus.GaugeVec)
	m.rejected = cs[13].(*prometheus.CounterVec)
	m.panics = cs[14].(*prometheus.CounterVec)
	m.quarantined = cs[15].(*prometheus.GaugeVec)
	m.quarantines = cs[16].(*prometheus.CounterVec)
	m.drainOwner = cs[17].(*prometheus.GaugeVec)
	m.ownerChanges = cs[18].(*prometheus.CounterVec)
	m.relayFrames = cs[19].(*prometheus.CounterVec)
	m.relayErrors = cs[20].(*prometheus.CounterVec)
	m.vecs = []interface {
		DeletePartialMatch(prometheus.Labels) int
	}{m.connected, m.reconnects, m.recvErrors, m.eventsApplied, m.blockEvents, m.skipped,
		m.decodeErrors, m.seqGaps, m.replays, m.resets, m.degraded, m.parity, m.admission,
		m.rejected, m.panics, m.quarantined, m.quarantines, m.drainOwner, m.ownerChanges, m.relayFrames, m.relayErrors}
	return m
}

// subMetrics are the children of one subscription, resolved once so the
// ingestion path never hashes label values.
type subMetrics struct {
	m       *metrics
	labels  prometheus.Labels
	conn    prometheus.Gauge
	reconn  prometheus.Counter
	recvErr prometheus.Counter
	applied [4]prometheus.Counter // by EventKind
	stored  prometheus.Counter
	removed prometheus.Counter
	skipped map[string]prometheus.Counter
	decErr  prometheus.Counter
	gaps    prometheus.Counter
	replays map[string]prometheus.Counter
	resets  map[string]prometheus.Counter
	degr    prometheus.Gauge
	reject  map[string]prometheus.Counter
	panics  prometheus.Counter
	quar    prometheus.Gauge
	quars   prometheus.Counter
	// TensorRT-LLM drain ownership and relay (withDrain; ZMQ endpoints
	// carry none of these series).
	drainOwner   prometheus.Gauge
	ownerChanges prometheus.Counter
	relaySent    prometheus.Counter
	relayRecv    prometheus.Counter
	relayErr     map[string]prometheus.Counter
}

func (m *metrics) forSub(service, ep string) *subMetrics {
	l := prometheus.Labels{"service": service, "ep_idx": ep}
	s := &subMetrics{
		m:       m,
		labels:  l,
		conn:    m.connected.With(l),
		reconn:  m.reconnects.With(l),
		recvErr: m.recvErrors.With(l),
		stored:  m.blockEvents.WithLabelValues(service, ep, "stored"),
		removed: m.blockEvents.WithLabelValues(service, ep, "removed"),
		skipped: make(map[string]prometheus.Counter),
		decErr:  m.decodeErrors.With(l),
		gaps:    m.seqGaps.With(l),
		replays: make(map[string]prometheus.Counter),
		resets:  make(map[string]prometheus.Counter),
		degr:    m.degraded.With(l),
		reject:  make(map[string]prometheus.Counter),
		panics:  m.panics.With(l),
		quar:    m.quarantined.With(l),
		quars:   m.quarantines.With(l),
	}
	for _, r := range allRejectReasons {
		s.reject[r] = m.rejected.WithLabelValues(service, ep, r)
	}

	for _, k := range []EventKind{KindUnknown, KindStored, KindRemoved, KindCleared} {
		s.applied[k] = m.eventsApplied.WithLabelValues(service, ep, k.String())
	}
	for _, r := range allSkipReasons {
		s.skipped[r] = m.skipped.WithLabelValues(service, ep, r)
	}
	for _, r := range []string{replayOK, replayIncomplete, replayUnavailable} {
		s.replays[r] = m.replays.WithLabelValues(service, ep, r)
	}
	for _, r := range []string{resetSeqBackwards, resetRestart, resetGap, resetCreated, resetChainFull, resetPanic, resetQuarantine} {
		s.resets[r] = m.resets.WithLabelValues(service, ep, r)
	}
	s.conn.Set(0)
	s.degr.Set(0)
	s.quar.Set(0)
	s.setParity(VerdictUnverified)
	return s
}

// withDrain adds the series of a TensorRT-LLM endpoint's drain ownership
// and relay.
func (s *subMetrics) withDrain() {
	m, service, ep := s.m, s.labels["service"], s.labels["ep_idx"]
	s.drainOwner = m.drainOwner.With(s.labels)
	s.ownerChanges = m.ownerChanges.With(s.labels)
	s.relaySent = m.relayFrames.WithLabelValues(service, ep, "published")
	s.relayRecv = m.relayFrames.WithLabelValues(service, ep, "received")
	s.relayErr = make(map[string]prometheus.Counter, len(allRelayErrors))
	for _, r := range allRelayErrors {
		s.relayErr[r] = m.relayErrors.WithLabelValues(service, ep, r)
	}
	s.drainOwner.Set(0)
}

func (s *subMetrics) setParity(verdict string) {
	for _, v := range allVerdicts {
		g := s.m.parity.WithLabelValues(s.labels["service"], s.labels["ep_idx"], v)
		if v == verdict {
			g.Set(1)
		} else {
			g.Set(0)
		}
	}
}

func (s *subMetrics) setAdmission(verdict string) {
	for _, v := range allAdmissions {
		g := s.m.admission.WithLabelValues(s.labels["service"], s.labels["ep_idx"], v)
		if v == verdict {
			g.Set(1)
		} else {
			g.Set(0)
		}
	}
}

// delete removes every series of the subscription.
func (s *subMetrics) delete() {
	for _, v := range s.m.vecs {
		v.DeletePartialMatch(s.labels)
	}
}
