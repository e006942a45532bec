package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/loxilb-llm/loxilb/pkg/blockhash"
	"github.com/loxilb-llm/loxilb/pkg/engine"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

// promptOpts select and tokenize a prompt offline, exactly as the gateway does.
type promptOpts struct {
	dir, model, prompt, chat, engine string
}

func (p *promptOpts) flags(cmd *cobra.Command) {
	f := cmd.Flags()
	f.StringVar(&p.dir, "tokenizer-dir", "/etc/loxilb/tokenizers", "directory of staged tokenizers (<model-slug>/tokenizer.json)")
	f.StringVar(&p.model, "model", "", "served model name (slug = name with / replaced by __)")
	f.StringVar(&p.prompt, "prompt", "", "prompt text, tokenized as /v1/completions")
	f.StringVar(&p.chat, "chat", "", "JSON file: a /v1/chat/completions body, or just its messages array")
	f.StringVar(&p.engine, "engine", string(engine.Default), "engine whose rendering rules apply: vllm, sglang, trtllm or llamacpp")
}

func (p *promptOpts) tokens() ([]uint32, error) {
	if p.model == "" {
		return nil, usagef("--model is required")
	}
	if (p.prompt == "") == (p.chat == "") {
		return nil, usagef("give exactly one of --prompt or --chat")
	}
	if _, ok := engine.Lookup(p.engine); !ok {
		return nil, usagef("--engine %q: want one of %s", p.engine, strings.Join(engine.Names(), ", "))
	}
	tok, err := tokenizer.Load(filepath.Join(p.dir, tokenizer.Slug(p.model)))
	if err != nil {
		return nil, fmt.Errorf("load tokenizer for %s: %w", p.model, err)
	}
	path, body := "/v1/completions", []byte(nil)
	if p.prompt != "" {
		body, _ = json.Marshal(map[string]any{"model": p.model, "prompt": p.prompt})
	} else {
		raw, err := os.ReadFile(p.chat)
		if err != nil {
			return nil, usagef("read --chat: %v", err)
		}
		path, body = "/v1/chat/completions", raw
		if trimmed := strings.TrimSpace(string(raw)); strings.HasPrefix(trimmed, "[") {
			body = []byte(`{"model":` + strconv.Quote(p.model) + `,"messages":` + trimmed + `}`)
		}
	}
	rt, err := tok.EncodeRequest(p.engine, path, body)
	if err != nil {
		return nil, err
	}
	if rt.Unhashable != "" {
		fmt.Fprintf(os.Stderr, "warning: the engine's hash of this request includes more than token ids (%s); keys would not match\n", rt.Unhashable)
	}
	return rt.IDs, nil
}

func newKVTokenizeCmd(g *globalOpts) *cobra.Command {
	p := &promptOpts{}
	cmd := &cobra.Command{
		Use:   "tokenize",
		Short: "Print the token ids the gateway computes for a prompt or chat",
		Args:  cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			ids, err := p.tokens()
			if err != nil {
				return err
			}
			if ids == nil {
				ids = []uint32{}
			}
			return printCompactJSON(g, map[string]any{"ids": ids})
		},
	}
	p.flags(cmd)
	return cmd
}

func printCompactJSON(g *globalOpts, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	g.printf("%s\n", b)
	return nil
}

func newKVHashCmd(g *globalOpts) *cobra.Command {
	p := &promptOpts{}
	var algo, seed, tokens string
	var blockSize int
	cmd := &cobra.Command{
		Use:   "hash",
		Short: "Print the block keys the gateway computes (compare with the engine's BlockStored events)",
		Long: `Print one key per full block. vLLM and TensorRT-LLM keys are unsigned 64-bit,
SGLang keys signed 64-bit, as each engine publishes them. --seed defaults to
$LLB_KV_NONE_HASH_SEED (vLLM's PYTHONHASHSEED).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			spec, ok := engine.Lookup(p.engine)
			if !ok || !spec.KVExact {
				return usagef("--engine %q: want vllm, sglang or trtllm", p.engine)
			}
			if algo == "" {
				algo = spec.DefaultAlgo
			}
			if !spec.AllowsAlgo(algo) {
				return usagef("--algo %q is incompatible with engine %s (omit it for %s)", algo, p.engine, spec.DefaultAlgo)
			}
			if !cmd.Flags().Changed("seed") {
				seed = os.Getenv("LLB_KV_NONE_HASH_SEED")
			}
			h, err := blockhash.New(blockhash.Config{Algo: blockhash.Algo(algo), BlockSize: blockSize, Seed: seed})
			if err != nil {
				return usageError{err}
			}
			var ids []uint32
			if tokens != "" {
				if p.model != "" || p.prompt != "" || p.chat != "" {
					return usagef("give either --tokens or --model with --prompt/--chat")
				}
				for _, s := range strings.Split(tokens, ",") {
					v, err := strconv.ParseUint(strings.TrimSpace(s), 10, 32)
					if err != nil {
						return usagef("--tokens entry %q is not a token id", s)
					}
					ids = append(ids, uint32(v))
				}
			} else if ids, err = p.tokens(); err != nil {
				return err
			}
			keys := h.Keys(nil, ids)
			out := make([]json.Number, len(keys))
			for i, k := range keys {
				out[i] = json.Number(blockhash.FormatKey(h.Algo(), k))
			}
			return printCompactJSON(g, map[string]any{"keys": out})
		},
	}
	p.flags(cmd)
	f := cmd.Flags()
	f.StringVar(&algo, "algo", "", "hash algorithm (default: the engine's)")
	f.StringVar(&seed, "seed", "", "vLLM none-hash seed (default $LLB_KV_NONE_HASH_SEED)")
	f.IntVar(&blockSize, "block-size", 16, "tokens per block")
	f.StringVar(&tokens, "tokens", "", "comma-separated token ids instead of a prompt")
	return cmd
}
