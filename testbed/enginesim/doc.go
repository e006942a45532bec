// Package enginesim emulates an LLM inference engine (vLLM, SGLang,
// TensorRT-LLM or llama.cpp) closely enough on the wire and in its cache to
// stand in for a GPU engine in end-to-end tests, demos and routing
// benchmarks.
//
// In: OpenAI-style HTTP requests (/v1/completions, /v1/chat/completions;
// SGLang also /generate),
// with the engine's prefill/decode parameters when disaggregated. Out:
// OpenAI-style responses and SSE streams in the engine's chunk format with
// usage.prompt_tokens_details.cached_tokens, and the engine's KV-cache event
// feed: vLLM and SGLang msgpack batches on ZMQ PUB sockets (one per DP rank)
// with a replay ROUTER, TensorRT-LLM JSON events drained by
// POST /kv_cache_events.
//
// Inside, each DP rank owns a fixed pool of blocks with LRU eviction of
// unreferenced blocks. A prompt is tokenized (Tokenizer; a real model
// tokenizer via LoadTokenizer or the built-in SimpleTokenizer), split into
// full blocks keyed by the engine's hash contract, matched as a longest
// prefix, and the missing blocks are "prefilled" (a modelled delay per
// uncached token) and inserted, which emits BlockStored and, under
// pressure, BlockRemoved. Decode costs a modelled delay per output token; a
// bounded number of sequences run at once and the rest queue. Fault knobs
// drop, reorder or delay event batches, restart the engine, stall or fail
// requests, and cut streams.
//
// The hashing (hash.go) and msgpack encoding (msgpack.go, events.go) are
// written independently of the gateway's pkg/blockhash and pkg/kvevents and
// are tested byte for byte against the reference vectors in
// testdata/vectors, so a bug on one side cannot hide one on the other.
//
// Neighbours: testbed/cmd/engine-sim wraps one Engine in a binary;
// testbed/fleet starts several. Nothing under pkg/ imports this package.
package enginesim
