package blockhash

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/fxamacker/cbor/v2"
)

var allAlgos = []Algo{SHA256CBOR, XXHashCBOR, SHA256SGLang, BlockHashTRTLLM, TRTLLMV1BlockKey}

func mustNew(t testing.TB, cfg Config) *Hasher {
	t.Helper()
	h, err := New(cfg)
	if err != nil {
		t.Fatalf("New(%+v): %v", cfg, err)
	}
	return h
}

func randTokens(r *rand.Rand, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		switch r.IntN(4) {
		case 0:
			out[i] = r.Uint32() // exercise the 5-byte CBOR form
		default:
			out[i] = uint32(r.IntN(152000))
		}
	}
	return out
}

func TestParseAlgo(t *testing.T) {
	for _, a := range Algos() {
		got, err := ParseAlgo(string(a))
		if err != nil || got != a {
			t.Errorf("ParseAlgo(%q) = %q, %v", a, got, err)
		}
	}
	for _, bad := range []string{"", "SHA256_CBOR", "sha256", "xxhash", string(TRTLLMV1BlockKey)} {
		if _, err := ParseAlgo(bad); !errors.Is(err, ErrUnknownAlgo) {
			t.Errorf("ParseAlgo(%q) err = %v, want ErrUnknownAlgo", bad, err)
		}
	}
}

// TestEveryRuleAlgoHashes checks that every algorithm pkg/engine lets a rule
// name has a hasher here, so the two cannot drift apart.
func TestEveryRuleAlgoHashes(t *testing.T) {
	if len(Algos()) == 0 {
		t.Fatal("no rule algorithms")
	}
	for _, a := range Algos() {
		h, err := New(Config{Algo: a, BlockSize: 4, Seed: "0"})
		if err != nil {
			t.Errorf("New(%q): %v", a, err)
			continue
		}
		if keys := h.Keys(nil, []uint32{1, 2, 3, 4}); len(keys) != 1 {
			t.Errorf("%s: %d keys for one full block, want 1", a, len(keys))
		}
	}
}

func TestNewValidation(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		want error
	}{
		{"unknown algo", Config{Algo: "md5", BlockSize: 16}, ErrUnknownAlgo},
		{"zero block", Config{Algo: SHA256CBOR, BlockSize: 0}, ErrBadBlockSize},
		{"negative block", Config{Algo: SHA256SGLang, BlockSize: -1}, ErrBadBlockSize},
		{"huge block", Config{Algo: SHA256SGLang, BlockSize: MaxBlockSize + 1}, ErrBadBlockSize},
		{"xxhash without seed", Config{Algo: XXHashCBOR, BlockSize: 16}, ErrSeedRequired},
		{"bad utf8 seed", Config{Algo: SHA256CBOR, BlockSize: 16, Seed: "\xff"}, ErrBadSeed},
		{"sha256 default seed", Config{Algo: SHA256CBOR, BlockSize: 16}, nil},
		{"sglang ignores seed", Config{Algo: SHA256SGLang, BlockSize: 1, Seed: "\xff"}, nil},
		{"max block", Config{Algo: BlockHashTRTLLM, BlockSize: MaxBlockSize}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := New(tt.cfg)
			if !errors.Is(err, tt.want) || (tt.want == nil && err != nil) {
				t.Fatalf("err = %v, want %v", err, tt.want)
			}
		})
	}
}

func TestDefaultSeedMatchesExplicit(t *testing.T) {
	a := mustNew(t, Config{Algo: SHA256CBOR, BlockSize: 16})
	b := mustNew(t, Config{Algo: SHA256CBOR, BlockSize: 16, Seed: DefaultVLLMSeed})
	if a.Root() != b.Root() || a.Seed() != DefaultVLLMSeed {
		t.Fatalf("default seed root %s != explicit %s", a.Root(), b.Root())
	}
}

func TestLongSeed(t *testing.T) {
	// Longer than 23 bytes needs a two-byte CBOR text head; vLLM has no
	// such limit, so neither do we.
	seed := "this-seed-is-longer-than-twenty-three-bytes"
	h := mustNew(t, Config{Algo: SHA256CBOR, BlockSize: 4, Seed: seed})
	in := append([]byte{0x78, byte(len(seed))}, seed...)
	if want := sha256.Sum256(in); !bytes.Equal(h.Root().Bytes(), want[:]) {
		t.Fatalf("root = %s", h.Root())
	}
}

func TestFormatKey(t *testing.T) {
	k := uint64(16086683699531821019)
	if got := FormatKey(SHA256SGLang, k); got != "-2360060374177730597" {
		t.Errorf("sglang = %s", got)
	}
	if got := FormatKey(BlockHashTRTLLM, k); got != "16086683699531821019" {
		t.Errorf("trtllm = %s", got)
	}
	if got := FormatKey(SHA256CBOR, k); got != "16086683699531821019" {
		t.Errorf("vllm = %s", got)
	}
}

func TestDigestFromBytes(t *testing.T) {
	if _, err := DigestFromBytes(make([]byte, 33)); !errors.Is(err, ErrBadDigest) {
		t.Fatalf("33 bytes: err = %v", err)
	}
	d, err := DigestFromBytes(nil)
	if err != nil || !d.IsZero() || d.Len() != 0 {
		t.Fatalf("empty digest = %v, %v", d, err)
	}
	// Short digests must not panic KeyOf, whatever the algorithm.
	short, _ := DigestFromBytes([]byte{1, 2, 3})
	for _, a := range allAlgos {
		h := mustNew(t, Config{Algo: a, BlockSize: 4, Seed: "0"})
		_ = h.KeyOf(short)
		_, _ = h.Next(short, []uint32{1, 2})
	}
}

func TestNextExtraRejectsNonVLLM(t *testing.T) {
	for _, a := range []Algo{SHA256SGLang, BlockHashTRTLLM, TRTLLMV1BlockKey} {
		h := mustNew(t, Config{Algo: a, BlockSize: 2})
		if _, _, err := h.NextExtra(Digest{}, []uint32{1, 2}, []ExtraKey{StringKey("x")}); !errors.Is(err, ErrExtraKeysUnsupported) {
			t.Errorf("%s: err = %v", a, err)
		}
		if _, _, err := h.NextExtra(Digest{}, []uint32{1, 2}, nil); err != nil {
			t.Errorf("%s: nil extra: %v", a, err)
		}
	}
	h := mustNew(t, Config{Algo: SHA256CBOR, BlockSize: 2})
	if _, _, err := h.NextExtra(Digest{}, []uint32{1, 2}, []ExtraKey{{Kind: 99}}); err == nil {
		t.Error("unknown extra kind accepted")
	}
}

// TestCBORCrossCheck compares the hand-written encoder with fxamacker/cbor
// in canonical mode on random blocks, parents and extra keys.
func TestCBORCrossCheck(t *testing.T) {
	em, err := cbor.CanonicalEncOptions().EncMode()
	if err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 500; i++ {
		parent := make([]byte, []int{0, 16, 32, 5}[i%4])
		for j := range parent {
			parent[j] = byte(r.Uint32())
		}
		toks := randTokens(r, r.IntN(300))
		var extra []ExtraKey
		var extraAny any
		if i%3 == 1 {
			lst := []any{}
			for j := 0; j < 1+r.IntN(3); j++ {
				switch r.IntN(3) {
				case 0:
					s := string(rune('a' + r.IntN(26)))
					extra = append(extra, StringKey(s))
					lst = append(lst, s)
				case 1:
					off := int64(r.IntN(1000)) - 500
					extra = append(extra, MMKey("img", off))
					lst = append(lst, []any{"img", off})
				case 2:
					b := []byte{1, 2, 3}
					extra = append(extra, BytesKey(b))
					lst = append(lst, b)
				}
			}
			extraAny = lst
		}
		mine, err := appendExtraCBOR(appendBlockCBOR(nil, parent, toks), extra)
		if err != nil {
			t.Fatal(err)
		}
		lib, err := em.Marshal([]any{parent, toks, extraAny})
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(mine, lib) {
			t.Fatalf("case %d:\n mine %x\n  lib %x", i, mine, lib)
		}
	}
}

// TestKeysEqualsNext checks the batched path against the primitive for
// every algorithm and a range of block sizes, including trailing partials.
func TestKeysEqualsNext(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for _, a := range allAlgos {
		for _, bs := range []int{1, 2, 15, 16, 32, 64, 257} {
			h := mustNew(t, Config{Algo: a, BlockSize: bs, Seed: "42"})
			toks := randTokens(r, bs*5+r.IntN(bs))
			if err := checkKeysEqualsNext(h, toks); err != nil {
				t.Fatalf("%s/bs=%d: %v", a, bs, err)
			}
		}
	}
}

func checkKeysEqualsNext(h *Hasher, toks []uint32) error {
	prefix := []uint64{7, 8}
	got := h.Keys(slices.Clone(prefix), toks)
	var want []uint64
	want = append(want, prefix...)
	parent := h.Root()
	for off := 0; off+h.BlockSize() <= len(toks); off += h.BlockSize() {
		d, k := h.Next(parent, toks[off:off+h.BlockSize()])
		if h.KeyOf(d) != k {
			return errors.New("KeyOf(digest) != key")
		}
		want = append(want, k)
		parent = d
	}
	if !slices.Equal(got, want) {
		return errors.New("Keys != repeated Next")
	}
	return nil
}

func TestTRTLLMGatewayKeyIsSGLangMath(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	toks := randTokens(r, 32*8)
	a := mustNew(t, Config{Algo: SHA256SGLang, BlockSize: 32})
	b := mustNew(t, Config{Algo: BlockHashTRTLLM, BlockSize: 32})
	if !slices.Equal(a.Keys(nil, toks), b.Keys(nil, toks)) {
		t.Fatal("blockhash_trtllm keys differ from sha256_sglang")
	}
}

func TestKeysZeroAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector drops sync.Pool items at random; `make test-allocs` checks allocations without it")
	}
	r := rand.New(rand.NewPCG(7, 8))
	toks := randTokens(r, 256*16)
	for _, a := range allAlgos {
		h := mustNew(t, Config{Algo: a, BlockSize: 16, Seed: "0"})
		dst := make([]uint64, 0, 256)
		h.Keys(dst, toks) // warm the pool
		allocs := testing.AllocsPerRun(20, func() {
			dst = h.Keys(dst[:0], toks)
		})
		if allocs != 0 {
			t.Errorf("%s: %.1f allocs per Keys call of 256 blocks", a, allocs)
		}
		parent := h.Root()
		allocs = testing.AllocsPerRun(20, func() {
			parent, _ = h.Next(parent, toks[:16])
		})
		if allocs != 0 {
			t.Errorf("%s: %.1f allocs per Next", a, allocs)
		}
	}
}

func TestConcurrentKeys(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	toks := randTokens(r, 64*16)
	for _, a := range allAlgos {
		h := mustNew(t, Config{Algo: a, BlockSize: 16, Seed: "0"})
		want := h.Keys(nil, toks)
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		for g := 0; g < 8; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var dst []uint64
				for i := 0; i < 50; i++ {
					dst = h.Keys(dst[:0], toks)
					if !slices.Equal(dst, want) {
						errs <- errors.New("concurrent Keys diverged")
						return
					}
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatalf("%s: %v", a, err)
		}
	}
}

func FuzzKeys(f *testing.F) {
	f.Add(uint8(0), uint8(16), []byte{1, 2, 3, 4, 5, 6, 7, 8})
	f.Add(uint8(1), uint8(1), []byte{0xff, 0xff, 0xff, 0xff})
	f.Add(uint8(2), uint8(3), []byte{})
	f.Add(uint8(4), uint8(32), bytes.Repeat([]byte{0x18}, 200))
	f.Fuzz(func(t *testing.T, algo, bs uint8, data []byte) {
		a := allAlgos[int(algo)%len(allAlgos)]
		h, err := New(Config{Algo: a, BlockSize: int(bs), Seed: "0"})
		if err != nil {
			if bs != 0 {
				t.Fatalf("New: %v", err)
			}
			return
		}
		toks := make([]uint32, len(data)/2)
		for i := range toks {
			// Spread two bytes over the CBOR size classes.
			v := uint32(data[2*i])<<8 | uint32(data[2*i+1])
			toks[i] = v << (8 * (v % 3))
		}
		if err := checkKeysEqualsNext(h, toks); err != nil {
			t.Fatal(err)
		}
	})
}
