package tokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestEncodeRequestBounds: a prompt past the byte bound is refused before
// any BPE work, one past the token bound stops encoding, and prompts
// within both get exactly the ids an unbounded encode gives.
func TestEncodeRequestBounds(t *testing.T) {
	tk := loadStaged(t, "Qwen__Qwen3-0.6B")
	body := func(v map[string]any) []byte { b, _ := json.Marshal(v); return b }
	words := strings.Repeat("lorem ipsum dolor ", 100) // 1,800 bytes
	chat := []map[string]string{{"role": "user", "content": words}}
	n := len(tk.Encode(words, true))
	rendered, err := tk.EncodeRequest(EngineVLLM, PathChatCompletions, body(map[string]any{"messages": chat}))
	if err != nil {
		t.Fatal(err)
	}
	nc := len(rendered.IDs)
	cases := []struct {
		name string
		path string
		body []byte
		opts RequestOptions
		want error
	}{
		{"prompt over bytes", PathCompletions, body(map[string]any{"prompt": words}), RequestOptions{MaxPromptBytes: 1000}, ErrPromptTooLong},
		{"prompt over tokens", PathCompletions, body(map[string]any{"prompt": words}), RequestOptions{MaxPromptTokens: n - 1}, ErrPromptTooLong},
		{"first of a batch over tokens", PathCompletions, body(map[string]any{"prompt": []string{words, "x"}}), RequestOptions{MaxPromptTokens: n - 1}, ErrPromptTooLong},
		{"token ids over tokens", PathCompletions, body(map[string]any{"prompt": make([]int, 101)}), RequestOptions{MaxPromptTokens: 100}, ErrPromptTooLong},
		{"token id batch over tokens", PathCompletions, body(map[string]any{"prompt": [][]int{make([]int, 101)}}), RequestOptions{MaxPromptTokens: 100}, ErrPromptTooLong},
		{"chat render over bytes", PathChatCompletions, body(map[string]any{"messages": chat}), RequestOptions{MaxPromptBytes: len(rendered.Rendered) - 1}, ErrPromptTooLong},
		{"chat over tokens", PathChatCompletions, body(map[string]any{"messages": chat}), RequestOptions{MaxPromptTokens: nc - 1}, ErrPromptTooLong},
		{"prompt within", PathCompletions, body(map[string]any{"prompt": words}), RequestOptions{MaxPromptBytes: 1800, MaxPromptTokens: n}, nil},
		{"chat within", PathChatCompletions, body(map[string]any{"messages": chat}), RequestOptions{MaxPromptBytes: len(rendered.Rendered), MaxPromptTokens: nc}, nil},
		{"token ids within", PathCompletions, body(map[string]any{"prompt": make([]int, 100)}), RequestOptions{MaxPromptTokens: 100}, nil},
	}
	for _, c := range cases {
		for _, engine := range []string{EngineVLLM, EngineSGLang} {
			got, err := tk.EncodeRequestWith(engine, c.path, c.body, c.opts)
			if !errors.Is(err, c.want) || (c.want == nil) != (err == nil) {
				t.Errorf("%s/%s: err %v, want %v", c.name, engine, err, c.want)
				continue
			}
			if err != nil {
				if errors.Is(err, ErrBadRequest) {
					t.Errorf("%s/%s: a long prompt is not a malformed one: %v", c.name, engine, err)
				}
				continue
			}
			free, err := tk.EncodeRequest(engine, c.path, c.body)
			if err != nil || !equalIDs(got.IDs, free.IDs) {
				t.Errorf("%s/%s: bounded ids differ from unbounded (%v)", c.name, engine, err)
			}
		}
	}
}

// TestEncodeLimitStopsEarly: the token bound stops BPE at the piece that
// crosses it, so a long prompt costs what its first tokens cost.
func TestEncodeLimitStopsEarly(t *testing.T) {
	tk := loadStaged(t, "meta-llama__Llama-3.1-8B-Instruct")
	text := strings.Repeat("the quick brown fox jumps over the lazy dog. ", 1<<15) // 1.4 MiB, ~330k tokens
	for _, special := range []bool{false, true} {
		ids, ok := tk.AppendEncodeLimit(nil, text, special, 100)
		if ok || len(ids) > 102 {
			t.Fatalf("special=%v: ok=%v after %d ids, want a stop right past 100", special, ok, len(ids))
		}
		short := text[:400]
		ids, ok = tk.AppendEncodeLimit(nil, short, special, len(tk.Encode(short, special)))
		if !ok || !equalIDs(ids, tk.Encode(short, special)) {
			t.Fatalf("special=%v: within the bound: ok=%v ids %v", special, ok, ids)
		}
	}
	// The post-processor's BOS counts too.
	if _, ok := tk.AppendEncodeLimit(nil, "the quick", true, 2); ok {
		t.Fatal("BOS + 2 tokens passed a 2-token bound")
	}
}

// TestEncodeSpacesBounded: a long run of one character is a single
// pre-tokenized piece, so its BPE cost grows with the run; a run the size
// of the default byte bound (1 MiB) must stay well under a second, and its
// working set must not be pinned in the scratch pools afterwards.
func TestEncodeSpacesBounded(t *testing.T) {
	tk := loadStaged(t, "Qwen__Qwen3-0.6B")
	s := strings.Repeat(" ", 1<<20)
	start := time.Now()
	ids := tk.Encode(s, false)
	el := time.Since(start)
	if len(ids) == 0 {
		t.Fatal("no ids")
	}
	t.Logf("1 MiB of spaces: %d ids in %v", len(ids), el)
	sc := tk.model.scratchBuf.Get().(*bpeScratch)
	if cap(sc.syms) > maxPooledScratch || cap(sc.heap) > maxPooledScratch {
		t.Fatalf("pooled BPE scratch kept %d symbols and %d heap entries after a 1 MiB word", cap(sc.syms), cap(sc.heap))
	}
	es := tk.pool.Get().(*encodeScratch)
	if cap(es.pieces) > maxPooledScratch {
		t.Fatalf("pooled encode scratch kept %d pieces", cap(es.pieces))
	}
}

func TestMaxLength(t *testing.T) {
	if got := loadStaged(t, "Qwen__Qwen3-0.6B").MaxLength(); got != 131072 {
		t.Errorf("Qwen3 model_max_length: %d, want 131072", got)
	}
	if got := loadStaged(t, "meta-llama__Llama-3.1-8B-Instruct").MaxLength(); got != 0 {
		t.Errorf("Llama-3.1 writes the 1e30 'no limit' sentinel: %d, want 0", got)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), minimalTokenizerJSON, 0o644); err != nil {
		t.Fatal(err)
	}
	for cfg, want := range map[string]int{
		`{"max_position_embeddings": 40960}`:                           40960,
		`{"text_config": {"max_position_embeddings": 8192}}`:           8192,
		`{"max_position_embeddings": 1000000000000000019884624838656}`: 0,
		`{"architectures": ["X"]}`:                                     0,
	} {
		if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(cfg), 0o644); err != nil {
			t.Fatal(err)
		}
		tk, err := Load(dir)
		if err != nil {
			t.Fatal(err)
		}
		if got := tk.MaxLength(); got != want {
			t.Errorf("%s: MaxLength %d, want %d", cfg, got, want)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(`{`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(dir); err == nil || !strings.Contains(err.Error(), "config.json") {
		t.Errorf("a broken config.json must fail the load naming it: %v", err)
	}
}

// FuzzEncodeRequestBounded: with small bounds, arbitrary bodies give an
// error or ids within the bounds that equal the unbounded encode.
func FuzzEncodeRequestBounded(f *testing.F) {
	for _, b := range []string{
		`{"prompt":"hello hello hello hello"}`, `{"prompt":"` + strings.Repeat(" ", 200) + `"}`, `{"prompt":[1,2,3,4,5,6,7,8,9,10,11,12]}`,
		`{"prompt":[[1,2,3],[4]]}`, `{"prompt":["aaaaaaaaaaaaaaaaaaaaaaaaaa","b"]}`,
		`{"messages":[{"role":"user","content":"` + strings.Repeat("ab ", 60) + `"}]}`,
	} {
		f.Add([]byte(b), uint8(40), uint8(8), false)
		f.Add([]byte(b), uint8(0), uint8(3), true)
	}
	tk := loadStaged(f, "Qwen__Qwen3-0.6B")
	f.Fuzz(func(t *testing.T, body []byte, maxBytes, maxTokens uint8, chat bool) {
		if len(body) > 4096 {
			return
		}
		path := PathCompletions
		if chat {
			path = PathChatCompletions
		}
		opts := RequestOptions{MaxPromptBytes: int(maxBytes), MaxPromptTokens: int(maxTokens)}
		got, err := tk.EncodeRequestWith(EngineVLLM, path, body, opts)
		if err != nil {
			return
		}
		if opts.MaxPromptTokens > 0 && len(got.IDs) > opts.MaxPromptTokens {
			t.Fatalf("%d ids past a %d-token bound", len(got.IDs), opts.MaxPromptTokens)
		}
		if opts.MaxPromptBytes > 0 && len(got.Rendered) > opts.MaxPromptBytes {
			t.Fatalf("rendered %d bytes past a %d-byte bound", len(got.Rendered), opts.MaxPromptBytes)
		}
		free, err := tk.EncodeRequest(EngineVLLM, path, body)
		if err != nil || !equalIDs(free.IDs, got.IDs) {
			t.Fatalf("bounded %v, unbounded %v (%v)", got.IDs, free.IDs, fmt.Sprint(err))
		}
	})
}
