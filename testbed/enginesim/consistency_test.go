package enginesim

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"testing"
)

// applyZMQ applies a decoded batch to a key set the way a consumer would.
func applyZMQ(t *testing.T, set map[uint64]bool, payload []byte) {
	for _, ev := range decodeBatch(t, payload).events {
		switch evType(ev) {
		case "BlockStored":
			for _, k := range evKeys(ev) {
				set[k] = true
			}
		case "BlockRemoved":
			for _, k := range evKeys(ev) {
				if !set[k] {
					t.Errorf("BlockRemoved for unknown key %d", k)
				}
				delete(set, k)
			}
		case "AllBlocksCleared":
			clear(set)
		}
	}
}

func sortedKeys(set map[uint64]bool) []uint64 {
	out := make([]uint64, 0, len(set))
	for k := range set {
		out = append(out, k)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

func cacheKeys(e *Engine, rank int) []uint64 {
	var out []uint64
	for _, b := range e.Cache().Ranks[rank].Blocks {
		out = append(out, b.Hash)
		if b.Refs != 0 {
			panic(fmt.Sprintf("block %d still pinned after all requests", b.Hash))
		}
	}
	return out
}

// workload sends concurrent requests over shared prefixes into a small
// cache, so hits, inserts and evictions interleave.
func workload(t *testing.T, e *Engine, n int) {
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for i := 0; i < n; i++ {
				group := rng.IntN(6)
				prompt := append(seqTokens(group*10000, 16*(1+rng.IntN(4))), seqTokens(100000+rng.IntN(50)*100, 1+rng.IntN(40))...)
				r := do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 1})
				if r.status != 200 {
					t.Errorf("status %d: %s", r.status, r.body)
				}
			}
		}(w)
	}
	wg.Wait()
}

func TestZMQEventsReconstructCache(t *testing.T) {
	for _, eng := range []string{EngineVLLM, EngineSGLang} {
		t.Run(eng, func(t *testing.T) {
			e := startEngine(t, Config{Engine: eng, CapacityBlocks: 12, MaxRunning: 3}, Deps{})
			sub := subscribe(t, e, 0, "")
			workload(t, e, 40)
			// Batches are numbered by the publisher goroutine; wait until it
			// has sent everything the requests handed it.
			waitFor(t, "publisher drained", func() bool {
				r := e.Stats().Ranks[0]
				return r.Published == r.Enqueued
			})
			set := map[uint64]bool{}
			want := e.Stats().Ranks[0].NextSeq
			for seq := uint64(0); seq < want; seq++ {
				m := sub.next(t)
				if got := binary.BigEndian.Uint64(m.Frames[1]); got != seq {
					t.Fatalf("seq %d, want %d", got, seq)
				}
				applyZMQ(t, set, m.Frames[2])
			}
			if got, want := sortedKeys(set), cacheKeys(e, 0); fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("event-built inventory %v\n differs from the cache %v", got, want)
			}
			if s := e.Stats(); s.Ranks[0].Evictions == 0 || s.HitTokens == 0 {
				t.Fatalf("workload too gentle: %+v", s)
			}
		})
	}
}

func TestTRTEventsReconstructCache(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineTRTLLM, BlockSize: 16, CapacityBlocks: 12, MaxRunning: 3}, Deps{})
	workload(t, e, 40)
	var evs []struct {
		EventID uint64 `json:"event_id"`
		Data    struct {
			Type   string
			Blocks []struct {
				BlockHash uint64 `json:"block_hash"`
			}
			BlockHashes []uint64 `json:"block_hashes"`
		}
	}
	if err := json.Unmarshal(do(t, "POST", e.URL()+"/kv_cache_events", nil).body, &evs); err != nil {
		t.Fatal(err)
	}
	set := map[uint64]bool{}
	for i, ev := range evs {
		if ev.EventID != uint64(i) {
			t.Fatalf("event_id %d at %d", ev.EventID, i)
		}
		for _, b := range ev.Data.Blocks {
			set[b.BlockHash] = true
		}
		for _, k := range ev.Data.BlockHashes {
			delete(set, k)
		}
	}
	if got, want := sortedKeys(set), cacheKeys(e, 0); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("event-built inventory %v\n differs from the cache %v", got, want)
	}
}
