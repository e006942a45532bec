package blockhash

import (
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

const vectorDir = "../../testdata/vectors"

func loadJSON(t testing.TB, name string, v any) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(vectorDir, name))
	if err != nil {
		t.Fatalf("read vectors: %v", err)
	}
	if err := json.Unmarshal(raw, v); err != nil {
		t.Fatalf("decode %s: %v", name, err)
	}
}

type vllmVectors struct {
	Cases []struct {
		Name            string   `json:"name"`
		Algo            string   `json:"algo"`
		Seed            string   `json:"seed"`
		NoneHashCBORHex string   `json:"none_hash_cbor_hex"`
		NoneHashHex     string   `json:"none_hash_hex"`
		BlockSize       int      `json:"block_size"`
		NumFullBlocks   int      `json:"num_full_blocks"`
		Tokens          []uint32 `json:"tokens"`
		Blocks          []struct {
			Index           int               `json:"index"`
			TokenIDs        []uint32          `json:"token_ids"`
			ExtraKeys       []json.RawMessage `json:"extra_keys"`
			ParentDigestHex string            `json:"parent_digest_hex"`
			CBORHex         string            `json:"cbor_hex"`
			DigestHex       string            `json:"digest_hex"`
			U64             uint64            `json:"u64"`
			ParentU64       *uint64           `json:"parent_u64"`
		} `json:"blocks"`
	} `json:"cases"`
}

// decodeExtra maps the JSON form of one extra_keys tuple (strings and
// [identifier, offset] pairs) to ExtraKeys.
func decodeExtra(t *testing.T, raw []json.RawMessage) []ExtraKey {
	t.Helper()
	var out []ExtraKey
	for _, r := range raw {
		var s string
		if err := json.Unmarshal(r, &s); err == nil {
			out = append(out, StringKey(s))
			continue
		}
		var pair []json.RawMessage
		if err := json.Unmarshal(r, &pair); err != nil || len(pair) != 2 {
			t.Fatalf("unsupported extra key %s", r)
		}
		var id string
		var off int64
		if err := json.Unmarshal(pair[0], &id); err != nil {
			t.Fatalf("extra key id %s: %v", pair[0], err)
		}
		if err := json.Unmarshal(pair[1], &off); err != nil {
			t.Fatalf("extra key offset %s: %v", pair[1], err)
		}
		out = append(out, MMKey(id, off))
	}
	return out
}

func TestVLLMVectors(t *testing.T) {
	var v vllmVectors
	loadJSON(t, "vllm_hash_vectors.json", &v)
	if len(v.Cases) == 0 {
		t.Fatal("no vLLM cases")
	}
	blocks := 0
	for _, c := range v.Cases {
		t.Run(c.Name, func(t *testing.T) {
			algo, err := ParseAlgo(c.Algo)
			if err != nil {
				t.Fatal(err)
			}
			h, err := New(Config{Algo: algo, BlockSize: c.BlockSize, Seed: c.Seed})
			if err != nil {
				t.Fatal(err)
			}
			if got := hex.EncodeToString(cborAppendText(nil, c.Seed)); got != c.NoneHashCBORHex {
				t.Errorf("NONE_HASH input = %s, want %s", got, c.NoneHashCBORHex)
			}
			if got := h.Root().String(); got != c.NoneHashHex {
				t.Fatalf("Root = %s, want %s", got, c.NoneHashHex)
			}
			if len(c.Blocks) != c.NumFullBlocks {
				t.Fatalf("vector has %d blocks, says %d", len(c.Blocks), c.NumFullBlocks)
			}
			hasExtra := false
			var want []uint64
			parent := Digest{} // zero parent must mean NONE_HASH
			for i, b := range c.Blocks {
				extra := decodeExtra(t, b.ExtraKeys)
				hasExtra = hasExtra || len(extra) > 0
				p := parent
				if p.IsZero() {
					p = h.Root()
				}
				if got := p.String(); got != b.ParentDigestHex {
					t.Fatalf("block %d parent = %s, want %s", i, got, b.ParentDigestHex)
				}
				enc, err := appendExtraCBOR(appendBlockCBOR(nil, p.b[:p.n], b.TokenIDs), extra)
				if err != nil {
					t.Fatal(err)
				}
				if got := hex.EncodeToString(enc); got != b.CBORHex {
					t.Fatalf("block %d CBOR\n got %s\nwant %s", i, got, b.CBORHex)
				}
				d, k, err := h.NextExtra(parent, b.TokenIDs, extra)
				if err != nil {
					t.Fatal(err)
				}
				if d.String() != b.DigestHex || k != b.U64 {
					t.Fatalf("block %d = %s/%d, want %s/%d", i, d, k, b.DigestHex, b.U64)
				}
				if b.ParentU64 != nil && h.KeyOf(parent) != *b.ParentU64 {
					t.Fatalf("block %d parent key = %d, want %d", i, h.KeyOf(parent), *b.ParentU64)
				}
				if len(extra) == 0 {
					d2, k2 := h.Next(parent, b.TokenIDs)
					if d2 != d || k2 != k {
						t.Fatalf("block %d Next disagrees with NextExtra", i)
					}
				}
				raw, _ := hex.DecodeString(b.DigestHex)
				fromRaw, err := DigestFromBytes(raw)
				if err != nil || fromRaw != d || h.KeyOf(fromRaw) != b.U64 {
					t.Fatalf("block %d DigestFromBytes round trip failed: %v", i, err)
				}
				want = append(want, b.U64)
				parent = d
				blocks++
			}
			if !hasExtra {
				got := h.Keys(nil, c.Tokens)
				if !slices.Equal(got, want) && !(len(got) == 0 && len(want) == 0) {
					t.Fatalf("Keys = %v, want %v", got, want)
				}
			}
		})
	}
	t.Logf("%d vLLM cases, %d blocks", len(v.Cases), blocks)
}

type sglangVectors struct {
	Cases []struct {
		Name     string   `json:"name"`
		PageSize int      `json:"page_size"`
		Tokens   []uint32 `json:"tokens"`
		Pages    []struct {
			PageIndex int      `json:"page_index"`
			TokenIDs  []uint32 `json:"token_ids"`
			Partial   bool     `json:"partial"`
			PriorHex  *string  `json:"prior_hex"`
			DigestHex string   `json:"digest_hex"`
			Int64     int64    `json:"int64"`
			Uint64    uint64   `json:"uint64"`
		} `json:"pages"`
	} `json:"cases"`
}

func TestSGLangVectors(t *testing.T) {
	var v sglangVectors
	loadJSON(t, "sglang_hash_vectors.json", &v)
	if len(v.Cases) == 0 {
		t.Fatal("no SGLang cases")
	}
	// blockhash_trtllm is the same arithmetic; run every case under both.
	for _, algo := range []Algo{SHA256SGLang, BlockHashTRTLLM} {
		for _, c := range v.Cases {
			t.Run(string(algo)+"/"+c.Name, func(t *testing.T) {
				h, err := New(Config{Algo: algo, BlockSize: c.PageSize})
				if err != nil {
					t.Fatal(err)
				}
				if !h.Root().IsZero() {
					t.Fatalf("root = %s, want no parent", h.Root())
				}
				var parent Digest
				var want []uint64
				var covered []uint32
				for i, p := range c.Pages {
					if (p.PriorHex == nil) != parent.IsZero() || (p.PriorHex != nil && *p.PriorHex != parent.String()) {
						t.Fatalf("page %d prior mismatch", i)
					}
					d, k := h.Next(parent, p.TokenIDs)
					if d.String() != p.DigestHex || k != p.Uint64 || SignedKey(k) != p.Int64 || KeyFromSigned(p.Int64) != k {
						t.Fatalf("page %d = %s/%d, want %s/%d/%d", i, d, k, p.DigestHex, p.Uint64, p.Int64)
					}
					if algo == SHA256SGLang && FormatKey(algo, k) != json.Number(itoa(p.Int64)).String() {
						t.Fatalf("page %d FormatKey = %s, want %d", i, FormatKey(algo, k), p.Int64)
					}
					if !p.Partial {
						want = append(want, k)
						covered = append(covered, p.TokenIDs...)
					}
					parent = d
				}
				got := h.Keys(nil, covered)
				if !slices.Equal(got, want) {
					t.Fatalf("Keys = %v, want %v", got, want)
				}
			})
		}
	}
}

func itoa(v int64) string {
	b, _ := json.Marshal(v)
	return string(b)
}

type trtVectors struct {
	Cases []struct {
		Name           string   `json:"name"`
		TokensPerBlock int      `json:"tokens_per_block"`
		Tokens         []uint32 `json:"tokens"`
		Blocks         []struct {
			Index      int      `json:"index"`
			TokenIDs   []uint32 `json:"token_ids"`
			ParentHash uint64   `json:"parent_hash"`
			BlockHash  uint64   `json:"block_hash"`
		} `json:"blocks"`
	} `json:"cases"`
}

func TestTRTLLMV1Vectors(t *testing.T) {
	var v trtVectors
	loadJSON(t, "trtllm_v1_block_key_vectors.json", &v)
	if len(v.Cases) == 0 {
		t.Fatal("no TRT-LLM cases")
	}
	for _, c := range v.Cases {
		t.Run(c.Name, func(t *testing.T) {
			h, err := New(Config{Algo: TRTLLMV1BlockKey, BlockSize: c.TokensPerBlock})
			if err != nil {
				t.Fatal(err)
			}
			var parent Digest
			var want []uint64
			for i, b := range c.Blocks {
				if h.KeyOf(parent) != b.ParentHash && !(parent.IsZero() && b.ParentHash == 0) {
					t.Fatalf("block %d parent = %d, want %d", i, h.KeyOf(parent), b.ParentHash)
				}
				d, k := h.Next(parent, b.TokenIDs)
				if k != b.BlockHash {
					t.Fatalf("block %d = %d, want %d", i, k, b.BlockHash)
				}
				want = append(want, k)
				parent = d
			}
			got := h.Keys(nil, c.Tokens)
			if !slices.Equal(got, want) && !(len(got) == 0 && len(want) == 0) {
				t.Fatalf("Keys = %v, want %v", got, want)
			}
		})
	}
}
