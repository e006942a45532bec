package tokenizer

import (
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
)

// TestEncodeRequestChatGoldens sends each chat golden as a request body
// through every engine and expects the Rust tokenizer's ids for the
// @huggingface/jinja render (the goldens use string content or the
// "\n"-joined parts vLLM and TRT-LLM produce).
func TestEncodeRequestChatGoldens(t *testing.T) {
	var cases []chatGolden
	readGolden(t, "chat.json", &cases)
	for _, c := range cases {
		tk := goldenTokenizer(t, c)
		body := map[string]json.RawMessage{"model": json.RawMessage(`"m"`), "messages": c.Request.Messages}
		if c.Request.Tools != nil {
			body["tools"] = c.Request.Tools
		}
		if c.Request.Kwargs != nil {
			body["chat_template_kwargs"] = c.Request.Kwargs
		}
		if c.Request.AddGenerationPrompt != nil {
			b, _ := json.Marshal(*c.Request.AddGenerationPrompt)
			body["add_generation_prompt"] = b
		}
		raw, _ := json.Marshal(body)
		for _, engine := range []string{EngineVLLM, EngineTRTLLM, EngineSGLang, EngineLlamaCPP} {
			if engine == EngineSGLang && strings.Contains(c.Case, "content_parts") {
				continue // SGLang joins parts with " "; checked below
			}
			got, err := tk.EncodeRequest(engine, "/v1/chat/completions", raw)
			if err != nil {
				t.Fatalf("%s/%s/%s: %v", c.Model, c.Case, engine, err)
			}
			if got.Kind != KindChat || got.Model != "m" || got.Unhashable != "" || got.Rendered != c.Rendered || !equalIDs(got.IDs, c.IDs) {
				t.Errorf("%s/%s/%s: got %+v\nwant rendered %q ids %v", c.Model, c.Case, engine, got, c.Rendered, c.IDs)
			}
		}
	}
}

func TestEncodeRequestChatEngineDifferences(t *testing.T) {
	tk := loadStaged(t, "Qwen__Qwen3-0.6B")
	body := []byte(`{"model":"q","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}`)
	v, err := tk.EncodeRequest(EngineVLLM, "/v1/chat/completions", body)
	if err != nil || !strings.Contains(v.Rendered, "user\na\nb<|im_end|>") {
		t.Fatalf("vllm parts: %q %v", v.Rendered, err)
	}
	s, err := tk.EncodeRequest(EngineSGLang, "/v1/chat/completions", body)
	if err != nil || !strings.Contains(s.Rendered, "user\na b<|im_end|>") {
		t.Fatalf("sglang parts: %q %v", s.Rendered, err)
	}
	// add_special_tokens on a chat request (vLLM honours it; Qwen3 has no BOS template, Llama does).
	lt := loadStaged(t, "meta-llama__Llama-3.1-8B-Instruct")
	plain, _ := lt.EncodeRequest(EngineVLLM, "/v1/chat/completions", []byte(`{"messages":[{"role":"user","content":"hi"}]}`))
	dbl, _ := lt.EncodeRequest(EngineVLLM, "/v1/chat/completions", []byte(`{"messages":[{"role":"user","content":"hi"}],"add_special_tokens":true}`))
	if plain.IDs[0] != 128000 || plain.IDs[1] == 128000 || dbl.IDs[0] != 128000 || dbl.IDs[1] != 128000 {
		t.Fatalf("BOS handling: plain %v, add_special_tokens %v", plain.IDs[:3], dbl.IDs[:3])
	}
	// Tool-call arguments given as a JSON string are rendered as an object.
	tc := []byte(`{"messages":[{"role":"user","content":"w"},{"role":"assistant","content":null,"tool_calls":[{"type":"function","function":{"name":"f","arguments":"{\"z\":1,\"a\":2}"}}]}]}`)
	r, err := tk.EncodeRequest(EngineVLLM, "/v1/chat/completions", tc)
	if err != nil || !strings.Contains(r.Rendered, `"arguments": {"z": 1, "a": 2}`) {
		t.Fatalf("tool args: %q %v", r.Rendered, err)
	}
	if _, err := tk.EncodeRequest(EngineSGLang, "/v1/chat/completions", tc); err != nil {
		t.Fatalf("sglang null content: %v", err)
	}
}

func TestEncodeRequestCompletions(t *testing.T) {
	lt := loadStaged(t, "meta-llama__Llama-3.1-8B-Instruct")
	text := "Hello, world!"
	withBOS := lt.Encode(text, true)
	noBOS := lt.Encode(text, false)
	cases := []struct {
		engine, body string
		opts         RequestOptions
		want         []uint32
		prompts      int
	}{
		{EngineVLLM, `{"model":"m","prompt":"Hello, world!"}`, RequestOptions{}, withBOS, 1},
		{EngineTRTLLM, `{"model":"m","prompt":"Hello, world!"}`, RequestOptions{}, withBOS, 1},
		{EngineVLLM, `{"model":"m","prompt":"Hello, world!","add_special_tokens":false}`, RequestOptions{}, noBOS, 1},
		{EngineSGLang, `{"model":"m","prompt":"Hello, world!"}`, RequestOptions{}, withBOS, 1},
		{EngineSGLang, `{"model":"m","prompt":"<|begin_of_text|>Hello, world!"}`, RequestOptions{CompletionsBOS: true}, append([]uint32{128000, 128000}, noBOS...), 1},
		{EngineLlamaCPP, `{"model":"m","prompt":"Hello, world!"}`, RequestOptions{}, withBOS, 1},
		{EngineVLLM, `{"model":"m","prompt":["Hello, world!","second"]}`, RequestOptions{}, withBOS, 2},
		{EngineVLLM, `{"model":"m","prompt":[1,2,4294967295]}`, RequestOptions{}, []uint32{1, 2, 4294967295}, 1},
		{EngineSGLang, `{"model":"m","prompt":[[7,8],[9]]}`, RequestOptions{}, []uint32{7, 8}, 2},
	}
	for i, c := range cases {
		got, err := lt.EncodeRequestWith(c.engine, "/v1/completions?x=1", []byte(c.body), c.opts)
		if err != nil {
			t.Fatalf("case %d: %v", i, err)
		}
		if !equalIDs(got.IDs, c.want) || got.Prompts != c.prompts || got.Kind != KindCompletions || got.Model != "m" {
			t.Errorf("case %d (%s %s): got %+v want ids %v prompts %d", i, c.engine, c.body, got, c.want, c.prompts)
		}
	}
}

func TestEncodeRequestUnhashable(t *testing.T) {
	tk := loadStaged(t, "Qwen__Qwen3-0.6B")
	for body, want := range map[string]string{
		`{"prompt":"x","cache_salt":"s1"}`:       "cache_salt",
		`{"prompt":"x","lora_path":"a"}`:         "LoRA adapter",
		`{"prompt_embeds":"AAAA"}`:               "prompt_embeds",
		`{"prompt":"x","chat_template":"{{x}}"}`: "request-supplied chat_template",
	} {
		got, err := tk.EncodeRequest(EngineVLLM, "/v1/completions", []byte(body))
		if err != nil || !strings.Contains(got.Unhashable, want) {
			t.Errorf("%s: unhashable %q err %v, want %q", body, got.Unhashable, err, want)
		}
	}
	mm := `{"messages":[{"role":"user","content":[{"type":"text","text":"what is this"},{"type":"image_url","image_url":{"url":"data:,"}}]}],"cache_salt":"z"}`
	got, err := tk.EncodeRequest(EngineVLLM, "/v1/chat/completions", []byte(mm))
	if err != nil || got.Unhashable != "cache_salt, multimodal content part image_url" {
		t.Fatalf("multimodal: %q %v", got.Unhashable, err)
	}
}

func TestEncodeRequestErrors(t *testing.T) {
	tk := loadStaged(t, "Qwen__Qwen3-0.6B")
	cases := []struct {
		engine, path, body string
		want               error
	}{
		{"tgi", "/v1/completions", `{"prompt":"x"}`, ErrUnknownEngine},
		{EngineVLLM, "/v1/embeddings", `{"prompt":"x"}`, ErrUnsupportedPath},
		{EngineVLLM, "/v1/completions", ``, ErrBadRequest},
		{EngineVLLM, "/v1/completions", `[1]`, ErrBadRequest},
		{EngineVLLM, "/v1/completions", `{"prompt":`, ErrBadRequest},
		{EngineVLLM, "/v1/completions", `{}`, ErrBadRequest},
		{EngineVLLM, "/v1/completions", `{"prompt":42}`, ErrBadRequest},
		{EngineVLLM, "/v1/completions", `{"prompt":[]}`, ErrBadRequest},
		{EngineVLLM, "/v1/completions", `{"prompt":["a",1]}`, ErrBadRequest},
		{EngineVLLM, "/v1/completions", `{"prompt":[1,-2]}`, ErrBadRequest},
		{EngineVLLM, "/v1/completions", `{"prompt":[1,4294967296]}`, ErrBadRequest},
		{EngineVLLM, "/v1/completions", `{"prompt":[1.5]}`, ErrBadRequest},
		{EngineVLLM, "/v1/completions", `{"prompt":[[1],["a"]]}`, ErrBadRequest},
		{EngineVLLM, "/v1/chat/completions", `{"prompt":"x"}`, ErrBadRequest},
		{EngineVLLM, "/v1/chat/completions", `{"messages":{"role":"user"}}`, ErrBadRequest},
		{EngineSGLang, "/v1/chat/completions", `{"messages":[1]}`, ErrBadRequest},
		{EngineVLLM, "/v1/chat/completions", `{"messages":[],"chat_template_kwargs":[1]}`, ErrBadRequest},
	}
	for _, c := range cases {
		if _, err := tk.EncodeRequest(c.engine, c.path, []byte(c.body)); !errors.Is(err, c.want) {
			t.Errorf("%s %s %s: got %v, want %v", c.engine, c.path, c.body, err, c.want)
		}
	}
	bare, err := LoadJSON(minimalTokenizerJSON, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bare.EncodeRequest(EngineVLLM, "/v1/chat/completions", []byte(`{"messages":[]}`)); !errors.Is(err, ErrNoChatTemplate) {
		t.Fatalf("want ErrNoChatTemplate, got %v", err)
	}
}

func TestRequestModel(t *testing.T) {
	if m, err := RequestModel([]byte(`{"model":"Qwen/Qwen3-0.6B","prompt":"x"}`)); err != nil || m != "Qwen/Qwen3-0.6B" {
		t.Fatalf("%q %v", m, err)
	}
	for _, b := range []string{`{}`, `{"model":""}`, `nope`, `{"model":1}`} {
		if _, err := RequestModel([]byte(b)); !errors.Is(err, ErrBadRequest) {
			t.Errorf("%s: %v", b, err)
		}
	}
}

func TestEncodeRequestTruncate(t *testing.T) {
	lt := loadStaged(t, "meta-llama__Llama-3.1-8B-Instruct")
	full := lt.Encode("one two three four five", true)
	got, err := lt.EncodeRequest(EngineVLLM, "/v1/completions", []byte(`{"prompt":"one two three four five","truncate_prompt_tokens":3}`))
	if err != nil || !equalIDs(got.IDs, full[len(full)-3:]) {
		t.Fatalf("vllm truncate: %v %v", got.IDs, err)
	}
	got, err = lt.EncodeRequest(EngineSGLang, "/v1/completions", []byte(`{"prompt":"one two three four five","truncate_prompt_tokens":3}`))
	if err != nil || !equalIDs(got.IDs, full) {
		t.Fatalf("sglang ignores truncate_prompt_tokens: %v %v", got.IDs, err)
	}
}

// BenchmarkEncodeRequestChat measures a typical chat request end to end:
// JSON parse, template render, encode.
func BenchmarkEncodeRequestChat(b *testing.B) {
	tk := loadStaged(b, "Qwen__Qwen3-0.6B")
	body := []byte(`{"model":"Qwen/Qwen3-0.6B","messages":[{"role":"system","content":"You are a helpful assistant."},` +
		`{"role":"user","content":"Summarise the design of a KV-cache aware load balancer in three sentences."},` +
		`{"role":"assistant","content":"It tokenizes prompts, hashes blocks and routes to the endpoint holding the longest prefix."},` +
		`{"role":"user","content":"And how are cache events consumed?"}],"tools":[{"type":"function","function":{"name":"lookup","description":"Look up a document.","parameters":{"type":"object","properties":{"id":{"type":"string"}},"required":["id"]}}}]}`)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := tk.EncodeRequest(EngineVLLM, "/v1/chat/completions", body); err != nil {
			b.Fatal(err)
		}
	}
}

// RequestOptions.IDs is written to when it fits the prompt, and the ids
// are those of a fresh encoding, whatever the array held before.
func TestEncodeParsedReusesIDs(t *testing.T) {
	tok := loadStaged(t, "Qwen__Qwen3-0.6B")
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("reuse the array ", 200) + `"}]}`)
	r, err := ParseRequest(body)
	if err != nil {
		t.Fatal(err)
	}
	want, err := tok.EncodeParsed(EngineVLLM, "/v1/chat/completions", r, RequestOptions{})
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]uint32, 7, len(body))
	for i := range buf[:cap(buf)] {
		buf[:cap(buf)][i] = 0xdead
	}
	got, err := tok.EncodeParsed(EngineVLLM, "/v1/chat/completions", r, RequestOptions{IDs: buf})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got.IDs, want.IDs) {
		t.Fatalf("ids with a reused array differ from a fresh encoding")
	}
	if &got.IDs[0] != &buf[:1][0] {
		t.Error("the ids were not written to the given array")
	}
	small := make([]uint32, 0, 4)
	got, err = tok.EncodeParsed(EngineVLLM, "/v1/chat/completions", r, RequestOptions{IDs: small})
	if err != nil || !slices.Equal(got.IDs, want.IDs) || &got.IDs[0] == &small[:1][0] {
		t.Errorf("an array too small for the prompt: ids differ (%v) or were written to it", err)
	}
}
