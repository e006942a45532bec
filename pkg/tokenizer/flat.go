package tokenizer

import (
	"errors"
	"hash/maphash"
	"math/bits"
	"sync"
	"sync/atomic"
)

// The BPE hot path does two lookups per piece and per merge step: the word
// cache and the merge ranks. Go maps spend most of such a lookup on group
// probing and hashing the key through an interface-sized hasher; these
// flat open-addressing tables (linear probing, at most half full, keys and
// values inline) make a lookup one multiply and usually one cache line.
// The KV index (pkg/kvindex) uses the same layout for its block table.

// emptyPair marks a free merge slot: no pair of uint32 ids other than
// (MaxUint32, MaxUint32) maps to it, and newMergeTable refuses that one.
const emptyPair = ^uint64(0)

var errPairRange = errors.New("merge pair of token ids 4294967295 is out of range")

type mergeSlot struct {
	pair uint64 // left id << 32 | right id; emptyPair when free
	merge
}

// mergeTable maps an adjacent id pair to its merge rank and the merged id.
// It is built once and only read afterwards, so readers need no lock.
type mergeTable struct {
	slots []mergeSlot
	shift uint8 // 64 - log2(len(slots))
}

// newMergeTable sizes a table for n pairs.
func newMergeTable(n int) mergeTable {
	size := 1 << max(bits.Len(uint(2*n)), 4)
	t := mergeTable{slots: make([]mergeSlot, size), shift: uint8(64 - bits.TrailingZeros(uint(size)))}
	for i := range t.slots {
		t.slots[i].pair = emptyPair
	}
	return t
}

// slot is Fibonacci hashing: the multiply spreads consecutive ids, which
// pairs of small ids are, across the whole table.
func (t *mergeTable) slot(pair uint64) uint64 {
	return (pair * 0x9E3779B97F4A7C15) >> t.shift
}

// set stores pair -> m, replacing an earlier rank for the same pair (a
// repeated pair keeps its last rank, as the Rust HashMap collect does).
func (t *mergeTable) set(pair uint64, m merge) error {
	if pair == emptyPair {
		return errPairRange
	}
	mask := uint64(len(t.slots) - 1)
	for i := t.slot(pair); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.pair == pair || s.pair == emptyPair {
			s.pair, s.merge = pair, m
			return nil
		}
	}
}

func (t *mergeTable) get(left, right uint32) (merge, bool) {
	pair := uint64(left)<<32 | uint64(right)
	mask := uint64(len(t.slots) - 1)
	for i := t.slot(pair); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.pair == pair {
			return s.merge, true
		}
		if s.pair == emptyPair {
			return merge{}, false
		}
	}
}

// wordCache memoises BPE results per pre-tokenized piece, as HuggingFace's
// BPE cache does. It is sharded to keep writers apart, and bounded: a full
// shard is replaced by an empty one, which keeps memory fixed without LRU
// bookkeeping on the hot path. Each shard is a flat table whose slots point
// into two fixed arenas (word bytes, ids), so an entry costs no allocation
// of its own.
//
// Reads take no lock. A lookup is one per piece of every prompt, and a
// read lock's two atomic adds on a shared counter cost as much as the
// lookup itself (more once several cores contend for the line). Writers
// serialise on the shard's mutex and only ever append: the entry's bytes
// and ids go into arena space no published slot covers, then its slot's
// hash is stored atomically, which publishes it. A published slot never
// changes; clearing swaps in a new table, and readers still holding the
// old one finish on it.
type wordCache struct {
	seed   maphash.Seed
	shards [cacheShards]cacheShard
}

const (
	cacheShards        = 16
	cacheShardCapacity = 4096 // entries per shard before it is cleared
	cacheMaxWordLen    = 256
	// cacheSlots keeps a shard at most half full.
	cacheSlots = 2 * cacheShardCapacity
	// Arena bounds per shard: room for the capacity at typical piece
	// lengths; a shard of unusually long pieces is cleared sooner.
	cacheWordBytes = cacheShardCapacity * 16
	cacheIDs       = cacheShardCapacity * 8
)

type cacheShard struct {
	mu  sync.Mutex // serialises writers; readers only load tab
	tab atomic.Pointer[cacheTable]
}

// cacheTable is one generation of a shard. Its arenas are fixed arrays, so
// appending never moves bytes a reader may be comparing.
type cacheTable struct {
	slots [cacheSlots]wordSlot
	words [cacheWordBytes]byte
	ids   [cacheIDs]uint32
	// Owned by the writer holding the shard's mutex.
	n, nWords, nIDs int
}

// wordSlot is one entry; hash 0 marks a free slot. The other fields are
// written before hash and never after.
type wordSlot struct {
	hash       atomic.Uint64
	word, nw   uint32 // offset and length in words
	idOff, nID uint32 // offset and length in ids
}

func (c *wordCache) init() {
	c.seed = maphash.MakeSeed()
}

// hash returns the word's hash, never 0; its low bits pick the shard and
// its high bits the slot.
func (c *wordCache) hash(w string) uint64 {
	return maphash.String(c.seed, w) | 1<<63
}

// appendCached appends the cached ids of w to dst.
func (c *wordCache) appendCached(dst []uint32, w string) ([]uint32, bool) {
	if len(w) > cacheMaxWordLen {
		return dst, false
	}
	h := c.hash(w)
	t := c.shards[h%cacheShards].tab.Load()
	if t == nil {
		return dst, false
	}
	if i, ok := t.find(h, w); ok {
		e := &t.slots[i]
		return append(dst, t.ids[e.idOff:e.idOff+e.nID]...), true
	}
	return dst, false
}

func (c *wordCache) put(w string, ids []uint32) {
	if len(w) > cacheMaxWordLen || len(ids) > cacheIDs {
		return
	}
	h := c.hash(w)
	s := &c.shards[h%cacheShards]
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.tab.Load()
	if t == nil {
		t = new(cacheTable)
		s.tab.Store(t)
	}
	i, found := t.find(h, w)
	if found {
		return // another request put it first: same word, same ids
	}
	if t.n >= cacheShardCapacity || t.nWords+len(w) > cacheWordBytes || t.nIDs+len(ids) > cacheIDs {
		t = new(cacheTable)
		s.tab.Store(t)
		i, _ = t.find(h, w)
	}
	e := &t.slots[i]
	e.word, e.nw = uint32(t.nWords), uint32(len(w))
	e.idOff, e.nID = uint32(t.nIDs), uint32(len(ids))
	t.nWords += copy(t.words[t.nWords:], w)
	t.nIDs += copy(t.ids[t.nIDs:], ids)
	t.n++
	e.hash.Store(h) // publishes the entry
}

// find returns the slot holding w, or the free slot where it belongs.
func (t *cacheTable) find(h uint64, w string) (int, bool) {
	const mask = cacheSlots - 1
	for i := int(h>>32) & mask; ; i = (i + 1) & mask {
		e := &t.slots[i]
		eh := e.hash.Load()
		if eh == 0 {
			return i, false
		}
		if eh == h && int(e.nw) == len(w) && string(t.words[e.word:e.word+e.nw]) == w {
			return i, true
		}
	}
}

// reset empties the cache (benchmarks).
func (c *wordCache) reset() {
	for i := range c.shards {
		s := &c.shards[i]
		s.mu.Lock()
		s.tab.Store(nil)
		s.mu.Unlock()
	}
}
