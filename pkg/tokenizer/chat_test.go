package tokenizer

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

type chatGolden struct {
	Model    string `json:"model"`
	Template string `json:"template"` // file under testdata/templates, "" for the model's own
	Case     string `json:"case"`
	Request  struct {
		Messages            json.RawMessage `json:"messages"`
		Tools               json.RawMessage `json:"tools"`
		AddGenerationPrompt *bool           `json:"add_generation_prompt"`
		Kwargs              json.RawMessage `json:"chat_template_kwargs"`
	} `json:"request"`
	Rendered string   `json:"rendered"`
	IDs      []uint32 `json:"ids"`
}

func slugOf(t *testing.T, model string) string {
	for _, m := range parityModels {
		if m.name == model {
			return m.slug
		}
	}
	t.Fatalf("unknown model %q in chat golden", model)
	return ""
}

// TestChatTemplateParity checks renders against @huggingface/jinja and the
// rendered prompt's ids against the Rust tokenizer.
func TestChatTemplateParity(t *testing.T) {
	var cases []chatGolden
	readGolden(t, "chat.json", &cases)
	perTemplate := map[string]int{}
	for _, c := range cases {
		t.Run(c.Model+"/"+c.Template+"/"+c.Case, func(t *testing.T) {
			tk := goldenTokenizer(t, c)
			got, err := tk.RenderChatJSON(c.Request.Messages, ChatOptions{
				AddGenerationPrompt: c.Request.AddGenerationPrompt,
				Tools:               c.Request.Tools,
				Kwargs:              c.Request.Kwargs,
			})
			if err != nil {
				t.Fatal(err)
			}
			if got != c.Rendered {
				t.Fatalf("render differs from @huggingface/jinja\n got: %q\nwant: %q", got, c.Rendered)
			}
			if ids := tk.Encode(got, false); !equalIDs(ids, c.IDs) {
				t.Fatalf("ids of render differ: got %v want %v", ids, c.IDs)
			}
			perTemplate[c.Model+"/"+c.Template]++
		})
	}
	if len(perTemplate) < 4 {
		t.Errorf("only %d templates covered", len(perTemplate))
	}
	for name, n := range perTemplate {
		if n < 6 {
			t.Errorf("%s: %d chat renders identical, want >= 6", name, n)
		}
	}
}

// goldenTokenizer is the staged tokenizer of a chat golden, with the
// golden's template when it is not the model's own.
func goldenTokenizer(t *testing.T, c chatGolden) *Tokenizer {
	t.Helper()
	tk := loadStaged(t, slugOf(t, c.Model))
	if c.Template == "" {
		return tk
	}
	src, err := os.ReadFile(filepath.Join("testdata", "templates", c.Template))
	if err != nil {
		t.Fatal(err)
	}
	tk, err = tk.WithChatTemplate(string(src))
	if err != nil {
		t.Fatal(err)
	}
	return tk
}

func TestRenderChatMessages(t *testing.T) {
	tk := loadStaged(t, "Qwen__Qwen3-0.6B")
	got, err := tk.RenderChat([]Message{{Role: "user", Content: "Hi"}}, ChatOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if want := "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"; got != want {
		t.Fatalf("got %q want %q", got, want)
	}
	no := false
	got, err = tk.RenderChat([]Message{{Role: "user", Content: "Hi"}}, ChatOptions{AddGenerationPrompt: &no})
	if err != nil || strings.HasSuffix(got, "assistant\n") {
		t.Fatalf("add_generation_prompt=false: %q %v", got, err)
	}
	// continue_final_message ends the prompt inside the assistant turn.
	got, err = tk.RenderChatJSON(json.RawMessage(`[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello the"}]`),
		ChatOptions{AddGenerationPrompt: &no, ContinueFinalMessage: true})
	if err != nil || !strings.HasSuffix(got, "Hello the") {
		t.Fatalf("continue_final_message: %q %v", got, err)
	}
}

func TestRenderChatToolArgumentsString(t *testing.T) {
	tk := loadStaged(t, "Qwen__Qwen3-0.6B")
	msgs := `[{"role":"user","content":"w?"},{"role":"assistant","content":"","tool_calls":[{"type":"function","function":{"name":"f","arguments":"{\"b\": 1, \"a\": [2]}"}}]}]`
	got, err := tk.RenderChatJSON(json.RawMessage(msgs), ChatOptions{ParseToolArguments: true})
	if err != nil {
		t.Fatal(err)
	}
	// Key order of the arguments string survives, with Python json.dumps spacing.
	if !strings.Contains(got, `"arguments": {"b": 1, "a": [2]}}`) {
		t.Fatalf("tool arguments not rendered as an ordered object: %q", got)
	}
	if _, err := tk.RenderChatJSON(json.RawMessage(`[{"role":"assistant","content":"","tool_calls":[{"function":{"name":"f","arguments":"{bad"}}]}]`),
		ChatOptions{ParseToolArguments: true}); err == nil {
		t.Fatal("invalid arguments JSON accepted")
	}
}

func TestRenderChatErrors(t *testing.T) {
	tk := loadStaged(t, "Qwen__Qwen3-0.6B")
	for name, msgs := range map[string]string{
		"not json":   `[{`,
		"not array":  `{"role":"user"}`,
		"not object": `["hi"]`,
		"trailing":   `[] []`,
	} {
		if _, err := tk.RenderChatJSON(json.RawMessage(msgs), ChatOptions{}); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	if _, err := tk.RenderChatJSON(json.RawMessage(`[]`), ChatOptions{Kwargs: json.RawMessage(`[1]`)}); err == nil {
		t.Error("non-object kwargs accepted")
	}
	bare, err := LoadJSON(minimalTokenizerJSON, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bare.RenderChat(nil, ChatOptions{}); !errors.Is(err, ErrNoChatTemplate) {
		t.Fatalf("want ErrNoChatTemplate, got %v", err)
	}
}

// minimalTokenizerJSON is a tiny byte-level BPE used by unit tests that do
// not need a real vocabulary.
var minimalTokenizerJSON = []byte(`{
 "added_tokens": [{"id": 5, "content": "<s>", "special": true, "lstrip": false, "rstrip": false, "normalized": false, "single_word": false}],
 "normalizer": null,
 "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
 "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
   "special_tokens": {"<s>": {"id": "<s>", "ids": [5], "tokens": ["<s>"]}}},
 "decoder": {"type": "ByteLevel"},
 "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "Ġ": 3, "Ġab": 4}, "merges": ["a b", "Ġ ab"]}
}`)
