package kvevents

import (
	"fmt"
	"sync"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/kvindex"
)

// Event-plane trust. Engines publish KV events without authentication:
// whoever answers on an engine's ZMQ port can publish blocks, and blocks
// are what Tier 1.5 steers requests by. The parity attestation sees each
// BlockStored event's token ids, so a publisher whose keys do not hash from
// their tokens under the rule's contract is caught, and its endpoint is
// quarantined:
//
//   - the endpoint's whole inventory (every rank) is cleared and nothing
//     it publishes is stored, so the router gives it no KV-hit credit;
//     removals and clears still apply;
//   - every BlockStored event is attested while quarantined (no sampling);
//   - the quarantine lifts once Config.QuarantineVerifyBlocks consecutive
//     blocks verify; a forged block meanwhile starts the count again. A
//     reconnect or an engine restart does not lift it by itself (both can
//     be faked on the same port): the restarted engine's blocks, verifying,
//     do. A rule change or daemon restart starts the endpoint afresh.
//
// A misconfigured engine (another PYTHONHASHSEED) is quarantined the same
// way; its keys could never match a request anyway. This cannot stop a
// publisher that knows the contract and sends true keys for tokens the
// engine does not hold, nor events without tokens: the publisher ports must
// be reachable from the engine network only.
type quarantine struct {
	mu sync.RWMutex // read-held around every Store, so entering is atomic with the clear
	on bool
	// verified counts consecutive verified blocks since entering.
	verified int
	reason   string
	since    time.Time
	entered  uint64
}

// QuarantineStatus is the quarantine state of one endpoint, part of its
// parity status.
type QuarantineStatus struct {
	Quarantined bool      `json:"quarantined"`
	Reason      string    `json:"quarantine_reason,omitempty"`
	Since       time.Time `json:"quarantined_since,omitzero"`
	// Entered counts the quarantines of this subscription.
	Entered uint64 `json:"quarantines"`
}

func (q *quarantine) status() QuarantineStatus {
	q.mu.RLock()
	defer q.mu.RUnlock()
	return QuarantineStatus{Quarantined: q.on, Reason: q.reason, Since: q.since, Entered: q.entered}
}

func (q *quarantine) active() bool {
	q.mu.RLock()
	defer q.mu.RUnlock()
	return q.on
}

// storeAttested stores one BlockStored event subject to attestation and
// quarantine, and reports whether it was stored.
func (s *subscription) storeAttested(rank int, e *Event, tier kvindex.Tier) bool {
	q := &s.quar
	res := s.parity.observe(e, q.active())
	switch res {
	case attestForged:
		s.forged()
		return false
	case attestVerified:
		if q.active() {
			s.probation(len(e.Hashes))
			return false
		}
	}
	q.mu.RLock()
	defer q.mu.RUnlock()
	if q.on {
		return false
	}
	if ts, ok := s.m.sink.(TierSink); ok {
		ts.StoreTier(s.spec.Service, s.spec.EPIdx, rank, tier, e.Hashes)
	} else {
		s.m.sink.Store(s.spec.Service, s.spec.EPIdx, rank, e.Hashes)
	}
	return true
}

// forged enters (or restarts) the quarantine after a forged block.
func (s *subscription) forged() {
	q := &s.quar
	q.mu.Lock()
	entering := !q.on
	q.verified = 0
	if entering {
		q.on = true
		q.entered++
		q.since = time.Now()
		q.reason = fmt.Sprintf("published blocks whose keys do not hash from their tokens (%s); no KV-hit credit until %d consecutive blocks verify",
			s.parity.status().Reason, s.m.cfg.QuarantineVerifyBlocks)
		// Under the write lock: no rank can store between the clear and
		// the flag.
		s.m.sink.ClearEndpoint(s.spec.Service, s.spec.EPIdx)
	}
	reason := q.reason
	q.mu.Unlock()
	if !entering {
		return
	}
	s.parity.forgetRank()
	s.met.quar.Set(1)
	s.met.quars.Inc()
	s.met.resets[resetQuarantine].Inc()
	s.m.log.Warn("kv endpoint quarantined: its publisher sent blocks that fail attestation; Tier 1.5 off for it",
		"service", s.spec.Service, "ep", s.spec.EPIdx, "engine", s.spec.Engine, "reason", reason)
}

// probation counts verified blocks of a quarantined endpoint and lifts the
// quarantine once enough verified in a row.
func (s *subscription) probation(n int) {
	q := &s.quar
	q.mu.Lock()
	q.verified += n
	lift := q.on && q.verified >= s.m.cfg.QuarantineVerifyBlocks
	if lift {
		q.on, q.verified, q.reason, q.since = false, 0, "", time.Time{}
	}
	q.mu.Unlock()
	if lift {
		s.met.quar.Set(0)
		s.m.log.Info("kv endpoint quarantine lifted: its blocks verify again", "service", s.spec.Service, "ep", s.spec.EPIdx,
			"verified_blocks", s.m.cfg.QuarantineVerifyBlocks)
	}
}
