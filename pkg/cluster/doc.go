// Package cluster is the membership of gateway nodes that share one rule
// store: each node announces itself (name, API address, the UDP address of
// its prefill announcements (pkg/peerprefill), version and the
// settings that decide where a request goes) under a lease it keeps alive,
// so a node that dies leaves the list within the lease's TTL; every node
// reads the others and reports where their settings differ (drift).
//
// The seeds require every node of an HA pair to hash and tokenize alike:
// the same LLB_KV_NONE_HASH_SEED, tokenizer files, and routing settings.
// Per-rule kvHashAlgo and kvBlockSize travel with the shared rules; what
// can differ is node-local, so it is what a node announces. The seed is
// announced only as a fingerprint (SeedFingerprint), never itself.
//
// In: the node's own settings (Local), and a Backend (the etcd store's
// leases). Out: a View (nodes, drift) for GET /cluster, the "cluster"
// capability and the loxilb_cluster_* metrics. Without a Backend (the
// embedded single-node store) the view is this node alone.
package cluster
