package enginesim

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"

	"github.com/zeebo/xxh3"
)

// Hash algorithm names accepted by Config.HashAlgo. They match the rule field
// spelling of the gateway so a test can configure both sides from one value.
const (
	AlgoSHA256CBOR      = "sha256_cbor"
	AlgoXXHashCBOR      = "xxhash_cbor"
	AlgoSHA256SGLang    = "sha256_sglang"
	AlgoBlockHashTRTLLM = "blockhash_trtllm"
)

// vllmDefaultSeed is the NONE_HASH seed current vLLM uses for sha256 and
// sha256_cbor when PYTHONHASHSEED is unset.
const vllmDefaultSeed = "vllm-none-hash"

// hashedBlock is one full block of a prompt with the key the engine publishes.
type hashedBlock struct {
	key    uint64   // the u64 published in events (SGLang: the int64 bit pattern)
	digest []byte   // full digest (vLLM only; events may carry it as bytes)
	tokens []uint32 // the block's tokens, aliasing the prompt slice
	extra  []string // vLLM extra_keys of this block (LoRA name, cache_salt); nil for none
	lora   *loraRef // the LoRA adapter the block belongs to, if any
}

// loraRef names a LoRA adapter as vLLM's events do.
type loraRef struct {
	name string
	id   int
}

// blockExtras are the request properties that vLLM mixes into block hashes.
type blockExtras struct {
	lora      *loraRef
	cacheSalt string
}

// blockHasher splits a token sequence into full blocks and keys them exactly
// as one engine contract does. Only full blocks are returned.
type blockHasher interface {
	hashBlocks(tokens []uint32) []hashedBlock
	algo() string
}

// newHasher builds the engine's hasher. seed is only used by vLLM algorithms;
// an empty seed mimics vLLM: "vllm-none-hash" for sha256_cbor, a random value
// for xxhash_cbor (so such an engine is deliberately unreproducible).
func newHasher(engine, algo, seed string, blockSize int) (blockHasher, error) {
	if blockSize <= 0 {
		return nil, fmt.Errorf("block size %d: must be positive", blockSize)
	}
	switch algo {
	case AlgoSHA256CBOR, AlgoXXHashCBOR:
		if engine != EngineVLLM {
			return nil, fmt.Errorf("hash algo %q is a vLLM contract, engine is %q", algo, engine)
		}
		if seed == "" {
			if algo == AlgoSHA256CBOR {
				seed = vllmDefaultSeed
			} else {
				var b [32]byte
				if _, err := rand.Read(b[:]); err != nil {
					return nil, fmt.Errorf("random none-hash seed: %w", err)
				}
				seed = hex.EncodeToString(b[:])
			}
		}
		h := &vllmHasher{xxh: algo == AlgoXXHashCBOR, blockSize: blockSize}
		h.noneHash = h.sum(cborText(nil, seed))
		return h, nil
	case AlgoSHA256SGLang:
		if engine != EngineSGLang {
			return nil, fmt.Errorf("hash algo %q is the SGLang contract, engine is %q", algo, engine)
		}
		return &sglangHasher{pageSize: blockSize}, nil
	case AlgoBlockHashTRTLLM:
		if engine != EngineTRTLLM {
			return nil, fmt.Errorf("hash algo %q is the TensorRT-LLM contract, engine is %q", algo, engine)
		}
		return &trtHasher{tokensPerBlock: blockSize}, nil
	default:
		return nil, fmt.Errorf("unknown hash algo %q (want %s, %s, %s or %s)", algo,
			AlgoSHA256CBOR, AlgoXXHashCBOR, AlgoSHA256SGLang, AlgoBlockHashTRTLLM)
	}
}

// defaultAlgo is the hash contract an engine uses when none is configured.
func defaultAlgo(engine string) string {
	switch engine {
	case EngineSGLang:
		return AlgoSHA256SGLang
	case EngineTRTLLM:
		return AlgoBlockHashTRTLLM
	default:
		return AlgoSHA256CBOR
	}
}

// vllmHasher implements vLLM's hash_block_tokens over canonical CBOR of
// (parent_digest, tuple(tokens), None) with SHA-256 or XXH3-128.
type vllmHasher struct {
	xxh       bool
	blockSize int
	noneHash  []byte
}

func (h *vllmHasher) algo() string {
	if h.xxh {
		return AlgoXXHashCBOR
	}
	return AlgoSHA256CBOR
}

func (h *vllmHasher) sum(b []byte) []byte {
	if h.xxh {
		d := xxh3.Hash128(b).Bytes()
		return d[:]
	}
	d := sha256.Sum256(b)
	return d[:]
}

func (h *vllmHasher) hashBlocks(tokens []uint32) []hashedBlock {
	return h.hashBlocksExtra(tokens, blockExtras{})
}

// hashBlocksExtra follows generate_block_hash_extra_keys: the LoRA name on
// every block, then the cache salt on block 0 only.
func (h *vllmHasher) hashBlocksExtra(tokens []uint32, x blockExtras) []hashedBlock {
	n := len(tokens) / h.blockSize
	out := make([]hashedBlock, 0, n)
	parent := h.noneHash
	var buf []byte
	for i := 0; i < n; i++ {
		blk := tokens[i*h.blockSize : (i+1)*h.blockSize]
		var extra []string
		if x.lora != nil {
			extra = append(extra, x.lora.name)
		}
		if i == 0 && x.cacheSalt != "" {
			extra = append(extra, x.cacheSalt)
		}
		buf = vllmBlockCBOR(buf[:0], parent, blk, extra)
		d := h.sum(buf)
		out = append(out, hashedBlock{key: binary.BigEndian.Uint64(d[len(d)-8:]), digest: d, tokens: blk,
			extra: extra, lora: x.lora})
		parent = d
	}
	return out
}

// vllmBlockCBOR appends canonical CBOR of the 3-tuple (parent, tokens,
// extra_keys), extra_keys being None or a tuple of strings.
func vllmBlockCBOR(dst, parent []byte, tokens []uint32, extra []string) []byte {
	dst = append(dst, 0x83)
	dst = cborHead(dst, 2, uint64(len(parent)))
	dst = append(dst, parent...)
	dst = cborHead(dst, 4, uint64(len(tokens)))
	for _, t := range tokens {
		dst = cborHead(dst, 0, uint64(t))
	}
	if extra == nil {
		return append(dst, 0xf6)
	}
	dst = cborHead(dst, 4, uint64(len(extra)))
	for _, k := range extra {
		dst = cborText(dst, k)
	}
	return dst
}

func cborText(dst []byte, s string) []byte {
	dst = cborHead(dst, 3, uint64(len(s)))
	return append(dst, s...)
}

// cborHead appends a CBOR major-type header with the shortest argument form,
// as canonical encoding requires.
func cborHead(dst []byte, major byte, v uint64) []byte {
	m := major << 5
	switch {
	case v < 24:
		return append(dst, m|byte(v))
	case v <= 0xff:
		return append(dst, m|24, byte(v))
	case v <= 0xffff:
		return append(dst, m|25, byte(v>>8), byte(v))
	case v <= 0xffffffff:
		return append(dst, m|26, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	default:
		dst = append(dst, m|27)
		return binary.BigEndian.AppendUint64(dst, v)
	}
}

// sglangHasher implements SGLang's page hash: SHA-256 over the previous page
// digest (absent under the root) and the page tokens as u32 little-endian.
// The key is the first 8 digest bytes big-endian (an int64 on the wire).
type sglangHasher struct{ pageSize int }

func (h *sglangHasher) algo() string { return AlgoSHA256SGLang }

func (h *sglangHasher) hashBlocks(tokens []uint32) []hashedBlock {
	n := len(tokens) / h.pageSize
	out := make([]hashedBlock, 0, n)
	var prior []byte
	buf := make([]byte, 0, 32+4*h.pageSize)
	for i := 0; i < n; i++ {
		blk := tokens[i*h.pageSize : (i+1)*h.pageSize]
		buf = append(buf[:0], prior...)
		for _, t := range blk {
			buf = binary.LittleEndian.AppendUint32(buf, t)
		}
		d := sha256.Sum256(buf)
		out = append(out, hashedBlock{key: binary.BigEndian.Uint64(d[:8]), digest: d[:], tokens: blk})
		prior = d[:]
	}
	return out
}

// partialPage hashes the trailing partial page of tokens (if any), chained
// to the last full page, as SGLang does when it publishes it.
func (h *sglangHasher) partialPage(tokens []uint32, full []hashedBlock) (hashedBlock, bool) {
	rest := len(tokens) % h.pageSize
	if rest == 0 {
		return hashedBlock{}, false
	}
	var buf []byte
	if len(full) > 0 {
		buf = append(buf, full[len(full)-1].digest...)
	}
	page := tokens[len(tokens)-rest:]
	for _, t := range page {
		buf = binary.LittleEndian.AppendUint32(buf, t)
	}
	d := sha256.Sum256(buf)
	return hashedBlock{key: binary.BigEndian.Uint64(d[:8]), digest: d[:], tokens: page}, true
}

// trtHasher implements TensorRT-LLM's v1 BlockKeyHasher for plain text blocks
// (no extra token ids, LoRA, salt or multimodal keys); the root parent is 0.
type trtHasher struct{ tokensPerBlock int }

func (h *trtHasher) algo() string { return AlgoBlockHashTRTLLM }

func (h *trtHasher) hashBlocks(tokens []uint32) []hashedBlock {
	n := len(tokens) / h.tokensPerBlock
	out := make([]hashedBlock, 0, n)
	var parent uint64
	for i := 0; i < n; i++ {
		blk := tokens[i*h.tokensPerBlock : (i+1)*h.tokensPerBlock]
		parent = trtBlockKey(blk, parent)
		out = append(out, hashedBlock{key: parent, tokens: blk})
	}
	return out
}

func trtBlockKey(tokens []uint32, parent uint64) uint64 {
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
