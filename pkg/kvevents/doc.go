// Package kvevents turns inference engines' KV-cache events into endpoint
// block inventories.
//
// In: the desired subscriptions (Manager.Sync, called by the control plane on
// rule create/update/delete) and the engines' event feeds:
//
//   - vLLM: a ZMQ SUB to tcp://endpointIP:kvZmqPort. Messages are three
//     frames [topic, seq (8 bytes big-endian), msgpack EventBatch].
//   - SGLang: one SUB per data-parallel rank at kvZmqPort+rank, same framing;
//     all ranks union into the endpoint's inventory, each under its own rank
//     so clearing one rank leaves the others.
//   - TensorRT-LLM: POST http://endpointIP:targetPort/kv_cache_events, a
//     destructive drain polled at an adaptive interval, after a
//     /server_info geometry admission check.
//
// Out: Store/Remove/ClearRank/ClearEndpoint calls on a Sink (pkg/kvindex),
// per-endpoint status (Manager.Status, served as-is by the inventory API),
// parity verdicts (Manager.Parity, for the capabilities API), and Prometheus
// metrics on the injected registerer.
//
// # Decoding
//
// Decoder walks msgpack by hand (no reflection): the outer EventBatch as a
// positional array [ts, events, rank?] or a map; inner events as tagged
// arrays of any historical length ["BlockStored", hashes, parent, tokens,
// block_size, lora_id, medium, lora_name|{cache_salt}, extra_keys,
// group_idx, kv_cache_spec_kind, ...] or as maps keyed by "type". Block
// hashes may be unsigned integers (vLLM), signed int64 (SGLang; kept as the
// same 64 bits) or raw digest bytes: vLLM's key is the last 8 digest bytes
// big-endian (int.from_bytes(digest, "big") & 2^64-1), SGLang's the first 8.
// Unknown event types are counted and skipped. TensorRT-LLM JSON is decoded
// with json.Number and strconv.ParseUint, so 64-bit hashes stay exact.
//
// Blocks are applied with their tier (see mediumTier: GPU, or CPU for any
// offloaded copy), optionally filtered by Config.Media; a medium nobody
// documents is skipped and counted. For hybrid models only the
// full-attention KV group is applied.
//
// TensorRT-LLM's own block_hash is a different contract from the one the
// request side computes, so each stored block's tokens are rehashed with the
// rule's algorithm (blockhash_trtllm), chained from the gateway digest of the
// parent handle; the engine hash is only a handle for later removals.
//
// # Sequence, replay and restarts
//
// Each publisher's seq is tracked. A gap triggers a replay request to the
// publisher's replay ROUTER (port + Config.ReplayPortOffset, or
// Spec.ReplayEndpoint): a DEALER sends ["", seq8] and reads
// ["", topic?, seq8, payload] replies up to the end marker (seq
// 0xffffffffffffffff, empty payload). What cannot be replayed is lost: the
// publisher is marked degraded and counted; a loss of at most
// Config.GapKeepWindow batches keeps its blocks (stale keys cost at most a
// cache miss), a larger one clears them. Degraded clears when the engine's
// cache resets (AllBlocksCleared, restart), since the inventory is then
// exact again.
//
// A seq at or below the last applied one means the engine restarted (vLLM
// sends no AllBlocksCleared then): that publisher's blocks are cleared.
// Only exact repeats are duplicates and skipped: the last applied batch
// again (same seq, same bytes), or batches a replay applied arriving live
// too (queued on the SUB while the replay ran, or held back by the
// publisher and filled in by a gap replay). A hash of each replayed batch
// is kept until live traffic passes the replayed range, and a live batch
// is a duplicate only if it repeats one of them, seq and bytes, in order.
// A seq alone proves nothing: right after the first replay, before any
// live batch, a restarted engine's seq 0..N are the very seqs the replay
// applied for the old process, but its batches carry other bytes (a new
// timestamp; AllBlocksCleared first), so they are a restart. On reconnect
// with replay available, the batch at the last applied seq is fetched again:
// the same bytes mean the same process; different bytes, or no batch that
// high, mean a restart (clear, then rebuild from the replay buffer). On the
// first connect every buffered batch is replayed. TensorRT-LLM event ids are
// tracked the same way; a gap there means another client drained the events.
//
// # Parity attestation
//
// BlockStored events carry token ids, so the gateway recomputes the rule's
// contract hash for them (root-anchored runs from the contract root,
// children from parent digests it computed earlier, in a bounded map) and
// keeps a per-endpoint verdict: ok, block_size_mismatch, hash_algo_mismatch
// (the keys match the other vLLM algorithm), hash_mismatch (seed or hash
// contract), or unverified. A change is logged once and exported as
// loxilb_kv_parity_verdict.
//
// # Untrusted input
//
// Every byte a publisher, a replay ROUTER or a TensorRT-LLM drain sends is
// untrusted. ZMQ peers are dialled by the package itself and read on the
// dialling goroutine (no zmq4 Socket, whose per-connection reader
// goroutines are out of reach of a recover). zmq4's Conn runs the
// handshake over a net.Conn that follows the ZMTP framing and fails the
// read of any frame header that would take a message over
// Config.MaxMessageBytes or Config.MaxMessageFrames: zmq4 sizes each frame
// body from its header, so the check must come first. After the handshake
// the package reads frames itself (zmtppeer.go), with the same checks on
// each header before its body, through one buffered read per burst into a
// reused message buffer, with pkg/rawio's reads (no scheduler hand-off per
// read): zmq4's reader made a syscall per frame header and body and
// allocated every body, most of a small batch's cost.
// The READY metadata is parsed with bounds checks and only peer socket types
// that can serve ours are accepted (zmq4 panics on unknown ones). A
// connection that ends in refused input is dropped and redialled with
// backoff; a panic in a subscriber is recovered per connection, counted, and
// the publisher's blocks cleared.
//
// Decoding is bounded by Config.MaxBatchEvents, MaxBatchHashes and
// MaxBatchTokens, checked on each container's announced length before it is
// decoded; a refused batch applies nothing (decoding finishes before
// applying) and marks the publisher degraded. TensorRT-LLM bodies are cut at
// TRTMaxBody and walked one element at a time.
//
// Anyone who can answer on a publisher port can also publish blocks. An
// endpoint whose publisher sends blocks that do not hash from their tokens
// is quarantined (see quarantine.go): its inventory is cleared and stays
// empty until Config.QuarantineVerifyBlocks consecutive blocks verify.
//
// # Metrics
//
// All carry labels service (the rule number) and ep_idx (the endpoint
// index), the label set of every per-endpoint metric of the daemon, and are deleted when the subscription stops:
// loxilb_kv_subscriber_connected, loxilb_kv_subscriber_reconnect_total,
// loxilb_kv_subscriber_recv_error_total, loxilb_kv_subscriber_degraded,
// loxilb_kv_events_applied_total{type}, loxilb_kv_block_events_applied_total{op},
// loxilb_kv_events_skipped_total{reason}, loxilb_kv_decode_errors_total,
// loxilb_kv_seq_gaps_total, loxilb_kv_replays_total{result},
// loxilb_kv_resets_total{reason}, loxilb_kv_parity_verdict{verdict},
// loxilb_kv_trtllm_admission{verdict}, loxilb_kv_rejected_total{reason},
// loxilb_kv_subscriber_panics_total, loxilb_kv_quarantined and
// loxilb_kv_quarantines_total.
//
// Neighbours: pkg/control builds the Specs; pkg/kvindex is the Sink;
// pkg/blockhash provides the contracts; pkg/rawio reads the ZMQ sockets;
// api serves Status and Parity.
package kvevents
