package enginesim

import (
	"container/list"
	"sort"
)

// cachedBlock is one resident KV block. A block with refs > 0 belongs to a
// running request and cannot be evicted; unreferenced blocks sit in the LRU.
type cachedBlock struct {
	key          uint64
	digest       []byte
	parent       uint64
	hasParent    bool
	parentDigest []byte
	refs         int
	elem         *list.Element // in lru while refs == 0
	dead         bool          // removed by eviction or a clear; late releases ignore it
	tokens       []uint32      // kept only with a CPU tier, for its stored events
}

// blockCache is one rank's prefix cache: a fixed pool of blocks with LRU
// eviction of unreferenced blocks. It is not safe for concurrent use; the
// owning rank serialises access.
type blockCache struct {
	capacity  int
	blockSize int
	perBlock  bool // SGLang publishes one event per page
	blocks    map[uint64]*cachedBlock
	lru       *list.List // front = most recently released

	evictions uint64
	dropped   uint64 // blocks that could not be cached because the pool was pinned

	// The host-memory tier (cpuCap > 0): blocks evicted from the pool,
	// front = most recently offloaded.
	cpuCap int
	cpu    map[uint64]*list.Element
	cpuLRU *list.List
}

func newBlockCache(capacity, blockSize int, perBlock bool) *blockCache {
	return &blockCache{capacity: capacity, blockSize: blockSize, perBlock: perBlock,
		blocks: make(map[uint64]*cachedBlock), lru: list.New()}
}

// match returns how many leading blocks of hbs (at most limit) are resident.
func (c *blockCache) match(hbs []hashedBlock, limit int) int {
	if limit > len(hbs) {
		limit = len(hbs)
	}
	n := 0
	for n < limit {
		if _, ok := c.blocks[hbs[n].key]; !ok {
			break
		}
		n++
	}
	return n
}

func (c *blockCache) ref(b *cachedBlock) {
	if b.refs == 0 && b.elem != nil {
		c.lru.Remove(b.elem)
		b.elem = nil
	}
	b.refs++
}

// acquire pins the first n blocks of hbs, which match reported as resident.
func (c *blockCache) acquire(hbs []hashedBlock, n int) []*cachedBlock {
	out := make([]*cachedBlock, 0, len(hbs))
	for i := 0; i < n; i++ {
		b, ok := c.blocks[hbs[i].key]
		if !ok {
			break
		}
		c.ref(b)
		out = append(out, b)
	}
	return out
}

// insert makes every block of hbs resident and pinned, evicting the least
// recently used unreferenced blocks when the pool is full. It returns the
// pinned blocks (to release later) and the events describing the change:
// removals first (they happen at allocation), then the stored runs. When the
// pool is entirely pinned the remaining blocks are not cached, as in an
// engine that cannot allocate.
func (c *blockCache) insert(hbs []hashedBlock, held []*cachedBlock) ([]*cachedBlock, []kvEvent) {
	var removed []uint64
	var offloaded []*cachedBlock
	type run struct{ from, to int }
	var runs []run
	have := make(map[*cachedBlock]bool, len(held))
	for _, b := range held {
		have[b] = true
	}
	for i := range hbs {
		hb := &hbs[i]
		if b, ok := c.blocks[hb.key]; ok {
			if !have[b] {
				c.ref(b)
				held = append(held, b)
				have[b] = true
			}
			continue
		}
		if len(c.blocks) >= c.capacity {
			back := c.lru.Back()
			if back == nil {
				c.dropped += uint64(len(hbs) - i)
				break
			}
			victim := back.Value.(*cachedBlock)
			c.lru.Remove(back)
			victim.elem = nil
			victim.dead = true
			delete(c.blocks, victim.key)
			c.evictions++
			removed = append(removed, victim.key)
			if c.cpuCap > 0 {
				offloaded = append(offloaded, victim)
			}
		}
		b := &cachedBlock{key: hb.key, digest: hb.digest, refs: 1}
		if c.cpuCap > 0 {
			b.tokens = hb.tokens
		}
		if i > 0 {
			b.hasParent = true
			b.parent = hbs[i-1].key
			b.parentDigest = hbs[i-1].digest
		}
		c.blocks[hb.key] = b
		held = append(held, b)
		have[b] = true
		if n := len(runs); n > 0 && runs[n-1].to == i {
			runs[n-1].to = i + 1
		} else {
			runs = append(runs, run{i, i + 1})
		}
	}
	// Offloaded copies are published before the GPU removals, so the
	// block is never absent from the engine's inventory in between.
	evs := c.offload(offloaded)
	if len(removed) > 0 {
		if c.perBlock {
			for _, k := range removed {
				evs = append(evs, kvEvent{kind: evRemoved, keys: []uint64{k}})
			}
		} else {
			evs = append(evs, kvEvent{kind: evRemoved, keys: removed})
		}
	}
	for _, r := range runs {
		if !c.perBlock {
			evs = append(evs, storedEvent(hbs, r.from, r.to, c.blockSize))
			continue
		}
		for s := r.from; s < r.to; s++ {
			// A page event reports its own length: a trailing partial
			// page is shorter than the page size.
			evs = append(evs, storedEvent(hbs, s, s+1, len(hbs[s].tokens)))
		}
	}
	return held, evs
}

func storedEvent(hbs []hashedBlock, from, to, blockSize int) kvEvent {
	e := kvEvent{kind: evStored, blockSize: blockSize}
	for i := from; i < to; i++ {
		e.keys = append(e.keys, hbs[i].key)
		e.digests = append(e.digests, hbs[i].digest)
		e.tokens = append(e.tokens, hbs[i].tokens...)
		e.extras = append(e.extras, hbs[i].extra)
		e.lora = hbs[i].lora
	}
	if from > 0 {
		e.hasParent = true
		e.parent = hbs[from-1].key
		e.parentDigest = hbs[from-1].digest
	}
	return e
}

// release unpins blocks; the last release makes a block evictable. Blocks
// are pushed tail first so that the deepest block of a prefix is evicted
// before its parents, as engines free a request's blocks in reverse order.
func (c *blockCache) release(held []*cachedBlock) {
	for i := len(held) - 1; i >= 0; i-- {
		b := held[i]
		if b.dead || b.refs == 0 {
			continue
		}
		b.refs--
		if b.refs == 0 {
			b.elem = c.lru.PushFront(b)
		}
	}
}

// clear drops every block (engine reset); pinned blocks are orphaned and
// their later release is ignored.
func (c *blockCache) clear() {
	for _, b := range c.blocks {
		b.dead = true
		b.elem = nil
	}
	c.blocks = make(map[uint64]*cachedBlock)
	c.lru.Init()
	c.cpu, c.cpuLRU = nil, nil
}

// offload moves blocks evicted from the pool to the CPU tier, returning
// its events in order: one BlockStored "CPU" per offloaded block, chained
// to its parent, each after the BlockRemoved "CPU" of the tier eviction
// that made room for it.
func (c *blockCache) offload(bs []*cachedBlock) []kvEvent {
	if len(bs) == 0 {
		return nil
	}
	if c.cpu == nil {
		c.cpu, c.cpuLRU = make(map[uint64]*list.Element), list.New()
	}
	var evs []kvEvent
	for _, b := range bs {
		if el, ok := c.cpu[b.key]; ok {
			c.cpuLRU.MoveToFront(el)
			continue
		}
		if len(c.cpu) >= c.cpuCap {
			back := c.cpuLRU.Back()
			k := c.cpuLRU.Remove(back).(uint64)
			delete(c.cpu, k)
			evs = append(evs, kvEvent{kind: evRemoved, cpu: true, keys: []uint64{k}})
		}
		c.cpu[b.key] = c.cpuLRU.PushFront(b.key)
		e := kvEvent{kind: evStored, cpu: true, blockSize: c.blockSize, keys: []uint64{b.key},
			digests: [][]byte{b.digest}, tokens: b.tokens, extras: [][]string{nil},
			hasParent: b.hasParent, parent: b.parent, parentDigest: b.parentDigest}
		evs = append(evs, e)
	}
	return evs
}

// cpuLen is the number of blocks in the CPU tier.
func (c *blockCache) cpuLen() int { return len(c.cpu) }

// BlockInfo describes one resident block in /sim/cache.
type BlockInfo struct {
	Hash   uint64  `json:"hash"`
	Parent *uint64 `json:"parent"`
	Refs   int     `json:"refs"`
}

func (c *blockCache) snapshot() []BlockInfo {
	out := make([]BlockInfo, 0, len(c.blocks))
	for _, b := range c.blocks {
		bi := BlockInfo{Hash: b.key, Refs: b.refs}
		if b.hasParent {
			p := b.parent
			bi.Parent = &p
		}
		out = append(out, bi)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Hash < out[j].Hash })
	return out
}

// cpuKeys lists the CPU tier's keys, most recently offloaded first.
func (c *blockCache) cpuKeys() []uint64 {
	if c.cpuLRU == nil {
		return nil
	}
	out := make([]uint64, 0, len(c.cpu))
	for el := c.cpuLRU.Front(); el != nil; el = el.Next() {
		out = append(out, el.Value.(uint64))
	}
	return out
}
