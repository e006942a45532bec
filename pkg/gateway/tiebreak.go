package gateway

import (
	"context"
	"time"
)

// Tie-break between nodes that start the same prefill at once.
//
// A node announces a leader when it registers it (remote.go), but siblings
// of a new prefix that reach two nodes within the announcement's latency
// are both routed before either node has heard of the other's, and each
// node forwards its own as a leader: the engine computes the prefix twice
// (loxilb_cluster_prefill_duplicate_leaders_total counts what a node sees
// of that). With Config.ClusterTieBreak set and another node that may
// rank before this one (PrefillPeers.Outranked: not heard from yet, or a
// lower instance), a request of this node that leads blocks and waits for
// nobody is announced at once and then held for at most ClusterTieBreak
// before it is forwarded. If another node's announcement of any of the same blocks at
// the same endpoint arrives meanwhile from a node that ranks first (a
// lower announcement instance, outranks), the request yields: it waits for
// that node's prefill as any follower does (bounded by CoalesceWait,
// counted in loxilb_kv_coalesced_total) and is forwarded after it. The
// node that ranks first does not yield, so exactly one of the crossing
// leaders goes on, without a round of messages: each side decides from the
// announcement it already has.
//
// Why a fixed order of processes and not of blocks: the two leaders may
// not start their blocks at the same key (one may have matched more of
// the prefix than the other), so a per-key rank could let both yield and
// wait for each other; a total order of instances cannot form a cycle.
//
// A yielding request keeps its own leadership and announcement: its own
// followers, here and on other nodes, are released at its first byte,
// which comes after the winner's prefill. Bounds: the deferral is at most
// ClusterTieBreak; the yield at most CoalesceWait and the announcement's
// TTL, as for any announced leader, so a forged announcement holds a
// request no longer than it could hold a follower.

// Outcomes of a deferral, the "outcome" label of
// loxilb_cluster_prefill_tiebreak_total.
const (
	tieYielded   = "yielded"
	tieKept      = "kept"
	tieCancelled = "cancelled"
)

// outranks reports whether a leader announced by process a goes first
// against one of process b when both lead the same blocks.
func outranks(a, b uint64) bool { return a < b }

// contesting reports whether a new leader of this node defers: the
// tie-break is on and another node may rank before this one (one not
// heard from yet, or with a lower instance). The node that ranks first
// among those it has heard from forwards at once: it never yields.
func (g *Gateway) contesting() bool {
	if g.cfg.ClusterTieBreak <= 0 {
		return false
	}
	return g.cfg.Peers != nil && g.cfg.Peers.Outranked()
}

// tieBreak holds self, a leader registered with contest, for up to
// ClusterTieBreak and returns the better-ranked node's leader of the same
// blocks when one was announced meanwhile (the request then waits for
// it), else nil; gone when the client went away meanwhile.
func (g *Gateway) tieBreak(ctx context.Context, st *service, self *leader) (won *leader, gone bool) {
	ch := self.contest
	if ch == nil {
		return nil, false
	}
	t := time.NewTimer(g.cfg.ClusterTieBreak)
	out := tieKept
	select {
	case won = <-ch:
	case <-t.C:
	case <-ctx.Done():
		out = tieCancelled
	}
	t.Stop()
	g.leaders.mu.Lock()
	self.contest = nil // no announcement is offered from here on
	g.leaders.mu.Unlock()
	if won == nil && out == tieKept {
		select {
		case won = <-ch: // offered as the timer fired
		default:
		}
	}
	if won != nil {
		out = tieYielded
	}
	g.m.tieBreak.WithLabelValues(st.label, out).Inc()
	return won, out == tieCancelled
}
