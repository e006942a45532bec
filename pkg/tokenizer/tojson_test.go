package tokenizer

import (
	"encoding/json"
	"testing"

	"github.com/ardanlabs/jinja"
)

func TestPyFloatRepr(t *testing.T) {
	// Expected values are Python 3 repr(float).
	for f, want := range map[float64]string{
		0: "0.0", 1: "1.0", -1.5: "-1.5", 0.1: "0.1", 1e16: "1e+16", 1234567890123456: "1234567890123456.0",
		0.0001: "0.0001", 0.00001: "1e-05", 1.5e-7: "1.5e-07", 123.456: "123.456", 1e100: "1e+100", 2.5e22: "2.5e+22",
	} {
		got, err := pyFloatRepr(f)
		if err != nil || got != want {
			t.Errorf("pyFloatRepr(%v) = %q, %v; want %q", f, got, err, want)
		}
	}
}

func TestPyTojson(t *testing.T) {
	v, err := decodeOrdered([]byte(`{"b": [1, 2.5, {"x": null}], "a": "<&>\u2028\n\u0001é", "e": {}, "l": [], "t": true}`))
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		kwargs map[string]jinja.Value
		want   string
	}{
		{nil, `{"b": [1, 2.5, {"x": null}], "a": "<&>` + "\u2028" + `\n\u0001é", "e": {}, "l": [], "t": true}`},
		{map[string]jinja.Value{"indent": jinja.NewInt(2)}, "{\n  \"b\": [\n    1,\n    2.5,\n    {\n      \"x\": null\n    }\n  ],\n  \"a\": \"<&>\u2028\\n\\u0001é\",\n  \"e\": {},\n  \"l\": [],\n  \"t\": true\n}"},
		{map[string]jinja.Value{"separators": jinja.NewList([]jinja.Value{jinja.NewString(","), jinja.NewString(":")}), "sort_keys": jinja.NewBool(true), "ensure_ascii": jinja.NewBool(true)},
			`{"a":"<&>\u2028\n\u0001\u00e9","b":[1,2.5,{"x":null}],"e":{},"l":[],"t":true}`},
	}
	for i, c := range cases {
		got, err := pyTojson([]jinja.Value{v}, c.kwargs)
		if err != nil {
			t.Fatal(err)
		}
		if got.AsString() != c.want {
			t.Errorf("case %d:\n got %s\nwant %s", i, got.AsString(), c.want)
		}
	}
	// An astral rune with ensure_ascii becomes a surrogate pair, as in Python.
	got, _ := pyTojson([]jinja.Value{jinja.NewString("😀")}, map[string]jinja.Value{"ensure_ascii": jinja.NewBool(true)})
	if got.AsString() != `"\ud83d\ude00"` {
		t.Errorf("surrogates: %s", got.AsString())
	}
	if _, err := pyTojson([]jinja.Value{v}, map[string]jinja.Value{"separators": jinja.NewString("x")}); err == nil {
		t.Error("bad separators accepted")
	}
	var s string
	if err := json.Unmarshal([]byte(`"\u2028"`), &s); err != nil || s != "\u2028" {
		t.Fatal("sanity")
	}
}
