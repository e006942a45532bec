package tokenizer

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/ardanlabs/jinja"
)

// A chat request used to be decoded three times before its prompt was
// rendered: encoding/json into RequestFields (validating the whole body
// first), the messages again for the content-part check, and once more,
// token by token through json.Decoder, into ordered template values. That
// was most of the CPU of a routing decision. jsonScan reads the body once,
// left to right, with no reflection: the top level into RequestFields
// (fields as spans of the body), the messages straight into template
// values. It accepts exactly the JSON that encoding/json accepts, and
// strings with escapes or invalid UTF-8 are decoded by encoding/json
// itself, so every value comes out as before (FuzzScanMatchesDecoder).

// maxSkipDepth is encoding/json's nesting limit, kept for fields the
// scanner only validates.
const maxSkipDepth = 10000

type jsonScan struct {
	b []byte
	i int
}

func (s *jsonScan) errorf(format string, args ...any) error {
	return fmt.Errorf("invalid JSON at offset %d: %s", s.i, fmt.Sprintf(format, args...))
}

func (s *jsonScan) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// peek returns the next byte after white space, 0 at the end.
func (s *jsonScan) peek() byte {
	s.ws()
	if s.i >= len(s.b) {
		return 0
	}
	return s.b[s.i]
}

// end fails unless only white space is left.
func (s *jsonScan) end() error {
	if s.ws(); s.i < len(s.b) {
		return s.errorf("trailing data after JSON value")
	}
	return nil
}

// strSpan validates the string at s.i and moves past it. It returns the
// quoted text and whether it needs decoding (escapes, invalid UTF-8).
func (s *jsonScan) strSpan() ([]byte, bool, error) {
	start := s.i
	if s.i >= len(s.b) || s.b[s.i] != '"' {
		return nil, false, s.errorf("want a string")
	}
	escaped, ascii := false, true
	for j := s.i + 1; j < len(s.b); j++ {
		c := s.b[j]
		switch {
		case c == '"':
			s.i = j + 1
			q := s.b[start:s.i]
			return q, escaped || !ascii && !utf8.Valid(q), nil
		case c == '\\':
			escaped = true
			j++
			if j >= len(s.b) {
				break
			}
			switch s.b[j] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
			case 'u':
				if j+4 >= len(s.b) || !isHex4(s.b[j+1:j+5]) {
					s.i = j
					return nil, false, s.errorf("bad \\u escape")
				}
				j += 4
			default:
				s.i = j
				return nil, false, s.errorf("bad escape \\%c", s.b[j])
			}
		case c < 0x20:
			s.i = j
			return nil, false, s.errorf("control character in string")
		case c >= utf8.RuneSelf:
			ascii = false
		}
	}
	s.i = len(s.b)
	return nil, false, s.errorf("unterminated string")
}

func isHex4(b []byte) bool {
	for _, c := range b {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return false
		}
	}
	return true
}

// str reads a string value.
func (s *jsonScan) str() (string, error) {
	q, slow, err := s.strSpan()
	if err != nil {
		return "", err
	}
	return unquote(q, slow)
}

// unquote turns a validated quoted span into its string; escapes and
// invalid UTF-8 go through encoding/json so they decode exactly as there.
func unquote(q []byte, slow bool) (string, error) {
	if !slow {
		return string(q[1 : len(q)-1]), nil
	}
	var v string
	if err := json.Unmarshal(q, &v); err != nil {
		return "", fmt.Errorf("invalid JSON string: %w", err)
	}
	return v, nil
}

// number validates the number at s.i (JSON grammar) and returns its text.
func (s *jsonScan) number() ([]byte, error) {
	start, b := s.i, s.b
	i := s.i
	digits := func() int {
		n := 0
		for i < len(b) && '0' <= b[i] && b[i] <= '9' {
			i++
			n++
		}
		return n
	}
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && '1' <= b[i] && b[i] <= '9':
		digits()
	default:
		s.i = i
		return nil, s.errorf("bad number")
	}
	if i < len(b) && b[i] == '.' {
		i++
		if digits() == 0 {
			s.i = i
			return nil, s.errorf("bad number fraction")
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if digits() == 0 {
			s.i = i
			return nil, s.errorf("bad number exponent")
		}
	}
	s.i = i
	return b[start:i], nil
}

func (s *jsonScan) literal(word string) error {
	if len(s.b)-s.i < len(word) || string(s.b[s.i:s.i+len(word)]) != word {
		return s.errorf("bad literal")
	}
	s.i += len(word)
	return nil
}

// skip validates one value (after white space) and moves past it.
func (s *jsonScan) skip(depth int) error {
	if depth > maxSkipDepth {
		return s.errorf("nested deeper than %d", maxSkipDepth)
	}
	switch c := s.peek(); c {
	case '{', '[':
		return s.container(c, func(string) error { return s.skip(depth + 1) })
	case '"':
		_, _, err := s.strSpan()
		return err
	case 't':
		return s.literal("true")
	case 'f':
		return s.literal("false")
	case 'n':
		return s.literal("null")
	default:
		_, err := s.number()
		return err
	}
}

// container walks the object or array opening at s.i, calling elem for
// each member value (with its key; "" in arrays) positioned before it.
func (s *jsonScan) container(open byte, elem func(key string) error) error {
	closing := byte(']')
	if open == '{' {
		closing = '}'
	}
	s.i++
	if s.peek() == closing {
		s.i++
		return nil
	}
	for {
		key := ""
		if open == '{' {
			if s.peek() != '"' {
				return s.errorf("want an object key")
			}
			var err error
			if key, err = s.str(); err != nil {
				return err
			}
			if s.peek() != ':' {
				return s.errorf("want ':' after an object key")
			}
			s.i++
		}
		if err := elem(key); err != nil {
			return err
		}
		switch s.peek() {
		case ',':
			s.i++
		case closing:
			s.i++
			return nil
		default:
			return s.errorf("want ',' or '%c'", closing)
		}
	}
}

// value decodes one value (after white space) into a template value:
// objects keep their key order (a repeated key keeps its first position
// and last value), integers stay integers.
func (s *jsonScan) value(depth int) (jinja.Value, error) {
	if depth > maxJSONDepth {
		return jinja.Value{}, fmt.Errorf("JSON nested deeper than %d", maxJSONDepth)
	}
	switch c := s.peek(); c {
	case '{':
		d := jinja.NewDict()
		dict := d.AsDict()
		err := s.container(c, func(k string) error {
			v, err := s.value(depth + 1)
			dict.Set(k, v)
			return err
		})
		return d, err
	case '[':
		items := []jinja.Value{}
		err := s.container(c, func(string) error {
			v, err := s.value(depth + 1)
			items = append(items, v)
			return err
		})
		return jinja.NewList(items), err
	case '"':
		v, err := s.str()
		return jinja.NewString(v), err
	case 't':
		return jinja.NewBool(true), s.literal("true")
	case 'f':
		return jinja.NewBool(false), s.literal("false")
	case 'n':
		return jinja.None(), s.literal("null")
	default:
		n, err := s.number()
		if err != nil {
			return jinja.Value{}, err
		}
		return jinja.FromGoValue(json.Number(n)), nil
	}
}

// decodeOrdered converts JSON to a jinja value keeping object key order
// (jinja.FromGoValue on a map would sort keys). Integers stay integers.
func decodeOrdered(raw []byte) (jinja.Value, error) {
	s := jsonScan{b: raw}
	v, err := s.value(0)
	if err != nil {
		return jinja.Value{}, err
	}
	if err := s.end(); err != nil {
		return jinja.Value{}, err
	}
	return v, nil
}

// parsePromptRequest fills req from a request body in one pass, as
// json.Unmarshal into RequestFields would: keys match field names exactly
// or case-insensitively, a repeated key's last value wins, a value of the
// wrong type for a typed field is an error, and raw fields are spans of
// body (not copies: body must outlive req).
func parsePromptRequest(body []byte, req *RequestFields) error {
	typeErr, err := scanRequestFields(body, req)
	if err != nil {
		return err
	}
	return typeErr
}

// scanRequestFields is parsePromptRequest that tells the two failures
// apart: err when body is not one JSON object, typeErr (the first) when a
// typed field has a value of the wrong type; the other fields are filled
// in either way.
func scanRequestFields(body []byte, req *RequestFields) (typeErr, err error) {
	s := jsonScan{b: body}
	if s.peek() != '{' {
		return nil, s.errorf("want a JSON object")
	}
	err = s.container('{', func(key string) error {
		s.ws()
		start := s.i
		if err := s.skip(1); err != nil {
			return err
		}
		if err := req.set(key, body[start:s.i]); err != nil && typeErr == nil {
			typeErr = err
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return typeErr, s.end()
}

// set stores one top-level member; unknown keys are ignored.
func (r *RequestFields) set(key string, v []byte) error {
	name := fieldName(key)
	if p := r.rawField(name); p != nil {
		*p = v
		return nil
	}
	null := v[0] == 'n'
	typeErr := func(want string) error {
		return fmt.Errorf("json: cannot unmarshal %.20s into field %q of type %s", v, name, want)
	}
	switch name {
	case "model":
		if null {
			return nil
		}
		if v[0] != '"' {
			return typeErr("string")
		}
		sc := jsonScan{b: v}
		m, err := sc.str()
		r.Model = m
		return err
	case "add_special_tokens", "add_generation_prompt", "continue_final_message":
		var b *bool
		switch v[0] {
		case 't', 'f':
			t := v[0] == 't'
			b = &t
		case 'n':
		default:
			return typeErr("bool")
		}
		switch name {
		case "add_special_tokens":
			r.AddSpecialTokens = b
		case "add_generation_prompt":
			r.AddGenerationPrompt = b
		default:
			if b != nil { // null leaves a plain bool as it was
				r.ContinueFinalMessage = *b
			}
		}
	case "truncate_prompt_tokens":
		if null {
			r.TruncatePromptTokens = nil
			return nil
		}
		n, err := strconv.ParseInt(string(v), 10, 64)
		if err != nil {
			return typeErr("int64")
		}
		r.TruncatePromptTokens = &n
	}
	return nil
}

// rawField is the raw (json.RawMessage) field a key names, nil for the
// typed ones and unknown keys.
func (r *RequestFields) rawField(name string) *json.RawMessage {
	switch name {
	case "prompt":
		return &r.Prompt
	case "messages":
		return &r.Messages
	case "tools":
		return &r.Tools
	case "documents":
		return &r.Documents
	case "chat_template":
		return &r.ChatTemplate
	case "chat_template_kwargs":
		return &r.ChatTemplateKwargs
	case "cache_salt":
		return &r.CacheSalt
	case "prompt_embeds":
		return &r.PromptEmbeds
	case "lora_path":
		return &r.LoRAPath
	case "lora_name":
		return &r.LoRAName
	case "lora_request":
		return &r.LoRARequest
	case "multi_modal_data":
		return &r.MultiModalData
	case "image_data":
		return &r.ImageData
	}
	return nil
}

// promptFields are the keys RequestFields reads.
var promptFields = []string{"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
	"continue_final_message", "tools", "documents", "chat_template", "chat_template_kwargs", "cache_salt",
	"prompt_embeds", "lora_path", "lora_name", "lora_request", "multi_modal_data", "image_data",
	"truncate_prompt_tokens"}

// fieldName maps a key to the RequestFields field it sets, as
// encoding/json matches (exactly, else case-insensitively); "" for none.
func fieldName(key string) string {
	for _, f := range promptFields {
		if key == f {
			return f
		}
	}
	for _, f := range promptFields {
		if strings.EqualFold(key, f) {
			return f
		}
	}
	return ""
}

// MessageSpan is one chat message as the routing key reads it: its role
// and its raw content (a span of the body).
type MessageSpan struct {
	Role    string
	Content json.RawMessage
}

// MessageSpans lists the request's messages without decoding their
// content, as json.Unmarshal into []struct{Role string; Content
// json.RawMessage} would: ok is false where that fails (messages not an
// array, a message neither an object nor null, a role not a string).
func (r *Request) MessageSpans() ([]MessageSpan, bool) {
	raw := r.Fields.Messages
	if len(raw) == 0 || raw[0] == 'n' {
		return nil, true
	}
	if raw[0] != '[' {
		return nil, false
	}
	s := jsonScan{b: raw}
	out := []MessageSpan{}
	ok := true
	err := s.container('[', func(string) error {
		var m MessageSpan
		switch s.peek() {
		case 'n':
			out = append(out, m)
			return s.literal("null")
		case '{':
		default:
			ok = false
			return s.skip(1)
		}
		err := s.container('{', func(k string) error {
			s.ws()
			start := s.i
			if err := s.skip(1); err != nil {
				return err
			}
			v := raw[start:s.i]
			switch {
			case strings.EqualFold(k, "role"):
				switch v[0] {
				case '"':
					sc := jsonScan{b: v}
					role, err := sc.str()
					m.Role = role
					return err
				case 'n':
				default:
					ok = false
				}
			case strings.EqualFold(k, "content"):
				m.Content = v
			}
			return nil
		})
		out = append(out, m)
		return err
	})
	return out, ok && err == nil
}
