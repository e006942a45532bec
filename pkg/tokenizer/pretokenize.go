package tokenizer

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync"

	"github.com/dlclark/regexp2"
)

// gpt2Pattern is the regex the ByteLevel pre-tokenizer applies when
// use_regex is true (HuggingFace tokenizers, byte_level.rs).
const gpt2Pattern = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`

// splitBehavior mirrors SplitDelimiterBehavior.
type splitBehavior int

const (
	behaviorRemoved splitBehavior = iota
	behaviorIsolated
	behaviorMergedWithPrevious
	behaviorMergedWithNext
	behaviorContiguous
)

func parseBehavior(s string) (splitBehavior, error) {
	switch s {
	case "Removed":
		return behaviorRemoved, nil
	case "Isolated":
		return behaviorIsolated, nil
	case "MergedWithPrevious":
		return behaviorMergedWithPrevious, nil
	case "MergedWithNext":
		return behaviorMergedWithNext, nil
	case "Contiguous":
		return behaviorContiguous, nil
	}
	return 0, fmt.Errorf("unknown split behavior %q", s)
}

// preTokenizer cuts each piece of normalized text into smaller pieces. It
// appends the result for one input piece to dst. Implementations must be
// safe for concurrent use.
type preTokenizer interface {
	split(dst []string, piece string) []string
}

// matcher finds pattern occurrences in a piece as byte ranges.
type matcher interface {
	find(dst []span, s string) []span
}

type span struct{ start, end int }

type literalMatcher struct{ lit string }

func (m literalMatcher) find(dst []span, s string) []span {
	off := 0
	for {
		i := strings.Index(s[off:], m.lit)
		if i < 0 {
			return dst
		}
		dst = append(dst, span{off + i, off + i + len(m.lit)})
		off += i + len(m.lit)
	}
}

// regexMatcher runs a .NET-mode regexp2 pattern. Default mode (not RE2) is
// required: in RE2 mode regexp2's \s is ASCII-only, whereas Oniguruma, which
// HuggingFace uses, treats U+2028, U+3000, U+00A0, U+0085... as whitespace.
type regexMatcher struct {
	re   *regexp2.Regexp
	pool sync.Pool // *runeScratch
}

type runeScratch struct {
	runes []rune
	offs  []int // byte offset of each rune, plus len(s)
}

func newRegexMatcher(pattern string) (*regexMatcher, error) {
	re, err := regexp2.Compile(pattern, regexp2.None)
	if err != nil {
		return nil, fmt.Errorf("compile split regex %q: %w", pattern, err)
	}
	m := &regexMatcher{re: re}
	m.pool.New = func() any { return &runeScratch{} }
	return m, nil
}

func (m *regexMatcher) find(dst []span, s string) []span {
	sc := m.pool.Get().(*runeScratch)
	defer func() {
		if cap(sc.runes) <= maxPooledScratch {
			m.pool.Put(sc)
		}
	}()
	sc.runes, sc.offs = sc.runes[:0], sc.offs[:0]
	for i, r := range s {
		sc.runes = append(sc.runes, r)
		sc.offs = append(sc.offs, i)
	}
	sc.offs = append(sc.offs, len(s))
	match, err := m.re.FindRunesMatch(sc.runes)
	for err == nil && match != nil {
		if match.Length > 0 {
			dst = append(dst, span{sc.offs[match.Index], sc.offs[match.Index+match.Length]})
		}
		match, err = m.re.FindNextMatch(match)
	}
	// regexp2 only fails on a match timeout, which is never set here; any
	// text not covered by a match still becomes a piece below, so nothing
	// is dropped either way.
	return dst
}

// splitPre is the HuggingFace Split pre-tokenizer.
type splitPre struct {
	m        matcher
	behavior splitBehavior
	invert   bool
	pool     sync.Pool // *[]span
}

func newSplitPre(m matcher, b splitBehavior, invert bool) *splitPre {
	p := &splitPre{m: m, behavior: b, invert: invert}
	p.pool.New = func() any { s := make([]span, 0, 64); return &s }
	return p
}

func (p *splitPre) split(dst []string, s string) []string {
	if s == "" {
		return dst
	}
	bufp := p.pool.Get().(*[]span)
	matches := p.m.find((*bufp)[:0], s)
	defer func() {
		if cap(matches) <= maxPooledScratch {
			*bufp = matches[:0]
			p.pool.Put(bufp)
		}
	}()

	if p.behavior == behaviorIsolated && !p.invert {
		// Fast path for the common case: matches and gaps all become pieces.
		prev := 0
		for _, m := range matches {
			if prev < m.start {
				dst = append(dst, s[prev:m.start])
			}
			dst = append(dst, s[m.start:m.end])
			prev = m.end
		}
		if prev < len(s) {
			dst = append(dst, s[prev:])
		}
		return dst
	}

	// General path: list every match and gap, flag delimiters, then fold
	// them as SplitDelimiterBehavior does in HuggingFace tokenizers.
	type part struct {
		start, end int
		isMatch    bool
	}
	parts := make([]part, 0, 2*len(matches)+1)
	prev := 0
	for _, m := range matches {
		if prev < m.start {
			parts = append(parts, part{prev, m.start, p.invert})
		}
		parts = append(parts, part{m.start, m.end, !p.invert})
		prev = m.end
	}
	if prev < len(s) {
		parts = append(parts, part{prev, len(s), p.invert})
	}
	var out []span
	switch p.behavior {
	case behaviorIsolated:
		for _, pt := range parts {
			out = append(out, span{pt.start, pt.end})
		}
	case behaviorRemoved:
		for _, pt := range parts {
			if !pt.isMatch {
				out = append(out, span{pt.start, pt.end})
			}
		}
	case behaviorMergedWithPrevious:
		prevMatch := false
		for _, pt := range parts {
			if pt.isMatch && !prevMatch && len(out) > 0 {
				out[len(out)-1].end = pt.end
			} else {
				out = append(out, span{pt.start, pt.end})
			}
			prevMatch = pt.isMatch
		}
	case behaviorMergedWithNext:
		prevMatch := false
		for i := len(parts) - 1; i >= 0; i-- {
			pt := parts[i]
			if pt.isMatch && !prevMatch && len(out) > 0 {
				out[len(out)-1].start = pt.start
			} else {
				out = append(out, span{pt.start, pt.end})
			}
			prevMatch = pt.isMatch
		}
		for i, j := 0, len(out)-1; i < j; i, j = i+1, j-1 {
			out[i], out[j] = out[j], out[i]
		}
	case behaviorContiguous:
		prevMatch := false
		for _, pt := range parts {
			if pt.isMatch == prevMatch && len(out) > 0 {
				out[len(out)-1].end = pt.end
			} else {
				out = append(out, span{pt.start, pt.end})
			}
			prevMatch = pt.isMatch
		}
	}
	for _, sp := range out {
		if sp.start < sp.end {
			dst = append(dst, s[sp.start:sp.end])
		}
	}
	return dst
}

// byteLevelPre is the ByteLevel pre-tokenizer. The byte-to-rune mapping
// itself is implicit: the BPE vocabulary of a byte-level model is keyed by
// raw bytes, so pieces stay raw text.
type byteLevelPre struct {
	addPrefixSpace bool
	regex          *splitPre // nil unless use_regex
}

func (p *byteLevelPre) split(dst []string, s string) []string {
	if p.addPrefixSpace && !strings.HasPrefix(s, " ") {
		s = " " + s
	}
	if p.regex != nil {
		return p.regex.split(dst, s)
	}
	if s == "" {
		return dst
	}
	return append(dst, s)
}

// preSequence applies pre-tokenizers in order, each to every piece the
// previous one produced.
type preSequence struct {
	steps []preTokenizer
	pool  sync.Pool // *[2][]string scratch
}

func newPreSequence(steps []preTokenizer) *preSequence {
	q := &preSequence{steps: steps}
	q.pool.New = func() any { return new([2][]string) }
	return q
}

func (q *preSequence) split(dst []string, s string) []string {
	bufs := q.pool.Get().(*[2][]string)
	cur := append(bufs[0][:0], s)
	next := bufs[1][:0]
	for _, p := range q.steps {
		next = next[:0]
		for _, piece := range cur {
			next = p.split(next, piece)
		}
		cur, next = next, cur
	}
	dst = append(dst, cur...)
	clear(cur) // drop references to the input text
	clear(next)
	if cap(cur) <= maxPooledScratch && cap(next) <= maxPooledScratch {
		bufs[0], bufs[1] = cur[:0], next[:0]
		q.pool.Put(bufs)
	}
	return dst
}

type rawPreTokenizer struct {
	Type           string            `json:"type"`
	Pretokenizers  []json.RawMessage `json:"pretokenizers"`
	Pattern        *rawPattern       `json:"pattern"`
	Behavior       string            `json:"behavior"`
	Invert         bool              `json:"invert"`
	AddPrefixSpace bool              `json:"add_prefix_space"`
	UseRegex       *bool             `json:"use_regex"`
}

// parsePreTokenizer builds the pre-tokenizer and reports whether the chain
// contains a ByteLevel step (which makes the model byte-level).
func parsePreTokenizer(raw json.RawMessage, depth int) (pt preTokenizer, byteLevel bool, err error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, false, nil
	}
	if depth > 8 {
		return nil, false, fmt.Errorf("pre_tokenizer nesting deeper than 8")
	}
	var r rawPreTokenizer
	if err := json.Unmarshal(raw, &r); err != nil {
		return nil, false, fmt.Errorf("pre_tokenizer: %w", err)
	}
	switch r.Type {
	case "Sequence":
		var seq []preTokenizer
		for i, sub := range r.Pretokenizers {
			p, bl, err := parsePreTokenizer(sub, depth+1)
			if err != nil {
				return nil, false, fmt.Errorf("pre_tokenizer Sequence[%d]: %w", i, err)
			}
			byteLevel = byteLevel || bl
			if p != nil {
				seq = append(seq, p)
			}
		}
		switch len(seq) {
		case 0:
			return nil, byteLevel, nil
		case 1:
			return seq[0], byteLevel, nil
		}
		return newPreSequence(seq), byteLevel, nil
	case "Split":
		if r.Pattern == nil {
			return nil, false, fmt.Errorf("pre_tokenizer Split without pattern")
		}
		b, err := parseBehavior(r.Behavior)
		if err != nil {
			return nil, false, fmt.Errorf("pre_tokenizer Split: %w", err)
		}
		var m matcher
		switch {
		case r.Pattern.Regex != nil:
			rm, err := newRegexMatcher(*r.Pattern.Regex)
			if err != nil {
				return nil, false, fmt.Errorf("pre_tokenizer Split: %w", err)
			}
			m = rm
			if fm := fastMatcherFor(*r.Pattern.Regex); fm != nil {
				m = fm
			}
		case r.Pattern.String != nil:
			if *r.Pattern.String == "" {
				return nil, false, fmt.Errorf("pre_tokenizer Split: empty String pattern")
			}
			m = literalMatcher{lit: *r.Pattern.String}
		default:
			return nil, false, fmt.Errorf("pre_tokenizer Split: pattern needs String or Regex")
		}
		return newSplitPre(m, b, r.Invert), false, nil
	case "ByteLevel":
		p := &byteLevelPre{addPrefixSpace: r.AddPrefixSpace}
		if r.UseRegex == nil || *r.UseRegex {
			rm, err := newRegexMatcher(gpt2Pattern)
			if err != nil {
				return nil, false, err
			}
			p.regex = newSplitPre(rm, behaviorIsolated, false)
		}
		return p, true, nil
	case "":
		return nil, false, fmt.Errorf("pre_tokenizer without type")
	default:
		return nil, false, fmt.Errorf("unsupported pre_tokenizer type %q", r.Type)
	}
}
