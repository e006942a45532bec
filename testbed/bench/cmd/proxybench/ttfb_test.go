package main

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

// TestChatBody2k checks that -ttfb sends the request the gateway's
// routing-decision benchmark measures: 2,793 prompt tokens with Qwen3,
// and a new prompt that differs only at the end of the long message.
func TestChatBody2k(t *testing.T) {
	tk, err := tokenizer.Load(filepath.Join("..", "..", "..", "..", "testdata", "tokenizers", "Qwen__Qwen3-0.6B"))
	if err != nil {
		t.Fatal(err)
	}
	same, err := tk.EncodeRequest(tokenizer.EngineVLLM, tokenizer.PathChatCompletions, chatBody2k(""))
	if err != nil {
		t.Fatal(err)
	}
	if len(same.IDs) != 2793 {
		t.Fatalf("%d prompt tokens, want 2793", len(same.IDs))
	}
	next, err := tk.EncodeRequest(tokenizer.EngineVLLM, tokenizer.PathChatCompletions, chatBody2k(" Request 7."))
	if err != nil {
		t.Fatal(err)
	}
	if len(next.IDs) <= len(same.IDs) {
		t.Fatalf("the new prompt has %d tokens, the base %d", len(next.IDs), len(same.IDs))
	}
}

func TestPct(t *testing.T) {
	var ds []time.Duration
	for i := 100; i >= 1; i-- {
		ds = append(ds, time.Duration(i))
	}
	if p50, p99 := pct(ds, 50), pct(ds, 99); p50 != 51 || p99 != 100 {
		t.Fatalf("p50 %v p99 %v", p50, p99)
	}
	if pct(nil, 50) != 0 {
		t.Fatal("empty")
	}
}

// Over 2n requests every target goes first equally often and every
// ordered pair of targets is adjacent (one right after the other) equally
// often, so no daemon is timed right after another target's request more
// often than a rival daemon is.
func TestTTFBOrderFair(t *testing.T) {
	for _, n := range []int{3, 4} {
		first := map[int]int{}
		follows := map[[2]int]int{}
		for i := 0; i < 2*n; i++ {
			o := ttfbOrder(i, n)
			if len(o) != n {
				t.Fatalf("n=%d i=%d: order %v", n, i, o)
			}
			seen := map[int]bool{}
			for k, j := range o {
				seen[j] = true
				if k > 0 {
					follows[[2]int{o[k-1], j}]++
				}
			}
			if len(seen) != n {
				t.Fatalf("n=%d i=%d: %v is not a permutation", n, i, o)
			}
			first[o[0]]++
		}
		for j := 0; j < n; j++ {
			if first[j] != 2 {
				t.Errorf("n=%d: target %d goes first %d times in %d requests", n, j, first[j], 2*n)
			}
		}
		if n < 4 {
			continue // one daemon: nothing to be fair to
		}
		// The two daemons follow each other target equally often.
		a, b := 2, 3
		if follows[[2]int{a, b}] != follows[[2]int{b, a}] {
			t.Errorf("daemon %d follows daemon %d %d times, the reverse %d times", b, a, follows[[2]int{a, b}], follows[[2]int{b, a}])
		}
		for p := 0; p < 2; p++ {
			if follows[[2]int{p, a}] != follows[[2]int{p, b}] {
				t.Errorf("n=%d: after target %d, daemon %d comes %d times and daemon %d %d times", n, p, a, follows[[2]int{p, a}], b, follows[[2]int{p, b}])
			}
		}
	}
}
