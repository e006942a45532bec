package enginesim

import (
	"encoding/json"
	"fmt"
	"hash/fnv"
	"strings"
	"unicode"
)

// Tokenizer turns an OpenAI-style request body into prompt token ids, as the
// engine would (chat requests go through the model's chat template). It must
// be safe for concurrent use. The emulator calls it only for text prompts;
// token-id prompts are taken as they are.
type Tokenizer interface {
	EncodeRequest(engine, path string, body []byte) ([]uint32, error)
}

// SimpleTokenizer is the built-in deterministic fallback used when no
// tokenizer directory is configured. It is not any model's tokenizer: text is
// split into words (a run of letters or digits together with the spaces
// before it) and single punctuation characters, and each piece maps to
// 256 + FNV-1a(piece) mod 50000. Chat requests are rendered first with a
// ChatML-like template ("<|im_start|>{role}\n{content}<|im_end|>\n" per
// message, then "<|im_start|>assistant\n"). Equal text prefixes therefore give
// equal token prefixes, which is what prefix caching needs. A gateway under
// test must use the same tokenizer to see cache hits: configure a real
// tokenizer directory on both sides for end-to-end tests, or send token-id
// prompts.
type SimpleTokenizer struct{}

var _ Tokenizer = SimpleTokenizer{}

// Encode tokenizes plain text.
func (SimpleTokenizer) Encode(text string) []uint32 {
	var out []uint32
	emit := func(p string) {
		h := fnv.New32a()
		h.Write([]byte(p))
		out = append(out, 256+h.Sum32()%50000)
	}
	start := 0
	inWord := false
	for i, r := range text {
		word := unicode.IsLetter(r) || unicode.IsDigit(r)
		space := unicode.IsSpace(r)
		switch {
		case word:
			inWord = true
		case space:
			if inWord {
				emit(text[start:i])
				start = i
				inWord = false
			}
		default: // punctuation or symbol: flush, then a piece of its own
			if i > start {
				emit(text[start:i])
			}
			end := i + len(string(r))
			emit(text[i:end])
			start = end
			inWord = false
		}
	}
	if start < len(text) {
		emit(text[start:])
	}
	return out
}

// EncodeRequest renders and tokenizes a completions or chat request body.
func (t SimpleTokenizer) EncodeRequest(_, path string, body []byte) ([]uint32, error) {
	var req struct {
		Prompt   json.RawMessage `json:"prompt"`
		Messages []chatMessage   `json:"messages"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		return nil, fmt.Errorf("%w: request body: %v", ErrBadRequest, err)
	}
	if strings.HasSuffix(path, "/chat/completions") || (req.Messages != nil && req.Prompt == nil) {
		text, err := renderChat(req.Messages)
		if err != nil {
			return nil, err
		}
		return t.Encode(text), nil
	}
	var s string
	if err := json.Unmarshal(req.Prompt, &s); err != nil {
		return nil, fmt.Errorf("%w: prompt must be a string or a list of token ids", ErrBadRequest)
	}
	return t.Encode(s), nil
}

type chatMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// messageText flattens string content or a list of {"type":"text"} parts.
func messageText(raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", fmt.Errorf("%w: message content must be a string or a list of content parts", ErrBadRequest)
	}
	var b strings.Builder
	for _, p := range parts {
		if p.Type != "text" {
			return "", fmt.Errorf("%w: content part type %q is not supported (text only)", ErrBadRequest, p.Type)
		}
		b.WriteString(p.Text)
	}
	return b.String(), nil
}

func renderChat(msgs []chatMessage) (string, error) {
	if len(msgs) == 0 {
		return "", fmt.Errorf("%w: messages must be a non-empty list", ErrBadRequest)
	}
	var b strings.Builder
	for i, m := range msgs {
		if m.Role == "" {
			return "", fmt.Errorf("%w: messages[%d].role is required", ErrBadRequest, i)
		}
		text, err := messageText(m.Content)
		if err != nil {
			return "", fmt.Errorf("messages[%d]: %w", i, err)
		}
		b.WriteString("<|im_start|>" + m.Role + "\n" + text + "<|im_end|>\n")
	}
	b.WriteString("<|im_start|>assistant\n")
	return b.String(), nil
}
