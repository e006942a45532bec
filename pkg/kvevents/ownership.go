package kvevents

import (
	"context"
	"net/http"
	"time"
)

// DrainOwnership elects, among the gateway nodes sharing a rule store, the
// one node that drains a TensorRT-LLM endpoint: its /kv_cache_events hands
// each event to a single reader, so with every node draining each would
// see only part of the engine's events. (*store.DrainElection) implements
// it over etcd leases; nil in Config means one node, which drains every
// endpoint itself.
type DrainOwnership interface {
	// Follow campaigns for key (the endpoint's host:port) with value
	// (this node's relay stream URL) until ctx ends, and calls report
	// with the owner's value whenever the owner changes: self is true
	// while this node holds the key, owner is "" while no owner is known
	// (no quorum, or this node lost its lease). report is called from one
	// goroutine. When Follow returns, this node has given the key up.
	Follow(ctx context.Context, key, value string, report func(owner string, self bool))
}

// Drain roles of a TensorRT-LLM endpoint on this node.
const (
	// DrainSingle: no shared store; this node drains the endpoint.
	DrainSingle = "single"
	// DrainOwner: this node won the endpoint's election; it drains the
	// engine and re-serves the events to the other nodes.
	DrainOwner = "owner"
	// DrainFollower: another node drains; this node reads its relay.
	DrainFollower = "follower"
	// DrainElecting: no owner known yet (or the store is unreachable):
	// nobody on this node reads the endpoint's events.
	DrainElecting = "electing"
)

// DrainStatus is who drains a TensorRT-LLM endpoint, as this node sees it.
type DrainStatus struct {
	Role string `json:"role"`
	// Owner is the relay stream URL of the owning node (this node's own
	// when Role is owner); empty while electing or single.
	Owner string `json:"owner,omitempty"`
	// Since is when Role or Owner last changed.
	Since time.Time `json:"since,omitzero"`
	// OwnerChanges counts changes of owner seen by this node.
	OwnerChanges uint64 `json:"owner_changes"`
	// Followers is the number of relay streams this node serves (owner).
	Followers int `json:"followers"`
	// RelayFrames counts frames published (owner) or received (follower);
	// RelayErrors relay streams dropped for a failure, by reason.
	RelayFrames uint64            `json:"relay_frames"`
	RelayErrors map[string]uint64 `json:"relay_errors,omitempty"`
}

// drainView is one ownership report.
type drainView struct {
	owner string
	self  bool
}

// role maps a report to this node's role. A report naming this node's own
// URL under another lease (a previous run of this node whose lease has not
// expired yet) is electing: following it would read nothing.
func (s *subscription) role(v drainView) string {
	switch {
	case v.self:
		return DrainOwner
	case v.owner == "" || v.owner == s.m.cfg.RelayURL:
		return DrainElecting
	}
	return DrainFollower
}

// runOwned runs the endpoint under an election: as the owner it drains
// and publishes, as a follower it reads the owner's relay, switching as
// the reports say. The chains (engine hash -> gateway key) persist across
// switches, so a follower promoted to owner continues where the relay
// left it.
func (s *subscription) runOwned(ctx context.Context, rs *rankState, st *trtState) {
	views := make(chan drainView, 1)
	followDone := make(chan struct{})
	go func() {
		defer close(followDone)
		s.m.cfg.Drain.Follow(ctx, hostPort(s.spec.Host, s.spec.TargetPort), s.m.cfg.RelayURL, func(owner string, self bool) {
			// Only the latest view matters; this is the only sender.
			select {
			case <-views:
			default:
			}
			views <- drainView{owner, self}
		})
	}()
	var stop func()
	defer func() {
		if stop != nil {
			stop()
		}
		s.hub.setOwning(false)
		<-followDone
	}()
	cur := drainView{}
	s.setDrain(DrainElecting, "")
	for {
		select {
		case <-ctx.Done():
			return
		case v := <-views:
			if v == cur {
				continue
			}
			cur = v
			if stop != nil {
				stop()
				stop = nil
			}
			role := s.role(v)
			s.setDrain(role, v.owner)
			s.hub.setOwning(role == DrainOwner)
			switch role {
			case DrainOwner:
				stop = s.spawn(ctx, rs, st, func(ctx context.Context) { s.drainLoop(ctx, rs, st) })
			case DrainFollower:
				stop = s.spawn(ctx, rs, st, func(ctx context.Context) { s.followLoop(ctx, rs, st, v.owner) })
			default:
				s.setConnected(rs, false, false)
			}
		}
	}
}

// spawn runs f (with panic recovery) until the returned stop is called.
func (s *subscription) spawn(ctx context.Context, rs *rankState, st *trtState, f func(context.Context)) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); s.guard(ctx, rs, st, f) }()
	return func() { cancel(); <-done }
}

// setDrain records a role change.
func (s *subscription) setDrain(role, owner string) {
	if role != DrainOwner && role != DrainFollower {
		owner = ""
	}
	s.mu.Lock()
	d := s.st.Drain
	changed := d == nil || d.Role != role || d.Owner != owner
	if d == nil {
		d = &DrainStatus{}
		s.st.Drain = d
	}
	if changed {
		if d.Owner != owner && owner != "" {
			d.OwnerChanges++
			s.met.ownerChanges.Inc()
		}
		d.Role, d.Owner, d.Since = role, owner, time.Now()
	}
	s.mu.Unlock()
	if !changed {
		return
	}
	if role == DrainOwner || role == DrainSingle {
		s.met.drainOwner.Set(1)
	} else {
		s.met.drainOwner.Set(0)
	}
	s.m.log.Info("trtllm drain ownership", "service", s.spec.Service, "ep", s.spec.EPIdx,
		"endpoint", hostPort(s.spec.Host, s.spec.TargetPort), "role", role, "owner", owner)
}

// followLoop reads the owner's relay stream, reconnecting with backoff,
// until ctx ends.
func (s *subscription) followLoop(ctx context.Context, rs *rankState, st *trtState, owner string) {
	cfg := &s.m.cfg
	cur := relayCursor{}
	backoff := cfg.ReconnectMin
	everConnected := false
	r := relayReader{cl: cfg.RelayClient, token: cfg.RelayToken, base: owner, endpoint: hostPort(s.spec.Host, s.spec.TargetPort),
		maxBody: cfg.TRTMaxBody, idle: 5 * cfg.RelayHeartbeat,
		onOpen: func() {
			backoff = cfg.ReconnectMin
			s.setConnected(rs, true, everConnected)
			everConnected = true
		},
		apply: func(body []byte) {
			s.met.relayRecv.Inc()
			s.mu.Lock()
			s.st.Drain.RelayFrames++
			s.mu.Unlock()
			s.applyTRTBody(rs, st.h, st.chains, body)
		},
		gap: func(n uint64) {
			s.relayError(rs, relayErrf(relayErrGap, "%d relay frames lost (the follower fell behind the owner's buffer)", n))
		},
	}
	for ctx.Err() == nil {
		err := r.read(ctx, &cur)
		if ctx.Err() != nil {
			return
		}
		s.relayError(rs, err)
		s.setConnected(rs, false, false)
		if !sleepCtx(ctx, backoff) {
			return
		}
		backoff = min(2*backoff, cfg.ReconnectMax)
	}
}

// relayError counts and records one relay failure.
func (s *subscription) relayError(rs *rankState, err error) {
	reason := relayReason(err)
	s.mu.Lock()
	if s.st.Drain != nil {
		if s.st.Drain.RelayErrors == nil {
			s.st.Drain.RelayErrors = make(map[string]uint64)
		}
		s.st.Drain.RelayErrors[reason]++
	}
	rs.st.LastError = err.Error()
	s.mu.Unlock()
	s.met.relayErr[reason].Inc()
	s.warnLimited("relay:"+reason, "trtllm relay stream failed", "reason", reason, "err", err)
}

// relayClient is the default client of relay streams: no overall timeout
// (a stream lasts as long as the ownership), a bounded wait for headers.
func relayClient(c *Config) *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxResponseHeaderBytes = int64(c.TRTMaxHeaderBytes)
	tr.ResponseHeaderTimeout = c.TRTHTTPTimeout
	return &http.Client{Transport: tr}
}
