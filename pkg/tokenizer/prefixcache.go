package tokenizer

import (
	"hash/maphash"
	"sort"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// prefixCache memoises the ids of text segments (the stretches of a prompt
// between added tokens, which encodeBody encodes independently of each
// other) and lets a new segment that shares a long byte prefix with a
// cached one resume tokenizing where the shared part stops mattering.
//
// A chat template puts every message in its own segment, so a
// conversation's next turn finds its earlier messages whole (an exact
// hit). A long message that only ends differently (a new question after
// the same document, a retry with an edited tail) shares all but its end
// with a cached segment: its ids up to a resume mark of that segment are
// reused and only the rest is tokenized (a resume).
//
// Why a resume is exact: the hand-written Qwen/Llama-3 pre-tokenizer
// (bpeScanner) is stateless from one match to the next and reads only
// forward from a match's start: letters, digits and punctuation runs up to
// the first rune of another class, a whitespace run to its end and one
// rune past it (`\s*[\r\n]+` and `\s+(?!\S)` choose where in the run to
// cut only once they have seen all of it, which is the one unbounded
// look-ahead). A mark is a match boundary b whose byte is ASCII and not
// white space, so no whitespace run crosses it and every match before b
// read nothing past byte b. If a new text agrees with the cached one on
// its first b+resumeMargin bytes, every match before b is the same in
// both, and so are its ids (BPE works within a match). NFC, the only
// normalizer resumption allows, leaves ASCII alone and never composes an
// ASCII character as the second of a pair, so normalizing a valid UTF-8
// text cuts at b into normalizing each side; marks are only recorded
// while the text is unchanged by normalization. Tokenizers whose
// pre-tokenizer is the general regexp2 path (a backtracking engine whose
// reads are not bounded by this argument), that have no pre-tokenizer
// (the whole segment is one BPE word), another normalizer (Prepend acts
// at the start of the text) or normalized added tokens get exact hits only.
//
// Lookup: an entry is indexed by the hash of its whole text (exact hits)
// and, when resumable, by the hash of each prefix whose length is a
// multiple of checkpointBytes. A new text's prefix hashes are looked up
// from the longest down; a candidate is verified by comparing bytes, never
// trusted on its hash, and the common prefix is then extended byte by
// byte. Entries are immutable once stored, so their ids are read without
// the lock.
//
// Memory is bounded by bytes (text, ids, marks, index keys and a fixed
// overhead per entry), evicting by second chance (CLOCK): an entry hit
// since the hand last passed it is kept once more. A segment resumed
// with only a small tail left to tokenize is not stored (encodeCached),
// so a stream of new questions after one document keeps one copy of it.
type prefixCache struct {
	seed     maphash.Seed
	capacity int64 // bytes; 0: nothing is cached

	mu     sync.RWMutex
	exact  map[uint64]*cacheEntry
	prefix map[uint64]*cacheEntry
	queue  []*cacheEntry // insertion order from head, the CLOCK's hand
	head   int
	bytes  int64

	stats *CacheMetrics
}

const (
	// cacheMinLen: shorter segments (role names, separators) are cheap to
	// encode from the word cache; caching them would only churn.
	cacheMinLen = 128
	// cacheMaxLen keeps one huge prompt from flushing the cache by itself.
	cacheMaxLen = 256 << 10
	// checkpointBytes is the spacing of the prefix hashes an entry is
	// indexed by: a resume can start at most this far (plus markGap)
	// before the end of the shared prefix, and a lookup hashes the new
	// text once and probes len/checkpointBytes keys.
	checkpointBytes = 256
	// markGap is the least spacing of an entry's resume marks.
	markGap = 32
	// resumeMargin is how many bytes past a mark must be shared before
	// the mark is used. The argument above needs 1 (the mark's own byte);
	// the rest is slack against a future scanner change reading further.
	resumeMargin = 16
	// resumeStoreFraction: a stretch resumed with at most 1/8 of it left
	// to tokenize is not stored (encodeCached).
	resumeStoreFraction = 8
	// entryOverhead approximates an entry's fixed cost and its map slots.
	entryOverhead = 160
	// keyOverhead approximates one prefix index slot.
	keyOverhead = 48
	// DefaultCacheBytes bounds each tokenizer's cache unless configured.
	DefaultCacheBytes = 8 << 20
)

// mark is a resume point: the text's first off bytes tokenize to the
// entry's first n ids.
type mark struct{ off, n uint32 }

type cacheEntry struct {
	text  string
	ids   []uint32
	marks []mark   // ascending; empty when the entry cannot be resumed from
	keys  []uint64 // prefix index keys, for removal
	full  uint64
	cost  int64
	ref   atomic.Bool // hit since the CLOCK hand last passed
}

// CacheMetrics counts a registry's tokenizer cache outcomes. The zero
// value is not usable; NewCacheMetrics builds one.
type CacheMetrics struct {
	Lookups      *prometheus.CounterVec // result: hit, resumed, miss
	Evictions    prometheus.Counter
	ResumedBytes prometheus.Counter
	hit, resumed prometheus.Counter
	miss         prometheus.Counter
}

// NewCacheMetrics builds the counters (unregistered).
func NewCacheMetrics() *CacheMetrics {
	m := &CacheMetrics{
		Lookups: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_tokenizer_cache_lookups_total",
			Help: "Prompt segments looked up in the tokenizers' prefix caches, by result: hit (the whole segment's ids), resumed (a cached segment's ids up to a shared prefix, the rest tokenized), miss.",
		}, []string{"result"}),
		Evictions: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "loxilb_tokenizer_cache_evictions_total",
			Help: "Segments evicted from the tokenizers' prefix caches to stay within --tokenizer-cache-bytes.",
		}),
		ResumedBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "loxilb_tokenizer_cache_resumed_bytes_total",
			Help: "Bytes of prompt text not tokenized again because a cached segment with the same prefix was resumed.",
		}),
	}
	m.hit, m.resumed, m.miss = m.Lookups.WithLabelValues("hit"), m.Lookups.WithLabelValues("resumed"), m.Lookups.WithLabelValues("miss")
	return m
}

// Collectors lists the counters for registration.
func (m *CacheMetrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.Lookups, m.Evictions, m.ResumedBytes}
}

func (c *prefixCache) init(capacity int64, stats *CacheMetrics) {
	c.seed = maphash.MakeSeed()
	c.capacity = capacity
	c.stats = stats
}

// configure replaces the bound and the counters and empties the cache.
// The bound and the counters are read without the lock, so it runs
// before the tokenizer is handed out (and in benchmarks between encodes),
// never while another goroutine encodes.
func (c *prefixCache) configure(capacity int64, stats *CacheMetrics) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.capacity, c.stats = max(capacity, 0), stats
	c.exact, c.prefix, c.queue, c.head, c.bytes = nil, nil, nil, 0, 0
}

// cacheable reports whether a segment of this length is looked up at all.
func (c *prefixCache) cacheable(s string) bool {
	return c.capacity > 0 && len(s) >= cacheMinLen && len(s) <= cacheMaxLen
}

// get returns the ids of segment s when it is cached whole. The slice is
// never modified after it is stored, so the caller may read it unlocked.
func (c *prefixCache) get(s string) ([]uint32, bool) {
	h := maphash.String(c.seed, s)
	c.mu.RLock()
	e := c.exact[h]
	c.mu.RUnlock()
	if e == nil || e.text != s {
		return nil, false
	}
	e.ref.Store(true)
	c.stats.hit.Inc()
	return e.ids, true
}

// prefixHashes appends the hashes of s's prefixes of length k*checkpointBytes.
func (c *prefixCache) prefixHashes(dst []uint64, s string) []uint64 {
	var h maphash.Hash
	h.SetSeed(c.seed)
	for end := checkpointBytes; end <= len(s); end += checkpointBytes {
		h.WriteString(s[end-checkpointBytes : end])
		dst = append(dst, h.Sum64())
	}
	return dst
}

// resume finds the cached entry sharing the longest prefix with s among
// those found at s's checkpoints (keys: s's prefix hashes) and its last
// mark that prefix covers. ok is false when none is usable.
func (c *prefixCache) resume(s string, keys []uint64) (e *cacheEntry, m mark, ok bool) {
	for k := len(keys); k > 0; k-- {
		c.mu.RLock()
		for ; k > 0; k-- {
			if e = c.prefix[keys[k-1]]; e != nil {
				break
			}
		}
		c.mu.RUnlock()
		n := k * checkpointBytes
		if e == nil || len(e.text) < n || e.text[:n] != s[:n] {
			continue // nothing indexed, or a hash collision: look shorter
		}
		p := n + commonPrefix(e.text[n:], s[n:])
		i := sort.Search(len(e.marks), func(i int) bool { return int(e.marks[i].off)+resumeMargin > p }) - 1
		if i < 0 {
			return nil, mark{}, false
		}
		e.ref.Store(true)
		return e, e.marks[i], true
	}
	return nil, mark{}, false
}

func commonPrefix(a, b string) int {
	n := min(len(a), len(b))
	i := 0
	for i+8 <= n && a[i:i+8] == b[i:i+8] {
		i += 8
	}
	for i < n && a[i] == b[i] {
		i++
	}
	return i
}

// put stores segment s with its ids and resume marks (nil: exact hits
// only) and the prefix hashes of s (used only when marks are given).
// Arguments are copied.
func (c *prefixCache) put(s string, ids []uint32, marks []mark, keys []uint64) {
	if len(marks) == 0 {
		keys = nil
	}
	cost := int64(len(s) + 4*len(ids) + 8*len(marks) + (8+keyOverhead)*len(keys) + entryOverhead)
	if cost > c.capacity {
		return
	}
	e := &cacheEntry{
		text:  string([]byte(s)), // the prompt it came from is not retained
		ids:   append([]uint32(nil), ids...),
		marks: append([]mark(nil), marks...),
		keys:  append([]uint64(nil), keys...),
		full:  maphash.String(c.seed, s),
		cost:  cost,
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if old := c.exact[e.full]; old != nil && old.text == s {
		return
	}
	for c.bytes+cost > c.capacity && c.head < len(c.queue) {
		c.evictOne()
	}
	if c.exact == nil {
		c.exact, c.prefix = map[uint64]*cacheEntry{}, map[uint64]*cacheEntry{}
	}
	c.exact[e.full] = e
	for _, k := range e.keys {
		c.prefix[k] = e // the newest entry answers for a shared prefix
	}
	c.queue = append(c.queue, e)
	c.bytes += cost
}

// evictOne removes the first entry the CLOCK hand finds not hit since it
// last passed (after one full turn, the one at the hand); c.mu is held and
// the queue is not empty.
func (c *prefixCache) evictOne() {
	for turn := len(c.queue) - c.head; turn > 1; turn-- {
		e := c.queue[c.head]
		if !e.ref.Swap(false) {
			break
		}
		c.queue[c.head] = nil
		c.head++
		c.queue = append(c.queue, e) // a second chance
	}
	e := c.queue[c.head]
	c.queue[c.head] = nil
	c.head++
	if c.head > len(c.queue)/2 {
		n := copy(c.queue, c.queue[c.head:])
		clear(c.queue[n:])
		c.queue, c.head = c.queue[:n], 0
	}
	if c.exact[e.full] == e {
		delete(c.exact, e.full)
	}
	for _, k := range e.keys {
		if c.prefix[k] == e {
			delete(c.prefix, k)
		}
	}
	c.bytes -= e.cost
	c.stats.Evictions.Inc()
}

// reset empties the cache (benchmarks).
func (c *prefixCache) reset() {
	c.configure(c.capacity, c.stats)
}
