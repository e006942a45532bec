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
		return scanClass(s, i+n0, clsLetter)
	}
	if r0 != '\r' && r0 != '\n' && c0 != clsNumber && i+n0 < len(s) {
		if r1, n1 := decodeAt(s, i+n0); classOf(r1) == clsLetter {
			return scanClass(s, i+n0+n1, clsLetter)
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
		r, n := decodeAt(s, j)
		if classOf(r) != cls {
			break
		}
		j += n
	}
	return j
}
