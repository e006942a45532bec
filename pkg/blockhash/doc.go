// Package blockhash reproduces, bit for bit, the block hashes inference
// engines use as prefix-cache keys, so the gateway can look up a request's
// blocks in inventories built from the engines' own KV events.
//
// In: token ids (uint32) and a Config naming the contract, block size and,
// for vLLM, the NONE_HASH seed. Out: one uint64 key per full block, exactly
// the value the engine publishes in BlockStored events. Neighbours: the
// tokenizer produces the ids; kvindex stores and matches the keys; kvevents
// uses Root/Next to recompute published blocks from their token ids (parity
// attestation).
//
// # Contracts
//
// sha256_cbor and xxhash_cbor (vLLM prefix caching):
//
//	NONE_HASH = H(cbor_text(seed))       seed = engine PYTHONHASHSEED
//	digest_i  = H(cbor([parent_digest, [tok...], extra_keys or null]))
//	key_i     = last 8 digest bytes, big-endian
//
// H is SHA-256 (32-byte digest) or XXH3-128 in canonical big-endian form
// (16 bytes). The parent of block 0 is NONE_HASH; every other parent is the
// full previous digest, never the key. CBOR is canonical: shortest integer
// heads, definite lengths. With no seed configured, sha256_cbor uses
// "vllm-none-hash" (what current vLLM does without PYTHONHASHSEED);
// xxhash_cbor refuses, because vLLM then picks a random seed. Extra keys
// (LoRA name, multimodal (id, offset), cache_salt on block 0, prompt-embeds
// digests) are supported by NextExtra for event-side recomputation; the
// request side hashes plain blocks only and leaves detection of such
// requests to its caller.
//
// sha256_sglang (SGLang page hash): digest_i = SHA-256(digest_{i-1} ||
// uint32-LE tokens), with no parent bytes at all for page 0 and no seed. The
// key is the first 8 digest bytes big-endian. SGLang publishes it as a
// signed int64; the same 64 bits are stored here as uint64 (SignedKey and
// FormatKey convert for display and comparison with engine output).
//
// blockhash_trtllm (TensorRT-LLM): the engine's HTTP event drain carries the
// token ids of every stored block, so the gateway does not depend on the
// engine's own block_hash (which mixes in token extra ids, LoRA task ids
// and salts, and differs between KV-cache manager versions). Both the
// request side and the event side rehash the token lists with the
// sha256_sglang arithmetic above (chained per block, no parent for the first
// block of an event whose parent_hash is null), and the engine's block_hash
// serves only as a handle to translate BlockRemoved events. This matches the
// loxilb inference-gateway's TensorRT-LLM contract.
//
// trtllm_v1_block_key is not a rule algorithm: it is TensorRT-LLM's own V1
// BlockKeyHasher::hash for plain blocks (root parent 0), provided so the event
// side can check the engine's block_hash values when it wants to.
// Its digest is the 8-byte big-endian key.
//
// # Performance
//
// A Hasher is immutable and safe for concurrent use. Keys reuses pooled
// scratch buffers and writes the CBOR by hand (no reflection), so it does not
// allocate per block; only dst grows. Only full blocks are hashed by Keys:
// the trailing partial block of a request can never match a published key
// (vLLM and TensorRT-LLM publish full blocks only; SGLang's partial pages are
// keyed by their own short token list and are rebuilt from scratch on
// extension).
package blockhash
