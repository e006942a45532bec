package blockhash

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"math/rand/v2"
	"testing"

	"github.com/zeebo/xxh3"
)

const (
	benchBlocks    = 256
	benchBlockSize = 16
)

// benchTokens is a 4096-token request with ids drawn from a Qwen-sized
// vocabulary, so the CBOR size classes mix as they do on real prompts.
func benchTokens() []uint32 {
	r := rand.New(rand.NewPCG(11, 12))
	out := make([]uint32, benchBlocks*benchBlockSize)
	for i := range out {
		out[i] = uint32(r.IntN(152000))
	}
	return out
}

// BenchmarkKeys hashes 256 blocks of 16 tokens per algorithm. Compare with
// BenchmarkRaw, which runs only the digest function over the exact bytes
// each algorithm hashes: the difference is the encoding and chaining cost.
func BenchmarkKeys(b *testing.B) {
	toks := benchTokens()
	for _, a := range allAlgos {
		b.Run(string(a), func(b *testing.B) {
			h := mustNew(b, Config{Algo: a, BlockSize: benchBlockSize, Seed: "0"})
			dst := make([]uint64, 0, benchBlocks)
			b.SetBytes(int64(len(toks) * 4))
			b.ReportAllocs()
			for b.Loop() {
				dst = h.Keys(dst[:0], toks)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*benchBlocks), "ns/block")
		})
	}
}

// rawInputs returns the exact per-block hash inputs algorithm a feeds to its
// digest function for benchTokens.
func rawInputs(b *testing.B, a Algo) [][]byte {
	toks := benchTokens()
	h := mustNew(b, Config{Algo: a, BlockSize: benchBlockSize, Seed: "0"})
	var out [][]byte
	parent := h.Root()
	for off := 0; off < len(toks); off += benchBlockSize {
		blk := toks[off : off+benchBlockSize]
		var in []byte
		if a.IsVLLM() {
			in, _ = appendExtraCBOR(appendBlockCBOR(nil, parent.b[:parent.n], blk), nil)
		} else {
			in = appendTokensLE(append([]byte(nil), parent.b[:parent.n]...), blk)
		}
		out = append(out, in)
		parent, _ = h.Next(parent, blk)
	}
	return out
}

func BenchmarkRaw(b *testing.B) {
	for _, a := range []Algo{SHA256CBOR, XXHashCBOR, SHA256SGLang} {
		ins := rawInputs(b, a)
		name := "sha256/" + string(a)
		if a == XXHashCBOR {
			name = "xxh3_128/" + string(a)
		}
		b.Run(name, func(b *testing.B) {
			b.SetBytes(int64(benchBlocks * benchBlockSize * 4))
			b.ReportAllocs()
			var sink byte
			for b.Loop() {
				for _, in := range ins {
					if a == XXHashCBOR {
						sink ^= byte(xxh3.Hash128(in).Lo)
					} else {
						s := sha256.Sum256(in)
						sink ^= s[0]
					}
				}
			}
			_ = sink
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*benchBlocks), "ns/block")
		})
	}
}

// branchFreeEncode writes each token as one big-endian 8-byte word (head
// and value) and advances by the size-class length. It is kept to show, in
// the same run, why cborAppendTokens uses plain appends instead.
func branchFreeEncode(b []byte, tokens []uint32) []byte {
	head := [4]uint64{0, 0x18 << 56, 0x19 << 56, 0x1a << 56}
	shift := [4]uint8{56, 48, 40, 24}
	size := [4]uint8{1, 2, 3, 5}
	b = cborAppendHead(b, majorArray, uint64(len(tokens)))
	n := len(b)
	b = growBytes(b, 5*len(tokens)+3)
	for _, t := range tokens {
		c := 0
		if t >= 24 {
			c++
		}
		if t >= 256 {
			c++
		}
		if t >= 65536 {
			c++
		}
		c &= 3
		binary.BigEndian.PutUint64(b[n:n+8], head[c]|uint64(t)<<shift[c])
		n += int(size[c])
	}
	return b[:n]
}

func BenchmarkEncodeTokens(b *testing.B) {
	toks := benchTokens()
	buf := make([]byte, 0, 256)
	b.Run("branchfree", func(b *testing.B) {
		for b.Loop() {
			for off := 0; off < len(toks); off += benchBlockSize {
				buf = branchFreeEncode(buf[:0], toks[off:off+benchBlockSize])
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*benchBlocks), "ns/block")
	})
	b.Run("plain", func(b *testing.B) {
		for b.Loop() {
			for off := 0; off < len(toks); off += benchBlockSize {
				buf = cborAppendTokens(buf[:0], toks[off:off+benchBlockSize])
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*benchBlocks), "ns/block")
	})
}

func TestBranchFreeEncodeAgrees(t *testing.T) {
	toks := benchTokens()
	toks = append(toks, 0, 23, 24, 255, 256, 65535, 65536, 1<<32-1)
	if !bytes.Equal(branchFreeEncode(nil, toks), cborAppendTokens(nil, toks)) {
		t.Fatal("encoders disagree")
	}
}
