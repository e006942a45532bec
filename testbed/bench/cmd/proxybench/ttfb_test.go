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
