// Package peerprefill tells the other gateway nodes sharing a rule store
// which prompt prefixes this node has just sent to an engine for prefill,
// so that their requests for the same prefix wait for it (prefill
// coalescing across nodes) instead of making the engine compute it again.
//
// A single node already holds a request routed to blocks its endpoint is
// still computing for an earlier request (pkg/gateway, coalesce.go). Nodes
// behind ECMP do not see each other's requests: siblings of a new prefix
// (best-of-N, agent fan-out) hashed to two nodes within the same
// milliseconds are placed on the same endpoint (rendezvous placement) but
// both start computing the prefix. With this package the node that sends
// the first of them announces "blocks K of rule S are in prefill at
// endpoint E" to the others, and "done" at the first response byte; the
// others treat the announcement as a leader of their own. Two nodes whose
// leaders of the same blocks cross (both sent before either heard of the
// other) are ranked by the announcements' sender instance: the receiver's
// gateway defers its new leaders briefly and yields to a lower instance
// (pkg/gateway, tiebreak.go).
//
// Transport: one UDP datagram per announcement and per "done", sent to
// every other member's peer address (announced in its membership record).
// Not etcd: a write per request would put etcd's commit latency (and a
// disk sync) on every request's path and its write rate would bound the
// request rate. Not a stream: an announcement is useful for the few
// milliseconds until the prefill ends, so a lost or late one is better
// dropped than retransmitted behind others, and a datagram needs no
// connection state per peer. A lost "begin" costs what no coalescing
// costs (a duplicate prefill); a lost "done" holds the other nodes'
// followers until the announcement's expiry, at most the coalescing wait.
//
// Load: the same socket carries each node's per-endpoint requests in
// flight (Config.LoadInterval, load.go), one snapshot per datagram, sent
// every interval when it changed and every LoadExpiry/4 when it did not;
// a receiver adds the other nodes' latest snapshots to its own counts
// (Node.PeerInFlight) and stops trusting a snapshot older than
// LoadExpiry. Behind ECMP a node alone sees only its share of an
// engine's requests; the engines' scraped gauges say the rest a scrape
// interval late, long enough for a hot prefix to queue on one endpoint
// that every node believes idle. Load snapshots are accepted from the
// same peer addresses as announcements, hold at most MaxLoads entries of
// at most MaxLoadInFlight requests each, in ascending endpoint order, and
// a sender's older snapshot never replaces a newer one; rejects are
// counted in loxilb_cluster_load_rejected_total{reason}.
//
// Bounds: a datagram is at most MaxDatagram bytes (MaxKeys block keys);
// datagrams from an address and port that are not a member's peer address
// (a node sends from the socket it receives on), with a
// wrong magic or version, truncated, over a limit or naming a rule or
// endpoint this node does not hold alike are counted
// (loxilb_cluster_prefill_dropped_total) and dropped. What the receiver
// keeps per announcement is bounded by its expiry and a cap on the
// announcements held at once (see Handler).
package peerprefill
