package enginesim

import (
	"fmt"

	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

// modelTokenizer adapts a real model tokenizer (tokenizer.json plus its chat
// template) to the Tokenizer interface, so prompts tokenize exactly as the
// engine would.
type modelTokenizer struct{ t *tokenizer.Tokenizer }

var _ Tokenizer = modelTokenizer{}

// LoadTokenizer loads dir/tokenizer.json (and tokenizer_config.json when
// present) as the engine's tokenizer.
func LoadTokenizer(dir string) (Tokenizer, error) {
	t, err := tokenizer.Load(dir)
	if err != nil {
		return nil, fmt.Errorf("tokenizer %s: %w", dir, err)
	}
	return modelTokenizer{t: t}, nil
}

// EncodeRequest renders and tokenizes the request as the engine does. The
// engine serves LoRA or salted requests too; the ids are what it would hash
// apart from those extra keys.
func (m modelTokenizer) EncodeRequest(engine, path string, body []byte) ([]uint32, error) {
	rt, err := m.t.EncodeRequest(engine, path, body)
	if err != nil {
		return nil, err
	}
	return rt.IDs, nil
}

// ModelTokenizer adapts an already loaded model tokenizer, so a harness
// that tokenizes requests itself shares one copy with its engines.
func ModelTokenizer(t *tokenizer.Tokenizer) Tokenizer { return modelTokenizer{t: t} }
