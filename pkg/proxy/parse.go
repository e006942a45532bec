package proxy

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"sync"
)

// HeaderModel lets a client name the model without a JSON body; it wins
// over the body's "model" field, as in the loxilb inference gateway.
const HeaderModel = "X-Model"

// ModelOf returns the model a request names: the X-Model header if set,
// else the top-level "model" string of a JSON object body. It never fails:
// a body that is not a JSON object, or whose "model" is not a string,
// yields "". Like the engines' JSON parsers, the last duplicate key wins.
func ModelOf(h http.Header, body []byte) string {
	if m := strings.TrimSpace(h.Get(HeaderModel)); m != "" {
		return m
	}
	return jsonModel(body)
}

// jsonModel scans only the top level of a JSON object, skipping nested
// values without decoding them, so a 32 MiB chat body costs one linear
// pass and no allocation beyond the model string itself. A full
// json.Unmarshal would validate and allocate the whole message tree just
// to read one field.
func jsonModel(b []byte) string {
	s := scanner{b: b}
	s.ws()
	if !s.eat('{') {
		return ""
	}
	model := ""
	for {
		s.ws()
		if s.eat('}') {
			return model
		}
		ks, ke, ok := s.str()
		if !ok {
			return model
		}
		s.ws()
		if !s.eat(':') {
			return model
		}
		s.ws()
		vs := s.i
		if !s.value(0) {
			return model
		}
		if isKey(b[ks:ke], "model") {
			model = ""
			if raw := b[vs:s.i]; raw[0] == '"' {
				model = unquote(raw)
			}
		}
		s.ws()
		if s.eat(',') {
			continue
		}
		if s.eat('}') {
			return model
		}
		return model
	}
}

// unquote decodes a raw JSON string (quotes included), copying it
// directly when it holds no escapes or control bytes, which is how model
// names look.
func unquote(raw []byte) string {
	inner := raw[1 : len(raw)-1]
	plain := true
	for _, c := range inner {
		if c == '\\' || c < 0x20 || c >= 0x80 {
			plain = false
			break
		}
	}
	if plain {
		return string(inner)
	}
	var m string
	if json.Unmarshal(raw, &m) != nil {
		return ""
	}
	return m
}

// isKey compares a raw JSON string (quotes included) with an ASCII key,
// decoding escapes only when present so "mod\u0065l" still matches.
func isKey(raw []byte, key string) bool {
	if bytes.IndexByte(raw, '\\') < 0 {
		return len(raw) == len(key)+2 && string(raw[1:len(raw)-1]) == key
	}
	var k string
	return json.Unmarshal(raw, &k) == nil && k == key
}

// maxDepth bounds nesting so hostile input cannot exhaust the stack.
const maxDepth = 512

// scanner is a minimal, allocation-free JSON skipper. It accepts a
// superset of JSON for skipped values (it does not validate numbers or
// literals strictly) because the engine, not the proxy, is the judge of
// request validity; it only needs to find the top-level keys reliably.
type scanner struct {
	b []byte
	i int
}

func (s *scanner) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

func (s *scanner) eat(c byte) bool {
	if s.i < len(s.b) && s.b[s.i] == c {
		s.i++
		return true
	}
	return false
}

// str consumes a string and returns its raw bounds, quotes included.
func (s *scanner) str() (start, end int, ok bool) {
	if !s.eat('"') {
		return 0, 0, false
	}
	start = s.i - 1
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case '\\':
			s.i += 2
		case '"':
			s.i++
			return start, s.i, true
		default:
			s.i++
		}
	}
	return 0, 0, false
}

func (s *scanner) value(depth int) bool {
	if depth > maxDepth || s.i >= len(s.b) {
		return false
	}
	switch s.b[s.i] {
	case '"':
		_, _, ok := s.str()
		return ok
	case '{', '[':
		closer := byte('}')
		if s.b[s.i] == '[' {
			closer = ']'
		}
		s.i++
		for {
			s.ws()
			if s.eat(closer) {
				return true
			}
			if closer == '}' {
				if _, _, ok := s.str(); !ok {
					return false
				}
				s.ws()
				if !s.eat(':') {
					return false
				}
				s.ws()
			}
			if !s.value(depth + 1) {
				return false
			}
			s.ws()
			if s.eat(',') {
				continue
			}
			if s.eat(closer) {
				return true
			}
			return false
		}
	default:
		start := s.i
		for s.i < len(s.b) {
			switch s.b[s.i] {
			case ',', '}', ']', ' ', '\t', '\n', '\r':
				return s.i > start
			}
			s.i++
		}
		return s.i > start
	}
}

// parseUsage extracts usage.prompt_tokens and
// usage.prompt_tokens_details.cached_tokens from one JSON document. It
// walks the raw bytes instead of unmarshalling: it runs on every
// response, and reflection-based decoding was a visible share of the
// proxy's own CPU time.
func parseUsage(b []byte, r *Result) {
	u := jsonPath(b, "usage")
	if len(u) == 0 || u[0] != '{' {
		return // absent, or null as in vLLM's non-final stream chunks
	}
	r.HasUsage = true
	if v, ok := parseDecimal(jsonPath(u, "prompt_tokens")); ok {
		r.PromptTokens = v
	}
	if v, ok := parseDecimal(jsonPath(u, "prompt_tokens_details", "cached_tokens")); ok {
		r.CachedTokens, r.HasCachedTokens = v, true
	}
}

// jsonPath returns the raw value found by following object keys from the
// top of b, or nil. At each level the first matching key is taken.
func jsonPath(b []byte, path ...string) []byte {
	s := scanner{b: b}
	for _, key := range path {
		s.ws()
		if !s.eat('{') {
			return nil
		}
		for {
			s.ws()
			ks, ke, ok := s.str()
			if !ok {
				return nil // '}' (key absent) or malformed
			}
			s.ws()
			if !s.eat(':') {
				return nil
			}
			s.ws()
			if isKey(b[ks:ke], key) {
				break
			}
			if !s.value(0) {
				return nil
			}
			s.ws()
			if !s.eat(',') {
				return nil
			}
		}
	}
	start := s.i
	if !s.value(0) {
		return nil
	}
	return b[start:s.i]
}

// usageTap watches response bytes as they are relayed and extracts usage
// without holding up the stream. For SSE it keeps only the current line
// (bounded) and parses "data:" lines that mention "usage"; for a JSON
// body it keeps a bounded copy and parses it at the end.
type usageTap struct {
	sse     bool
	limit   int
	buf     []byte
	over    bool // current line / body exceeded limit; ignore it
	matched bool // a usage-bearing document was parsed
	res     Result
	pooled  *[]byte
}

var usageKey = []byte(`"usage"`)

var tapBufPool = sync.Pool{New: func() any { b := make([]byte, 0, 4<<10); return &b }}

func (t *usageTap) Write(p []byte) {
	if t.buf == nil {
		t.pooled = tapBufPool.Get().(*[]byte)
		t.buf = (*t.pooled)[:0]
	}
	if !t.sse {
		if t.over {
			return
		}
		if len(t.buf)+len(p) > t.limit {
			t.over, t.buf = true, t.buf[:0]
			return
		}
		t.buf = append(t.buf, p...)
		return
	}
	for len(p) > 0 {
		nl := bytes.IndexByte(p, '\n')
		chunk := p
		if nl >= 0 {
			chunk = p[:nl]
		}
		if !t.over {
			if len(t.buf)+len(chunk) > t.limit {
				t.over, t.buf = true, t.buf[:0]
			} else {
				t.buf = append(t.buf, chunk...)
			}
		}
		if nl < 0 {
			return
		}
		if !t.over {
			t.line(t.buf)
		}
		t.buf, t.over = t.buf[:0], false
		p = p[nl+1:]
	}
}

func (t *usageTap) line(l []byte) {
	l = bytes.TrimSuffix(l, []byte{'\r'})
	data, ok := bytes.CutPrefix(l, []byte("data:"))
	if !ok || !bytes.Contains(data, usageKey) {
		return
	}
	var r Result
	parseUsage(bytes.TrimSpace(data), &r)
	if r.HasUsage {
		t.res, t.matched = r, true
	}
}

// release returns the scan buffer to the pool; the tap is unusable after.
func (t *usageTap) release() {
	if t.pooled != nil && cap(t.buf) <= 64<<10 {
		*t.pooled = t.buf[:0]
		tapBufPool.Put(t.pooled)
	}
	t.pooled, t.buf = nil, nil
}

// finish parses what is left and copies usage into r.
func (t *usageTap) finish(r *Result) {
	switch {
	case !t.sse && !t.over && bytes.Contains(t.buf, usageKey):
		parseUsage(t.buf, &t.res)
		t.matched = t.res.HasUsage
	case t.sse && !t.over && len(t.buf) > 0:
		t.line(t.buf)
	}
	if t.matched {
		r.HasUsage = true
		r.PromptTokens = t.res.PromptTokens
		r.CachedTokens = t.res.CachedTokens
		r.HasCachedTokens = t.res.HasCachedTokens
	}
}
