package tokenizer

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

// TestSegmentCacheExact grows conversations turn by turn, so later turns
// hit the segment cache for every earlier message, and checks each encode
// against the same prompt encoded with the cache emptied, with and
// without a token limit.
func TestSegmentCacheExact(t *testing.T) {
	for _, m := range parityModels {
		t.Run(m.name, func(t *testing.T) {
			tk := loadStaged(t, m.slug)
			msgs := []Message{{Role: "system", Content: strings.Repeat("You route requests by their cached prefix. ", 8)}}
			for turn := 0; turn < 6; turn++ {
				msgs = append(msgs, Message{Role: "user", Content: fmt.Sprintf("Turn %d: %s", turn, strings.Repeat("why ünïcode 中文 🚀 and  spaces\t? ", 6+turn))})
				prompt, err := tk.RenderChat(msgs, ChatOptions{})
				if err != nil {
					t.Fatal(err)
				}
				warm := tk.Encode(prompt, false)
				limit := len(warm) - 3
				warmLim, warmOK := tk.AppendEncodeLimit(nil, prompt, false, limit)
				tk.segs.reset()
				cold := tk.Encode(prompt, false)
				tk.segs.reset()
				coldLim, coldOK := tk.AppendEncodeLimit(nil, prompt, false, limit)
				if !slices.Equal(warm, cold) {
					t.Fatalf("turn %d: ids differ with the segment cache warm", turn)
				}
				if warmOK || coldOK {
					t.Fatalf("turn %d: a limit below the prompt's length passed (warm %v, cold %v)", turn, warmOK, coldOK)
				}
				_, _ = warmLim, coldLim
				msgs = append(msgs, Message{Role: "assistant", Content: strings.Repeat("Answer text. ", 12+turn)})
				// Warm the cache with this turn before the next one.
				tk.Encode(prompt, false)
			}
		})
	}
}

func TestSegmentCacheBounded(t *testing.T) {
	var c segCache
	c.init()
	for i := 0; i < 4000; i++ {
		s := fmt.Sprintf("%0200d", i) + strings.Repeat("x", i%500)
		c.put(s, make([]uint32, 60))
		if ids, ok := c.get(s); !ok || len(ids) != 60 {
			t.Fatalf("%d: just stored, not found", i)
		}
	}
	for i := range c.shards {
		if b := c.shards[i].bytes; b > segShardBytes {
			t.Fatalf("shard %d holds %d bytes, bound %d", i, b, segShardBytes)
		}
	}
	huge := strings.Repeat("y", segShardBytes)
	c.put(huge, []uint32{1})
	if _, ok := c.get(huge); ok {
		t.Fatal("a segment larger than a shard was cached")
	}
}
