package dispatch

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/loxilb-llm/loxilb/pkg/engine"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

// PathGenerate is SGLang's native generation API. A P/D rule of an SGLang
// pool dispatches it like the OpenAI paths: the bootstrap fields go into
// the body sent to both legs, as lists with one room per prompt for a
// batch ("text" or "input_ids" given as a list of prompts).
const PathGenerate = engine.PathGenerate

// IsGenerate reports whether path is SGLang's /generate (a trailing slash
// or query string aside).
func IsGenerate(path string) bool {
	if i := strings.IndexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	return strings.TrimSuffix(path, "/") == PathGenerate
}

// checkGenerate refuses a /generate body whose prompt the bootstrap
// fields cannot be matched to: SGLang needs exactly one of "text" (a
// string or a list of strings) and "input_ids" (token ids or a list of
// token-id lists), and a batch must not be empty or mix kinds, since each
// prompt gets the room at its position.
func checkGenerate(m map[string]json.RawMessage) error {
	text, hasText := m["text"]
	ids, hasIDs := m["input_ids"]
	hasText, hasIDs = hasText && !isNull(text), hasIDs && !isNull(ids)
	switch {
	case hasText && hasIDs:
		return fmt.Errorf("%w: /generate takes either text or input_ids, not both", proxy.ErrBadRequest)
	case hasText:
		return checkPrompts("text", text, '"')
	case hasIDs:
		return checkPrompts("input_ids", ids, '[')
	}
	return fmt.Errorf("%w: /generate needs text or input_ids", proxy.ErrBadRequest)
}

// checkPrompts checks one prompt field: a single prompt (a string for text,
// a list of numbers for input_ids), or a non-empty list whose items are
// all prompts of the field's kind (item starts with want).
func checkPrompts(name string, v json.RawMessage, want byte) error {
	v = bytes.TrimSpace(v)
	if v[0] == '"' && want == '"' {
		return nil
	}
	var items []json.RawMessage
	if v[0] != '[' || json.Unmarshal(v, &items) != nil {
		return fmt.Errorf("%w: /generate %s must be %s or a list of them, got %s", proxy.ErrBadRequest, name, kindName(want), excerpt(v))
	}
	if len(items) == 0 {
		return fmt.Errorf("%w: /generate %s is an empty list", proxy.ErrBadRequest, name)
	}
	first := bytes.TrimSpace(items[0])
	batch := first[0] == want
	if !batch && want == '"' {
		return fmt.Errorf("%w: /generate text must be a string or a list of strings, got %s", proxy.ErrBadRequest, excerpt(v))
	}
	for i, it := range items {
		it = bytes.TrimSpace(it)
		if isBatch := it[0] == want; isBatch != batch {
			return fmt.Errorf("%w: /generate %s mixes single values and lists (item %d: %s)", proxy.ErrBadRequest, name, i, excerpt(it))
		}
		if batch && want == '[' && (len(bytes.TrimSpace(it[1:len(it)-1])) == 0) {
			return fmt.Errorf("%w: /generate input_ids item %d is an empty prompt", proxy.ErrBadRequest, i)
		}
	}
	return nil
}

func kindName(want byte) string {
	if want == '"' {
		return "a string"
	}
	return "a list of token ids"
}
