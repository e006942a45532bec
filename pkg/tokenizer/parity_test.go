package tokenizer

import (
	"compress/gzip"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// The golden files in testdata/ are written by testbed/parity/gen.mjs from
// HuggingFace's Rust tokenizer (npm tokenizers) and @huggingface/jinja; see
// testdata/manifest.json for the pinned versions and file hashes.

const stagedDir = "../../testdata/tokenizers"

var parityModels = []struct{ name, slug string }{
	{"qwen3", "Qwen__Qwen3-0.6B"},
	{"llama3_1", "meta-llama__Llama-3.1-8B-Instruct"},
}

// loaded caches tokenizers across tests: loading 10 MB of JSON per test
// would dominate the run time.
var (
	loadedMu sync.Mutex
	loaded   = map[string]*Tokenizer{}
)

func loadStaged(t testing.TB, slug string) *Tokenizer {
	t.Helper()
	loadedMu.Lock()
	defer loadedMu.Unlock()
	if tk, ok := loaded[slug]; ok {
		return tk
	}
	tk, err := Load(filepath.Join(stagedDir, slug))
	if err != nil {
		t.Fatalf("load %s: %v", slug, err)
	}
	loaded[slug] = tk
	return tk
}

func readGolden(t testing.TB, name string, v any) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatalf("read golden (regenerate with testbed/parity/regen.sh): %v", err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("parse %s: %v", name, err)
	}
}

func equalIDs(a, b []uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func firstDiff(a, b []uint32) int {
	for i := range a {
		if i >= len(b) || a[i] != b[i] {
			return i
		}
	}
	return len(a)
}

func TestParityWithRustTokenizer(t *testing.T) {
	var corpus []string
	readGolden(t, "corpus.json", &corpus)
	if len(corpus) < 3000 {
		t.Fatalf("corpus has %d strings, want >= 3000", len(corpus))
	}
	for _, m := range parityModels {
		t.Run(m.name, func(t *testing.T) {
			tk := loadStaged(t, m.slug)
			var want [][]uint32
			readGolden(t, "ids_"+m.name+".json", &want)
			if len(want) != len(corpus) {
				t.Fatalf("golden has %d entries, corpus %d", len(want), len(corpus))
			}
			bad := 0
			for i, s := range corpus {
				got := tk.Encode(s, false)
				if !equalIDs(got, want[i]) {
					bad++
					if bad <= 5 {
						d := firstDiff(got, want[i])
						t.Errorf("case %d %q: first diff at %d: got %v want %v", i, trunc(s), d, window(got, d), window(want[i], d))
					}
				}
			}
			if bad > 0 {
				t.Fatalf("%d/%d strings differ from the Rust tokenizer", bad, len(corpus))
			}
			t.Logf("%d/%d strings identical", len(corpus), len(corpus))
		})
	}
}

func TestParityAddSpecialTokensAndDecode(t *testing.T) {
	var corpus []string
	readGolden(t, "corpus.json", &corpus)
	for _, m := range parityModels {
		t.Run(m.name, func(t *testing.T) {
			tk := loadStaged(t, m.slug)
			var special [][]uint32
			var decoded []string
			readGolden(t, "ids_special_"+m.name+".json", &special)
			readGolden(t, "decode_"+m.name+".json", &decoded)
			for i := range special {
				if got := tk.Encode(corpus[i], true); !equalIDs(got, special[i]) {
					t.Errorf("case %d %q add_special_tokens: got %v want %v", i, trunc(corpus[i]), got, special[i])
				}
				if got := tk.Decode(tk.Encode(corpus[i], false)); got != decoded[i] {
					t.Errorf("case %d %q decode: got %q want %q", i, trunc(corpus[i]), got, decoded[i])
				}
			}
		})
	}
}

func trunc(s string) string {
	if len(s) > 60 {
		return s[:60] + "..."
	}
	return s
}

func window(ids []uint32, at int) []uint32 {
	lo, hi := max(0, at-3), min(len(ids), at+3)
	if lo > hi {
		return nil
	}
	return ids[lo:hi]
}

// TestParityRegexpPath runs the corpus through the general regexp2 path
// (the scanner switched off) so that path stays proven too: it is what any
// tokenizer with an unfamiliar Split pattern uses.
func TestParityRegexpPath(t *testing.T) {
	if testing.Short() {
		t.Skip("regexp2 path parity is slow; skipped with -short")
	}
	var corpus []string
	readGolden(t, "corpus.json", &corpus)
	for _, m := range parityModels {
		t.Run(m.name, func(t *testing.T) {
			tk, err := Load(filepath.Join(stagedDir, m.slug))
			if err != nil {
				t.Fatal(err)
			}
			split := tk.pre.(*preSequence).steps[0].(*splitPre)
			pattern := qwenPattern
			if m.name == "llama3_1" {
				pattern = llama3Pattern
			}
			if split.m, err = newRegexMatcher(pattern); err != nil {
				t.Fatal(err)
			}
			tk.scan = nil // the pieces come from the regex again
			var want [][]uint32
			readGolden(t, "ids_"+m.name+".json", &want)
			for i, s := range corpus {
				if got := tk.Encode(s, false); !equalIDs(got, want[i]) {
					t.Fatalf("case %d %q: regexp2 path differs from the Rust tokenizer", i, trunc(s))
				}
			}
		})
	}
}

// TestParityExtraTokenizers covers code paths the Qwen3/Llama-3.1 files do
// not: gpt-4o's Split (another regex, invert + Removed, run by regexp2) and
// Llama-2's SentencePiece-style BPE (Prepend/Replace normalizer,
// byte_fallback, fuse_unk, TemplateProcessing BOS, Metaspace-style decode).
func TestParityExtraTokenizers(t *testing.T) {
	var corpus []string
	readGolden(t, "corpus.json", &corpus)
	for _, name := range []string{"gpt4o", "llama2"} {
		t.Run(name, func(t *testing.T) {
			dir := filepath.Join("testdata", "extra", name)
			tj := readGz(t, filepath.Join(dir, "tokenizer.json.gz"))
			cj, err := os.ReadFile(filepath.Join(dir, "tokenizer_config.json"))
			if err != nil {
				t.Fatal(err)
			}
			tk, err := LoadJSON(tj, cj)
			if err != nil {
				t.Fatal(err)
			}
			var g struct {
				IDs     [][]uint32 `json:"ids"`
				Special [][]uint32 `json:"special"`
				Decoded []string   `json:"decoded"`
			}
			if err := json.Unmarshal(readGz(t, filepath.Join(dir, "golden.json.gz")), &g); err != nil {
				t.Fatal(err)
			}
			if len(g.IDs) != len(corpus) {
				t.Fatalf("golden has %d entries, corpus %d", len(g.IDs), len(corpus))
			}
			bad := 0
			for i, s := range corpus {
				got := tk.Encode(s, false)
				if !equalIDs(got, g.IDs[i]) {
					bad++
					if bad <= 5 {
						d := firstDiff(got, g.IDs[i])
						t.Errorf("case %d %q: first diff at %d: got %v want %v", i, trunc(s), d, window(got, d), window(g.IDs[i], d))
					}
				}
				if i < len(g.Special) {
					if got := tk.Encode(s, true); !equalIDs(got, g.Special[i]) {
						t.Errorf("case %d %q add_special_tokens: got %v want %v", i, trunc(s), got, g.Special[i])
					}
					if got := tk.Decode(g.IDs[i]); got != g.Decoded[i] {
						t.Errorf("case %d %q decode: got %q want %q", i, trunc(s), got, g.Decoded[i])
					}
				}
			}
			if bad > 0 {
				t.Fatalf("%d/%d strings differ from the Rust tokenizer", bad, len(corpus))
			}
		})
	}
}

func readGz(t testing.TB, path string) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatalf("read golden (regenerate with testbed/parity/regen.sh): %v", err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	b, err := io.ReadAll(zr)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return b
}
