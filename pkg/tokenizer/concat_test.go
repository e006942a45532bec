package tokenizer

import (
	"strings"
	"testing"

	"github.com/ardanlabs/jinja"
)

func TestSplitConcatOutputs(t *testing.T) {
	for _, c := range []struct{ src, want string }{
		{`x {{- 'a' + m.role + '\n' + m.content -}} y`, `x {{- 'a' }}{{ m.role }}{{ '\n' }}{{ m.content -}} y`},
		{`{{ "q}}" + xs[0].c }}`, `{{ "q}}" }}{{ xs[0].c }}`},
		{`{{ 'a+b' + ' + c' }}`, `{{ 'a+b' }}{{ ' + c' }}`},
		{`{{ 'it\'s' + n }}`, `{{ 'it\'s' }}{{ n }}`},
		// Not a literal-led chain of plain operands: left alone.
		{`{{ a + 'b' }}`, `{{ a + 'b' }}`},
		{`{{ 'a' + b | upper }}`, `{{ 'a' + b | upper }}`},
		{`{{ 'a' + b if c else d }}`, `{{ 'a' + b if c else d }}`},
		{`{{ 'a' + b.strip() }}`, `{{ 'a' + b.strip() }}`},
		{`{{ 'a' ~ b }}`, `{{ 'a' ~ b }}`},
		{`{{ 'a' }}`, `{{ 'a' }}`},
		// Statements, comments and literals inside them are not touched.
		{`{% set s = '{{ "a" + b }}' %}{# {{ 'a' + b }} #}`, `{% set s = '{{ "a" + b }}' %}{# {{ 'a' + b }} #}`},
		{`{{ 'a' + b `, `{{ 'a' + b `},
	} {
		if got := splitConcatOutputs(c.src); got != c.want {
			t.Errorf("%q:\n got %q\nwant %q", c.src, got, c.want)
		}
	}
}

// TestSplitConcatOutputsRendersTheSame renders templates before and after
// the rewrite with operands of every kind of value.
func TestSplitConcatOutputsRendersTheSame(t *testing.T) {
	srcs := []string{
		"A  {{- 'x' + v + '|' + m.k + '|' + xs[1] }}  B {{ 'y' + v -}}\n  C",
		"{% for m in ms %}  {{- '<' + m.role + '>' + m.content + '</>' + '\\n' }}\n{%- endfor %}",
		"{% if true %}\n  {{ '[' + v + ']' }}\n{% endif %}\n{{- 'z' + missing + m.nope }}",
	}
	vals := []jinja.Value{jinja.NewString("s"), jinja.NewInt(7), jinja.NewFloat(1.5), jinja.NewBool(true), jinja.None(),
		jinja.NewList([]jinja.Value{jinja.NewString("a"), jinja.NewInt(1)})}
	for _, src := range srcs {
		if splitConcatOutputs(src) == src {
			t.Fatalf("%q was not rewritten", src)
		}
		orig, err := jinja.Compile(src)
		if err != nil {
			t.Fatal(err)
		}
		split, err := jinja.Compile(splitConcatOutputs(src))
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range vals {
			m := jinja.NewDict()
			m.AsDict().Set("k", v)
			m.AsDict().Set("role", jinja.NewString("user"))
			m.AsDict().Set("content", v)
			ctx := map[string]jinja.Value{"v": v, "m": m, "xs": jinja.NewList([]jinja.Value{v, v}),
				"ms": jinja.NewList([]jinja.Value{m, m})}
			want, werr := orig.RenderValues(ctx)
			got, gerr := split.RenderValues(ctx)
			if got != want || (werr == nil) != (gerr == nil) {
				t.Fatalf("%q with %v: got %q %v, want %q %v", src, v, got, gerr, want, werr)
			}
		}
	}
}

// TestSplitConcatOutputsStagedTemplates checks that the staged models'
// templates take the rewrite (the chat parity goldens then prove the
// output unchanged).
func TestSplitConcatOutputsStagedTemplates(t *testing.T) {
	tk := loadStaged(t, "Qwen__Qwen3-0.6B")
	src := tk.Config().ChatTemplate
	if got := splitConcatOutputs(src); strings.Count(got, "{{") <= strings.Count(src, "{{") {
		t.Fatal("the Qwen3 template's message lines were not split")
	}
}
