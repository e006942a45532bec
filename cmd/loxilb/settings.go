package main

import (
	"flag"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// A value is the typed destination of one setting. Set parses a flag or
// environment text (syntax only); check reports a parsed value outside
// the accepted range, as "want ..." text the caller prefixes with the flag
// or variable that gave it. Keeping the two apart lets one range message
// name whichever source the value came from.
type value interface {
	flag.Value
	check() error
	// span is the accepted range as documented ("1..1000"); "" for text.
	span() string
}

// number is an integer setting within lo..hi. words are accepted spellings
// of special values (such as "auto" for -1), matched without case; a word's
// value is accepted whatever the range. Surrounding blanks are ignored.
type number[T ~int | ~int64] struct {
	p      *T
	lo, hi T
	words  map[string]T
	unit   string // documentation only: "bytes", "ms", ...
	// word is set when the value was given as one of words.
	word bool
}

func intVal[T ~int | ~int64](p *T, def, lo, hi T) *number[T] {
	*p = def
	return &number[T]{p: p, lo: lo, hi: hi}
}

// with adds a special spelling.
func (n *number[T]) with(word string, v T) *number[T] {
	if n.words == nil {
		n.words = map[string]T{}
	}
	n.words[word] = v
	n.word = n.word || *n.p == v // the default is spelt as the word
	return n
}

// in names the unit the value counts, for the documentation.
func (n *number[T]) in(unit string) *number[T] { n.unit = unit; return n }

func (n *number[T]) Set(s string) error {
	s = strings.TrimSpace(s)
	for w, v := range n.words {
		if strings.EqualFold(s, w) {
			*n.p, n.word = v, true
			return nil
		}
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil || int64(T(v)) != v {
		return fmt.Errorf("want an integer in %s", n.span())
	}
	*n.p, n.word = T(v), false
	return nil
}

func (n *number[T]) String() string {
	if n.p == nil {
		return "0"
	}
	for w, v := range n.words {
		if *n.p == v {
			return w
		}
	}
	return strconv.FormatInt(int64(*n.p), 10)
}

func (n *number[T]) check() error {
	if n.word {
		return nil
	}
	if *n.p < n.lo || *n.p > n.hi {
		return fmt.Errorf("want %s", n.span())
	}
	return nil
}

func (n *number[T]) span() string {
	s := fmt.Sprintf("%d..%d", n.lo, n.hi)
	if n.unit == "bytes" {
		s = sizeText(int64(n.lo)) + ".." + sizeText(int64(n.hi))
	}
	var ws []string
	for w := range n.words {
		ws = append(ws, w)
	}
	if len(ws) > 0 {
		s += " or " + strings.Join(ws, ", ")
	}
	if n.unit != "" && n.unit != "bytes" { // sizes carry their unit
		s += " " + n.unit
	}
	return s
}

// duration is a duration setting within lo..hi. With unit 0 it is written
// as Go durations ("30s"); otherwise as a count of unit ("250" for 250 ms),
// fractional when fraction is set ("2.5" seconds).
type duration struct {
	p        *time.Duration
	lo, hi   time.Duration
	unit     time.Duration
	fraction bool
	// spanText replaces the rendered range (for an open lower bound).
	spanText string
}

func durVal(p *time.Duration, def, lo, hi time.Duration) *duration {
	*p = def
	return &duration{p: p, lo: lo, hi: hi}
}

// counted makes the value a count of unit, fractional or not.
func (d *duration) counted(unit time.Duration, fraction bool) *duration {
	d.unit, d.fraction = unit, fraction
	return d
}

func (d *duration) Set(s string) error {
	s = strings.TrimSpace(s)
	if d.unit == 0 {
		v, err := time.ParseDuration(s)
		if err != nil {
			return fmt.Errorf("want a duration such as 30s")
		}
		*d.p = v
		return nil
	}
	if !d.fraction {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n > math.MaxInt64/int64(d.unit) || n < math.MinInt64/int64(d.unit) {
			return fmt.Errorf("want an integer count of %s in %s", unitName(d.unit), d.span())
		}
		*d.p = time.Duration(n) * d.unit
		return nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsNaN(f) || math.Abs(f*float64(d.unit)) > math.MaxInt64/2 {
		return fmt.Errorf("want a number of %s in %s", unitName(d.unit), d.span())
	}
	*d.p = time.Duration(f * float64(d.unit))
	return nil
}

func (d *duration) String() string {
	if d.p == nil {
		return "0"
	}
	if d.unit == 0 {
		return shortDuration(*d.p)
	}
	return strconv.FormatFloat(float64(*d.p)/float64(d.unit), 'f', -1, 64)
}

func (d *duration) check() error {
	if *d.p < d.lo || *d.p > d.hi {
		return fmt.Errorf("want %s", d.span())
	}
	return nil
}

func (d *duration) span() string {
	if d.spanText != "" {
		return d.spanText
	}
	if d.unit == 0 {
		return shortDuration(d.lo) + ".." + shortDuration(d.hi)
	}
	f := func(v time.Duration) string { return strconv.FormatFloat(float64(v)/float64(d.unit), 'f', -1, 64) }
	return fmt.Sprintf("%s..%s %s", f(d.lo), f(d.hi), unitName(d.unit))
}

// shortDuration is d as Go writes it without zero trailing units: 24h,
// 5m, 1m30s.
func shortDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = s[:len(s)-2]
	}
	if strings.HasSuffix(s, "h0m") {
		s = s[:len(s)-2]
	}
	return s
}

func unitName(u time.Duration) string {
	switch u {
	case time.Millisecond:
		return "ms"
	case time.Second:
		return "s"
	}
	return u.String()
}

// fraction is a floating-point setting within lo..hi.
type fraction struct {
	p      *float64
	lo, hi float64
}

func floatVal(p *float64, def, lo, hi float64) *fraction {
	*p = def
	return &fraction{p: p, lo: lo, hi: hi}
}

func (f *fraction) Set(s string) error {
	v, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil {
		return fmt.Errorf("want a number in %s", f.span())
	}
	*f.p = v
	return nil
}

func (f *fraction) String() string {
	if f.p == nil {
		return "0"
	}
	return strconv.FormatFloat(*f.p, 'g', -1, 64)
}

func (f *fraction) check() error {
	if !(*f.p >= f.lo && *f.p <= f.hi) { // NaN fails too
		return fmt.Errorf("want %s", f.span())
	}
	return nil
}

func (f *fraction) span() string { return fmt.Sprintf("%g..%g", f.lo, f.hi) }

// boolean is an on/off setting: strconv.ParseBool's spellings.
type boolean struct{ p *bool }

func boolVal(p *bool, def bool) *boolean { *p = def; return &boolean{p} }

func (b *boolean) Set(s string) error {
	v, err := strconv.ParseBool(strings.TrimSpace(s))
	if err != nil {
		return fmt.Errorf("want true or false (1, 0, t, f)")
	}
	*b.p = v
	return nil
}

func (b *boolean) String() string {
	if b.p == nil || !*b.p {
		return "false"
	}
	return "true"
}

func (b *boolean) IsBoolFlag() bool { return true }
func (b *boolean) check() error     { return nil }
func (b *boolean) span() string     { return "" }

// toggle is a three-state switch: unset (nil: the caller decides), on or
// off, in the spellings on/off, 1/0, true/false, yes/no.
type toggle struct{ p **bool }

func toggleVal(p **bool) *toggle { *p = nil; return &toggle{p} }

func (t *toggle) Set(s string) error {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "1", "true", "on", "yes":
		v := true
		*t.p = &v
	case "0", "false", "off", "no":
		v := false
		*t.p = &v
	default:
		return fmt.Errorf("want on/off (1/0, true/false, yes/no) or unset")
	}
	return nil
}

func (t *toggle) String() string {
	switch {
	case t.p == nil || *t.p == nil:
		return "unset"
	case **t.p:
		return "on"
	}
	return "off"
}

func (t *toggle) check() error { return nil }
func (t *toggle) span() string { return "on, off" }

// text is a string setting; its meaning is checked where it is used (a
// path is opened, a list split).
type text struct{ p *string }

func strVal(p *string, def string) *text { *p = def; return &text{p} }

func (t *text) Set(s string) error { *t.p = s; return nil }
func (t *text) String() string {
	if t.p == nil {
		return ""
	}
	return *t.p
}
func (t *text) check() error { return nil }
func (t *text) span() string { return "" }
