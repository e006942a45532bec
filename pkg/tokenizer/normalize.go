package tokenizer

import (
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// normalizer transforms the plain text between added tokens before
// pre-tokenization. Implementations must be safe for concurrent use.
type normalizer interface {
	normalize(s string) string
}

type normForm struct{ f norm.Form }

func (n normForm) normalize(s string) string {
	if n.isNormal(s) {
		return s
	}
	return n.f.String(s)
}

// isNormal is n.f.IsNormalString(s), with the ASCII between other text
// skipped for NFC: a prompt is mostly ASCII, and x/text looks every byte
// up. An ASCII character is unchanged by NFC, has combining class 0 and is
// never the second of a composition, so NFC acts on each run of
// non-ASCII text together with the ASCII character before it (which may
// compose with the run, as "e" with U+0301) independently of the rest:
// s is normal if and only if every such piece is. That holds for valid
// UTF-8 only: x/text reads an invalid lead byte together with whatever
// follows it, ASCII included, so text with invalid bytes is checked whole.
func (n normForm) isNormal(s string) bool {
	const nfcGap = 64
	if n.f != norm.NFC || !utf8.ValidString(s) {
		return n.f.IsNormalString(s)
	}
	for i := 0; i < len(s); {
		if s[i] < utf8.RuneSelf {
			i++
			continue
		}
		// Runs closer than nfcGap bytes go into one piece: each call of
		// x/text allocates, and any ASCII character is a place to cut.
		j := i + 1
		for j < len(s) {
			if s[j] >= utf8.RuneSelf {
				j++
				continue
			}
			k := j
			for k < len(s) && k-j < nfcGap && s[k] < utf8.RuneSelf {
				k++
			}
			if k == len(s) || k-j == nfcGap {
				break
			}
			j = k
		}
		if !n.f.IsNormalString(s[max(i-1, 0):j]) {
			return false
		}
		i = j
	}
	return true
}

type normSequence []normalizer

func (q normSequence) normalize(s string) string {
	for _, n := range q {
		s = n.normalize(s)
	}
	return s
}

type normPrepend struct{ prefix string }

func (p normPrepend) normalize(s string) string {
	if s == "" {
		return s
	}
	return p.prefix + s
}

type normReplace struct{ pattern, content string }

func (r normReplace) normalize(s string) string { return strings.ReplaceAll(s, r.pattern, r.content) }

type normLowercase struct{}

func (normLowercase) normalize(s string) string { return strings.ToLower(s) }

type rawNormalizer struct {
	Type        string            `json:"type"`
	Normalizers []json.RawMessage `json:"normalizers"`
	Prepend     string            `json:"prepend"`
	Pattern     *rawPattern       `json:"pattern"`
	Content     string            `json:"content"`
}

type rawPattern struct {
	String *string `json:"String"`
	Regex  *string `json:"Regex"`
}

// parseNormalizer builds the normalizer described by tokenizer.json. A nil
// result means "no normalization". Types that would change ids if ignored
// are rejected rather than skipped.
func parseNormalizer(raw json.RawMessage, depth int) (normalizer, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	if depth > 8 {
		return nil, fmt.Errorf("normalizer nesting deeper than 8")
	}
	var r rawNormalizer
	if err := json.Unmarshal(raw, &r); err != nil {
		return nil, fmt.Errorf("normalizer: %w", err)
	}
	switch r.Type {
	case "NFC":
		return normForm{norm.NFC}, nil
	case "NFD":
		return normForm{norm.NFD}, nil
	case "NFKC":
		return normForm{norm.NFKC}, nil
	case "NFKD":
		return normForm{norm.NFKD}, nil
	case "Lowercase":
		return normLowercase{}, nil
	case "Prepend":
		return normPrepend{prefix: r.Prepend}, nil
	case "Replace":
		if r.Pattern == nil || r.Pattern.String == nil {
			return nil, fmt.Errorf("normalizer Replace: only String patterns are supported")
		}
		if *r.Pattern.String == "" {
			return nil, fmt.Errorf("normalizer Replace: empty pattern")
		}
		return normReplace{pattern: *r.Pattern.String, content: r.Content}, nil
	case "Sequence":
		var seq normSequence
		for i, sub := range r.Normalizers {
			n, err := parseNormalizer(sub, depth+1)
			if err != nil {
				return nil, fmt.Errorf("normalizer Sequence[%d]: %w", i, err)
			}
			if n != nil {
				seq = append(seq, n)
			}
		}
		if len(seq) == 0 {
			return nil, nil
		}
		return seq, nil
	case "":
		return nil, fmt.Errorf("normalizer without type")
	default:
		return nil, fmt.Errorf("unsupported normalizer type %q", r.Type)
	}
}
