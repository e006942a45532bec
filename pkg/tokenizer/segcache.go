package tokenizer

import (
	"hash/maphash"
	"strings"
	"sync"
)

// segCache memoises the ids of whole text segments: the stretches of a
// prompt between added tokens, which encodeBody encodes independently of
// each other. A chat template puts every message in its own segment
// (between tokens such as <|im_start|> and <|im_end|>), so the next turn
// of a conversation, which repeats the earlier messages, finds them here
// and tokenizes only what is new. Since a segment's ids are a pure
// function of its text, a hit is bit-exact by construction; the split into
// segments is still computed on the whole prompt every time.
//
// The cache is bounded by bytes (text plus ids) per shard; a full shard is
// cleared, as the word cache does.
type segCache struct {
	seed   maphash.Seed
	shards [segShards]segShard
}

const (
	segShards = 8
	// segMinLen: shorter segments (role names, separators) are cheap to
	// encode from the word cache; caching them would only churn.
	segMinLen = 128
	// segMaxLen keeps one huge prompt from flushing a shard by itself.
	segMaxLen = 256 << 10
	// segShardBytes bounds each shard: 8 shards x 1 MiB per model.
	segShardBytes = 1 << 20
)

type segShard struct {
	mu    sync.RWMutex
	m     map[string][]uint32
	bytes int
}

func (c *segCache) init() { c.seed = maphash.MakeSeed() }

func (c *segCache) shard(s string) *segShard {
	return &c.shards[maphash.String(c.seed, s)%segShards]
}

// cacheable reports whether a segment of this length is looked up at all.
func (c *segCache) cacheable(s string) bool { return len(s) >= segMinLen && len(s) <= segMaxLen }

// get returns the ids of segment s. The slice is never modified after it
// is stored, so the caller may read it without the lock.
func (c *segCache) get(s string) ([]uint32, bool) {
	sh := c.shard(s)
	sh.mu.RLock()
	ids, ok := sh.m[s]
	sh.mu.RUnlock()
	return ids, ok
}

func (c *segCache) put(s string, ids []uint32) {
	cost := len(s) + 4*len(ids)
	if cost > segShardBytes {
		return
	}
	sh := c.shard(s)
	cp := append([]uint32(nil), ids...)
	key := strings.Clone(s) // the prompt it came from is not retained
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if _, ok := sh.m[key]; ok {
		return
	}
	if sh.m == nil || sh.bytes+cost > segShardBytes {
		sh.m, sh.bytes = make(map[string][]uint32), 0
	}
	sh.m[key] = cp
	sh.bytes += cost
}

// reset empties the cache (benchmarks).
func (c *segCache) reset() {
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.Lock()
		sh.m, sh.bytes = nil, 0
		sh.mu.Unlock()
	}
}
