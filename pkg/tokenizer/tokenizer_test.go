package tokenizer

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestMinimalTokenizer(t *testing.T) {
	tk, err := LoadJSON(minimalTokenizerJSON, []byte(`{"bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := tk.Encode("ab ab", false); !equalIDs(got, []uint32{2, 4}) {
		t.Fatalf("encode: %v", got)
	}
	if got := tk.Encode("<s>ab", true); !equalIDs(got, []uint32{5, 5, 2}) {
		t.Fatalf("encode with special: %v", got)
	}
	if got := tk.Decode([]uint32{5, 2, 4, 999}); got != "<s>ab ab" {
		t.Fatalf("decode: %q", got)
	}
	if got := tk.DecodeSkipSpecial([]uint32{5, 2}); got != "ab" {
		t.Fatalf("decode skip special: %q", got)
	}
	if id, ok := tk.TokenID("<s>"); !ok || id != 5 || !tk.IsSpecial(5) || tk.IsSpecial(2) {
		t.Fatal("token lookups")
	}
	if c := tk.Config(); c.BOSToken != "<s>" || !tk.HasChatTemplate() {
		t.Fatalf("config %+v", c)
	}
	if a := tk.AddedTokens(); len(a) != 1 || a[0].Content != "<s>" {
		t.Fatalf("added tokens %+v", a)
	}
	out, err := tk.RenderChat([]Message{{Role: "user", Content: "ab"}}, ChatOptions{})
	if err != nil || out != "<s>ab" {
		t.Fatalf("render %q %v", out, err)
	}
	// split_special_tokens: special text is encoded as plain text.
	split, err := LoadJSON(minimalTokenizerJSON, []byte(`{"split_special_tokens": true}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := split.Encode("<s>", false); len(got) != 0 {
		// "<", "s", ">" are not in the tiny vocab: no ids, and crucially not id 5.
		t.Fatalf("split_special_tokens: %v", got)
	}
}

// TestAddedTokenFlags checks lstrip, rstrip, single_word, normalized and
// HuggingFace's added-token id assignment against the Rust tokenizer, on a
// synthetic tokenizer (testdata/added_flags.json, written by gen.mjs).
func TestAddedTokenFlags(t *testing.T) {
	var g struct {
		Tokenizer json.RawMessage `json:"tokenizer"`
		Cases     []struct {
			Text string   `json:"text"`
			IDs  []uint32 `json:"ids"`
		} `json:"cases"`
	}
	readGolden(t, "added_flags.json", &g)
	tk, err := LoadJSON(g.Tokenizer, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(g.Cases) < 10 {
		t.Fatalf("only %d cases", len(g.Cases))
	}
	for _, c := range g.Cases {
		if got := tk.Encode(c.Text, false); !equalIDs(got, c.IDs) {
			t.Errorf("%q: got %v want %v", c.Text, got, c.IDs)
		}
	}
}

func TestLoadErrors(t *testing.T) {
	for name, js := range map[string]string{
		"not json":        `{`,
		"no model":        `{}`,
		"unigram":         `{"model": {"type": "Unigram", "vocab": []}}`,
		"no vocab":        `{"model": {"type": "BPE"}}`,
		"merge oov":       `{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}}`,
		"bad merge":       `{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a"]}}`,
		"dropout":         `{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [], "dropout": 0.1}}`,
		"subword prefix":  `{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [], "continuing_subword_prefix": "##"}}`,
		"unk missing":     `{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [], "unk_token": "<unk>"}}`,
		"bad normalizer":  `{"normalizer": {"type": "Precompiled"}, "model": {"type": "BPE", "vocab": {}, "merges": []}}`,
		"bad pre":         `{"pre_tokenizer": {"type": "Whitespace"}, "model": {"type": "BPE", "vocab": {}, "merges": []}}`,
		"bad regex":       `{"pre_tokenizer": {"type": "Split", "pattern": {"Regex": "("}, "behavior": "Isolated"}, "model": {"type": "BPE", "vocab": {}, "merges": []}}`,
		"bad behavior":    `{"pre_tokenizer": {"type": "Split", "pattern": {"String": "x"}, "behavior": "Sideways"}, "model": {"type": "BPE", "vocab": {}, "merges": []}}`,
		"bad post":        `{"post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<x>"}}], "special_tokens": {}}, "model": {"type": "BPE", "vocab": {}, "merges": []}}`,
		"empty added":     `{"added_tokens": [{"id": 1, "content": ""}], "model": {"type": "BPE", "vocab": {}, "merges": []}}`,
		"deep normalizer": `{"normalizer": ` + strings.Repeat(`{"type": "Sequence", "normalizers": [`, 20) + `{"type": "NFC"}` + strings.Repeat(`]}`, 20) + `, "model": {"type": "BPE", "vocab": {}, "merges": []}}`,
	} {
		if _, err := LoadJSON([]byte(js), nil); err == nil {
			t.Errorf("%s: loaded without error", name)
		}
	}
	if _, err := LoadJSON(minimalTokenizerJSON, []byte(`{"chat_template": "{% for %}"}`)); err == nil {
		t.Error("broken chat template accepted")
	}
	if _, err := LoadJSON(minimalTokenizerJSON, []byte(`[]`)); err == nil {
		t.Error("non-object config accepted")
	}
	if _, err := Load(t.TempDir()); err == nil {
		t.Error("empty dir loaded")
	}
}

func TestSplitBehaviors(t *testing.T) {
	m := literalMatcher{lit: "-"}
	for b, want := range map[splitBehavior][]string{
		behaviorIsolated:           {"a", "-", "b", "-", "-", "c"},
		behaviorRemoved:            {"a", "b", "c"},
		behaviorMergedWithPrevious: {"a-", "b-", "-", "c"},
		behaviorMergedWithNext:     {"a", "-b", "-", "-c"},
		behaviorContiguous:         {"a", "-", "b", "--", "c"},
	} {
		got := newSplitPre(m, b, false).split(nil, "a-b--c")
		if strings.Join(got, "|") != strings.Join(want, "|") {
			t.Errorf("behavior %d: got %q want %q", b, got, want)
		}
	}
	if got := newSplitPre(m, behaviorRemoved, true).split(nil, "a-b--c"); strings.Join(got, "|") != "-|-|-" {
		t.Errorf("inverted removed: %q", got)
	}
}

func TestLossyUTF8(t *testing.T) {
	for in, want := range map[string]string{
		"ok":               "ok",
		"\xe2\x82":         "\ufffd",       // truncated 3-byte sequence: one replacement
		"\xff\xfe":         "\ufffd\ufffd", // two invalid bytes
		"a\xf0\x9f\x98":    "a\ufffd",
		"\xed\xa0\x80":     "\ufffd\ufffd\ufffd", // surrogate encoding: each byte invalid
		"\xc3\xa9\xc3":     "é\ufffd",
		"\xf4\x90\x80\x80": "\ufffd\ufffd\ufffd\ufffd",
	} {
		if got := string(appendLossyUTF8(nil, []byte(in))); got != want {
			t.Errorf("%q: got %q want %q", in, got, want)
		}
	}
}
