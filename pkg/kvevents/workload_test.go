package kvevents

import (
	"container/list"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/blockhash"
)

// simEngine is a minimal prefix-caching engine: an LRU of blocks keyed by
// the real hash contract, publishing the events vLLM (map encoding, one
// BlockStored per run) or SGLang (tagged arrays, one per page, signed keys)
// would for each request.
type simEngine struct {
	h      *blockhash.Hasher
	bs     int
	cap    int
	sglang bool
	lru    *list.List // of uint64, front = most recent
	at     map[uint64]*list.Element
	seq    uint64
}

func newSimEngine(t *testing.T, algo blockhash.Algo, bs, capacity int, sglang bool) *simEngine {
	h, err := blockhash.New(blockhash.Config{Algo: algo, BlockSize: bs, Seed: "42"})
	if err != nil {
		t.Fatal(err)
	}
	return &simEngine{h: h, bs: bs, cap: capacity, sglang: sglang, lru: list.New(), at: map[uint64]*list.Element{}}
}

// restart models a process restart: an empty cache and seq from 0, with no
// AllBlocksCleared.
func (e *simEngine) restart() {
	e.lru.Init()
	clear(e.at)
	e.seq = 0
}

func (e *simEngine) keys() []uint64 {
	out := make([]uint64, 0, len(e.at))
	for k := range e.at {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func (e *simEngine) putKey(m *mp, k uint64) {
	if e.sglang && int64(k) < 0 {
		m.i64(int64(k))
	} else {
		m.u64(k)
	}
}

// serve processes one request and returns the batch it publishes (nil when
// nothing changed) with its seq.
func (e *simEngine) serve(tokens []uint32) ([]byte, uint64, bool) {
	type run struct {
		parent    uint64
		hasParent bool
		keys      []uint64
		tokens    []uint32
	}
	var runs []run
	var evicted []uint64
	var d blockhash.Digest
	var prev uint64
	for i := 0; (i+1)*e.bs <= len(tokens); i++ {
		blk := tokens[i*e.bs : (i+1)*e.bs]
		var k uint64
		d, k = e.h.Next(d, blk)
		if el, ok := e.at[k]; ok {
			e.lru.MoveToFront(el)
		} else {
			for e.lru.Len() >= e.cap {
				old := e.lru.Remove(e.lru.Back()).(uint64)
				delete(e.at, old)
				evicted = append(evicted, old)
			}
			e.at[k] = e.lru.PushFront(k)
			if len(runs) == 0 || e.sglang || runs[len(runs)-1].keys[len(runs[len(runs)-1].keys)-1] != prev {
				runs = append(runs, run{parent: prev, hasParent: i > 0})
			}
			r := &runs[len(runs)-1]
			r.keys = append(r.keys, k)
			r.tokens = append(r.tokens, blk...)
		}
		prev = k
	}
	n := len(runs)
	if len(evicted) > 0 {
		n++
	}
	if n == 0 {
		return nil, 0, false
	}
	var m mp
	m.arr(3).f64(0).arr(n)
	// Evictions happen before the stores that needed the room.
	if len(evicted) > 0 {
		if e.sglang {
			m.arr(3).str("BlockRemoved").arr(len(evicted))
		} else {
			m.mapN(3).str("type").str("BlockRemoved").str("block_hashes").arr(len(evicted))
		}
		for _, k := range evicted {
			e.putKey(&m, k)
		}
		if !e.sglang {
			m.str("medium")
		}
		m.str("GPU")
	}
	for _, r := range runs {
		if e.sglang {
			m.arr(7).str("BlockStored").arr(len(r.keys))
		} else {
			m.mapN(6).str("type").str("BlockStored").str("block_hashes").arr(len(r.keys))
		}
		for _, k := range r.keys {
			e.putKey(&m, k)
		}
		if !e.sglang {
			m.str("parent_block_hash")
		}
		if r.hasParent {
			e.putKey(&m, r.parent)
		} else {
			m.nil_()
		}
		if !e.sglang {
			m.str("token_ids")
		}
		m.arr(len(r.tokens))
		for _, t := range r.tokens {
			m.WriteByte(0xce)
			m.Write([]byte{byte(t >> 24), byte(t >> 16), byte(t >> 8), byte(t)})
		}
		if !e.sglang {
			m.str("block_size")
		}
		m.fix(e.bs)
		if e.sglang {
			m.nil_().str("GPU")
		} else {
			m.str("medium").str("GPU")
		}
	}
	m.fix(0)
	seq := e.seq
	e.seq++
	return m.Bytes(), seq, true
}

// workload draws requests sharing a few system prompts, so prefixes repeat
// and the LRU evicts.
func workload(rng *rand.Rand, bs int) []uint32 {
	prefix := rng.IntN(4)
	n := bs * (2 + rng.IntN(7))
	out := make([]uint32, n+rng.IntN(bs))
	for i := range out {
		if i < 2*bs {
			out[i] = uint32(1000*prefix + i)
		} else {
			out[i] = uint32(rng.IntN(50000))
		}
	}
	return out
}

// TestWorkloadMatchesEngineCache drives simulated engines through a workload
// with evictions and a restart, and checks the inventory equals each
// engine's own cache, with parity attested.
func TestWorkloadMatchesEngineCache(t *testing.T) {
	for _, tc := range []struct {
		name   string
		engine string
		algo   blockhash.Algo
		ranks  int
	}{
		{"vllm", EngineVLLM, blockhash.SHA256CBOR, 1},
		{"vllm-xxhash", EngineVLLM, blockhash.XXHashCBOR, 1},
		{"sglang-3-ranks", EngineSGLang, blockhash.SHA256SGLang, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const bs = 16
			ps := consecutivePublishers(t, tc.ranks)
			spec := Spec{Service: 21, EPIdx: 0, Engine: tc.engine, Host: "127.0.0.1", ZmqPort: ps[0].port, Ranks: tc.ranks,
				HashAlgo: string(tc.algo), BlockSize: bs, Seed: "42"}
			h := startManager(t, fastConfig(), spec)
			engines := make([]*simEngine, tc.ranks)
			for r := range engines {
				engines[r] = newSimEngine(t, tc.algo, bs, 48, tc.engine == EngineSGLang)
				// seq 0 of every engine is an empty batch, repeated until seen.
				engines[r].seq = 1
				ps[r].handshake(h, 21, 0, r, 0, emptyBatch(r))
			}
			rng := rand.New(rand.NewPCG(7, uint64(tc.ranks)))
			last := make([]uint64, tc.ranks)
			step := func(r int) {
				if b, seq, ok := engines[r].serve(workload(rng, bs)); ok {
					ps[r].send(seq, b)
					last[r] = seq
				}
			}
			for i := 0; i < 300; i++ {
				step(i % tc.ranks)
			}
			// Rank 0's engine restarts: seq goes back to 0, cache empty.
			engines[0].restart()
			for i := 0; i < 60; i++ {
				step(0)
			}
			for r := range engines {
				waitFor(t, "all batches applied", func() bool { return h.status(21, 0).Ranks[r].LastSeq == last[r] })
			}
			for r, e := range engines {
				if got, want := h.sink.keys(21, 0, r), e.keys(); !slices.Equal(got, want) {
					t.Fatalf("rank %d inventory has %d keys, engine cache %d", r, len(got), len(want))
				}
			}
			st := h.status(21, 0)
			if st.Resets != 1 || st.Gaps != 0 || st.DecodeErrors != 0 || st.Degraded || st.BlocksRemoved == 0 {
				t.Fatalf("status = %+v", st)
			}
			if st.Parity.Verdict != VerdictOK || st.Parity.MismatchedBlocks != 0 || st.Parity.VerifiedBlocks == 0 {
				t.Fatalf("parity = %+v", st.Parity)
			}
		})
	}
}
