package tokenizer

import (
	"unicode"
	"unicode/utf8"
)

// The pre-tokenizer patterns of Qwen2/2.5/3 and Llama-3.x. Their only
// difference is how many digits one piece may hold.
const (
	qwenPattern   = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	llama3Pattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
)

// fastMatcherFor returns a hand-written matcher equivalent to pattern, or
// nil when none is known (regexp2 is then used).
func fastMatcherFor(pattern string) matcher {
	switch pattern {
	case qwenPattern:
		return bpeScanner{maxDigits: 1}
	case llama3Pattern:
		return bpeScanner{maxDigits: 3}
	}
	return nil
}

// directScanner reports whether pre is a known pattern's Split (isolated,
// not inverted), alone or followed by a ByteLevel step that neither adds a
// prefix space nor splits again: the pieces are then exactly the
// scanner's matches, in order, and the encoder can walk them directly.
func directScanner(pre preTokenizer) (bpeScanner, bool) {
	if q, ok := pre.(*preSequence); ok {
		if len(q.steps) != 2 {
			return bpeScanner{}, false
		}
		bl, ok := q.steps[1].(*byteLevelPre)
		if !ok || bl.addPrefixSpace || bl.regex != nil {
			return bpeScanner{}, false
		}
		pre = q.steps[0]
	}
	sp, ok := pre.(*splitPre)
	if !ok || sp.behavior != behaviorIsolated || sp.invert {
		return bpeScanner{}, false
	}
	sc, ok := sp.m.(bpeScanner)
	return sc, ok
}

// bpeScanner matches exactly what regexp2 (default mode) matches for
// qwenPattern / llama3Pattern, without allocating: the regex engine
// allocates per match and dominates encode time. Character classes use the
// same definitions as regexp2: \p{L} = unicode.IsLetter, \p{N} =
// unicode.IsNumber, \s = unicode.IsSpace, (?i) = unicode.ToLower.
// Equivalence is checked against regexp2 on the parity corpus and by
// FuzzScannerMatchesRegexp.
//
// At every position one alternative matches (letters, numbers, whitespace
// and "other" characters are each covered), so the matches tile the input
// and the scanner only has to find where each one ends.
type bpeScanner struct{ maxDigits int }

const (
	clsOther = iota
	clsLetter
	clsNumber
	clsSpace
)

func classOf(r rune) int {
	if r < utf8.RuneSelf {
		return int(asciiClass[r])
	}
	switch {
	case unicode.IsLetter(r):
		return clsLetter
	case unicode.IsNumber(r):
		return clsNumber
	case unicode.IsSpace(r):
		return clsSpace
	}
	return clsOther
}

var asciiClass = func() (t [utf8.RuneSelf]uint8) {
	for r := rune(0); r < utf8.RuneSelf; r++ {
		switch {
		case unicode.IsLetter(r):
			t[r] = clsLetter
		case unicode.IsNumber(r):
			t[r] = clsNumber
		case unicode.IsSpace(r):
			t[r] = clsSpace
		default:
			t[r] = clsOther
		}
	}
	return t
}()

func decodeAt(s string, i int) (rune, int) {
	if c := s[i]; c < utf8.RuneSelf {
		return rune(c), 1
	}
	return utf8.DecodeRuneInString(s[i:])
}

func (m bpeScanner) find(dst []span, s string) []span {
	for i := 0; i < len(s); {
		end := m.matchAt(s, i)
		dst = append(dst, span{i, end})
		i = end
	}
	return dst
}

// lowerAt returns unicode.ToLower of the rune at i and its size, or -1 at the end.
func lowerAt(s string, i int) (rune, int) {
	if i >= len(s) {
		return -1, 0
	}
	r, n := decodeAt(s, i)
	return unicode.ToLower(r), n
}

func (m bpeScanner) matchAt(s string, i int) int {
	// ASCII fast paths for the pieces most text is made of: a word, a
	// space and a word, a digit. Each is what the general path below
	// returns for these inputs (the contractions start with '\'', which
	// takes the general path).
	if c := s[i]; c < utf8.RuneSelf {
		switch asciiClass[c] {
		case clsLetter:
			return scanLetters(s, i+1)
		case clsNumber:
			if m.maxDigits == 1 {
				return i + 1
			}
		case clsSpace:
			if c == ' ' && i+1 < len(s) {
				if d := s[i+1]; d < utf8.RuneSelf && asciiClass[d] == clsLetter {
					return scanLetters(s, i+2)
				}
			}
		}
	}
	r0, n0 := decodeAt(s, i)
	c0 := classOf(r0)

	// (?i:'s|'t|'re|'ve|'m|'ll|'d)
	if r0 == '\'' {
		l1, n1 := lowerAt(s, i+1)
		switch l1 {
		case 's', 't', 'm', 'd':
			return i + 1 + n1
		case 'r', 'v':
			if l2, n2 := lowerAt(s, i+1+n1); l2 == 'e' {
				return i + 1 + n1 + n2
			}
		case 'l':
			if l2, n2 := lowerAt(s, i+1+n1); l2 == 'l' {
				return i + 1 + n1 + n2
			}
		}
	}

	// [^\r\n\p{L}\p{N}]?\p{L}+
	if c0 == clsLetter {
		return scanLetters(s, i+n0)
	}
	if r0 != '\r' && r0 != '\n' && c0 != clsNumber && i+n0 < len(s) {
		if r1, n1 := decodeAt(s, i+n0); classOf(r1) == clsLetter {
			return scanLetters(s, i+n0+n1)
		}
	}

	// \p{N} or \p{N}{1,3}
	if c0 == clsNumber {
		j := i + n0
		for k := 1; k < m.maxDigits && j < len(s); k++ {
			r, n := decodeAt(s, j)
			if classOf(r) != clsNumber {
				break
			}
			j += n
		}
		return j
	}

	// ' ?[^\s\p{L}\p{N}]+[\r\n]*'
	j := i
	if r0 == ' ' {
		j = i + 1
	}
	if j < len(s) {
		if r, n := decodeAt(s, j); classOf(r) == clsOther {
			j = scanClass(s, j+n, clsOther)
			for j < len(s) && (s[j] == '\r' || s[j] == '\n') {
				j++
			}
			return j
		}
	}

	// Only whitespace is left at i. Find the run and its last CR/LF.
	j = i
	lastNL, lastSize := -1, 0
	for j < len(s) {
		r, n := decodeAt(s, j)
		if classOf(r) != clsSpace {
			break
		}
		if r == '\r' || r == '\n' {
			lastNL = j
		}
		lastSize = n
		j += n
	}
	if j == i {
		// Unreachable for valid classes; never return an empty match.
		return i + n0
	}
	// \s*[\r\n]+ : up to and including the run's last CR/LF.
	if lastNL >= 0 {
		return lastNL + 1
	}
	// \s+(?!\S) : the whole run at the end of input, else all but its last rune.
	if j == len(s) {
		return j
	}
	if j-lastSize > i {
		return j - lastSize
	}
	// \s+ : a single whitespace rune before non-space.
	return j
}

// scanClass advances j over runes of class cls.
func scanClass(s string, j int, cls int) int {
	for j < len(s) {
		if c := s[j]; c < utf8.RuneSelf {
			if int(asciiClass[c]) != cls {
				break
			}
			j++
			continue
		}
		r, n := utf8.DecodeRuneInString(s[j:])
		if classOf(r) != cls {
			break
		}
		j += n
	}
	return j
}

// scanLetters is scanClass(s, j, clsLetter) with the ASCII loop on its
// own: a word is most of what the scanner reads.
func scanLetters(s string, j int) int {
	for j < len(s) {
		c := s[j]
		if c >= utf8.RuneSelf {
			return scanClass(s, j, clsLetter)
		}
		if asciiClass[c] != clsLetter {
			break
		}
		j++
	}
	return j
}
