// Package tokenizer turns OpenAI-style requests into the exact token ids an
// inference engine computes for them, so that the gateway's block hashes
// match the engine's KV-cache events bit for bit.
//
// In: a HuggingFace tokenizer.json (+ tokenizer_config.json) staged under
// the tokenizer directory (daemon flag --tokenizer-dir, default
// /etc/loxilb/tokenizers) as DIR/<slug>/, where slug is the served model
// name with every "/" replaced by "__" (case-sensitive); and request bodies
// from pkg/proxy. Out: []uint32 token ids (RequestTokens) for pkg/blockhash.
// Neighbours: pkg/proxy (caller), pkg/blockhash (consumer of the ids), the
// capability/diagnostics API (Registry.Status) and loxicmd's offline
// "kv tokenize" tool.
//
// # Encoding
//
// The encoder is a pure-Go implementation of the HuggingFace pipeline for
// byte-level BPE (Qwen2/2.5/3, Llama-3.x) and plain BPE with byte fallback:
//
//  1. added tokens are cut out first, leftmost-longest, honouring special,
//     lstrip, rstrip, single_word and normalized;
//  2. the normalizer (NFC for Qwen) runs on the text between them (the NFC
//     check skips ASCII, which NFC leaves alone);
//  3. the Split pre-tokenizer regex runs with github.com/dlclark/regexp2 in
//     its default (.NET) mode, whose \s is Unicode White_Space like
//     Oniguruma's (RE2 mode would treat U+2028, U+3000... as non-space). For
//     the Qwen and Llama-3 patterns an allocation-free hand-written scanner
//     is used instead; it is checked to produce the same pieces as regexp2
//     on the parity corpus and by a fuzz target. When the pre-tokenizer is
//     that scanner alone (plus a ByteLevel step that does not split), the
//     encoder walks its matches directly instead of listing the pieces;
//  4. BPE merges by (rank, position): the lowest rank first, ties leftmost
//     (ordering by rank alone changes ids for runs such as "aaaa" or
//     whitespace). Results are cached per piece; ignore_merges is honoured.
//     The merge ranks and the per-piece cache are flat open-addressing
//     tables (flat.go), not Go maps: map probing was ~45% of encode time.
//     The per-piece cache is read without a lock (writers append and then
//     publish a slot atomically); one- and two-byte pieces skip it.
//     The ids of each whole stretch between added tokens are cached too
//     (prefixcache.go): a chat template puts each message in such a
//     stretch, so a conversation's next turn encodes only its new
//     messages, and a stretch that shares a long prefix with a cached one
//     (the same document with a new question) resumes from a mark of it,
//     exactly, when the pre-tokenizer is the scanner (its reads stop at
//     an ASCII non-space byte) and the normalizer is none or NFC. The
//     cache is bounded by bytes (--tokenizer-cache-bytes) and counted in
//     loxilb_tokenizer_cache_lookups_total and
//     loxilb_tokenizer_cache_evictions_total;
//  5. with add_special_tokens, the post-processor (TemplateProcessing,
//     e.g. Llama-3's <|begin_of_text|>) wraps the result.
//
// Parity is proven against HuggingFace's Rust tokenizer (npm tokenizers)
// with the real Qwen3 and Llama-3.1 files on 3,000+ strings: golden files
// in testdata/ are produced by testbed/parity/regen.sh, which CI reruns and
// diffs. github.com/daulet/tokenizers (cgo over the Rust crate) is not used
// because the Rust crates registry is not reachable to build it.
//
// # Chat templates
//
// chat_template is rendered with github.com/ardanlabs/jinja. Request JSON
// is converted to template values with object key order preserved (Python
// dicts keep insertion order, and tools | tojson prints keys in that
// order). A body is read once, by a reflection-free scanner (jsonscan.go,
// held to encoding/json by fuzz targets): the top level into
// RequestFields (ParseRequest; the gateway's routing key reads the same
// fields), the messages straight into template values. Output tags that
// only concatenate a string literal with variables and literals (each
// message line of the Qwen templates) are split into one tag per operand
// before compiling (concat.go): the library copies the growing string at
// every "+". The tojson filter is replaced by a Python json.dumps equivalent:
// the library's own tojson(indent=N) sorts keys and escapes HTML
// characters, which breaks Llama-3.1/3.2 tool prompts.
//
// # Engines
//
// EncodeRequest reproduces each engine's prompt construction: for
// /v1/completions a string prompt is encoded with special tokens (vLLM and
// TRT-LLM honour the request's add_special_tokens; SGLang can be
// configured for the "BOS + text" quirk), token-id prompts are used as
// given, and for a batch the first prompt is used; for
// /v1/chat/completions the template output is encoded without adding
// special tokens again. Requests whose engine hash would also cover a LoRA
// adapter, cache_salt, multimodal inputs or prompt embeddings are reported
// in RequestTokens.Unhashable rather than hashed as plain text.
//
// Prompts come from untrusted clients, so RequestOptions bounds the work:
// a prompt text (or rendered chat) longer than MaxPromptBytes is refused
// before any BPE, and encoding stops once the ids pass MaxPromptTokens
// (ErrPromptTooLong). A run of one character is a single pre-tokenized
// piece whose BPE costs O(n log n) (the heap-driven merge HuggingFace
// uses too), about 0.65 s per MiB of spaces, which is what the byte bound
// caps. Tokenizer.MaxLength gives the model's context length when its
// config.json or tokenizer_config.json is staged.
//
// # Registry
//
// Registry loads tokenizers lazily by model name, notices files staged or
// replaced after start (stat fingerprint, rechecked at most every few
// seconds once loaded, on every lookup while missing), returns typed
// errors (ErrNotStaged, ErrUnreadable, ErrInvalid, ErrInvalidModelName) and
// counts every failed lookup by reason in
// loxilb_tokenizer_lookup_failures_total, so a missing tokenizer is never a
// silent fall-through. Lookups take any name a client sends, so only a
// staged tokenizer or a model pinned by the rules (Pin) keeps an entry.
//
// Tokenizer values are immutable and safe for concurrent use; encoding
// allocates nothing in the steady state beyond the returned slice.
package tokenizer
