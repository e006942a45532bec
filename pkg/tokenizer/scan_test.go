package tokenizer

import (
	"path/filepath"
	"testing"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

func spansEqual(a, b []span) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestScannerMatchesRegexp proves the hand-written scanners equal regexp2
// on every string of the parity corpus, for both patterns.
func TestScannerMatchesRegexp(t *testing.T) {
	var corpus []string
	readGolden(t, "corpus.json", &corpus)
	corpus = append(corpus, "'ſ", "'ſt", "'S", "'RE", "'Ll", "'lL", "'K", "x'x", "'", "''s", "\xff\xfe", "a\xffb", "\x85 \xc2\x85")
	for _, pat := range []string{qwenPattern, llama3Pattern} {
		re, err := newRegexMatcher(pat)
		if err != nil {
			t.Fatal(err)
		}
		sc := fastMatcherFor(pat)
		if sc == nil {
			t.Fatal("no scanner for a known pattern")
		}
		for i, s := range corpus {
			want := re.find(nil, s)
			got := sc.find(nil, s)
			if !spansEqual(got, want) {
				t.Fatalf("pattern %d case %d %q: scanner %v, regexp2 %v", len(pat), i, trunc(s), got, want)
			}
		}
	}
}

func FuzzScannerMatchesRegexp(f *testing.F) {
	for _, s := range []string{"Hello world", "  \n\n x", "I'm 12345 ", "\u3000\u2028a", "!!! ??\r\n", "'ll'RE", "a\xffb"} {
		f.Add(s)
	}
	qre, _ := newRegexMatcher(qwenPattern)
	lre, _ := newRegexMatcher(llama3Pattern)
	qs, ls := fastMatcherFor(qwenPattern), fastMatcherFor(llama3Pattern)
	f.Fuzz(func(t *testing.T, s string) {
		if !utf8.ValidString(s) {
			// regexp2 sees invalid bytes as U+FFFD runes of width 1, as the
			// scanner does; keep checking them too.
			_ = s
		}
		if got, want := qs.find(nil, s), qre.find(nil, s); !spansEqual(got, want) {
			t.Fatalf("qwen %q: scanner %v regexp2 %v", s, got, want)
		}
		if got, want := ls.find(nil, s), lre.find(nil, s); !spansEqual(got, want) {
			t.Fatalf("llama3 %q: scanner %v regexp2 %v", s, got, want)
		}
	})
}

// TestDirectScanner checks that the staged models take the direct path
// (the scanner's matches fed straight to BPE) and that it gives the ids
// of the general path, which materialises the pre-tokenizer's pieces.
func TestDirectScanner(t *testing.T) {
	var corpus []string
	readGolden(t, "corpus.json", &corpus)
	for _, m := range parityModels {
		t.Run(m.name, func(t *testing.T) {
			direct, err := Load(filepath.Join(stagedDir, m.slug))
			if err != nil {
				t.Fatal(err)
			}
			if direct.scan == nil {
				t.Fatal("a known split pattern does not take the direct path")
			}
			pieces, err := Load(filepath.Join(stagedDir, m.slug))
			if err != nil {
				t.Fatal(err)
			}
			pieces.scan = nil
			for i, s := range corpus {
				if got, want := direct.Encode(s, false), pieces.Encode(s, false); !equalIDs(got, want) {
					t.Fatalf("case %d %q: direct path differs at token %d", i, trunc(s), firstDiff(got, want))
				}
			}
		})
	}
	// Any other pre-tokenizer keeps the general path.
	for _, pre := range []preTokenizer{
		&byteLevelPre{regex: newSplitPre(bpeScanner{maxDigits: 1}, behaviorIsolated, false)},
		newSplitPre(bpeScanner{maxDigits: 1}, behaviorRemoved, false),
		newSplitPre(bpeScanner{maxDigits: 1}, behaviorIsolated, true),
		newSplitPre(literalMatcher{lit: " "}, behaviorIsolated, false),
		newPreSequence([]preTokenizer{newSplitPre(bpeScanner{maxDigits: 1}, behaviorIsolated, false), &byteLevelPre{addPrefixSpace: true}}),
	} {
		if _, ok := directScanner(pre); ok {
			t.Fatalf("%#v takes the direct path", pre)
		}
	}
}

// FuzzNFCIsNormal checks the piecewise NFC check against x/text's.
func FuzzNFCIsNormal(f *testing.F) {
	for _, s := range []string{"e\u0301", "abc", "Ünïcödé 中文 🚀", "a\u0301\u0327b", "\u1100\u1161", "x\u0344y", "\xffe\u0301", "", "é\u0301", "\u0958", "A\u030a\u0301"} {
		f.Add(s)
	}
	n := normForm{norm.NFC}
	f.Fuzz(func(t *testing.T, s string) {
		if got, want := n.isNormal(s), norm.NFC.IsNormalString(s); got != want {
			t.Fatalf("%q: isNormal %v, x/text %v", s, got, want)
		}
	})
}

func TestNFCIsNormalCorpus(t *testing.T) {
	var corpus []string
	readGolden(t, "corpus.json", &corpus)
	n := normForm{norm.NFC}
	for i, s := range corpus {
		if got, want := n.isNormal(s), norm.NFC.IsNormalString(s); got != want {
			t.Fatalf("case %d %q: isNormal %v, x/text %v", i, trunc(s), got, want)
		}
	}
}
