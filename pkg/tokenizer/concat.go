package tokenizer

import (
	"regexp"
	"strings"
)

// Chat templates print each message as one concatenation, e.g. Qwen's
//
//	{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
//
// ardanlabs/jinja evaluates "+" left to right, building a new string at
// every step, so a long message is copied once per operand after it
// before the output copies it again: for a 2k-token prompt that is most of
// the render's time. splitConcatOutputs rewrites such a tag into one tag
// per operand, which prints the same text:
//
//	{{- '<|im_start|>' }}{{ message.role }}{{ '\n' }}{{ message.content }}{{ '<|im_end|>' }}{{ '\n' }}
//
// Only tags whose whole expression is a string literal followed by "+"
// and operands that are string literals or plain variable paths (names,
// attributes, integer subscripts) are rewritten. Then every intermediate
// value is a string (the library's string + x is string + print(x)), so
// printing the operands one after another gives the same bytes, and the
// operands are evaluated in the same order, so a failing one fails the
// render as before. No text is added between the new tags, so whitespace
// control ("{{-", "-}}", and the trimming of block tags, which skips over
// expression tags to the nearest text) acts on the same text.
var (
	concatOutput  = regexp.MustCompile(`^\s*(` + jinjaString + `)((?:\s*\+\s*(?:` + concatOperand + `))+)\s*$`)
	concatOperand = jinjaString + `|[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*|\[[0-9]+\])*`
	concatNext    = regexp.MustCompile(`\+\s*(` + concatOperand + `)`)
)

// jinjaString is a quoted literal as the library's scanner delimits it: a
// backslash escapes the next byte.
const jinjaString = `'(?:[^'\\]|\\(?s:.))*'|"(?:[^"\\]|\\(?s:.))*"`

// splitConcatOutputs rewrites src as described above. It walks the
// template the way ardanlabs/jinja's scanner does (text, then {{ }}, {% %}
// and {# #} tags; quotes skipped inside expression and statement tags), so
// nothing inside a statement, a comment or a string literal is touched.
func splitConcatOutputs(src string) string {
	var b strings.Builder
	last := 0 // src[last:] is not yet written to b
	for i := 0; i+1 < len(src); {
		if src[i] != '{' || (src[i+1] != '{' && src[i+1] != '%' && src[i+1] != '#') {
			i++
			continue
		}
		kind, tagStart := src[i+1], i
		i += 2
		trimLeft := i < len(src) && src[i] == '-'
		if trimLeft {
			i++
		}
		contentStart := i
		closer := "}}"
		switch kind {
		case '%':
			closer = "%}"
		case '#':
			closer = "#}"
		}
		contentEnd, trimRight := -1, false
		for i < len(src) {
			c := src[i]
			if kind != '#' && (c == '\'' || c == '"') {
				i++
				for i < len(src) && src[i] != c {
					if src[i] == '\\' && i+1 < len(src) {
						i++
					}
					i++
				}
				if i < len(src) {
					i++
				}
				continue
			}
			if c == '-' && i+2 < len(src) && src[i+1:i+3] == closer {
				contentEnd, trimRight = i, true
				i += 3
				break
			}
			if i+1 < len(src) && src[i:i+2] == closer {
				contentEnd = i
				i += 2
				break
			}
			i++
		}
		if contentEnd < 0 {
			break // unterminated: leave it for the library to report
		}
		if kind != '{' {
			continue
		}
		ops := concatOperands(src[contentStart:contentEnd])
		if ops == nil {
			continue
		}
		b.WriteString(src[last:tagStart])
		for k, op := range ops {
			b.WriteString("{{")
			if k == 0 && trimLeft {
				b.WriteByte('-')
			}
			b.WriteByte(' ')
			b.WriteString(op)
			b.WriteByte(' ')
			if k == len(ops)-1 && trimRight {
				b.WriteByte('-')
			}
			b.WriteString("}}")
		}
		last = i
	}
	if last == 0 {
		return src
	}
	b.WriteString(src[last:])
	return b.String()
}

// concatOperands returns the operands of expr when it is a literal-led
// concatenation of literals and variable paths, else nil.
func concatOperands(expr string) []string {
	m := concatOutput.FindStringSubmatch(expr)
	if m == nil {
		return nil
	}
	ops := []string{m[1]}
	for _, n := range concatNext.FindAllStringSubmatch(m[2], -1) {
		ops = append(ops, n[1])
	}
	return ops
}
