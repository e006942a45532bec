// Package selector implements the endpoint selection algorithms of a load
// balancer rule, identified by loxilb's `sel` number, behind one interface.
//
// In: a Request (routing key and client address) and the rule's endpoints as
// a slice of Candidate (endpoint index, weight, health, in-flight requests
// counted by the proxy, and engine metrics scraped from the endpoint).
// Out: the index of the chosen endpoint (Candidate.Idx, not the slice
// position), or ok=false when no healthy candidate exists.
//
// Neighbours: the mode-4 proxy calls a Selector for every request that Tier
// 1.5 (package router) does not route by KV-cache overlap; the router uses
// Load to express endpoint load in the same unit as the gpu-aware selector.
// The L4 modes serve chwbl from a Maglev table that the eBPF data plane
// builds itself (pkg/dataplane/ebpf, slots.go).
//
// Selectors by sel number:
//
//	0  rr        round robin over healthy candidates (exactly even).
//	1  hash      rendezvous (highest-random-weight) hash of the key, so an
//	             endpoint going away only remaps the keys it owned.
//	2  priority  smooth weighted round robin over Weight > 0; weight-0
//	             endpoints are backups that receive traffic only when no
//	             positive-weight endpoint is healthy.
//	3  persist   client-IP affinity with a sliding timeout (default 3h, as
//	             loxilb's persist timeout); new clients are placed by
//	             rendezvous hash of the address.
//	4  lc        least in-flight requests; ties rotate.
//	5  n2, 6 n3  SCTP NGAP / GTP-U selectors: not applicable to HTTP
//	             inference traffic, New returns ErrNotApplicable.
//	8  chwbl     consistent hashing with bounded load (Mirrokni et al.) over
//	             the key (model + prompt prefix): 256 virtual nodes per
//	             endpoint; an endpoint is skipped while its in-flight count
//	             is at or above ceil(MeanLoadFactor/100 * (L+1)/n), L the
//	             fleet's in-flight total and n the healthy count. With the
//	             default factor 175% no endpoint ever holds more than 1.75x
//	             the mean load (rounded up), and because at least one
//	             endpoint is always under the cap the walk always ends.
//	9  gpu-aware least Load, which blends the proxy's in-flight count with
//	             the engine's scraped queue depth, running requests and KV
//	             cache usage; ties are broken by rendezvous hash of the key
//	             so equally loaded endpoints keep prefix affinity. Unlike
//	             loxilb, whose plain-pool selector 9 only hashes, this uses
//	             live engine metrics.
//	10 wrr-hash  chwbl with virtual nodes and the load cap proportional to
//	             Weight.
//
// All selectors are safe for concurrent use. Stateful ones (rr, priority,
// persist, lc tie rotation) keep their state inside the value returned by
// New; there is no package-level mutable state.
package selector
