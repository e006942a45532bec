package tokenizer

import (
	"fmt"
	"math"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"github.com/ardanlabs/jinja"
)

// pyTojsonName is the template-scope callable that replaces the built-in
// tojson filter. ardanlabs/jinja v1.8.0's tojson(indent=N) goes through
// encoding/json.MarshalIndent, which sorts keys and escapes <, > and &
// (Llama-3.1/3.2 tool prompts use it), and its string encoder escapes
// U+2028/U+2029. Engines render with Python's json.dumps, reproduced here.
const pyTojsonName = "loxilb_tojson"

var tojsonFilter = regexp.MustCompile(`\|\s*tojson\b`)

// rewriteTojson points every "| tojson" filter of a template at pyTojson.
// ardanlabs/jinja resolves unknown filter names from the render scope.
func rewriteTojson(src string) string {
	return tojsonFilter.ReplaceAllLiteralString(src, "| "+pyTojsonName)
}

// pyTojson is transformers' tojson filter:
// json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
func pyTojson(args []jinja.Value, kwargs map[string]jinja.Value) (jinja.Value, error) {
	if len(args) == 0 {
		return jinja.NewString(""), nil
	}
	o := pyJSONOpts{indent: -1, itemSep: ", ", keySep: ": "}
	if v, ok := kwargs["indent"]; ok && !v.IsNone() && !v.IsUndefined() {
		switch {
		case v.IsInt():
			o.indentStr = strings.Repeat(" ", int(max(0, min(v.AsInt(), 64))))
			o.indent = len(o.indentStr)
		case v.IsString():
			o.indentStr, o.indent = v.AsString(), 0
		default:
			return jinja.Value{}, fmt.Errorf("tojson: indent must be an integer or a string")
		}
		o.itemSep = ","
	}
	if v, ok := kwargs["separators"]; ok && !v.IsNone() && !v.IsUndefined() {
		if !v.IsList() || v.AsList().Len() != 2 || !v.AsList().Items[0].IsString() || !v.AsList().Items[1].IsString() {
			return jinja.Value{}, fmt.Errorf("tojson: separators must be two strings")
		}
		o.itemSep, o.keySep = v.AsList().Items[0].AsString(), v.AsList().Items[1].AsString()
	}
	if v, ok := kwargs["sort_keys"]; ok {
		o.sortKeys = v.IsTruthy()
	}
	if v, ok := kwargs["ensure_ascii"]; ok {
		o.ensureASCII = v.IsTruthy()
	}
	var b strings.Builder
	if err := o.encode(&b, args[0], 0); err != nil {
		return jinja.Value{}, err
	}
	return jinja.NewString(b.String()), nil
}

type pyJSONOpts struct {
	indent      int // -1: no newlines
	indentStr   string
	itemSep     string
	keySep      string
	sortKeys    bool
	ensureASCII bool
}

const maxTojsonDepth = 256

func (o *pyJSONOpts) newline(b *strings.Builder, level int) {
	if o.indent < 0 {
		return
	}
	b.WriteByte('\n')
	for i := 0; i < level; i++ {
		b.WriteString(o.indentStr)
	}
}

func (o *pyJSONOpts) encode(b *strings.Builder, v jinja.Value, level int) error {
	if level > maxTojsonDepth {
		return fmt.Errorf("tojson: value nested deeper than %d", maxTojsonDepth)
	}
	switch {
	case v.IsNone(), v.IsUndefined(), v.IsCallable():
		b.WriteString("null")
	case v.IsBool():
		if v.AsBool() {
			b.WriteString("true")
		} else {
			b.WriteString("false")
		}
	case v.IsInt():
		b.WriteString(strconv.FormatInt(v.AsInt(), 10))
	case v.IsFloat():
		s, err := pyFloatRepr(v.AsFloat())
		if err != nil {
			return err
		}
		b.WriteString(s)
	case v.IsString():
		o.writeString(b, v.AsString())
	case v.IsList():
		items := v.AsList().Items
		if len(items) == 0 {
			b.WriteString("[]")
			return nil
		}
		b.WriteByte('[')
		for i, it := range items {
			if i > 0 {
				b.WriteString(o.itemSep)
			}
			o.newline(b, level+1)
			if err := o.encode(b, it, level+1); err != nil {
				return err
			}
		}
		o.newline(b, level)
		b.WriteByte(']')
	case v.IsDict():
		d := v.AsDict()
		if d.Len() == 0 {
			b.WriteString("{}")
			return nil
		}
		keys := d.Keys
		if o.sortKeys {
			keys = append([]string(nil), keys...)
			sort.Strings(keys)
		}
		b.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				b.WriteString(o.itemSep)
			}
			o.newline(b, level+1)
			o.writeString(b, k)
			b.WriteString(o.keySep)
			if err := o.encode(b, d.Data[k], level+1); err != nil {
				return err
			}
		}
		o.newline(b, level)
		b.WriteByte('}')
	default:
		b.WriteString("null")
	}
	return nil
}

// writeString escapes like Python's json encoder: the two-character
// escapes for \" \\ \b \f \n \r \t, \u00XX for other C0 controls, and
// with ensure_ascii every non-ASCII rune as \uXXXX (surrogate pairs above
// the BMP).
func (o *pyJSONOpts) writeString(b *strings.Builder, s string) {
	const hex = "0123456789abcdef"
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		default:
			switch {
			case r < 0x20 || (o.ensureASCII && r >= 0x7f):
				write := func(u rune) {
					b.WriteString(`\u`)
					b.WriteByte(hex[u>>12&15])
					b.WriteByte(hex[u>>8&15])
					b.WriteByte(hex[u>>4&15])
					b.WriteByte(hex[u&15])
				}
				if r > 0xffff {
					r -= 0x10000
					write(0xd800 + (r >> 10))
					write(0xdc00 + (r & 0x3ff))
				} else {
					write(r)
				}
			default:
				b.WriteRune(r)
			}
		}
	}
	b.WriteByte('"')
}

// pyFloatRepr formats f as Python's float repr (what json.dumps uses):
// shortest round-trip digits, fixed notation with at least one decimal for
// exponents in [-4, 16), otherwise d.ddde+XX.
func pyFloatRepr(f float64) (string, error) {
	switch {
	case math.IsNaN(f):
		return "NaN", nil
	case math.IsInf(f, 1):
		return "Infinity", nil
	case math.IsInf(f, -1):
		return "-Infinity", nil
	}
	e := strconv.FormatFloat(f, 'e', -1, 64) // e.g. -1.2345e+06
	mant, expStr, _ := strings.Cut(e, "e")
	exp, err := strconv.Atoi(expStr)
	if err != nil {
		return "", fmt.Errorf("tojson: format %v: %w", f, err)
	}
	neg := strings.HasPrefix(mant, "-")
	mant = strings.TrimPrefix(mant, "-")
	digits := strings.Replace(mant, ".", "", 1)
	var out string
	if exp >= -4 && exp < 16 {
		if exp >= 0 {
			if len(digits) <= exp+1 {
				out = digits + strings.Repeat("0", exp+1-len(digits)) + ".0"
			} else {
				out = digits[:exp+1] + "." + digits[exp+1:]
			}
		} else {
			out = "0." + strings.Repeat("0", -exp-1) + digits
		}
	} else {
		m := digits[:1]
		if len(digits) > 1 {
			m += "." + digits[1:]
		}
		sign := "+"
		if exp < 0 {
			sign, exp = "-", -exp
		}
		out = fmt.Sprintf("%se%s%02d", m, sign, exp)
	}
	if neg {
		out = "-" + out
	}
	return out, nil
}
