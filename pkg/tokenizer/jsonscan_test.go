package tokenizer

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"reflect"
	"strings"
	"testing"

	"github.com/ardanlabs/jinja"
)

// decodeOrderedStd is the json.Decoder-based decoder jsonScan replaced:
// the reference the scanner must agree with.
func decodeOrderedStd(raw []byte) (jinja.Value, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	v, err := decodeValueStd(dec, 0)
	if err != nil {
		return jinja.Value{}, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return jinja.Value{}, fmt.Errorf("trailing data after JSON value")
	}
	return v, nil
}

func decodeValueStd(dec *json.Decoder, depth int) (jinja.Value, error) {
	if depth > maxJSONDepth {
		return jinja.Value{}, fmt.Errorf("JSON nested deeper than %d", maxJSONDepth)
	}
	tok, err := dec.Token()
	if err != nil {
		return jinja.Value{}, err
	}
	switch v := tok.(type) {
	case json.Delim:
		switch v {
		case '[':
			items := []jinja.Value{}
			for dec.More() {
				it, err := decodeValueStd(dec, depth+1)
				if err != nil {
					return jinja.Value{}, err
				}
				items = append(items, it)
			}
			if _, err := dec.Token(); err != nil {
				return jinja.Value{}, err
			}
			return jinja.NewList(items), nil
		case '{':
			d := jinja.NewDict()
			for dec.More() {
				kt, err := dec.Token()
				if err != nil {
					return jinja.Value{}, err
				}
				k, ok := kt.(string)
				if !ok {
					return jinja.Value{}, fmt.Errorf("key %v", kt)
				}
				val, err := decodeValueStd(dec, depth+1)
				if err != nil {
					return jinja.Value{}, err
				}
				d.AsDict().Set(k, val)
			}
			if _, err := dec.Token(); err != nil {
				return jinja.Value{}, err
			}
			return d, nil
		}
		return jinja.Value{}, fmt.Errorf("delimiter %v", v)
	default:
		return jinja.FromGoValue(v), nil
	}
}

// dump prints a value with its kinds and key order, so two decoders'
// results compare exactly.
func dump(b *strings.Builder, v jinja.Value) {
	switch {
	case v.IsDict():
		b.WriteString("{")
		d := v.AsDict()
		for _, k := range d.Keys {
			fmt.Fprintf(b, "%q:", k)
			dump(b, d.Data[k])
			b.WriteString(",")
		}
		b.WriteString("}")
	case v.IsList():
		b.WriteString("[")
		for _, it := range v.AsList().Items {
			dump(b, it)
			b.WriteString(",")
		}
		b.WriteString("]")
	case v.IsNone():
		b.WriteString("None")
	case v.IsBool():
		fmt.Fprintf(b, "bool:%v", v.AsBool())
	case v.IsInt():
		fmt.Fprintf(b, "int:%d", v.AsInt())
	case v.IsFloat():
		fmt.Fprintf(b, "float:%v", v.AsFloat())
	case v.IsString():
		fmt.Fprintf(b, "str:%q", v.AsString())
	default:
		fmt.Fprintf(b, "other:%s", v.String())
	}
}

func dumpString(v jinja.Value) string {
	var b strings.Builder
	dump(&b, v)
	return b.String()
}

var scanSeeds = []string{
	`[{"role":"user","content":"hi"}]`, `{"a":1,"b":[true,false,null],"a":2.5}`, `"\u00e9\ud83d\ude80\ud800x\\\"\/\b\f\n\r\t"`,
	"\"\xff\xfe ok\"", `-0.5e+10`, `12345678901234567890`, `9007199254740993`, `1.0`, `[]`, `{}`, ` [ 1 , 2 ] `,
	`[1,]`, `{"a":}`, `{"a" 1}`, `01`, `1.`, `-`, `1e`, `tru`, `nul`, `"abc`, "\"a\x01\"", `"\x"`, `"\u12g4"`,
	`[1] x`, `{"a":1}{}`, strings.Repeat("[", 130) + strings.Repeat("]", 130), `{"K":1,"\u212a":2}`,
	`[{"content":[{"type":"text","text":"a"},{"type":"image_url"}]}]`,
}

func FuzzScanMatchesDecoder(f *testing.F) {
	for _, s := range scanSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		got, gerr := decodeOrdered(b)
		want, werr := decodeOrderedStd(b)
		if (gerr == nil) != (werr == nil) {
			t.Fatalf("%q: scanner err %v, decoder err %v", b, gerr, werr)
		}
		if gerr == nil {
			if g, w := dumpString(got), dumpString(want); g != w {
				t.Fatalf("%q:\nscanner %s\ndecoder %s", b, g, w)
			}
		}
	})
}

var requestSeeds = []string{
	`{"model":"m","messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false}`,
	`{"Model":"a","MODEL":"b","prompt":"x","add_special_tokens":null,"truncate_prompt_tokens":5}`,
	`{"model":null,"continue_final_message":true,"continue_final_message":null,"cache_salt":"s"}`,
	`{"model":1}`, `{"add_special_tokens":"yes"}`, `{"truncate_prompt_tokens":1.5}`, `{"truncate_prompt_tokens":-0}`,
	`{"truncate_prompt_tokens":99999999999999999999}`, `{"lora_name":{"x":[1,2]},"image_data":null}`, `{"model":"\u00e9\ud800"}`,
	`{"ſtuff":1,"model":"m","moDel":"n"}`, `{} `, `{"a":1,}`, `[]`, `{"model":"m"} x`, `{"prompt":[1,2,3],"tools":[]}`,
}

func FuzzParsePromptRequest(f *testing.F) {
	for _, s := range requestSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var got, want RequestFields
		gerr := parsePromptRequest(b, &got)
		werr := json.Unmarshal(b, &want)
		if len(bytes.TrimSpace(b)) > 0 && bytes.TrimSpace(b)[0] != '{' {
			// Only objects reach the parser (EncodeRequestWith checks).
			return
		}
		if (gerr == nil) != (werr == nil) {
			t.Fatalf("%q: scanner err %v, encoding/json err %v", b, gerr, werr)
		}
		if gerr == nil && !reflect.DeepEqual(normRaw(got), normRaw(want)) {
			t.Fatalf("%q:\nscanner %+v\njson    %+v", b, got, want)
		}
	})
}

// normRaw makes empty and nil raw fields equal (a span and a copy hold the
// same bytes either way).
func normRaw(r RequestFields) RequestFields {
	for _, p := range []*json.RawMessage{&r.Prompt, &r.Messages, &r.Tools, &r.Documents, &r.ChatTemplate,
		&r.ChatTemplateKwargs, &r.CacheSalt, &r.PromptEmbeds, &r.LoRAPath, &r.LoRAName, &r.LoRARequest,
		&r.MultiModalData, &r.ImageData} {
		if len(*p) == 0 {
			*p = nil
		}
	}
	return r
}

func TestScanSeeds(t *testing.T) {
	for _, s := range scanSeeds {
		got, gerr := decodeOrdered([]byte(s))
		want, werr := decodeOrderedStd([]byte(s))
		if (gerr == nil) != (werr == nil) || gerr == nil && dumpString(got) != dumpString(want) {
			t.Errorf("%q: scanner %s %v, decoder %s %v", s, dumpString(got), gerr, dumpString(want), werr)
		}
	}
	for _, s := range requestSeeds {
		var got, want RequestFields
		gerr, werr := parsePromptRequest([]byte(s), &got), json.Unmarshal([]byte(s), &want)
		if s == `[]` {
			continue
		}
		if (gerr == nil) != (werr == nil) || gerr == nil && !reflect.DeepEqual(normRaw(got), normRaw(want)) {
			t.Errorf("%q: scanner %+v %v, json %+v %v", s, got, gerr, want, werr)
		}
	}
}

func TestFirstNonTextPart(t *testing.T) {
	for _, c := range []struct{ msgs, want string }{
		{`[{"role":"user","content":"hi"}]`, ""},
		{`[{"content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{}}]}]`, "image_url"},
		{`[{"content":[{"TYPE":"input_audio"}]}]`, "input_audio"},
		{`[{"content":[{"type":"text","Type":"video"}]}]`, "video"},
		{`[{"content":[null,{"type":"image"}]}]`, "image"},
		{`[{"content":["x",{"type":"image"}]},{"content":[{"type":"file"}]}]`, "file"},
		{`[{"content":[{"type":3},{"type":"image"}]}]`, ""},
	} {
		v, err := decodeOrdered([]byte(c.msgs))
		if err != nil {
			t.Fatal(err)
		}
		if got := firstNonTextPart(v); got != c.want {
			t.Errorf("%s: got %q, want %q", c.msgs, got, c.want)
		}
	}
}

func FuzzMessageSpans(f *testing.F) {
	for _, s := range append(requestSeeds,
		`{"messages":[{"role":"user","content":[{"type":"text"}]},null,{"ROLE":"a","Role":null,"content":null}]}`,
		`{"messages":[{"role":1}]}`, `{"messages":["x"]}`, `{"messages":{}}`, `{"messages":[]}`, `{"messages":null}`) {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var want struct {
			Messages []struct {
				Role    string
				Content json.RawMessage
			}
		}
		werr := json.Unmarshal(b, &want)
		r, err := ParseRequest(b)
		if err != nil {
			if werr == nil && len(bytes.TrimSpace(b)) > 0 && bytes.TrimSpace(b)[0] == '{' {
				t.Fatalf("%q: ParseRequest: %v", b, err)
			}
			return
		}
		got, ok := r.MessageSpans()
		if ok != (werr == nil) {
			t.Fatalf("%q: spans ok %v, encoding/json err %v", b, ok, werr)
		}
		if !ok {
			return
		}
		if (got == nil) != (want.Messages == nil) || len(got) != len(want.Messages) {
			t.Fatalf("%q: got %+v, want %+v", b, got, want.Messages)
		}
		for i, m := range want.Messages {
			if got[i].Role != m.Role || !bytes.Equal(got[i].Content, m.Content) {
				t.Fatalf("%q: [%d] got %+v, want %+v", b, i, got[i], m)
			}
		}
	})
}
