package lbrule

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strings"
)

// MaxBodyBytes bounds a rule body; a rule is a few hundred bytes.
const MaxBodyBytes = 1 << 20

// Decode parses a rule body strictly: unknown fields, keys spelled in
// another case than loxilb's (encoding/json would match them), duplicate
// keys (encoding/json would keep the last), wrong types, trailing data and
// empty bodies are rejected with an error naming the field. It does
// not validate semantics; call Validate for that.
func Decode(body []byte) (*Rule, error) {
	if len(bytes.TrimSpace(body)) == 0 {
		return nil, invalid("", "empty body: expected a JSON object with serviceArguments and endpoints")
	}
	if len(body) > MaxBodyBytes {
		return nil, invalid("", "body of %d bytes exceeds the %d-byte limit", len(body), MaxBodyBytes)
	}
	if err := checkKeys(body); err != nil {
		return nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	var r Rule
	if err := dec.Decode(&r); err != nil {
		return nil, jsonError(err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, invalid("", "unexpected data after the JSON object")
	}
	return &r, nil
}

// maxDepth bounds the nesting of a rule body; a rule nests three levels.
const maxDepth = 16

// shape is the key set a JSON value must use: the exact json tag names of
// an object's fields, or the shape of an array's elements.
type shape struct {
	fields map[string]*shape
	elem   *shape
}

func shapeOf(t reflect.Type) *shape {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Struct:
		s := &shape{fields: map[string]*shape{}}
		for i := 0; i < t.NumField(); i++ {
			f := t.Field(i)
			name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
			if name == "-" || !f.IsExported() {
				continue
			}
			if name == "" {
				name = f.Name
			}
			s.fields[name] = shapeOf(f.Type)
		}
		return s
	case reflect.Slice, reflect.Array:
		return &shape{elem: shapeOf(t.Elem())}
	}
	return nil
}

// checkKeys walks the body's tokens and rejects a key that appears twice
// in one object, or that matches a field only case-insensitively: loxilb's
// names mix camelCase and snake_case (kvExactMode, pd_disagg_mode) and are
// matched exactly as written. Unknown keys and wrong types are left to the
// decoder, which names them.
func checkKeys(body []byte) error {
	dec := json.NewDecoder(bytes.NewReader(body))
	return walkKeys(dec, shapeOf(reflect.TypeOf(Rule{})), "", 0)
}

func walkKeys(dec *json.Decoder, sh *shape, path string, depth int) error {
	if depth > maxDepth {
		return invalid(path, "nested deeper than %d levels", maxDepth)
	}
	tok, err := dec.Token()
	if err != nil {
		return jsonError(err)
	}
	d, ok := tok.(json.Delim)
	if !ok {
		return nil
	}
	switch d {
	case '{':
		seen := map[string]bool{}
		for dec.More() {
			tok, err := dec.Token()
			if err != nil {
				return jsonError(err)
			}
			key, _ := tok.(string)
			field := joinPath(path, key)
			if seen[key] {
				return invalid(field, "duplicate key: each key may appear once in an object")
			}
			seen[key] = true
			var child *shape
			if sh != nil && sh.fields != nil {
				var known bool
				if child, known = sh.fields[key]; !known {
					for name := range sh.fields {
						if strings.EqualFold(name, key) {
							return invalid(field, "unknown field: keys are case-sensitive, write %q", name)
						}
					}
				}
			}
			if err := walkKeys(dec, child, field, depth+1); err != nil {
				return err
			}
		}
	case '[':
		var elem *shape
		if sh != nil {
			elem = sh.elem
		}
		for i := 0; dec.More(); i++ {
			if err := walkKeys(dec, elem, fmt.Sprintf("%s[%d]", path, i), depth+1); err != nil {
				return err
			}
		}
	}
	if _, err := dec.Token(); err != nil { // the closing delimiter
		return jsonError(err)
	}
	return nil
}

func joinPath(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

func jsonError(err error) *RuleError {
	var typeErr *json.UnmarshalTypeError
	var syntaxErr *json.SyntaxError
	switch {
	case errors.As(err, &typeErr):
		field := typeErr.Field
		if field == "" {
			field = "(body)"
		}
		return invalid(field, "wrong type: got JSON %s, want %s", typeErr.Value, jsonKind(typeErr.Type.Kind().String()))
	case errors.As(err, &syntaxErr):
		return invalid("", "malformed JSON at byte %d: %v", syntaxErr.Offset, syntaxErr)
	case errors.Is(err, io.ErrUnexpectedEOF):
		return invalid("", "malformed JSON: body ends early")
	}
	msg := err.Error()
	if f, ok := strings.CutPrefix(msg, "json: unknown field "); ok {
		return invalid(strings.Trim(f, `"`), "unknown field (check the spelling: e.g. kvExactMode, pd_disagg_mode, ep_role)")
	}
	return invalid("", "malformed JSON: %v", err)
}

func jsonKind(k string) string {
	switch k {
	case "int", "int64", "int32", "uint32", "uint16":
		return "an integer"
	case "bool":
		return "true or false"
	case "string":
		return "a string"
	case "slice":
		return "an array"
	case "struct", "ptr":
		return "an object"
	}
	return k
}

// Encode renders a rule as JSON (used for read-back and the store).
func Encode(r *Rule) ([]byte, error) {
	b, err := json.Marshal(r)
	if err != nil {
		return nil, fmt.Errorf("encode rule: %w", err)
	}
	return b, nil
}
