package cluster

import (
	"errors"
	"reflect"
	"strings"
	"testing"
)

func mem(name string, kv ...string) Member {
	m := Member{Name: name, Settings: map[string]string{}}
	for i := 0; i+1 < len(kv); i += 2 {
		m.Settings[kv[i]] = kv[i+1]
	}
	return m
}

func TestComputeDrift(t *testing.T) {
	for _, tc := range []struct {
		name    string
		members []Member
		want    []Drift
	}{
		{"one node never drifts", []Member{mem("a", SettingSeed, "x")}, nil},
		{"agreeing nodes", []Member{mem("a", SettingSeed, "x", "E", "1"), mem("b", SettingSeed, "x", "E", "1")}, nil},
		{"two nodes, seed differs: both drift (no majority)",
			[]Member{mem("b", SettingSeed, "y"), mem("a", SettingSeed, "x")},
			[]Drift{{Setting: SettingSeed, Values: []NodeValue{{"a", "x"}, {"b", "y"}}, Drifting: []string{"a", "b"}}}},
		{"three nodes: the minority drifts",
			[]Member{mem("a", SettingSeed, "x"), mem("b", SettingSeed, "y"), mem("c", SettingSeed, "x")},
			[]Drift{{Setting: SettingSeed, Values: []NodeValue{{"a", "x"}, {"b", "y"}, {"c", "x"}}, Drifting: []string{"b"}}}},
		{"tokenizer staged on one node only",
			[]Member{mem("a", TokenizerPrefix+"m", "s1"), mem("b"), mem("c", TokenizerPrefix+"m", "s1")},
			[]Drift{{Setting: TokenizerPrefix + "m", Values: []NodeValue{{"a", "s1"}, {"b", ""}, {"c", "s1"}}, Drifting: []string{"b"}}}},
		{"three values among four nodes, no majority for either of two",
			[]Member{mem("a", "E", "1"), mem("b", "E", "1"), mem("c", "E", "2"), mem("d", "E", "2")},
			[]Drift{{Setting: "E", Values: []NodeValue{{"a", "1"}, {"b", "1"}, {"c", "2"}, {"d", "2"}}, Drifting: []string{"a", "b", "c", "d"}}}},
		{"several settings ordered by name",
			[]Member{mem("a", "Z", "1", "A", "1"), mem("b", "Z", "2", "A", "2"), mem("c", "Z", "1", "A", "2")},
			[]Drift{
				{Setting: "A", Values: []NodeValue{{"a", "1"}, {"b", "2"}, {"c", "2"}}, Drifting: []string{"a"}},
				{Setting: "Z", Values: []NodeValue{{"a", "1"}, {"b", "2"}, {"c", "1"}}, Drifting: []string{"b"}},
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for range 20 { // map order must not change the answer
				if got := ComputeDrift(tc.members); !reflect.DeepEqual(got, tc.want) {
					t.Fatalf("got %+v\nwant %+v", got, tc.want)
				}
			}
		})
	}
}

func TestDriftOf(t *testing.T) {
	d := ComputeDrift([]Member{mem("a", SettingSeed, "x"), mem("b", SettingSeed, "x"), mem("c")})
	if got := DriftOf("a", d); got != nil {
		t.Fatalf("a holds the majority value: %v", got)
	}
	got := DriftOf("c", d)
	if len(got) != 1 || got[0] != "seed_fingerprint differs (a=x, b=x, c=(unset))" {
		t.Fatalf("c: %q", got)
	}
}

func TestDecodeBounds(t *testing.T) {
	good, err := mem("a", SettingSeed, "x").Encode()
	if err != nil {
		t.Fatal(err)
	}
	if m, err := Decode("a", good); err != nil || m.Settings[SettingSeed] != "x" {
		t.Fatalf("round trip: %+v %v", m, err)
	}
	many := mem("a")
	for i := range MaxSettings + 1 {
		many.Settings[strings.Repeat("k", 1+i%200)+string(rune('a'+i%26))+strings.Repeat("x", i/200)] = "v"
	}
	for name, tc := range map[string]struct {
		key string
		b   []byte
	}{
		"not json":            {"a", []byte("{")},
		"names another node":  {"b", good},
		"bad name":            {"a b", []byte(`{"name":"a b"}`)},
		"too large":           {"a", []byte(`{"name":"a","version":"` + strings.Repeat("x", MaxRecordBytes) + `"}`)},
		"value over a limit":  {"a", []byte(`{"name":"a","settings":{"k":"` + strings.Repeat("x", 300) + `"}}`)},
		"empty setting name":  {"a", []byte(`{"name":"a","settings":{"":"v"}}`)},
		"peer over a limit":   {"a", []byte(`{"name":"a","peer":"` + strings.Repeat("x", 300) + `"}`)},
		"array for settings":  {"a", []byte(`{"name":"a","settings":[1,2]}`)},
		"too many settings":   {"a", mustJSON(t, many)},
		"null":                {"a", []byte(`null`)},
		"deeply nested value": {"a", []byte(`{"name":"a","x":` + strings.Repeat("[", 100000) + `}`)},
	} {
		if _, err := Decode(tc.key, tc.b); !errors.Is(err, ErrInvalidRecord) {
			t.Errorf("%s: %v, want ErrInvalidRecord", name, err)
		}
	}
}

func mustJSON(t *testing.T, m Member) []byte {
	t.Helper()
	if _, err := m.Encode(); !errors.Is(err, ErrInvalidRecord) {
		t.Fatalf("Encode accepted what Decode must refuse: %v", err)
	}
	// Encode refuses it too, so the record is written by hand.
	var sb strings.Builder
	sb.WriteString(`{"name":"` + m.Name + `","settings":{`)
	i := 0
	for k, v := range m.Settings {
		if i > 0 {
			sb.WriteByte(',')
		}
		sb.WriteString(`"` + k + `":"` + v + `"`)
		i++
	}
	sb.WriteString(`}}`)
	return []byte(sb.String())
}

func TestValidName(t *testing.T) {
	for _, ok := range []string{"a", "node-1", "gw.example_2", strings.Repeat("n", MaxNameLen)} {
		if err := ValidName(ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	for _, bad := range []string{"", "-a", ".a", "a/b", "a b", "ä", strings.Repeat("n", MaxNameLen+1)} {
		if ValidName(bad) == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestNameFromHost(t *testing.T) {
	for host, want := range map[string]string{"gw-1.example.com": "gw-1.example.com", "": "node", "-x y": "x-y", "ä": "node",
		strings.Repeat("h", 70): strings.Repeat("h", MaxNameLen)} {
		got := NameFromHost(host)
		if got != want || ValidName(got) != nil {
			t.Errorf("%q: %q (%v), want %q", host, got, ValidName(got), want)
		}
	}
}
