package gateway

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/kvindex"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

// kvModelProfile sglang-completions-bos makes the gateway encode SGLang
// completions prompts as BOS + text, as those deployments do, even when
// the tokenizer's post-processor adds no BOS (a model whose metadata names
// a BOS token its tokenizer.json does not insert).
func TestModelProfileCompletionsBOS(t *testing.T) {
	const model = "Qwen/Qwen3-0.6B"
	dir := t.TempDir()
	stage := filepath.Join(dir, "Qwen__Qwen3-0.6B")
	if err := os.MkdirAll(stage, 0o755); err != nil {
		t.Fatal(err)
	}
	src := filepath.Join("..", "..", "testdata", "tokenizers", "Qwen__Qwen3-0.6B")
	tj, err := os.ReadFile(filepath.Join(src, "tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	raw, _ := os.ReadFile(filepath.Join(src, "tokenizer_config.json"))
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	cfg["bos_token"] = "<|endoftext|>"
	raw, _ = json.Marshal(cfg)
	if os.WriteFile(filepath.Join(stage, "tokenizer.json"), tj, 0o644) != nil || os.WriteFile(filepath.Join(stage, "tokenizer_config.json"), raw, 0o644) != nil {
		t.Fatal("staging failed")
	}
	ids := func(profile string) []uint32 {
		reg := prometheus.NewRegistry()
		toks, err := tokenizer.NewRegistry(dir, nil, reg)
		if err != nil {
			t.Fatal(err)
		}
		ix, _ := kvindex.New(kvindex.Config{}, reg)
		rt, _ := router.New(router.DefaultConfig(), ix, nil, reg)
		g, err := New(Config{}, toks, ix, rt, nil, new(proxy.InFlightTable), nil, reg)
		if err != nil {
			t.Fatal(err)
		}
		r := rule(3, model)
		r.Service.KVEngine, r.Service.KVModelProfile = "sglang", profile
		p, err := lbrule.Prepare(r, lbrule.Settings{})
		if err != nil {
			t.Fatal(err)
		}
		if err := g.Reconcile(context.Background(), []control.Service{{ID: 1, Rule: p}}); err != nil {
			t.Fatal(err)
		}
		got, reason, err := g.promptTokens(context.Background(), g.lookup(1), model, req(`{"model":"`+model+`","prompt":"Hello, world!"}`))
		if err != nil || reason != "" {
			t.Fatalf("profile %q: %v %q", profile, err, reason)
		}
		return got
	}
	const bos = 151643 // <|endoftext|>
	plain, withBOS := ids(""), ids("sglang-completions-bos")
	if len(plain) == 0 || plain[0] == bos {
		t.Fatalf("without a profile the prompt starts with BOS: %v", plain)
	}
	if len(withBOS) != len(plain)+1 || withBOS[0] != bos {
		t.Fatalf("sglang-completions-bos: got %v, want BOS then %v", withBOS, plain)
	}
}
