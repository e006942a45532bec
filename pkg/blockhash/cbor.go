package blockhash

import (
	"encoding/binary"
	"fmt"
	"slices"
)

// Canonical CBOR (RFC 8949 §4.2.1, what cbor2.dumps(x, canonical=True)
// produces) for the only shapes vLLM hashes: an array of a byte string, an
// array of unsigned integers, and null or an array of extra keys. Written by
// hand into caller-owned buffers because this is the request hot path and a
// reflection-based encoder would allocate per block.

const (
	majorUint  = 0
	majorNeg   = 1
	majorBytes = 2
	majorText  = 3
	majorArray = 4
)

// cborAppendHead appends the shortest head for major type m and argument n.
func cborAppendHead(b []byte, m byte, n uint64) []byte {
	m <<= 5
	switch {
	case n < 24:
		return append(b, m|byte(n))
	case n <= 0xff:
		return append(b, m|24, byte(n))
	case n <= 0xffff:
		return append(b, m|25, byte(n>>8), byte(n))
	case n <= 0xffffffff:
		return append(b, m|26, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	default:
		b = append(b, m|27)
		return binary.BigEndian.AppendUint64(b, n)
	}
}

func cborAppendText(b []byte, s string) []byte {
	b = cborAppendHead(b, majorText, uint64(len(s)))
	return append(b, s...)
}

func cborAppendInt(b []byte, v int64) []byte {
	if v >= 0 {
		return cborAppendHead(b, majorUint, uint64(v))
	}
	return cborAppendHead(b, majorNeg, uint64(-1-v))
}

// cborAppendTokens appends array(len(tokens)) of shortest-form uints.
// Measured in BenchmarkEncodeTokens against a branch-free variant (8-byte
// word stores advancing by a size-class length): the branch-free form needs
// about 2.5x the instructions and is no faster on realistic vocabularies, so
// the plain form stays.
func cborAppendTokens(b []byte, tokens []uint32) []byte {
	b = cborAppendHead(b, majorArray, uint64(len(tokens)))
	if cap(b)-len(b) < 5*len(tokens) {
		b = slices.Grow(b, 5*len(tokens))
	}
	for _, t := range tokens {
		b = cborAppendHead(b, majorUint, uint64(t))
	}
	return b
}

// appendBlockCBOR appends 0x83, bstr(parent), array(tokens) — the 3-tuple
// without its third element, which the caller appends (null or extra keys).
func appendBlockCBOR(b []byte, parent []byte, tokens []uint32) []byte {
	b = append(b, 0x83)
	b = cborAppendHead(b, majorBytes, uint64(len(parent)))
	b = append(b, parent...)
	return cborAppendTokens(b, tokens)
}

// ExtraKind says which Python value an ExtraKey stands for.
type ExtraKind uint8

const (
	// ExtraString is a str: a LoRA name or a cache_salt.
	ExtraString ExtraKind = iota + 1
	// ExtraMM is a (identifier str, offset int) 2-tuple for a multimodal item.
	ExtraMM
	// ExtraBytes is a bytes value: a prompt-embeds SHA-256 digest.
	ExtraBytes
)

// ExtraKey is one element of vLLM's per-block extra_keys tuple.
type ExtraKey struct {
	Kind  ExtraKind
	Str   string // ExtraString value or ExtraMM identifier
	Int   int64  // ExtraMM offset (may be negative)
	Bytes []byte // ExtraBytes value
}

// StringKey is a LoRA-name or cache_salt extra key.
func StringKey(s string) ExtraKey { return ExtraKey{Kind: ExtraString, Str: s} }

// MMKey is a multimodal (identifier, offset) extra key.
func MMKey(id string, offset int64) ExtraKey { return ExtraKey{Kind: ExtraMM, Str: id, Int: offset} }

// BytesKey is a prompt-embeds digest extra key.
func BytesKey(b []byte) ExtraKey { return ExtraKey{Kind: ExtraBytes, Bytes: b} }

// appendExtraCBOR appends the third tuple element: null for no extra keys
// (vLLM passes None when the list is empty), else an array of the keys.
func appendExtraCBOR(b []byte, extra []ExtraKey) ([]byte, error) {
	if len(extra) == 0 {
		return append(b, 0xf6), nil
	}
	b = cborAppendHead(b, majorArray, uint64(len(extra)))
	for i, k := range extra {
		switch k.Kind {
		case ExtraString:
			b = cborAppendText(b, k.Str)
		case ExtraMM:
			b = append(b, 0x82)
			b = cborAppendText(b, k.Str)
			b = cborAppendInt(b, k.Int)
		case ExtraBytes:
			b = cborAppendHead(b, majorBytes, uint64(len(k.Bytes)))
			b = append(b, k.Bytes...)
		default:
			return b, fmt.Errorf("extra key %d: unknown kind %d", i, k.Kind)
		}
	}
	return b, nil
}
