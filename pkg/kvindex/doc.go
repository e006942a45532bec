// Package kvindex keeps the KV-cache block inventory of every (service,
// endpoint) pair and answers the router's question: for this request's
// ordered block keys, how long a consecutive prefix does each candidate
// endpoint already hold?
//
// In: block keys (uint64, as produced by blockhash and as published by the
// engines) from the KV-event ingester: Store, Remove, ClearRank (one DP
// rank's AllBlocksCleared), ClearEndpoint (publisher reset), DropService
// (rule deleted); speculative entries from the router (StoreSpeculative).
// Out: PrefixMatch for the router, RankPrefixMatch (the same per
// data-parallel rank of one endpoint) for the gateway's rank choice, Len
// and Snapshot for the inventory API,
// and the metrics loxilb_pd_kv_blocks{service,ep_idx},
// loxilb_kv_inv_cap_evictions_total{service,ep},
// loxilb_kv_inv_speculative_dropped_total{service,ep} and
// loxilb_kv_inv_rejected_total{service,reason}.
//
// # Layout
//
// Each service owns one open-addressing hash table mapping a block key to
// the 64-bit mask of endpoints holding it. A prefix query therefore probes
// once per request block for all candidates together and stops at the first
// block none of the remaining candidates holds; its cost does not grow with
// the number of endpoints. Endpoint indices are limited to 0..63 (rules
// hold at most 32 endpoints).
//
// Per endpoint the index keeps the block count, the insertion order (a
// slice of keys, for eviction) and, only when a rank other than 0 has
// published, a small table of rank masks (ranks 0..7). A block leaves an
// endpoint when its last rank removes it, so AllBlocksCleared from rank 1
// never erases what rank 0 holds.
//
// # Caps and eviction
//
// Each endpoint holds at most Config.MaxBlocksPerEndpoint real blocks. A
// Store beyond the cap evicts the endpoint's oldest-inserted blocks (from
// all its ranks) and counts them. Engines evict least-recently-used leaves
// first, so the oldest insertions are the likeliest to be gone from the GPU
// already. Re-storing a present block does not refresh its position; a
// block removed and stored again may, until the next internal compaction of
// the order, be evicted at its earlier position. The cap is a memory bound,
// not an accuracy feature: size it above the engine's block count.
//
// # Speculative entries
//
// After routing a request the router may record its blocks for the chosen
// endpoint with a short TTL, so siblings sharing a brand-new prefix follow
// it before the engine's BlockStored events arrive. PrefixMatch counts them
// until they expire (checked on every read against the injectable clock);
// Len, Snapshot and the block gauge never do; a real BlockStored for the
// same key and endpoint replaces the entry. Run sweeps expired entries
// periodically to reclaim memory and cap room.
//
// # Concurrency
//
// All methods are safe for concurrent use. Each service has two locks: a
// writer lock that serialises its writers (the ingester applies each
// endpoint's events in order) and guards what only writers read (insertion
// orders), and a read-write query lock that writers take, after it, only
// to change what queries read (the block table, counts, rank tables,
// speculative entries). Queries (PrefixMatch and RankPrefixMatch alike)
// take only the query lock and never wait on other services. Large
// batches are applied in chunks of 128 keys so one huge event cannot
// stall queries.
//
// Growth never happens under the query lock. A writer allocates (and
// faults in) the block table of the next size holding only the writer
// lock, installs it under the query lock, and then every write moves two
// entries of the previous table per key it writes (at least 64), so a
// table replaced at 4/5 load (as before, so memory per block is
// unchanged) has moved over before the new one is 3/5 full; Sweep
// finishes a move that writes left half done. Until then a lookup that
// misses the current table also probes the previous one; with no move
// under way the query path is what it was (one probe per block). The
// same happens in reverse after mass removal (shrink below 1/16 load).
// Only tables of at most 1024 slots rehash in place (microseconds, from
// the allocator's small-object caches); a fresh table of a megabyte alone
// costs hundreds of page faults, over a millisecond on a virtual machine.
// Rank tables are copied to their next size off the query lock and
// swapped in under it. Insertion orders grow, and are compacted, under the
// writer lock alone. With a 10M-block service no write holds the query
// lock for more than a bounded step (see BENCHMARKS.md, "Inventory
// growth"). Bulk clears (ClearEndpoint, ClearRank) still walk the
// endpoint's own insertion order under the query lock; they are
// memory-latency bound, about 35 ms for a 100k-block endpoint in a
// 6.4M-block service, and happen only on engine resets.
//
// # Memory
//
// A block costs one 16-byte table slot (key and endpoint mask) at a load
// factor between 0.4 and 0.8, shared by every endpoint holding it, plus 8 to
// 12 bytes of insertion order per endpoint: 30 to 42 bytes per inventoried
// block measured with distinct blocks per endpoint (BenchmarkBytesPerBlock).
package kvindex
