package proxy

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

func TestModelOf(t *testing.T) {
	cases := []struct {
		name, header, body, want string
	}{
		{"plain", "", `{"model":"a"}`, "a"},
		{"whitespace", "", " \n{ \"model\" : \"a b\" }", "a b"},
		{"escaped value", "", `{"model":"Qwen\/Qwen2.5\u002d7B"}`, "Qwen/Qwen2.5-7B"},
		{"escaped key", "", `{"mod\u0065l":"k"}`, "k"},
		{"nested model ignored", "", `{"messages":[{"model":"inner"}],"x":{"model":"deep"}}`, ""},
		{"after nested", "", `{"messages":[{"role":"user","content":"{\"model\":\"no\"}"}],"model":"yes"}`, "yes"},
		{"last duplicate wins", "", `{"model":"first","model":"second"}`, "second"},
		{"non-string model", "", `{"model":42}`, ""},
		{"null model", "", `{"model":null}`, ""},
		{"array body", "", `[{"model":"a"}]`, ""},
		{"truncated", "", `{"model":"a`, ""},
		{"truncated after model", "", `{"model":"a","messages":[`, "a"},
		{"header wins", "h", `{"model":"b"}`, "h"},
		{"header trimmed", "  h  ", ``, "h"},
		{"empty", "", ``, ""},
	}
	for _, tc := range cases {
		h := http.Header{}
		if tc.header != "" {
			h.Set(HeaderModel, tc.header)
		}
		if got := ModelOf(h, []byte(tc.body)); got != tc.want {
			t.Errorf("%s: ModelOf = %q, want %q", tc.name, got, tc.want)
		}
	}
}

func TestModelOfDeepNestingBounded(t *testing.T) {
	body := `{"x":` + strings.Repeat("[", 100000) + strings.Repeat("]", 100000) + `,"model":"m"}`
	if got := ModelOf(http.Header{}, []byte(body)); got != "" {
		t.Errorf("over-deep body: model %q, want the scan to give up", got)
	}
	ok := `{"x":` + strings.Repeat("[", 100) + strings.Repeat("]", 100) + `,"model":"m"}`
	if got := ModelOf(http.Header{}, []byte(ok)); got != "m" {
		t.Errorf("nested body: model %q", got)
	}
}

func TestUsageTapSSE(t *testing.T) {
	stream := "data: {\"choices\":[{\"delta\":{}}]}\r\n\r\n" +
		"data: {\"usage\":{\"prompt_tokens\":10,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\n" +
		"data: {\"usage\":{\"prompt_tokens\":20,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\r\n\r\n" +
		"data: [DONE]\n\n"
	// Every split point must give the same answer: the tap sees network
	// chunks, not lines.
	for split := 0; split <= len(stream); split++ {
		tap := usageTap{sse: true, limit: 1 << 10}
		tap.Write([]byte(stream[:split]))
		tap.Write([]byte(stream[split:]))
		var r Result
		tap.finish(&r)
		if !r.HasCachedTokens || r.CachedTokens != 16 || r.PromptTokens != 20 {
			t.Fatalf("split %d: %+v", split, r)
		}
	}
	// A line longer than the limit is skipped, not truncated into garbage.
	tap := usageTap{sse: true, limit: 16}
	tap.Write([]byte("data: {\"usage\":{\"prompt_tokens\":1}}\n\n"))
	var r Result
	tap.finish(&r)
	if r.HasUsage {
		t.Errorf("over-limit line parsed: %+v", r)
	}
	// Final line without newline.
	tap = usageTap{sse: true, limit: 1 << 10}
	tap.Write([]byte(`data: {"usage":{"prompt_tokens":5}}`))
	r = Result{}
	tap.finish(&r)
	if !r.HasUsage || r.HasCachedTokens || r.PromptTokens != 5 {
		t.Errorf("unterminated last line: %+v", r)
	}
}

func TestUsageTapJSON(t *testing.T) {
	body := `{"usage":{"prompt_tokens":7,"prompt_tokens_details":{"cached_tokens":3}}}`
	tap := usageTap{limit: 1 << 10}
	for i := range body {
		tap.Write([]byte(body[i : i+1]))
	}
	var r Result
	tap.finish(&r)
	if r.CachedTokens != 3 || r.PromptTokens != 7 || !r.HasCachedTokens {
		t.Errorf("%+v", r)
	}
	tap = usageTap{limit: 10}
	tap.Write([]byte(body))
	r = Result{}
	tap.finish(&r)
	if r.HasUsage {
		t.Error("body over the scan limit was parsed")
	}
}

// FuzzModelOf feeds arbitrary bodies and headers to the request parser:
// it must never panic, and for valid JSON objects it must agree with
// encoding/json (last duplicate key wins in both).
func FuzzModelOf(f *testing.F) {
	for _, s := range []string{
		`{"model":"a"}`, `{"messages":[{"content":"x"}],"model":"m"}`, `{"model":1}`,
		`{"mod\u0065l":"k"}`, `{"a":"\"model\":","model":"z"}`, `[`, `{"model":"\ud800"}`,
		`{"x":[[[[{}]]]],"model":"y"}`, "", `{"model":"a","model":{"b":1}}`,
	} {
		f.Add(s, "")
	}
	f.Add(`{"model":"b"}`, "hdr")
	f.Fuzz(func(t *testing.T, body, header string) {
		h := http.Header{}
		if header != "" {
			h[HeaderModel] = []string{header}
		}
		got := ModelOf(h, []byte(body))
		if strings.TrimSpace(header) != "" {
			if got != strings.TrimSpace(header) {
				t.Fatalf("header %q ignored: %q", header, got)
			}
			return
		}
		var obj map[string]json.RawMessage
		if json.Unmarshal([]byte(body), &obj) != nil {
			return
		}
		want := ""
		if raw, ok := obj["model"]; ok {
			var s string
			if json.Unmarshal(raw, &s) == nil {
				want = s
			}
		}
		if got != want && strings.Count(body, "[")+strings.Count(body, "{") < maxDepth {
			t.Fatalf("body %q: model %q, encoding/json says %q", body, got, want)
		}
	})
}

func TestParseUsage(t *testing.T) {
	cases := []struct {
		body               string
		has, hasCached     bool
		prompt, cachedToks int64
	}{
		{`{"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":8}}}`, true, true, 10, 8},
		{`{"choices":[{"usage":{"prompt_tokens":1}}],"usage":{"prompt_tokens":3}}`, true, false, 3, 0},
		{`{"usage":null}`, false, false, 0, 0},
		{`{"usage":{"prompt_tokens_details":null,"prompt_tokens":4}}`, true, false, 4, 0},
		{`{"usage":{"prompt_tokens":"x","prompt_tokens_details":{"cached_tokens":-1}}}`, true, false, 0, 0},
		{`{"id":"a"}`, false, false, 0, 0},
		{`{"usage":{"prompt_tokens":1`, false, false, 0, 0}, // truncated: ignored
		{`garbage`, false, false, 0, 0},
	}
	for _, tc := range cases {
		var r Result
		parseUsage([]byte(tc.body), &r)
		if r.HasUsage != tc.has || r.HasCachedTokens != tc.hasCached || r.PromptTokens != tc.prompt || r.CachedTokens != tc.cachedToks {
			t.Errorf("%s: %+v", tc.body, r)
		}
	}
}

// FuzzUsageTap feeds arbitrary response bytes, split at an arbitrary
// point, through both tap modes: no panic, and never usage invented
// from a body that does not mention it.
func FuzzUsageTap(f *testing.F) {
	f.Add(`data: {"usage":{"prompt_tokens":1,"prompt_tokens_details":{"cached_tokens":1}}}`+"\n\n", 5)
	f.Add(`{"usage":{"prompt_tokens":2}}`, 0)
	f.Fuzz(func(t *testing.T, body string, split int) {
		if split < 0 || split > len(body) {
			split = len(body) / 2
		}
		for _, sse := range []bool{false, true} {
			tap := usageTap{sse: sse, limit: 256}
			tap.Write([]byte(body[:split]))
			tap.Write([]byte(body[split:]))
			var r Result
			tap.finish(&r)
			tap.release()
			if r.HasUsage && !strings.Contains(body, "usage") {
				t.Fatalf("usage found in %q", body)
			}
		}
	})
}
