package gateway

import (
	"net/netip"
	"sync"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/peerprefill"
)

// Prefill coalescing across gateway nodes.
//
// Each node coalesces the requests it routes itself (coalesce.go). With
// several nodes behind ECMP, siblings of a new prefix reach different
// nodes within milliseconds; rendezvous placement sends them to the same
// endpoint, but every node's first sibling starts the prefill again. With
// Config.Peers set (given at construction; the gateway is in turn the
// handler the peerprefill.Node's Run serves), a node announces each leader it registers (its rule,
// endpoint, uncached block keys) to the other nodes and says when its
// first byte came back (pkg/peerprefill). A receiving node treats the
// announcement as a leader of its own: the blocks become speculative
// entries of the endpoint in its inventory (so its router sees the
// prefix there, as the announcing node does) and a leader its requests
// wait for, released by the "done", or at the announcement's expiry
// (at most CoalesceWait) when the "done" was lost.

// PrefillPeers sends this node's leaders to the other gateway nodes
// (*peerprefill.Node).
type PrefillPeers interface {
	// Announce sends p and returns the function that announces its end.
	Announce(p peerprefill.Prefill) func()
}

// maxRemoteLeaders bounds the other nodes' announcements held at once: far
// more prefills than a fleet runs at once, and small enough (each holds at
// most peerprefill.MaxKeys keys) to bound the memory a peer can pin.
const maxRemoteLeaders = 4096

// remoteLeaders are the other nodes' announcements held, by id.
type remoteLeaders struct {
	mu sync.Mutex
	m  map[peerprefill.ID]*remoteLeader
}

type remoteLeader struct {
	end   func()
	timer *time.Timer
}

// end ends announcement id, if still held.
func (rl *remoteLeaders) end(id peerprefill.ID) {
	rl.mu.Lock()
	r := rl.m[id]
	delete(rl.m, id)
	rl.mu.Unlock()
	if r != nil {
		r.timer.Stop()
		r.end()
	}
}

// count is how many announcements are held.
func (rl *remoteLeaders) count() int {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	return len(rl.m)
}

// RemoteBegin implements peerprefill.Handler: another node is computing
// p.Keys at p.EP. Announcements for a rule this node does not route by KV
// blocks, or whose endpoint index names another address here, are refused.
func (g *Gateway) RemoteBegin(_ netip.Addr, p peerprefill.Prefill) string {
	st := g.lookup(p.Service)
	if st == nil || st.hasher == nil || p.EP >= len(st.addrs) || peerprefill.EndpointHash(st.addrs[p.EP]) != p.EPHash {
		return peerprefill.DropRule
	}
	if g.cfg.CoalesceWait <= 0 {
		return ""
	}
	rl := &g.remote
	rl.mu.Lock()
	if rl.m == nil {
		rl.m = make(map[peerprefill.ID]*remoteLeader)
	}
	if _, dup := rl.m[p.ID]; dup {
		rl.mu.Unlock()
		return ""
	}
	if len(rl.m) >= maxRemoteLeaders {
		rl.mu.Unlock()
		return peerprefill.DropFull
	}
	end, _ := g.leaders.registerKeys(st.id, p.EP, p.Keys, max(p.Uncached, 1), false)
	id := p.ID
	rl.m[id] = &remoteLeader{end: end, timer: time.AfterFunc(min(p.TTL, g.cfg.CoalesceWait), func() { rl.end(id) })}
	rl.mu.Unlock()
	if g.cfg.SpeculativeTTL > 0 {
		// Routed here, the prefix is this endpoint's as on the sender
		// (the index copies the keys).
		g.inv.StoreSpeculative(st.id, p.EP, p.Keys, g.cfg.SpeculativeTTL)
	}
	return ""
}

// RemoteDone implements peerprefill.Handler: the other node's request
// has its first byte, so the endpoint holds the prefix now.
func (g *Gateway) RemoteDone(id peerprefill.ID) { g.remote.end(id) }

// announce tells the other nodes about a leader this node registered for
// keys on endpoint ep and returns the function that announces its end. A
// node alone (Config.Peers nil) has no one to tell.
func (g *Gateway) announce(st *service, ep int, keys []uint64, uncached int64) func() {
	if g.cfg.Peers == nil || len(keys) == 0 {
		return func() {}
	}
	return g.cfg.Peers.Announce(peerprefill.Prefill{Service: st.id, EP: ep, EPHash: peerprefill.EndpointHash(st.addrs[ep]),
		Uncached: uncached, TTL: g.cfg.CoalesceWait, Keys: keys[:min(len(keys), peerprefill.MaxKeys)]})
}
