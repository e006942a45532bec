package gateway

import "github.com/loxilb-llm/loxilb/pkg/peerprefill"

// Load across gateway nodes.
//
// Each node counts the requests it sent to an endpoint (candidates). Behind
// ECMP that is a third of an endpoint's requests with three nodes; with
// Config.ClusterLoad the rest is added: the other nodes' own in-flight
// counts as their latest load snapshots say (Config.PeerLoad, sent every
// few tens of milliseconds, pkg/peerprefill), else, when some node's
// snapshot is missing or stale, the engine's running+waiting at the last
// scrape less this node's share then (Config.Engine.Others). The snapshot
// is what the other nodes hold now; the scrape is up to a scrape interval
// old, long enough for a hot prefix's holder to take three nodes' worth of
// requests while each node believes it below the spill floor.

// PeerLoad is the other gateway nodes' requests in flight on an endpoint
// (*peerprefill.Node): ok is false unless every other node's recent load
// is known for the endpoint at address hash epHash
// (peerprefill.EndpointHash).
type PeerLoad interface {
	PeerInFlight(service uint32, ep int, epHash uint64) (n int, ok bool)
}

// otherNodes is the load other nodes put on endpoint i of st: their load
// snapshots when every node's is fresh, else the scraped estimate; 0
// without either.
func (g *Gateway) otherNodes(st *service, i int) int {
	if g.cfg.PeerLoad != nil {
		if n, ok := g.cfg.PeerLoad.PeerInFlight(st.id, i, peerprefill.EndpointHash(st.addrs[i])); ok {
			return n
		}
	}
	if o, ok := g.others.Others(st.id, i); ok {
		return o
	}
	return 0
}

// localInFlight is this node's own load on endpoint i of st: requests
// open to it, held for a prefill on it, and queued for one of its prefill
// slots.
func (g *Gateway) localInFlight(st *service, i int) int {
	return g.inflight.Count(st.id, i) + g.leaders.heldFor(st.id, i) + g.prefill.queuedFor(st.id, i)
}

// LocalLoad implements peerprefill.LoadSource: this node's own load on
// every endpoint of every rule it routes, for the other nodes. Endpoints
// with nothing in flight are left out (a snapshot names the loaded ones).
func (g *Gateway) LocalLoad(dst []peerprefill.Load) []peerprefill.Load {
	for _, st := range *g.table.Load() {
		for i, addr := range st.addrs {
			if n := g.localInFlight(st, i); n > 0 {
				dst = append(dst, peerprefill.Load{Service: st.id, EP: i, EPHash: peerprefill.EndpointHash(addr), InFlight: n})
			}
		}
	}
	return dst
}
