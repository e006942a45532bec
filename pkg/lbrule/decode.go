package lbrule

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
)

// MaxBodyBytes bounds a rule body; a rule is a few hundred bytes.
const MaxBodyBytes = 1 << 20

// Decode parses a rule body strictly: unknown fields, wrong types, trailing
// data and empty bodies are rejected with an error naming the field. It does
// not validate semantics; call Validate for that.
func Decode(body []byte) (*Rule, error) {
	if len(bytes.TrimSpace(body)) == 0 {
		return nil, invalid("", "empty body: expected a JSON object with serviceArguments and endpoints")
	}
	if len(body) > MaxBodyBytes {
		return nil, invalid("", "body of %d bytes exceeds the %d-byte limit", len(body), MaxBodyBytes)
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
