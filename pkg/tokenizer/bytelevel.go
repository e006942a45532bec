package tokenizer

import "unicode/utf8"

// byteLevelAlphabet is GPT-2's reversible byte-to-rune mapping used by the
// ByteLevel pre-tokenizer and decoder: printable Latin-1 bytes map to
// themselves, the remaining 68 bytes map to U+0100 upwards so that every
// byte has a visible, whitespace-free stand-in in vocab strings.
type byteLevelAlphabet struct {
	toRune [256]rune
	toByte map[rune]byte
}

func newByteLevelAlphabet() *byteLevelAlphabet {
	a := &byteLevelAlphabet{toByte: make(map[rune]byte, 256)}
	n := 0
	for b := 0; b < 256; b++ {
		if (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF) {
			a.toRune[b] = rune(b)
		} else {
			a.toRune[b] = rune(256 + n)
			n++
		}
		a.toByte[a.toRune[b]] = byte(b)
	}
	return a
}

// decode maps a vocab string written in the byte-level alphabet back to the
// raw bytes it stands for. ok is false when s holds a rune outside the
// alphabet: such an entry can never be produced by byte-level BPE.
func (a *byteLevelAlphabet) decode(s string) (out []byte, ok bool) {
	out = make([]byte, 0, len(s))
	for _, r := range s {
		b, found := a.toByte[r]
		if !found {
			return nil, false
		}
		out = append(out, b)
	}
	return out, true
}

// encode maps raw bytes to their byte-level alphabet string.
func (a *byteLevelAlphabet) encode(b []byte) string {
	buf := make([]byte, 0, len(b)*2)
	for _, c := range b {
		buf = utf8.AppendRune(buf, a.toRune[c])
	}
	return string(buf)
}

// appendLossyUTF8 appends b to dst, replacing every maximal ill-formed
// subsequence with U+FFFD. This is the substitution rule of Rust's
// String::from_utf8_lossy (and Unicode's recommended practice), which the
// HuggingFace ByteLevel decoder uses; Go's utf8 helpers would instead emit
// one replacement per byte of a truncated sequence.
func appendLossyUTF8(dst []byte, b []byte) []byte {
	for i := 0; i < len(b); {
		c := b[i]
		if c < utf8.RuneSelf {
			dst = append(dst, c)
			i++
			continue
		}
		r, size := utf8.DecodeRune(b[i:])
		if r != utf8.RuneError || size > 1 {
			dst = append(dst, b[i:i+size]...)
			i += size
			continue
		}
		// Invalid: consume the longest prefix of a well-formed sequence.
		i += maximalSubpart(b[i:])
		dst = append(dst, "\uFFFD"...)
	}
	return dst
}

// maximalSubpart returns the length (>= 1) of the longest prefix of b that
// is a valid start of a UTF-8 sequence but not a complete one.
func maximalSubpart(b []byte) int {
	c := b[0]
	var need int
	lo, hi := byte(0x80), byte(0xBF)
	switch {
	case c >= 0xC2 && c <= 0xDF:
		need = 1
	case c == 0xE0:
		need, lo = 2, 0xA0
	case c >= 0xE1 && c <= 0xEC, c == 0xEE, c == 0xEF:
		need = 2
	case c == 0xED:
		need, hi = 2, 0x9F
	case c == 0xF0:
		need, lo = 3, 0x90
	case c >= 0xF1 && c <= 0xF3:
		need = 3
	case c == 0xF4:
		need, hi = 3, 0x8F
	default:
		return 1
	}
	n := 1
	for k := 0; k < need && n < len(b); k++ {
		x := b[n]
		if x < lo || x > hi {
			break
		}
		lo, hi = 0x80, 0xBF
		n++
	}
	return n
}
