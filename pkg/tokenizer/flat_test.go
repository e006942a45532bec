package tokenizer

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
)

func TestMergeTableAgreesWithMap(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	want := map[uint64]merge{}
	tab := newMergeTable(5000)
	for i := 0; i < 5000; i++ {
		// Small ids collide in the low bits, as real vocabularies do; a
		// repeated pair keeps its last value.
		pair := uint64(rng.IntN(300))<<32 | uint64(rng.IntN(300))
		m := merge{rank: uint32(i), newID: rng.Uint32()}
		want[pair] = m
		if err := tab.set(pair, m); err != nil {
			t.Fatal(err)
		}
	}
	for l := uint32(0); l < 310; l++ {
		for r := uint32(0); r < 310; r++ {
			got, ok := tab.get(l, r)
			w, wok := want[uint64(l)<<32|uint64(r)]
			if ok != wok || got != w {
				t.Fatalf("(%d,%d): got %v %v, want %v %v", l, r, got, ok, w, wok)
			}
		}
	}
	if err := tab.set(emptyPair, merge{}); err == nil {
		t.Fatal("the reserved pair was accepted")
	}
}

func TestWordCacheBoundedAndExact(t *testing.T) {
	var c wordCache
	c.init()
	idsOf := func(w string) []uint32 {
		ids := make([]uint32, len(w)%7+1)
		for i := range ids {
			ids[i] = uint32(len(w)*31 + i)
		}
		return ids
	}
	// Far more words than the cache holds: every hit must still return
	// exactly what was put, after any number of shard clears.
	for i := 0; i < 20*cacheShards*cacheShardCapacity/10; i++ {
		w := fmt.Sprintf("w%d", i)
		c.put(w, idsOf(w))
		if i%97 == 0 {
			probe := fmt.Sprintf("w%d", i/2)
			if got, ok := c.appendCached([]uint32{7}, probe); ok && !slices.Equal(got, append([]uint32{7}, idsOf(probe)...)) {
				t.Fatalf("%s: got %v", probe, got)
			}
		}
	}
	for i := range c.shards {
		s := c.shards[i].tab.Load()
		if s.n > cacheShardCapacity || s.nWords > cacheWordBytes || s.nIDs > cacheIDs {
			t.Fatalf("shard %d over its bounds: %d entries, %d bytes, %d ids", i, s.n, s.nWords, s.nIDs)
		}
	}
	long := string(make([]byte, cacheMaxWordLen+1))
	c.put(long, []uint32{1})
	if _, ok := c.appendCached(nil, long); ok {
		t.Fatal("a word over cacheMaxWordLen was cached")
	}
	if got, ok := c.appendCached(nil, "w1999"); ok && !slices.Equal(got, idsOf("w1999")) {
		t.Fatalf("got %v", got)
	}
}

// TestWordCacheConcurrent runs readers against writers that keep clearing
// shards (run with -race).
func TestWordCacheConcurrent(t *testing.T) {
	var c wordCache
	c.init()
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 20000; i++ {
				w := fmt.Sprintf("g%d-%d", g%2, i%9000)
				if got, ok := c.appendCached(nil, w); ok && (len(got) != 1 || got[0] != uint32(i%9000)) {
					t.Errorf("%s: got %v", w, got)
					return
				}
				c.put(w, []uint32{uint32(i % 9000)})
			}
		}()
	}
	wg.Wait()
}

// TestShortWordsSkipTheCache checks the one- and two-byte shortcut of
// encodeWord against the merge loop for every such word.
func TestShortWordsSkipTheCache(t *testing.T) {
	for _, m := range parityModels {
		tk := loadStaged(t, m.slug)
		bm := tk.model
		for i := 0; i < 1<<16+256; i++ {
			w := string([]byte{byte(i)})
			if i >= 256 {
				w = string([]byte{byte(i >> 8), byte(i)})
			}
			want := bm.merge(nil, w)
			if bm.ignoreMerges {
				if id, ok := bm.vocab[w]; ok {
					want = []uint32{id}
				}
			}
			if got := bm.encodeWord(nil, w); !slices.Equal(got, want) {
				t.Fatalf("%s %q: %v, want %v", m.name, w, got, want)
			}
		}
	}
}
