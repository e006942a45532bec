package gateway

import (
	"bytes"
	"context"
	"sync"
	"weak"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/zeebo/xxh3"

	"github.com/loxilb-llm/loxilb/pkg/blockhash"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

// The body cache keeps, for recent request bodies seen at least twice, what
// the routing decision computed from them before scoring: the prompt's
// token ids, its rendered chat text and its block keys. A body that comes
// again byte for byte (a retry, many clients sending one prompt, a
// benchmark) then skips decoding, the template render, tokenizing and
// hashing, about 80% of a repeated 2k-token chat request's decision.
//
// It is exact: an entry is used only for the same bytes (compared in full,
// not only by hash), the same request path, the same service, and the very
// tokenizer and block hasher it was computed with (a reload of the staged
// files or a rebuilt rule makes new ones, so old entries never match
// again and age out). Entries hold weak pointers to those, so a replaced
// tokenizer's tables are not kept alive by the cache.
//
// It is bounded by bytes (body, ids, keys and rendered text of each entry,
// Config.BodyCacheBytes) and evicts the least recently used entries. A
// body is admitted on its second sighting only (a direct-mapped table of
// recent body hashes): a stream of new prompts, each seen once, costs a
// hash per request and copies nothing into the cache, so it neither pays
// for storing nor pushes repeated bodies out. Safe for concurrent use;
// entries are immutable once stored, so a hit's slices are read without
// the lock (an entry evicted meanwhile stays valid for its reader).

// bodySeenSlots is the size of the admission table: bodies seen once are
// remembered by hash until another body's hash takes the slot.
const bodySeenSlots = 1024

// bodyEntryOverhead approximates an entry's fixed cost beyond its arrays.
const bodyEntryOverhead = 160

type bodyCache struct {
	max int64

	mu      sync.Mutex
	used    int64
	entries map[uint64]*bodyEntry
	// head is the most recently used entry, tail the least.
	head, tail *bodyEntry
	seen       [bodySeenSlots]uint64

	hits, misses, admitted, evicted prometheus.Counter
	bytesG                          prometheus.Gauge
	collectors                      []prometheus.Collector
}

// bodyEntry is one body's routing inputs; immutable once stored.
type bodyEntry struct {
	sum        uint64
	svc        uint32
	path       string
	tok        weak.Pointer[tokenizer.Tokenizer]
	hasher     weak.Pointer[blockhash.Hasher]
	body       []byte
	ids        []uint32
	keys       []uint64
	rendered   string
	size       int64
	prev, next *bodyEntry
}

// bodyHit is what a hit hands Pick: read-only views of the entry.
type bodyHit struct {
	ids      []uint32
	keys     []uint64
	rendered string
}

func newBodyCache(max int64) *bodyCache {
	c := &bodyCache{max: max, entries: map[uint64]*bodyEntry{}}
	lookups := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_gateway_body_cache_lookups_total",
		Help: "Routing decisions that looked their request body up in the body cache: hit (decode, render, tokenize and hash skipped), miss; admitted counts misses stored because the body was seen before."},
		[]string{"result"})
	c.hits, c.misses, c.admitted = lookups.WithLabelValues("hit"), lookups.WithLabelValues("miss"), lookups.WithLabelValues("admitted")
	c.evicted = prometheus.NewCounter(prometheus.CounterOpts{Name: "loxilb_gateway_body_cache_evictions_total",
		Help: "Body cache entries evicted to stay within --tokenize-body-cache-bytes."})
	c.bytesG = prometheus.NewGauge(prometheus.GaugeOpts{Name: "loxilb_gateway_body_cache_bytes",
		Help: "Bytes held by the body cache (bodies, token ids, block keys, rendered prompts)."})
	c.collectors = []prometheus.Collector{lookups, c.evicted, c.bytesG}
	return c
}

// bodySum is the cache's hash of a body.
func bodySum(body []byte) uint64 { return xxh3.Hash(body) }

// get returns the entry for body when it was computed for the same
// service, path, tokenizer and hasher.
func (c *bodyCache) get(sum uint64, svc uint32, path string, tok *tokenizer.Tokenizer, h *blockhash.Hasher, body []byte) (bodyHit, bool) {
	c.mu.Lock()
	e := c.entries[sum]
	if e == nil || e.svc != svc || e.path != path || e.tok.Value() != tok || e.hasher.Value() != h || !bytes.Equal(e.body, body) {
		c.mu.Unlock()
		c.misses.Inc()
		return bodyHit{}, false
	}
	c.moveFront(e)
	c.mu.Unlock()
	c.hits.Inc()
	return bodyHit{ids: e.ids, keys: e.keys, rendered: e.rendered}, true
}

// offer stores a decision's inputs if body was seen before (the second
// sighting), copying the slices, which belong to the caller's pools.
func (c *bodyCache) offer(sum uint64, svc uint32, path string, tok *tokenizer.Tokenizer, h *blockhash.Hasher, body []byte, ids []uint32, keys []uint64, rendered string) {
	size := int64(len(body)+4*len(ids)+8*len(keys)+len(rendered)+len(path)) + bodyEntryOverhead
	if size > c.max {
		return
	}
	slot := &c.seen[sum%bodySeenSlots]
	c.mu.Lock()
	if *slot != sum {
		*slot = sum
		c.mu.Unlock()
		return
	}
	if _, ok := c.entries[sum]; ok {
		// Another request stored it meanwhile, or a colliding body holds
		// the hash: keep what is there.
		c.mu.Unlock()
		return
	}
	c.mu.Unlock()
	// Copy outside the lock: tens of KB for a long prompt.
	e := &bodyEntry{sum: sum, svc: svc, path: path, tok: weak.Make(tok), hasher: weak.Make(h),
		body: bytes.Clone(body), ids: append([]uint32(nil), ids...), keys: append([]uint64(nil), keys...),
		rendered: rendered, size: size}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.entries[sum]; ok {
		return
	}
	for c.used+size > c.max && c.tail != nil {
		c.remove(c.tail)
		c.evicted.Inc()
	}
	c.entries[sum] = e
	c.used += size
	c.pushFront(e)
	c.admitted.Inc()
	c.bytesG.Set(float64(c.used))
}

func (c *bodyCache) remove(e *bodyEntry) {
	c.unlink(e)
	delete(c.entries, e.sum)
	c.used -= e.size
	c.bytesG.Set(float64(c.used))
}

func (c *bodyCache) unlink(e *bodyEntry) {
	if e.prev != nil {
		e.prev.next = e.next
	} else {
		c.head = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else {
		c.tail = e.prev
	}
	e.prev, e.next = nil, nil
}

func (c *bodyCache) pushFront(e *bodyEntry) {
	e.next = c.head
	if c.head != nil {
		c.head.prev = e
	}
	c.head = e
	if c.tail == nil {
		c.tail = e
	}
}

func (c *bodyCache) moveFront(e *bodyEntry) {
	if c.head == e {
		return
	}
	c.unlink(e)
	c.pushFront(e)
}

// promptKeys is promptTokensRendered followed by the prompt's block keys
// (appended to keys), through the body cache when it is on. shared
// reports that ids belong to the cache: read them, never pool or change
// them. buf is the pooled array the ids are encoded into on a miss.
func (g *Gateway) promptKeys(ctx context.Context, st *service, model string, req *proxy.Request, body *parsedBody, buf []uint32,
	keys []uint64) (ids []uint32, rendered string, outKeys []uint64, shared bool, reason string, err error) {
	var sum uint64
	var tok *tokenizer.Tokenizer
	if g.bodies != nil {
		// A model without a loadable tokenizer takes the uncached path,
		// which counts and reports why.
		if t, terr := g.tok.Get(model); terr == nil {
			tok, sum = t, bodySum(req.Body)
			if h, ok := g.bodies.get(sum, st.id, req.Path, tok, st.hasher, req.Body); ok {
				return h.ids, h.rendered, append(keys, h.keys...), true, "", nil
			}
		}
	}
	ids, rendered, reason, err = g.promptTokensRendered(ctx, st, model, req, body, buf)
	if err != nil || reason != "" {
		return ids, rendered, keys, false, reason, err
	}
	keys = st.hasher.Keys(keys, ids)
	if tok != nil {
		g.bodies.offer(sum, st.id, req.Path, tok, st.hasher, req.Body, ids, keys, rendered)
	}
	return ids, rendered, keys, false, "", nil
}
