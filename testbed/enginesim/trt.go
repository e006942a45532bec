package enginesim

import (
	"math/rand/v2"
	"sync"
	"sync/atomic"
)

// TensorRT-LLM KV event JSON, shaped like tensorrt_llm/_utils.py
// KVCacheEventSerializer. Hashes are uint64 and exceed 2^53; encoding/json
// writes them exactly.

type trtEvent struct {
	EventID         uint64 `json:"event_id"`
	Data            any    `json:"data"`
	WindowSize      int    `json:"window_size"`
	AttentionDPRank *int   `json:"attention_dp_rank,omitempty"`
}

type trtCreated struct {
	Type                   string `json:"type"`
	NumBlocksPerCacheLevel []int  `json:"num_blocks_per_cache_level"`
}

type trtStored struct {
	Type       string           `json:"type"`
	ParentHash *uint64          `json:"parent_hash"`
	Blocks     []trtStoredBlock `json:"blocks"`
}

type trtStoredBlock struct {
	Type       string     `json:"type"`
	BlockHash  uint64     `json:"block_hash"`
	Tokens     []trtToken `json:"tokens"`
	CacheLevel int        `json:"cache_level"`
	Priority   int        `json:"priority"`
}

type trtToken struct {
	Type         string `json:"type"`
	TokenID      uint32 `json:"token_id"`
	TokenExtraID int    `json:"token_extra_id"`
}

type trtRemoved struct {
	Type        string   `json:"type"`
	BlockHashes []uint64 `json:"block_hashes"`
}

// trtDefaultPriority is TensorRT-LLM's default retention priority.
const trtDefaultPriority = 35

// trtQueue is the engine-side event buffer drained by POST /kv_cache_events.
// A full buffer drops its oldest events and counts them.
type trtQueue struct {
	mu         sync.Mutex
	events     []trtEvent
	lastBatch  int // index where the newest batch starts, for reordering
	nextID     uint64
	max        int
	windowSize int
	capacity   int
	multiRank  bool
	faults     *faultState
	rng        *rand.Rand

	overflow, dropped, reordered, drains atomic.Uint64
	// drainers counts drains by consumer (guarded by mu): a gateway node
	// names itself in X-Loxilb-Node, anything else is known by its
	// remote address. Several gateway nodes on one engine must show one.
	drainers map[string]uint64
}

func newTRTQueue(max, windowSize, capacity int, multiRank bool, faults *faultState, seed uint64) *trtQueue {
	q := &trtQueue{max: max, windowSize: windowSize, capacity: capacity, multiRank: multiRank,
		faults: faults, rng: rand.New(rand.NewPCG(seed, 0x747274))}
	q.pushCreated()
	return q
}

func (q *trtQueue) pushCreated() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.appendLocked([]any{trtCreated{Type: "created", NumBlocksPerCacheLevel: []int{q.capacity, 0}}}, 0, false)
}

func (q *trtQueue) appendLocked(datas []any, rank int, reorder bool) {
	start := len(q.events)
	for _, d := range datas {
		ev := trtEvent{EventID: q.nextID, Data: d, WindowSize: q.windowSize}
		if q.multiRank {
			r := rank
			ev.AttentionDPRank = &r
		}
		q.nextID++
		q.events = append(q.events, ev)
	}
	if reorder && q.lastBatch < start {
		// Move this batch in front of the previous one.
		batch := append([]trtEvent(nil), q.events[start:]...)
		prev := append([]trtEvent(nil), q.events[q.lastBatch:start]...)
		copy(q.events[q.lastBatch:], batch)
		copy(q.events[q.lastBatch+len(batch):], prev)
	} else {
		q.lastBatch = start
	}
	if over := len(q.events) - q.max; q.max > 0 && over > 0 {
		q.events = append(q.events[:0:0], q.events[over:]...)
		q.lastBatch = max(0, q.lastBatch-over)
		q.overflow.Add(uint64(over))
	}
}

// push converts one cache mutation (a batch) into TRT-LLM events.
func (q *trtQueue) push(evs []kvEvent, rank int) {
	var datas []any
	for i := range evs {
		e := &evs[i]
		switch e.kind {
		case evStored:
			s := trtStored{Type: "stored"}
			if e.hasParent {
				p := e.parent
				s.ParentHash = &p
			}
			for j, k := range e.keys {
				blk := trtStoredBlock{Type: "stored_block", BlockHash: k, CacheLevel: 0, Priority: trtDefaultPriority}
				for _, t := range e.tokens[j*e.blockSize : (j+1)*e.blockSize] {
					blk.Tokens = append(blk.Tokens, trtToken{Type: "unique_token", TokenID: t})
				}
				s.Blocks = append(s.Blocks, blk)
			}
			datas = append(datas, s)
		case evRemoved:
			datas = append(datas, trtRemoved{Type: "removed", BlockHashes: e.keys})
		}
	}
	if len(datas) == 0 {
		return
	}
	act := q.faults.batchAction(q.rng)
	q.mu.Lock()
	defer q.mu.Unlock()
	if act.drop {
		q.nextID += uint64(len(datas))
		q.dropped.Add(1)
		return
	}
	if act.reorder {
		q.reordered.Add(1)
	}
	q.appendLocked(datas, rank, act.reorder)
}

// drain removes and returns every buffered event, as the destructive
// TensorRT-LLM endpoint does, and counts the drain for consumer.
func (q *trtQueue) drain(consumer string) []trtEvent {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.drainers == nil {
		q.drainers = make(map[string]uint64)
	}
	q.drainers[consumer]++
	out := q.events
	q.events = nil
	q.lastBatch = 0
	q.drains.Add(1)
	if out == nil {
		out = []trtEvent{}
	}
	return out
}

// restart empties the queue and restarts event ids, then queues "created".
func (q *trtQueue) restart() {
	q.mu.Lock()
	q.events = nil
	q.lastBatch = 0
	q.nextID = 0
	q.mu.Unlock()
	q.pushCreated()
}
