package tokenizer

import (
	"encoding/json"
	"fmt"
)

// parseConfig reads the tokenizer_config.json fields that affect prompt
// rendering. Special tokens may be plain strings or AddedToken objects
// ({"content": ...}); chat_template may be a string or a list of named
// templates.
func parseConfig(b []byte) (Config, error) {
	var raw struct {
		ChatTemplate   json.RawMessage `json:"chat_template"`
		BOSToken       json.RawMessage `json:"bos_token"`
		EOSToken       json.RawMessage `json:"eos_token"`
		PADToken       json.RawMessage `json:"pad_token"`
		UNKToken       json.RawMessage `json:"unk_token"`
		AddBOSToken    *bool           `json:"add_bos_token"`
		AddEOSToken    *bool           `json:"add_eos_token"`
		TokenizerClass string          `json:"tokenizer_class"`
		SplitSpecial   bool            `json:"split_special_tokens"`
		ModelMaxLength json.Number     `json:"model_max_length"`
	}
	if err := json.Unmarshal(b, &raw); err != nil {
		return Config{}, fmt.Errorf("parse: %w", err)
	}
	c := Config{AddBOSToken: raw.AddBOSToken, AddEOSToken: raw.AddEOSToken, TokenizerClass: raw.TokenizerClass, SplitSpecialTokens: raw.SplitSpecial,
		ModelMaxLength: maxLength(raw.ModelMaxLength)}
	var err error
	for _, f := range []struct {
		name string
		raw  json.RawMessage
		dst  *string
	}{{"bos_token", raw.BOSToken, &c.BOSToken}, {"eos_token", raw.EOSToken, &c.EOSToken}, {"pad_token", raw.PADToken, &c.PADToken}, {"unk_token", raw.UNKToken, &c.UNKToken}} {
		if *f.dst, err = specialTokenString(f.raw); err != nil {
			return Config{}, fmt.Errorf("%s: %w", f.name, err)
		}
	}
	if len(raw.ChatTemplate) > 0 && string(raw.ChatTemplate) != "null" {
		var s string
		if err := json.Unmarshal(raw.ChatTemplate, &s); err == nil {
			c.ChatTemplate = s
		} else {
			var named []struct {
				Name     string `json:"name"`
				Template string `json:"template"`
			}
			if err := json.Unmarshal(raw.ChatTemplate, &named); err != nil {
				return Config{}, fmt.Errorf("chat_template: neither a string nor a list of {name, template}")
			}
			c.ChatTemplates = make(map[string]string, len(named))
			for _, n := range named {
				c.ChatTemplates[n.Name] = n.Template
			}
			c.ChatTemplate = c.ChatTemplates["default"]
		}
	}
	return c, nil
}

func specialTokenString(raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var obj struct {
		Content string `json:"content"`
	}
	if err := json.Unmarshal(raw, &obj); err != nil {
		return "", fmt.Errorf("neither a string nor {\"content\": ...}")
	}
	return obj.Content, nil
}

// maxLengthCeiling is the largest context length taken at face value.
// transformers writes int(1e30) for "no limit", and no model's context
// comes near 2^24 tokens.
const maxLengthCeiling = 1 << 24

// maxLength reads a context length; 0 when absent, not a positive
// integer, or the "no limit" sentinel.
func maxLength(n json.Number) int {
	v, err := n.Int64()
	if err != nil || v <= 0 || v > maxLengthCeiling {
		return 0
	}
	return int(v)
}

// parseModelConfig reads the context length from a model's config.json:
// max_position_embeddings, at the top level or (multimodal models) under
// text_config. 0 when none is given.
func parseModelConfig(b []byte) (int, error) {
	var raw struct {
		MaxPositionEmbeddings json.Number `json:"max_position_embeddings"`
		TextConfig            *struct {
			MaxPositionEmbeddings json.Number `json:"max_position_embeddings"`
		} `json:"text_config"`
	}
	if err := json.Unmarshal(b, &raw); err != nil {
		return 0, fmt.Errorf("parse: %w", err)
	}
	if n := maxLength(raw.MaxPositionEmbeddings); n > 0 {
		return n, nil
	}
	if raw.TextConfig != nil {
		return maxLength(raw.TextConfig.MaxPositionEmbeddings), nil
	}
	return 0, nil
}
