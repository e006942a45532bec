package blockhash

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/zeebo/xxh3"

	"github.com/loxilb-llm/loxilb/pkg/engine"
)

// Algo names a block-hash contract. The string values are the ones used in
// rule configuration (kvHashAlgo) and on the command line; the rule
// algorithms take their names from pkg/engine, which says which engine
// speaks which.
type Algo string

const (
	// SHA256CBOR is vLLM's --prefix-caching-hash-algo sha256_cbor.
	SHA256CBOR Algo = engine.AlgoSHA256CBOR
	// XXHashCBOR is vLLM's --prefix-caching-hash-algo xxhash_cbor (XXH3-128).
	XXHashCBOR Algo = engine.AlgoXXHashCBOR
	// SHA256SGLang is SGLang's page hash (raw SHA-256 chain, no seed).
	SHA256SGLang Algo = engine.AlgoSHA256SGLang
	// BlockHashTRTLLM is the gateway's own chained key for TensorRT-LLM token
	// lists: the same arithmetic as SHA256SGLang, applied on both the request
	// side and the event side (the engine's block_hash is only a handle).
	BlockHashTRTLLM Algo = engine.AlgoBlockHashTRTLLM
	// TRTLLMV1BlockKey is TensorRT-LLM's own KV-cache manager V1 block key
	// (BlockKeyHasher::hash) for plain-text blocks. It is not a rule
	// algorithm: it exists so the event side can check the block_hash values a
	// TensorRT-LLM engine publishes. ParseAlgo does not accept it; New does.
	TRTLLMV1BlockKey Algo = "trtllm_v1_block_key"
)

// DefaultVLLMSeed is the NONE_HASH seed vLLM uses for sha256 and sha256_cbor
// when PYTHONHASHSEED is unset (vLLM releases that resolve the seed with
// DEFAULT_NONE_HASH_SEED). Older releases and xxhash_cbor use a random seed,
// which no gateway can reproduce.
const DefaultVLLMSeed = "vllm-none-hash"

// MaxBlockSize bounds Config.BlockSize. Engines use 1..256 in practice; the
// bound only keeps per-call scratch buffers small and predictable.
const MaxBlockSize = 1 << 16

// Errors callers branch on.
var (
	// ErrUnknownAlgo is returned for an algorithm name that is not a contract.
	ErrUnknownAlgo = errors.New("unknown block hash algorithm")
	// ErrBadBlockSize is returned for a block size outside 1..MaxBlockSize.
	ErrBadBlockSize = errors.New("block size out of range")
	// ErrSeedRequired is returned for xxhash_cbor without a seed: vLLM then
	// derives NONE_HASH from a random seed, so no key could ever match.
	ErrSeedRequired = errors.New("xxhash_cbor requires an explicit NONE_HASH seed (PYTHONHASHSEED of the engine)")
	// ErrBadSeed is returned for a seed that is not valid UTF-8 text.
	ErrBadSeed = errors.New("NONE_HASH seed is not valid UTF-8")
	// ErrExtraKeysUnsupported is returned when extra keys are given for an
	// algorithm that has no extra-key input (everything except vLLM's).
	ErrExtraKeysUnsupported = errors.New("extra keys are only defined for the vLLM algorithms")
	// ErrBadDigest is returned for a digest longer than 32 bytes.
	ErrBadDigest = errors.New("digest longer than 32 bytes")
)

// Algos returns the rule algorithms, in engine.AllAlgos order.
func Algos() []Algo {
	out := make([]Algo, len(engine.AllAlgos))
	for i, a := range engine.AllAlgos {
		out[i] = Algo(a)
	}
	return out
}

// ParseAlgo validates a rule algorithm name. Matching is exact
// (case-sensitive), like the loxilb rule field.
func ParseAlgo(s string) (Algo, error) {
	if engine.KnownAlgo(s) {
		return Algo(s), nil
	}
	return "", fmt.Errorf("%w: %q (want one of %s)", ErrUnknownAlgo, s, strings.Join(engine.AllAlgos, ", "))
}

// DigestSize is the length in bytes of one block digest under a.
func (a Algo) DigestSize() int {
	switch a {
	case XXHashCBOR:
		return 16
	case TRTLLMV1BlockKey:
		return 8
	default:
		return 32
	}
}

// SignedKeys reports whether the engine publishes keys of this algorithm as
// signed 64-bit integers (SGLang). The stored key is the same 64 bits.
func (a Algo) SignedKeys() bool { return a == SHA256SGLang }

// IsVLLM reports whether a is one of vLLM's CBOR contracts (the ones with a
// NONE_HASH seed and extra keys).
func (a Algo) IsVLLM() bool { return a == SHA256CBOR || a == XXHashCBOR }

// SignedKey reinterprets a key as the signed int64 SGLang puts on the wire.
func SignedKey(k uint64) int64 { return int64(k) }

// KeyFromSigned reinterprets a signed wire key (SGLang) as the stored uint64.
func KeyFromSigned(v int64) uint64 { return uint64(v) }

// FormatKey prints a key the way the engine running algorithm a publishes it:
// signed decimal for SGLang, unsigned decimal otherwise. Operators compare
// these strings with engine logs and event dumps.
func FormatKey(a Algo, k uint64) string {
	if a.SignedKeys() {
		return strconv.FormatInt(int64(k), 10)
	}
	return strconv.FormatUint(k, 10)
}

// Digest is the full hash of one block: the value chained into the next
// block. It is a fixed-size comparable value, so it can be a map key.
// The zero Digest means "no parent" and is accepted by Next as the root.
type Digest struct {
	n uint8
	b [32]byte
}

// DigestFromBytes builds a Digest from raw bytes, for example the raw
// block_hashes vLLM publishes with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0.
func DigestFromBytes(b []byte) (Digest, error) {
	var d Digest
	if len(b) > len(d.b) {
		return d, fmt.Errorf("%w: %d bytes", ErrBadDigest, len(b))
	}
	d.n = uint8(len(b))
	copy(d.b[:], b)
	return d, nil
}

// Len is the digest length in bytes (0 for the zero Digest).
func (d Digest) Len() int { return int(d.n) }

// IsZero reports whether d is the zero Digest (no parent).
func (d Digest) IsZero() bool { return d.n == 0 }

// Bytes returns a copy of the digest bytes.
func (d Digest) Bytes() []byte { return append([]byte(nil), d.b[:d.n]...) }

// String is the lower-case hex of the digest bytes.
func (d Digest) String() string { return hex.EncodeToString(d.b[:d.n]) }

// Config selects a contract.
type Config struct {
	// Algo is the contract.
	Algo Algo
	// BlockSize is tokens per block (vLLM --block-size, SGLang page size,
	// TensorRT-LLM tokens_per_block).
	BlockSize int
	// Seed is vLLM's NONE_HASH seed: the engine's PYTHONHASHSEED
	// (LLB_KV_NONE_HASH_SEED on the gateway). Empty means DefaultVLLMSeed for
	// sha256_cbor and is an error for xxhash_cbor. Ignored by other algorithms.
	Seed string
}

// Hasher computes block keys and digests for one contract. It is immutable
// after New and safe for concurrent use.
type Hasher struct {
	algo Algo
	bs   int
	seed string
	root Digest
	// bufs holds *[]byte scratch buffers sized for one block's hash input,
	// so hashing allocates nothing per block (nor per call, once warm).
	bufs sync.Pool
}

// New validates cfg and returns a Hasher.
func New(cfg Config) (*Hasher, error) {
	switch cfg.Algo {
	case SHA256CBOR, XXHashCBOR, SHA256SGLang, BlockHashTRTLLM, TRTLLMV1BlockKey:
	default:
		return nil, fmt.Errorf("%w: %q", ErrUnknownAlgo, cfg.Algo)
	}
	if cfg.BlockSize < 1 || cfg.BlockSize > MaxBlockSize {
		return nil, fmt.Errorf("%w: %d (want 1..%d)", ErrBadBlockSize, cfg.BlockSize, MaxBlockSize)
	}
	h := &Hasher{algo: cfg.Algo, bs: cfg.BlockSize}
	if cfg.Algo.IsVLLM() {
		seed := cfg.Seed
		if seed == "" {
			if cfg.Algo == XXHashCBOR {
				return nil, ErrSeedRequired
			}
			seed = DefaultVLLMSeed
		}
		if !utf8.ValidString(seed) {
			return nil, fmt.Errorf("%w: %q", ErrBadSeed, seed)
		}
		h.seed = seed
		h.root = h.sum(cborAppendText(nil, seed))
	}
	bufSize := h.maxInput()
	h.bufs.New = func() any {
		b := make([]byte, 0, bufSize)
		return &b
	}
	return h, nil
}

// maxInput is the largest hash input of one plain block.
func (h *Hasher) maxInput() int {
	switch h.algo {
	case SHA256CBOR, XXHashCBOR:
		// array(3) + bstr head(2) + 32 + array head(<=5) + 5/token + null
		return 1 + 2 + 32 + 5 + 5*h.bs + 1
	case SHA256SGLang, BlockHashTRTLLM:
		return 32 + 4*h.bs
	default:
		return 0
	}
}

// Algo is the contract this Hasher implements.
func (h *Hasher) Algo() Algo { return h.algo }

// BlockSize is tokens per block.
func (h *Hasher) BlockSize() int { return h.bs }

// Seed is the effective vLLM NONE_HASH seed ("" for other algorithms).
func (h *Hasher) Seed() string { return h.seed }

// Root is the chain anchor: vLLM's NONE_HASH, or the zero Digest for the
// algorithms whose first block has no parent (SGLang, TensorRT-LLM).
func (h *Hasher) Root() Digest { return h.root }

// KeyOf is the 64-bit key the engine publishes for a block digest.
func (h *Hasher) KeyOf(d Digest) uint64 {
	switch h.algo {
	case SHA256CBOR, XXHashCBOR:
		// int.from_bytes(digest, "big") & (2**64-1): the last 8 bytes.
		if d.n < 8 {
			var tmp [8]byte
			copy(tmp[8-d.n:], d.b[:d.n])
			return binary.BigEndian.Uint64(tmp[:])
		}
		return binary.BigEndian.Uint64(d.b[d.n-8 : d.n])
	default:
		// SGLang int(hex[:16], 16) and the TRT v1 u64: the first 8 bytes.
		return binary.BigEndian.Uint64(d.b[:8])
	}
}

// sum hashes a vLLM input with the algorithm's digest function.
func (h *Hasher) sum(in []byte) Digest {
	var d Digest
	if h.algo == XXHashCBOR {
		d.n = 16
		u := xxh3.Hash128(in)
		binary.BigEndian.PutUint64(d.b[0:8], u.Hi)
		binary.BigEndian.PutUint64(d.b[8:16], u.Lo)
		return d
	}
	d.n = 32
	d.b = sha256.Sum256(in)
	return d
}

func (h *Hasher) getBuf() *[]byte  { return h.bufs.Get().(*[]byte) }
func (h *Hasher) putBuf(b *[]byte) { h.bufs.Put(b) }

// Next hashes one block given its parent digest and returns the block's
// digest and published key. A zero parent means the chain root (vLLM
// substitutes NONE_HASH, like `if not parent_block_hash`). tokens may be
// shorter than the block size: SGLang publishes trailing partial pages, and
// the event side must be able to recompute them.
func (h *Hasher) Next(parent Digest, tokens []uint32) (Digest, uint64) {
	d, _ := h.next(parent, tokens, nil)
	return d, h.KeyOf(d)
}

// NextExtra is Next for a vLLM block that carries extra keys (LoRA name,
// multimodal identifiers, cache_salt, prompt-embeds digests), as published in
// BlockStored.extra_keys. A nil or empty extra is a plain block.
func (h *Hasher) NextExtra(parent Digest, tokens []uint32, extra []ExtraKey) (Digest, uint64, error) {
	if len(extra) > 0 && !h.algo.IsVLLM() {
		return Digest{}, 0, fmt.Errorf("%s: %w", h.algo, ErrExtraKeysUnsupported)
	}
	d, err := h.next(parent, tokens, extra)
	if err != nil {
		return Digest{}, 0, err
	}
	return d, h.KeyOf(d), nil
}

func (h *Hasher) next(parent Digest, tokens []uint32, extra []ExtraKey) (Digest, error) {
	switch h.algo {
	case SHA256CBOR, XXHashCBOR:
		if parent.n == 0 {
			parent = h.root
		}
		bp := h.getBuf()
		b := appendBlockCBOR((*bp)[:0], parent.b[:parent.n], tokens)
		b, err := appendExtraCBOR(b, extra)
		var d Digest
		if err == nil {
			d = h.sum(b)
		}
		*bp = b[:0]
		h.putBuf(bp)
		return d, err
	case SHA256SGLang, BlockHashTRTLLM:
		bp := h.getBuf()
		b := append((*bp)[:0], parent.b[:parent.n]...)
		b = appendTokensLE(b, tokens)
		d := Digest{n: 32, b: sha256.Sum256(b)}
		*bp = b[:0]
		h.putBuf(bp)
		return d, nil
	default: // TRTLLMV1BlockKey
		var p uint64
		if parent.n != 0 {
			p = binary.BigEndian.Uint64(parent.b[:8])
		}
		return trtV1Digest(trtV1BlockKey(p, tokens)), nil
	}
}

// Keys appends the key of every full block of tokens to dst and returns the
// extended slice. A trailing partial block is not hashed: engines only
// publish (vLLM, TensorRT-LLM) or only match (SGLang) full blocks for a
// request prefix. Keys allocates only when dst must grow.
func (h *Hasher) Keys(dst []uint64, tokens []uint32) []uint64 {
	n := len(tokens) / h.bs
	if n == 0 {
		return dst
	}
	dst = growKeys(dst, n)
	switch h.algo {
	case SHA256CBOR, XXHashCBOR:
		return h.keysVLLM(dst, tokens[:n*h.bs])
	case SHA256SGLang, BlockHashTRTLLM:
		return h.keysSGLang(dst, tokens[:n*h.bs])
	default:
		var p uint64
		for off := 0; off < n*h.bs; off += h.bs {
			p = trtV1BlockKey(p, tokens[off:off+h.bs])
			dst = append(dst, p)
		}
		return dst
	}
}

func growKeys(dst []uint64, n int) []uint64 {
	if cap(dst)-len(dst) >= n {
		return dst
	}
	nd := make([]uint64, len(dst), len(dst)+n)
	copy(nd, dst)
	return nd
}

// keysVLLM keeps the CBOR prefix "83 58 20 <parent>" (or "83 50 <parent>")
// in place and overwrites only the parent bytes and the token array per
// block, so each block costs one encode of its tokens plus one digest.
func (h *Hasher) keysVLLM(dst []uint64, tokens []uint32) []uint64 {
	bp := h.getBuf()
	dl := int(h.root.n)
	b := append((*bp)[:0], 0x83)
	b = cborAppendHead(b, majorBytes, uint64(dl))
	pOff := len(b)
	b = append(b, h.root.b[:dl]...)
	prefix := len(b)
	for off := 0; off < len(tokens); off += h.bs {
		b = cborAppendTokens(b[:prefix], tokens[off:off+h.bs])
		b = append(b, 0xf6)
		d := h.sum(b)
		dst = append(dst, binary.BigEndian.Uint64(d.b[dl-8:dl]))
		copy(b[pOff:prefix], d.b[:dl])
	}
	*bp = b[:0]
	h.putBuf(bp)
	return dst
}

// keysSGLang keeps the 32-byte prior at the front of the buffer; block 0
// hashes only its tokens (no prior under the root).
func (h *Hasher) keysSGLang(dst []uint64, tokens []uint32) []uint64 {
	bp := h.getBuf()
	b := (*bp)[:32]
	for off := 0; off < len(tokens); off += h.bs {
		b = appendTokensLE(b[:32], tokens[off:off+h.bs])
		in := b
		if off == 0 {
			in = b[32:]
		}
		sum := sha256.Sum256(in)
		dst = append(dst, binary.BigEndian.Uint64(sum[:8]))
		copy(b[:32], sum[:])
	}
	*bp = b[:0]
	h.putBuf(bp)
	return dst
}

func appendTokensLE(b []byte, tokens []uint32) []byte {
	n := len(b)
	b = growBytes(b, 4*len(tokens))
	for i, t := range tokens {
		binary.LittleEndian.PutUint32(b[n+4*i:], t)
	}
	return b
}

// growBytes extends b by n bytes (contents of the new bytes unspecified).
func growBytes(b []byte, n int) []byte {
	if cap(b)-len(b) < n {
		nb := make([]byte, len(b), 2*cap(b)+n)
		copy(nb, b)
		b = nb
	}
	return b[:len(b)+n]
}

// trtV1BlockKey is TensorRT-LLM's BlockKeyHasher::hash for a block with no
// token extra ids, LoRA task, cache salt or multimodal keys.
func trtV1BlockKey(parent uint64, tokens []uint32) uint64 {
	seed := uint64(len(tokens)) ^ (parent * 0xbf58476d1ce4e5b9)
	for _, t := range tokens {
		a := t
		a = ((a >> 16) ^ a) * 0x45d9f3b
		a = ((a >> 16) ^ a) * 0x45d9f3b
		a = (a >> 16) ^ a
		seed ^= uint64(a) + 0x9e3779b9 + (seed << 6) + (seed >> 2)
	}
	return seed
}

func trtV1Digest(k uint64) Digest {
	d := Digest{n: 8}
	binary.BigEndian.PutUint64(d.b[:8], k)
	return d
}
