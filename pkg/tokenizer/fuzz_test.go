package tokenizer

import (
	"testing"
	"unicode/utf8"
)

// FuzzLoad: malformed tokenizer.json / tokenizer_config.json must produce
// an error, never a panic; whatever loads must encode and decode safely.
func FuzzLoad(f *testing.F) {
	f.Add(minimalTokenizerJSON, []byte(nil))
	f.Add(minimalTokenizerJSON, []byte(`{"chat_template": "{{ messages[0].content }}", "bos_token": {"content": "<s>"}}`))
	f.Add([]byte(`{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [["a", "a"]]}}`), []byte(`{"chat_template": [{"name": "default", "template": "x"}]}`))
	f.Add([]byte(`{"normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
	  "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "MergedWithNext", "invert": true},
	  "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Metaspace", "replacement": "▁"}]},
	  "model": {"type": "BPE", "vocab": {"<0x41>": 0, "▁": 1, "b": 2, "<unk>": 3}, "merges": [], "byte_fallback": true, "unk_token": "<unk>", "fuse_unk": true}}`), []byte(nil))
	f.Add([]byte(`{"model": null}`), []byte(`{"chat_template": "{% for"}`))
	f.Add([]byte(`{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a"]}}`), []byte(nil))
	f.Add([]byte(`{"added_tokens": [{"id": 1, "content": "x", "lstrip": true, "rstrip": true, "single_word": true, "normalized": true}], "normalizer": {"type": "Lowercase"},
	  "pre_tokenizer": {"type": "Split", "pattern": {"String": "x"}, "behavior": "Contiguous"},
	  "post_processor": {"type": "Sequence", "processors": [{"type": "RobertaProcessing", "cls": ["x", 1], "sep": ["x", 1]}]},
	  "model": {"type": "BPE", "vocab": {"a": 0, "x": 1}, "merges": []}}`), []byte(nil))
	f.Fuzz(func(t *testing.T, tj, cj []byte) {
		tk, err := LoadJSON(tj, cj)
		if err != nil {
			return
		}
		for _, s := range []string{"", "ab ab", "x a x\u3000xx", "<s>a\n\nb", "\xff"} {
			for _, special := range []bool{false, true} {
				ids := tk.Encode(s, special)
				_ = tk.Decode(ids)
			}
		}
		_, _ = tk.RenderChat([]Message{{Role: "user", Content: "hi"}}, ChatOptions{})
	})
}

// FuzzEncode: encoding arbitrary text must not panic, and for Llama-3.1
// (byte-level, no normalizer) decoding must give the input back.
func FuzzEncode(f *testing.F) {
	for _, s := range []string{"", "Hello, world!", "I'm CAN'T 12345", "<|im_start|>user\n你好<|im_end|>", "  \u3000\u2028 x", "👨‍👩‍👧‍👦🇺🇸", "e\u0301", "\xff\xfe", "<|eot_id|><|begin_of_text|>"} {
		f.Add(s, false)
	}
	q := loadStaged(f, "Qwen__Qwen3-0.6B")
	l := loadStaged(f, "meta-llama__Llama-3.1-8B-Instruct")
	f.Fuzz(func(t *testing.T, s string, special bool) {
		_ = q.Decode(q.Encode(s, special))
		ids := l.Encode(s, false)
		if utf8.ValidString(s) {
			if got := l.Decode(ids); got != s {
				t.Fatalf("llama3.1 round trip %q -> %v -> %q", s, ids, got)
			}
		}
		if special {
			withBOS := l.Encode(s, true)
			if len(withBOS) != len(ids)+1 || withBOS[0] != 128000 {
				t.Fatalf("add_special_tokens did not prepend exactly one BOS: %v vs %v", withBOS, ids)
			}
		}
	})
}

// FuzzEncodeRequest: arbitrary request bodies (untrusted client input) must
// give ids or an error, never a panic.
func FuzzEncodeRequest(f *testing.F) {
	for _, b := range []string{
		`{"model":"m","prompt":"hi"}`, `{"prompt":[1,2,3]}`, `{"prompt":[[1],[2]]}`, `{"prompt":["a","b"],"add_special_tokens":false}`,
		`{"messages":[{"role":"user","content":"hi"}]}`, `{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url"}]}],"cache_salt":"x"}`,
		`{"messages":[{"role":"assistant","content":null,"tool_calls":[{"function":{"name":"f","arguments":"{}"}}]}],"tools":[{"type":"function"}]}`,
		`{"messages":[],"chat_template_kwargs":{"enable_thinking":false},"continue_final_message":true}`, `{"prompt":"x","truncate_prompt_tokens":1}`,
	} {
		f.Add([]byte(b), uint8(0), true)
	}
	tk := loadStaged(f, "Qwen__Qwen3-0.6B")
	engines := []string{EngineVLLM, EngineSGLang, EngineTRTLLM, EngineLlamaCPP}
	f.Fuzz(func(t *testing.T, body []byte, engine uint8, chat bool) {
		path := PathCompletions
		if chat {
			path = PathChatCompletions
		}
		_, _ = tk.EncodeRequest(engines[int(engine)%len(engines)], path, body)
		_, _ = RequestModel(body)
	})
}
