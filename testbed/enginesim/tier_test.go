package enginesim

import (
	"fmt"
	"testing"
)

// TestCPUOffloadTier: with a CPU tier, a block evicted from the GPU pool
// is published as BlockStored "CPU" before its BlockRemoved "GPU", and the
// tier's own evictions are BlockRemoved "CPU".
func TestCPUOffloadTier(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineVLLM, BlockSize: 4, CapacityBlocks: 2, CPUOffloadBlocks: 1}, Deps{})
	sub := subscribe(t, e, 0, "")
	var got []string
	for i := 0; i < 3; i++ {
		cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(100*(i+1), 8), "max_tokens": 1}))
	}
	for len(got) < 8 {
		b := decodeBatch(t, sub.next(t).Frames[2])
		for _, ev := range b.events {
			m := ev.(map[string]any)
			got = append(got, fmt.Sprintf("%s/%v/%d", m["type"], m["medium"], len(m["block_hashes"].([]any))))
		}
	}
	// Request 1 stores 2 GPU blocks; request 2 evicts both (each moves to
	// the 1-block CPU tier, the first pushed out again by the second) and
	// stores its own; request 3 does the same.
	want := []string{
		"BlockStored/GPU/2",
		"BlockStored/CPU/1", "BlockRemoved/CPU/1", "BlockStored/CPU/1", "BlockRemoved/GPU/2", "BlockStored/GPU/2",
	}
	for i, w := range want {
		if got[i] != w {
			t.Fatalf("events %v, want prefix %v", got, want)
		}
	}
	if st := e.Stats(); st.Ranks[0].CPUBlocks != 1 {
		t.Fatalf("cpu tier holds %d blocks, want 1", st.Ranks[0].CPUBlocks)
	}
}
