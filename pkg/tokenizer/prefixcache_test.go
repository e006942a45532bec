package tokenizer

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// cacheModels are every tokenizer in testdata: the staged Qwen3 and
// Llama-3.1 (the scanner, resumable) and the extra gpt-4o (regexp2 Split)
// and Llama-2 (no pre-tokenizer, Prepend normalizer), which get exact hits
// only.
var cacheModels = []struct {
	name      string
	resumable bool
	load      func(testing.TB) *Tokenizer
}{
	{"qwen3", true, func(t testing.TB) *Tokenizer { return loadStaged(t, "Qwen__Qwen3-0.6B") }},
	{"llama3_1", true, func(t testing.TB) *Tokenizer { return loadStaged(t, "meta-llama__Llama-3.1-8B-Instruct") }},
	{"gpt4o", false, func(t testing.TB) *Tokenizer { return loadExtra(t, "gpt4o") }},
	{"llama2", false, func(t testing.TB) *Tokenizer { return loadExtra(t, "llama2") }},
}

// loadExtra loads testdata/extra/<name> once per test binary.
func loadExtra(t testing.TB, name string) *Tokenizer {
	t.Helper()
	loadedMu.Lock()
	defer loadedMu.Unlock()
	key := "extra/" + name
	if tk, ok := loaded[key]; ok {
		return tk
	}
	dir := filepath.Join("testdata", "extra", name)
	cj, err := os.ReadFile(filepath.Join(dir, "tokenizer_config.json"))
	if err != nil {
		t.Fatal(err)
	}
	tk, err := LoadJSON(readGz(t, filepath.Join(dir, "tokenizer.json.gz")), cj)
	if err != nil {
		t.Fatal(err)
	}
	loaded[key] = tk
	return tk
}

// uncached returns a tokenizer with tk's encoder and no segment cache, the
// reference every cached encode is held to.
func uncached(tk *Tokenizer) *Tokenizer {
	c := &core{added: tk.added, rawMatch: tk.rawMatch, normMatch: tk.normMatch, normalizer: tk.normalizer, pre: tk.pre,
		scan: tk.scan, model: tk.model, post: tk.post, decoder: tk.decoder, decodeTab: tk.decodeTab, tokenToID: tk.tokenToID,
		specialIDs: tk.specialIDs, resumable: tk.resumable}
	c.pool.New = func() any { return &encodeScratch{} }
	c.cache.init(0, NewCacheMetrics())
	return &Tokenizer{core: c, cfg: tk.cfg, chat: tk.chat}
}

// TestResumableTokenizers pins which tokenizers in testdata may resume.
func TestResumableTokenizers(t *testing.T) {
	for _, m := range cacheModels {
		if got := m.load(t).resumable; got != m.resumable {
			t.Errorf("%s: resumable %v, want %v", m.name, got, m.resumable)
		}
	}
}

// TestSegmentCacheExact grows conversations turn by turn, so later turns
// hit the cache for every earlier message, and checks each encode against
// the uncached encoder, with and without a token limit.
func TestSegmentCacheExact(t *testing.T) {
	for _, m := range parityModels {
		t.Run(m.name, func(t *testing.T) {
			tk := loadStaged(t, m.slug)
			ref := uncached(tk)
			msgs := []Message{{Role: "system", Content: strings.Repeat("You route requests by their cached prefix. ", 8)}}
			for turn := 0; turn < 6; turn++ {
				msgs = append(msgs, Message{Role: "user", Content: fmt.Sprintf("Turn %d: %s", turn, strings.Repeat("why ünïcode 中文 🚀 and  spaces\t? ", 6+turn))})
				prompt, err := tk.RenderChat(msgs, ChatOptions{})
				if err != nil {
					t.Fatal(err)
				}
				want := ref.Encode(prompt, false)
				if got := tk.Encode(prompt, false); !slices.Equal(got, want) {
					t.Fatalf("turn %d: ids differ with the cache", turn)
				}
				if _, ok := tk.AppendEncodeLimit(nil, prompt, false, len(want)-3); ok {
					t.Fatalf("turn %d: a limit below the prompt's length passed", turn)
				}
				if got, ok := tk.AppendEncodeLimit(nil, prompt, false, len(want)); !ok || !slices.Equal(got, want) {
					t.Fatalf("turn %d: the prompt's own length as the limit: ok %v", turn, ok)
				}
				msgs = append(msgs, Message{Role: "assistant", Content: strings.Repeat("Answer text. ", 12+turn)})
			}
		})
	}
}

// textPieces exercise the scanner's classes: words, digit runs,
// contractions, runs of spaces, tabs and newlines, CJK, emoji, Unicode
// white space, added-token text.
var textPieces = []string{"the", " cache", " prefix", "Tokens", " 12345", "67", "'s", "'LL", " don't", "  ", "   ", "\t", "\n", "\n\n", " \n ", "\r\n",
	"中文", "ünïcödé", "🚀", "👨‍👩‍👧", " ", "\u3000", "\u2028", "x := y[i];", "...", "!?", "<|im_end|>", "<|eot_id|>", "ſ", "K"}

// hostilePieces add what NFC changes (combining marks after ASCII
// letters, a lone mark) and invalid UTF-8.
var hostilePieces = append([]string{"e\u0301", "a\u0308", "\u0301", "\xff", "\xe2\x82"}, textPieces...)

// randomText builds n bytes or so of text from pieces.
func randomText(r *rand.Rand, n int, pieces []string) string {
	var b strings.Builder
	for b.Len() < n {
		b.WriteString(pieces[r.IntN(len(pieces))])
		if r.IntN(3) == 0 {
			b.WriteByte(' ')
		}
	}
	return b.String()
}

// edit applies one random change at a random position, usually towards
// the end (where a conversation or a retry changes), sometimes anywhere.
func edit(r *rand.Rand, s string, pieces []string) string {
	pos := len(s) - r.IntN(min(len(s), 200)+1)
	if r.IntN(4) == 0 {
		pos = r.IntN(len(s) + 1)
	}
	snippet := randomText(r, 1+r.IntN(40), pieces)
	switch r.IntN(4) {
	case 0: // insert
		return s[:pos] + snippet + s[pos:]
	case 1: // delete
		end := min(len(s), pos+1+r.IntN(30))
		return s[:pos] + s[end:]
	case 2: // replace
		end := min(len(s), pos+1+r.IntN(30))
		return s[:pos] + snippet + s[end:]
	}
	return s[:pos] + snippet // truncate and append
}

// TestPrefixCacheExactUnderEdits is the property the cache rests on: for
// random texts and chains of random edits, every cached encode (exact hit,
// resume or miss) gives the ids of the uncached encoder, for every
// tokenizer in testdata; with a token limit, the same verdict. The
// resumable tokenizers must actually resume.
func TestPrefixCacheExactUnderEdits(t *testing.T) {
	for _, m := range cacheModels {
		t.Run(m.name, func(t *testing.T) {
			tk := m.load(t)
			ref := uncached(tk)
			stats := NewCacheMetrics()
			tk.cache.configure(DefaultCacheBytes, stats)
			defer tk.cache.configure(DefaultCacheBytes, NewCacheMetrics())
			r := rand.New(rand.NewPCG(1, uint64(len(m.name))))
			rounds := 60
			if testing.Short() {
				rounds = 15
			}
			for round := 0; round < rounds; round++ {
				pieces := textPieces
				if round%3 == 2 {
					pieces = hostilePieces
				}
				s := randomText(r, 200+r.IntN(3000), pieces)
				for step := 0; step < 12; step++ {
					want := ref.Encode(s, false)
					if got := tk.Encode(s, false); !slices.Equal(got, want) {
						t.Fatalf("round %d step %d: cached ids differ for %q", round, step, s)
					}
					if lim := len(want) - r.IntN(5); lim > 0 {
						got, ok := tk.AppendEncodeLimit(nil, s, false, lim)
						if ok != (lim >= len(want)) || ok && !slices.Equal(got, want) {
							t.Fatalf("round %d step %d: limit %d of %d: ok %v", round, step, lim, len(want), ok)
						}
					}
					s = edit(r, s, pieces)
				}
			}
			resumed := testutil.ToFloat64(stats.resumed)
			if m.resumable != (resumed > 0) {
				t.Fatalf("resumed %v times, resumable %v", resumed, m.resumable)
			}
			if testutil.ToFloat64(stats.hit) == 0 {
				t.Fatal("no exact hit")
			}
		})
	}
}

// FuzzPrefixCacheExact: a text, then the text edited at any position,
// encoded through the cache (the second usually resumes from the first)
// give the uncached encoder's ids, for every tokenizer in testdata.
func FuzzPrefixCacheExact(f *testing.F) {
	f.Add("the cache prefix", uint16(3), uint8(0), "\u0301", uint8(0))
	f.Add("line one\n\n   line two   \n", uint16(9), uint8(1), "x", uint8(1))
	f.Add("don't stop 12345 中文 🚀", uint16(500), uint8(2), "'ll", uint8(0))
	f.Add("a\u3000 b\u2028c", uint16(2), uint8(3), "\xff\xfe", uint8(1))
	f.Add("<|im_end|>tail", uint16(0), uint8(0), "<|eot_id|>", uint8(2))
	f.Add("spaces    then\tword", uint16(7), uint8(1), "\n", uint8(3))
	tks := make([]*Tokenizer, len(cacheModels))
	refs := make([]*Tokenizer, len(cacheModels))
	for i, m := range cacheModels {
		tks[i] = m.load(f)
		refs[i] = uncached(tks[i])
	}
	// The text starts with a fixed paragraph, so fuzzed inputs are long
	// enough to be cached and indexed at a checkpoint.
	lead := strings.Repeat("Paragraph: routing follows the cached prefix, so prefill is skipped. ", 6)
	f.Fuzz(func(t *testing.T, base string, pos uint16, cut uint8, insert string, model uint8) {
		i := int(model) % len(tks)
		tk, ref := tks[i], refs[i]
		s := lead + base
		p := len(lead) + int(pos)%(len(base)+1)
		e := s[:p] + insert + s[min(len(s), p+int(cut)%8):]
		for _, text := range []string{s, e, s} {
			if got, want := tk.Encode(text, false), ref.Encode(text, false); !slices.Equal(got, want) {
				t.Fatalf("%s: cached ids differ for %q", cacheModels[i].name, text)
			}
		}
	})
}

// TestPrefixCacheConcurrent encodes related texts from several goroutines
// (run with -race): every result is exact while entries are added,
// resumed from and evicted concurrently.
func TestPrefixCacheConcurrent(t *testing.T) {
	tk := loadStaged(t, "Qwen__Qwen3-0.6B")
	ref := uncached(tk)
	stats := NewCacheMetrics()
	tk.cache.configure(64<<10, stats) // small: evictions happen
	defer tk.cache.configure(DefaultCacheBytes, NewCacheMetrics())
	r := rand.New(rand.NewPCG(7, 7))
	// No added-token text: each text is one long segment.
	plain := slices.DeleteFunc(slices.Clone(textPieces), func(p string) bool { return strings.HasPrefix(p, "<|") })
	base := randomText(r, 4000, plain)
	texts := make([]string, 64)
	want := make([][]uint32, len(texts))
	for i := range texts {
		texts[i] = base[:len(base)-r.IntN(500)] + fmt.Sprintf(" request %d %s", i, randomText(r, 50, plain))
		want[i] = ref.Encode(texts[i], false)
	}
	var wg sync.WaitGroup
	errs := make(chan string, 8)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for k := 0; k < 200; k++ {
				i := (g*31 + k*7) % len(texts)
				if got := tk.Encode(texts[i], false); !slices.Equal(got, want[i]) {
					errs <- fmt.Sprintf("goroutine %d: text %d differs", g, i)
					return
				}
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Fatal(e)
	}
	if testutil.ToFloat64(stats.resumed) == 0 || testutil.ToFloat64(stats.Evictions) == 0 {
		t.Fatalf("resumed %v, evicted %v: the test did not exercise both", testutil.ToFloat64(stats.resumed), testutil.ToFloat64(stats.Evictions))
	}
}

// TestPrefixCacheBounded fills a cache far past its bound: it never holds
// more than the bound, every eviction is counted, the index holds no key
// of an evicted entry, and an entry larger than the bound is not stored.
func TestPrefixCacheBounded(t *testing.T) {
	var c prefixCache
	const capacity = 256 << 10
	c.init(capacity, NewCacheMetrics())
	r := rand.New(rand.NewPCG(3, 3))
	stored := 0
	for i := 0; i < 4000; i++ {
		s := fmt.Sprintf("%0200d", i) + strings.Repeat("x", r.IntN(2000))
		keys := c.prefixHashes(nil, s)
		c.put(s, make([]uint32, 60), []mark{{off: 0, n: 0}, {off: 64, n: 20}}, keys)
		stored++
		if ids, ok := c.get(s); !ok || len(ids) != 60 {
			t.Fatalf("%d: just stored, not found", i)
		}
		if c.bytes > capacity {
			t.Fatalf("%d: holds %d bytes, bound %d", i, c.bytes, capacity)
		}
	}
	held := len(c.queue) - c.head
	if ev := int(testutil.ToFloat64(c.stats.Evictions)); ev != stored-held || ev == 0 {
		t.Fatalf("evictions %d, stored %d, held %d", ev, stored, held)
	}
	live := map[*cacheEntry]bool{}
	for _, e := range c.queue[c.head:] {
		live[e] = true
	}
	for _, e := range c.prefix {
		if !live[e] {
			t.Fatal("the prefix index points to an evicted entry")
		}
	}
	if len(c.exact) != held {
		t.Fatalf("exact index holds %d entries, queue %d", len(c.exact), held)
	}
	huge := strings.Repeat("y", capacity)
	c.put(huge, []uint32{1}, nil, nil)
	if _, ok := c.get(huge); ok {
		t.Fatal("a segment larger than the bound was cached")
	}
	var off prefixCache
	off.init(0, NewCacheMetrics())
	if off.cacheable(strings.Repeat("z", 1000)) {
		t.Fatal("a cache of 0 bytes looks segments up")
	}
}

// TestPrefixCacheSecondChance: an entry hit since the hand last passed
// outlives older entries that were not.
func TestPrefixCacheSecondChance(t *testing.T) {
	var c prefixCache
	c.init(4*(1000+4*10+entryOverhead), NewCacheMetrics())
	text := func(i int) string { return fmt.Sprintf("%01000d", i) }
	for i := 0; i < 4; i++ {
		c.put(text(i), make([]uint32, 10), nil, nil)
	}
	if _, ok := c.get(text(0)); !ok {
		t.Fatal("entry 0 missing")
	}
	c.put(text(4), make([]uint32, 10), nil, nil) // evicts one: not 0, which was hit
	if _, ok := c.get(text(0)); !ok {
		t.Fatal("the entry hit was evicted first")
	}
	if _, ok := c.get(text(1)); ok {
		t.Fatal("the oldest entry not hit is still held")
	}
}

// TestRegistryCacheSetting: the registry hands its bound and its
// registered counters to every tokenizer it loads; 0 turns the cache off.
func TestRegistryCacheSetting(t *testing.T) {
	doc := strings.Repeat("The gateway routes each request to the worker that holds its prefix. ", 40)
	for _, capacity := range []int64{1 << 20, 0} {
		reg := prometheus.NewRegistry()
		r, err := NewRegistry(stagedDir, nil, reg, WithCacheBytes(capacity))
		if err != nil {
			t.Fatal(err)
		}
		tk, err := r.Get("meta-llama/Llama-3.1-8B-Instruct")
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range []string{doc + "First question?", doc + "First question?", doc + "Second question?"} {
			tk.Encode(s, false)
		}
		want := map[string]float64{"miss": 1, "hit": 1, "resumed": 1}
		if capacity == 0 {
			want = map[string]float64{"miss": 0, "hit": 0, "resumed": 0}
		}
		for result, n := range want {
			if got := testutil.ToFloat64(r.cacheStats.Lookups.WithLabelValues(result)); got != n {
				t.Errorf("capacity %d: %s %v, want %v", capacity, result, got, n)
			}
		}
		if n, err := testutil.GatherAndCount(reg, "loxilb_tokenizer_cache_lookups_total", "loxilb_tokenizer_cache_evictions_total",
			"loxilb_tokenizer_cache_resumed_bytes_total"); err != nil || n != 5 {
			t.Errorf("capacity %d: %d cache series registered (%v), want 5", capacity, n, err)
		}
	}
}
