package tokenizer

import (
	"unicode"
	"unicode/utf8"
)

// AddedToken is one entry of tokenizer.json "added_tokens".
type AddedToken struct {
	ID         uint32 `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	LStrip     bool   `json:"lstrip"`
	RStrip     bool   `json:"rstrip"`
	Normalized bool   `json:"normalized"`
	Special    bool   `json:"special"`
}

// addedMatcher finds added tokens in text with leftmost-longest semantics,
// the same non-overlapping match sequence as the Aho-Corasick automaton
// (MatchKind::LeftmostLongest) HuggingFace builds over added tokens.
type addedMatcher struct {
	nodes []trieNode
	first [256]bool // bytes that can start a token: lets the scan skip ahead
	any   bool
}

type trieNode struct {
	next  map[byte]int32
	token int32 // index into tokens, -1 if no token ends here
}

func newAddedMatcher(tokens []AddedToken, include func(AddedToken) bool) *addedMatcher {
	m := &addedMatcher{nodes: []trieNode{{token: -1}}}
	for i, t := range tokens {
		if t.Content == "" || !include(t) {
			continue
		}
		n := int32(0)
		for j := 0; j < len(t.Content); j++ {
			c := t.Content[j]
			if m.nodes[n].next == nil {
				m.nodes[n].next = make(map[byte]int32, 1)
			}
			nx, ok := m.nodes[n].next[c]
			if !ok {
				nx = int32(len(m.nodes))
				m.nodes = append(m.nodes, trieNode{token: -1})
				m.nodes[n].next[c] = nx
			}
			n = nx
		}
		// Duplicate contents: the first definition wins, like a map keyed by content.
		if m.nodes[n].token < 0 {
			m.nodes[n].token = int32(i)
		}
		m.first[t.Content[0]] = true
		m.any = true
	}
	return m
}

// longestAt returns the token index and end offset of the longest token that
// starts at text[i:], or -1.
func (m *addedMatcher) longestAt(text string, i int) (tok int32, end int) {
	tok, end = -1, -1
	n := int32(0)
	for j := i; j < len(text); j++ {
		nx, ok := m.nodes[n].next[text[j]]
		if !ok {
			break
		}
		n = nx
		if m.nodes[n].token >= 0 {
			tok, end = m.nodes[n].token, j+1
		}
	}
	return tok, end
}

// segment is a piece of input: either an added token (id valid) or plain
// text to be normalized and run through the model.
type segment struct {
	start, end int
	added      bool
	id         uint32
}

// split cuts text[from:to] into plain and added-token segments, appending to
// dst. It applies the single_word, lstrip and rstrip rules exactly where the
// HuggingFace AddedVocabulary does: after a match is found, before it is cut.
func (m *addedMatcher) split(dst []segment, tokens []AddedToken, text string, from, to int) []segment {
	if !m.any {
		return append(dst, segment{start: from, end: to})
	}
	sub := text[:to]
	startOffset := from
	for i := from; i < to; {
		if !m.first[sub[i]] {
			i++
			continue
		}
		ti, end := m.longestAt(sub, i)
		if ti < 0 {
			i++
			continue
		}
		t := tokens[ti]
		start, stop := i, end
		i = end // non-overlapping: the automaton resumes after the match
		if t.SingleWord {
			startSpace := start == 0 || !isWordRune(lastRune(sub[:start]))
			stopSpace := stop == len(sub) || !isWordRune(firstRune(sub[stop:]))
			if !startSpace || !stopSpace {
				continue
			}
		}
		if t.LStrip {
			ns := start
			for ns > startOffset {
				r, size := utf8.DecodeLastRuneInString(sub[:ns])
				if !unicode.IsSpace(r) {
					break
				}
				ns -= size
			}
			start = ns
		}
		if t.RStrip {
			for stop < len(sub) {
				r, size := utf8.DecodeRuneInString(sub[stop:])
				if !unicode.IsSpace(r) {
					break
				}
				stop += size
			}
			i = stop
		}
		if startOffset < start {
			dst = append(dst, segment{start: startOffset, end: start})
		}
		dst = append(dst, segment{start: start, end: stop, added: true, id: t.ID})
		startOffset = stop
	}
	if startOffset < to {
		dst = append(dst, segment{start: startOffset, end: to})
	}
	return dst
}

func isWordRune(r rune) bool {
	return r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r) || unicode.IsNumber(r)
}

func lastRune(s string) rune  { r, _ := utf8.DecodeLastRuneInString(s); return r }
func firstRune(s string) rune { r, _ := utf8.DecodeRuneInString(s); return r }
