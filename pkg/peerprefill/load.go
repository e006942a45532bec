package peerprefill

import (
	"context"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Load sharing between nodes.
//
// Behind ECMP each node sees a third (with three nodes) of the requests
// an engine serves, so its own in-flight count tells it an endpoint is
// nearly idle while the other nodes are queueing on it; the engines'
// scraped running/waiting gauges correct that only once a scrape
// interval (a second) after the fact. With Config.LoadInterval set, each
// node sends its per-endpoint in-flight counts to the others every
// interval when they changed (and every LoadExpiry/4 when they did not),
// and the gateway adds the other nodes' latest counts to its own
// (PeerInFlight). Counts older than LoadExpiry are not used: the gateway
// then falls back to the scraped estimate.

// LoadSource is what a Handler implements to share its load: the node's
// requests in flight per endpoint, appended to dst. Called every
// Config.LoadInterval from one goroutine; it must not block.
type LoadSource interface {
	LocalLoad(dst []Load) []Load
}

// Reasons a load datagram is rejected (loxilb_cluster_load_rejected_total).
const (
	LoadRejectUnknownPeer = DropUnknownPeer // not from a member's peer address
	LoadRejectMalformed   = DropMalformed   // truncated, over a limit, out of order
	LoadRejectStale       = "stale"         // older than the sender's last snapshot held
)

// DefaultLoadInterval is how often a node's load snapshot is read and,
// when changed, sent: a few times within one short prefill (tens of
// milliseconds), so the other nodes see a burst while it builds, at most
// 50 datagrams a second per peer.
const DefaultLoadInterval = 20 * time.Millisecond

// DefaultLoadExpiry is how long a peer's snapshot counts when no newer one
// arrives: several keepalives (LoadExpiry/4), so one lost datagram does
// not drop a live peer's load, and short against the engines' scrape
// interval, which is what is used once it lapses.
const DefaultLoadExpiry = time.Second

// peerLoad is the last snapshot one peer address sent.
type peerLoad struct {
	instance, seq uint64
	at            time.Time
	loads         []Load // sorted by loadOrder
}

// loadState is the node's load-sharing state and metrics.
type loadState struct {
	mu    sync.RWMutex
	peers map[netip.AddrPort]*peerLoad

	sent, received, truncated prometheus.Counter
	rejected                  *prometheus.CounterVec
}

func newLoadState() loadState {
	return loadState{peers: map[netip.AddrPort]*peerLoad{},
		sent: prometheus.NewCounter(prometheus.CounterOpts{Name: "loxilb_cluster_load_sent_total",
			Help: "Load snapshots (this node's in-flight requests per endpoint) sent to the other gateway nodes, one per peer."}),
		received: prometheus.NewCounter(prometheus.CounterOpts{Name: "loxilb_cluster_load_received_total",
			Help: "Load snapshots from the other gateway nodes taken."}),
		truncated: prometheus.NewCounter(prometheus.CounterOpts{Name: "loxilb_cluster_load_truncated_total",
			Help: "Loaded endpoints left out of a load snapshot over its entry limit (the least loaded)."}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_cluster_load_rejected_total",
			Help: "Load snapshots from the other gateway nodes rejected, by reason (unknown_peer, malformed, stale)."}, []string{"reason"}),
	}
}

func (n *Node) loadCollectors() []prometheus.Collector {
	age := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "loxilb_cluster_load_freshest_age_seconds",
		Help: "Age of the freshest load snapshot held from another gateway node; -1 when none is held."},
		func() float64 { return n.freshestLoadAge(time.Now()).Seconds() })
	return []prometheus.Collector{n.load.sent, n.load.received, n.load.truncated, n.load.rejected, age}
}

// freshestLoadAge is the age of the newest snapshot held from a current
// peer, -1s when none.
func (n *Node) freshestLoadAge(now time.Time) time.Duration {
	ps := n.peers.Load()
	n.load.mu.RLock()
	defer n.load.mu.RUnlock()
	age := time.Duration(-1)
	for _, a := range ps.addrs {
		if pl := n.load.peers[a]; pl != nil && (age < 0 || now.Sub(pl.at) < age) {
			age = now.Sub(pl.at)
		}
	}
	if age < 0 {
		return -time.Second
	}
	return age
}

// isLoad reports whether b's header names a load datagram, for counting
// the ones dropped before they are decoded.
func isLoad(b []byte) bool {
	return len(b) >= headerLen && string(b[:4]) == magic && b[4] == version && b[5] == kindLoad
}

// takeLoad keeps the snapshot of a load datagram from peer address from;
// it returns the reject reason, "" when kept.
func (n *Node) takeLoad(from netip.AddrPort, id ID, body []byte, buf []Load, now time.Time) string {
	ls, err := decodeLoads(body, buf)
	if err != nil {
		return LoadRejectMalformed
	}
	n.load.mu.Lock()
	defer n.load.mu.Unlock()
	pl := n.load.peers[from]
	if pl == nil {
		// from is a current peer (handle checked), and refresh forgets
		// the addresses that leave: at most maxPeers entries.
		pl = &peerLoad{}
		n.load.peers[from] = pl
	} else if pl.instance == id.Instance && id.Seq <= pl.seq {
		return LoadRejectStale
	}
	pl.instance, pl.seq, pl.at = id.Instance, id.Seq, now
	pl.loads = append(pl.loads[:0], ls...)
	return ""
}

// forgetLoads drops the snapshots of addresses no longer in ps.
func (n *Node) forgetLoads(ps *peerSet) {
	n.load.mu.Lock()
	defer n.load.mu.Unlock()
	for a := range n.load.peers {
		if !ps.from[a] {
			delete(n.load.peers, a)
		}
	}
}

// PeerInFlight is the other nodes' requests in flight on endpoint ep of
// rule service, whose address hashes to epHash here (EndpointHash), as of
// their latest snapshots. ok is false, and the caller should estimate the
// other nodes' load another way, unless every current peer sent a
// snapshot within LoadExpiry whose entry for the endpoint (if any) names
// the same address: a peer not sharing load, silent or mid rule change
// would otherwise count as idle.
func (n *Node) PeerInFlight(service uint32, ep int, epHash uint64) (int, bool) {
	ps := n.peers.Load()
	if len(ps.addrs) == 0 || n.cfg.LoadInterval <= 0 {
		return 0, false
	}
	now := time.Now()
	key := Load{Service: service, EP: ep}
	sum := 0
	n.load.mu.RLock()
	defer n.load.mu.RUnlock()
	for _, a := range ps.addrs {
		pl := n.load.peers[a]
		if pl == nil || now.Sub(pl.at) > n.cfg.LoadExpiry {
			return 0, false
		}
		if i, ok := slices.BinarySearchFunc(pl.loads, key, loadOrder); ok {
			if pl.loads[i].EPHash != epHash {
				return 0, false
			}
			sum += pl.loads[i].InFlight
		}
	}
	return sum, true
}

// shareLoad sends src's snapshot to every peer each LoadInterval when it
// changed, and at least every LoadExpiry/4 so that the peers keep it,
// until ctx ends.
func (n *Node) shareLoad(ctx context.Context, src LoadSource) {
	t := time.NewTicker(n.cfg.LoadInterval)
	defer t.Stop()
	keepalive := n.cfg.LoadExpiry / 4
	var cur, last []Load
	var lastAt time.Time
	buf := make([]byte, 0, headerLen+2+loadEntryLen*MaxLoads)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		ps := n.peers.Load()
		if len(ps.addrs) == 0 {
			continue
		}
		var cut int
		cur, cut = normalizeLoads(src.LocalLoad(cur[:0]))
		n.load.truncated.Add(float64(cut))
		now := time.Now()
		if slices.Equal(cur, last) && now.Sub(lastAt) < keepalive {
			continue
		}
		buf = appendLoad(buf[:0], ID{Instance: n.instance, Seq: n.seq.Add(1)}, cur)
		for _, a := range ps.addrs {
			if _, err := n.conn.WriteToUDPAddrPort(buf, a); err != nil {
				n.sendErrors.Inc()
				continue
			}
			n.load.sent.Inc()
		}
		last, lastAt = append(last[:0], cur...), now
	}
}
