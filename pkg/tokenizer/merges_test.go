package tokenizer

import (
	"slices"
	"strings"
	"testing"
)

// Both serialisations decode to the same pairs whichever the first
// element says, and a malformed array fails as before the format was
// picked from it.
func TestParseMergesForms(t *testing.T) {
	want := [][2]string{{"a", "b"}, {"Ġ", "ab"}}
	for _, raw := range []string{`["a b", "Ġ ab"]`, ` [ "a b","Ġ ab" ] `, `[["a","b"],["Ġ","ab"]]`, "\n[\n [\"a\", \"b\"], [\"Ġ\", \"ab\"]]"} {
		got, err := parseMerges([]byte(raw))
		if err != nil || !slices.Equal(got, want) {
			t.Errorf("parseMerges(%s) = %q, %v; want %q", raw, got, err, want)
		}
	}
	for _, raw := range []string{`[]`, `null`, ``} {
		if got, err := parseMerges([]byte(raw)); err != nil || len(got) != 0 {
			t.Errorf("parseMerges(%q) = %q, %v; want none", raw, got, err)
		}
	}
	for raw, msg := range map[string]string{
		`["a"]`:          "want two space-separated parts",
		`["a b c"]`:      "want two space-separated parts",
		`["a b", ["c"]]`: "neither",
		`[["a","b"], 1]`: "neither",
		`{"a": "b"}`:     "neither",
		`[`:              "neither",
	} {
		if _, err := parseMerges([]byte(raw)); err == nil || !strings.Contains(err.Error(), msg) {
			t.Errorf("parseMerges(%s) error %v, want one containing %q", raw, err, msg)
		}
	}
}
