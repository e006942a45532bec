package tokenizer

import (
	"encoding/json"
	"fmt"
	"strings"
)

// postProcessor adds special tokens around an encoded sequence when the
// caller asks for add_special_tokens. body appends the sequence's ids.
type postProcessor interface {
	apply(dst []uint32, body func([]uint32) []uint32) []uint32
}

// templatePost is TemplateProcessing's "single" template: a list of pieces,
// each either fixed ids or the sequence itself.
type templatePost struct {
	items []templateItem
}

type templateItem struct {
	seq bool
	ids []uint32
}

func (p *templatePost) apply(dst []uint32, body func([]uint32) []uint32) []uint32 {
	for _, it := range p.items {
		if it.seq {
			dst = body(dst)
		} else {
			dst = append(dst, it.ids...)
		}
	}
	return dst
}

// noopPost stands for processors that do not change ids (ByteLevel).
type noopPost struct{}

func (noopPost) apply(dst []uint32, body func([]uint32) []uint32) []uint32 { return body(dst) }

type postSequence []postProcessor

func (q postSequence) apply(dst []uint32, body func([]uint32) []uint32) []uint32 {
	if len(q) == 0 {
		return body(dst)
	}
	// Nest so that each processor wraps the result of the ones after it.
	return q[0].apply(dst, func(d []uint32) []uint32 { return q[1:].apply(d, body) })
}

type rawPost struct {
	Type          string                     `json:"type"`
	Processors    []json.RawMessage          `json:"processors"`
	Single        []json.RawMessage          `json:"single"`
	SpecialTokens map[string]rawSpecialToken `json:"special_tokens"`
	Sep           []json.RawMessage          `json:"sep"`
	Cls           []json.RawMessage          `json:"cls"`
}

type rawSpecialToken struct {
	ID  string   `json:"id"`
	IDs []uint32 `json:"ids"`
}

func parsePostProcessor(raw json.RawMessage, vocab map[string]uint32, depth int) (postProcessor, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	if depth > 8 {
		return nil, fmt.Errorf("post_processor nesting deeper than 8")
	}
	var r rawPost
	if err := json.Unmarshal(raw, &r); err != nil {
		return nil, fmt.Errorf("post_processor: %w", err)
	}
	switch r.Type {
	case "ByteLevel":
		return noopPost{}, nil
	case "Sequence":
		var seq postSequence
		for i, sub := range r.Processors {
			p, err := parsePostProcessor(sub, vocab, depth+1)
			if err != nil {
				return nil, fmt.Errorf("post_processor Sequence[%d]: %w", i, err)
			}
			if p != nil {
				seq = append(seq, p)
			}
		}
		return seq, nil
	case "TemplateProcessing":
		p := &templatePost{}
		for i, itemRaw := range r.Single {
			var item struct {
				SpecialToken *struct {
					ID string `json:"id"`
				} `json:"SpecialToken"`
				Sequence *struct {
					ID string `json:"id"`
				} `json:"Sequence"`
			}
			if err := json.Unmarshal(itemRaw, &item); err != nil {
				return nil, fmt.Errorf("post_processor TemplateProcessing single[%d]: %w", i, err)
			}
			switch {
			case item.Sequence != nil:
				if item.Sequence.ID != "A" {
					return nil, fmt.Errorf("post_processor TemplateProcessing single[%d]: sequence %q in a single template", i, item.Sequence.ID)
				}
				p.items = append(p.items, templateItem{seq: true})
			case item.SpecialToken != nil:
				st, ok := r.SpecialTokens[item.SpecialToken.ID]
				if !ok || len(st.IDs) == 0 {
					return nil, fmt.Errorf("post_processor TemplateProcessing: special token %q missing from special_tokens", item.SpecialToken.ID)
				}
				p.items = append(p.items, templateItem{ids: st.IDs})
			default:
				return nil, fmt.Errorf("post_processor TemplateProcessing single[%d]: neither SpecialToken nor Sequence", i)
			}
		}
		return p, nil
	case "BertProcessing", "RobertaProcessing":
		cls, err := tokenPairID(r.Cls, vocab)
		if err != nil {
			return nil, fmt.Errorf("post_processor %s cls: %w", r.Type, err)
		}
		sep, err := tokenPairID(r.Sep, vocab)
		if err != nil {
			return nil, fmt.Errorf("post_processor %s sep: %w", r.Type, err)
		}
		return &templatePost{items: []templateItem{{ids: []uint32{cls}}, {seq: true}, {ids: []uint32{sep}}}}, nil
	case "":
		return nil, fmt.Errorf("post_processor without type")
	default:
		return nil, fmt.Errorf("unsupported post_processor type %q", r.Type)
	}
}

// tokenPairID reads the ["token", id] pairs Bert/Roberta processors use.
func tokenPairID(pair []json.RawMessage, vocab map[string]uint32) (uint32, error) {
	if len(pair) != 2 {
		return 0, fmt.Errorf("want [token, id]")
	}
	var id uint32
	if err := json.Unmarshal(pair[1], &id); err != nil {
		return 0, fmt.Errorf("id: %w", err)
	}
	return id, nil
}

// decoderKind is the subset of HuggingFace decoders the gateway needs to
// turn ids back into text for diagnostics.
type decoderKind struct {
	byteLevel    bool
	metaspace    string // replacement rune written as space, e.g. "▁"
	byteFallback bool
	stripStart   int // leading spaces to strip (Strip decoder / Metaspace prepend)
}

type rawDecoder struct {
	Type        string            `json:"type"`
	Decoders    []json.RawMessage `json:"decoders"`
	Pattern     *rawPattern       `json:"pattern"`
	Content     string            `json:"content"`
	Replacement string            `json:"replacement"`
	Start       int               `json:"start"`
}

func parseDecoder(raw json.RawMessage) (decoderKind, error) {
	var d decoderKind
	if len(raw) == 0 || string(raw) == "null" {
		return d, nil
	}
	var walk func(json.RawMessage, int) error
	walk = func(raw json.RawMessage, depth int) error {
		if depth > 8 {
			return fmt.Errorf("decoder nesting deeper than 8")
		}
		var r rawDecoder
		if err := json.Unmarshal(raw, &r); err != nil {
			return fmt.Errorf("decoder: %w", err)
		}
		switch r.Type {
		case "ByteLevel":
			d.byteLevel = true
		case "Sequence":
			for _, sub := range r.Decoders {
				if err := walk(sub, depth+1); err != nil {
					return err
				}
			}
		case "Replace":
			if r.Pattern != nil && r.Pattern.String != nil && r.Content == " " {
				d.metaspace = *r.Pattern.String
			}
		case "Metaspace":
			d.metaspace = r.Replacement
			d.stripStart = 1
		case "ByteFallback":
			d.byteFallback = true
		case "Strip":
			d.stripStart = r.Start
		case "Fuse":
		default:
			// Decoding is diagnostic only; an unknown decoder degrades to
			// concatenating token strings rather than refusing the file.
		}
		return nil
	}
	return d, walk(raw, 0)
}

// tokenBytes is what one token contributes to decoded output.
func (d decoderKind) tokenBytes(tok string, alpha *byteLevelAlphabet) []byte {
	if d.byteLevel {
		if b, ok := alpha.decode(tok); ok {
			return b
		}
		return []byte(tok)
	}
	if d.byteFallback && len(tok) == 6 && strings.HasPrefix(tok, "<0x") && tok[5] == '>' {
		var b byte
		if _, err := fmt.Sscanf(tok[3:5], "%02X", &b); err == nil {
			return []byte{b}
		}
	}
	if d.metaspace != "" {
		tok = strings.ReplaceAll(tok, d.metaspace, " ")
	}
	return []byte(tok)
}

func (d decoderKind) finish(raw []byte) string {
	out := appendLossyUTF8(make([]byte, 0, len(raw)), raw)
	s := string(out)
	for i := 0; i < d.stripStart && strings.HasPrefix(s, " "); i++ {
		s = s[1:]
	}
	return s
}
