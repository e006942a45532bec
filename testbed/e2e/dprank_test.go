package e2e

import (
	"fmt"
	"strings"
	"testing"
)

// TestDataParallelRankTargeting: on engines with two data-parallel ranks
// each, the gateway scores the rank holding the prompt's prefix and names
// it to the engine (SGLang: routed_dp_rank in the body; vLLM: the
// X-data-parallel-rank header), so the engine serves from cache exactly
// what the gateway predicted and a session's steps stay on one rank.
// Without the rank named, the engine's own balancer alternates ranks and
// every other step finds a cold cache.
func TestDataParallelRankTargeting(t *testing.T) {
	cases := []struct {
		name, engine string
		net          int
	}{
		{"sglang", "sglang", 75},
		{"vllm", "vllm", 76},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			const sessions, steps, bs = 5, 4, 16 // an odd number: some endpoint serves an odd count of sessions, so its balancer alternates their ranks
			p := newPool(t, poolOpts{n: 2, net: c.net, kvEngine: c.engine, ranks: 2, bs: bs})
			prompts := make([]string, sessions)
			for s := range prompts {
				prompts[s] = longPrompt(fmt.Sprintf("%s-session-%d", c.name, s), s)
			}
			var short, steps2, switched, predicted, cached int
			ranks := make([]int, sessions)
			for step := 0; step < steps; step++ {
				for s := range prompts {
					if step > 0 {
						prompts[s] += fmt.Sprintf(" The assistant answered step %d of session %d at length, and the user asks a follow-up question about section %d.", step, s, step+s)
					}
					before := servedByRank(p)
					r := complete(t, p.vip, prompts[s])
					served := rankServed(t, before, servedByRank(p))
					if r.rank < 0 || r.rank > 1 || served != [2]int{r.ep, r.rank} {
						t.Errorf("session %d step %d: receipt names endpoint %d rank %d, engine %d served it on rank %d",
							s, step, r.ep, r.rank, served[0], served[1])
					}
					r.rank = served[1] + 10*served[0] // what the engines did, for the rank changes below
					if step > 0 {
						steps2++
						predicted += r.matched * bs
						cached += r.cached
						if r.cached < r.matched*bs {
							short++
						}
						if r.rank != ranks[s] {
							switched++
						}
					}
					ranks[s] = r.rank
				}
				for ep := range p.engines {
					p.waitSameInventory(t, ep, fmt.Sprintf("after step %d", step))
				}
			}
			t.Logf("%s: %d follow-up steps, predicted %d cached tokens, engines served %d; %d served fewer than predicted, %d changed rank",
				c.name, steps2, predicted, cached, short, switched)
			if predicted == 0 {
				t.Fatal("the gateway predicted no cached tokens; the test proves nothing")
			}
			if short != 0 || cached < predicted {
				t.Errorf("%d of %d follow-up steps were served fewer cached tokens than predicted (%d predicted, %d served)", short, steps2, predicted, cached)
			}
			if switched != 0 {
				t.Errorf("%d of %d follow-up steps changed rank", switched, steps2)
			}
			var targeted, served uint64
			for _, e := range p.engines {
				for _, r := range e.Stats().Ranks {
					targeted += r.Targeted
					served += r.Served
				}
			}
			if targeted != served || served != uint64(sessions*steps) {
				t.Errorf("engines served %d requests, %d of them on a named rank; want all %d named", served, targeted, sessions*steps)
			}
			text := metrics(t, p.d)
			if n := metricValue(text, "loxilb_kv_rank_targeted_total", `service="1"`); n != float64(sessions*steps) {
				t.Errorf("loxilb_kv_rank_targeted_total = %g, want %d", n, sessions*steps)
			}
			if !strings.Contains(text, `loxilb_kv_rank_targeted_total{ep_idx=`) {
				t.Errorf("no per-endpoint rank series in the export")
			}
			checkMetricLabels(t, text)
		})
	}
}

// servedByRank is every engine's per-rank count of requests served.
func servedByRank(p *pool) [][]uint64 {
	out := make([][]uint64, len(p.engines))
	for i, e := range p.engines {
		for _, r := range e.Stats().Ranks {
			out[i] = append(out[i], r.Served)
		}
	}
	return out
}

// rankServed is the (endpoint, rank) whose count grew by one between two
// servedByRank samples taken around one request.
func rankServed(t *testing.T, before, after [][]uint64) [2]int {
	t.Helper()
	got := [2]int{-1, -1}
	for ep := range after {
		for rk := range after[ep] {
			if after[ep][rk] != before[ep][rk] {
				if got[0] >= 0 || after[ep][rk] != before[ep][rk]+1 {
					t.Fatalf("more than one request served: %v -> %v", before, after)
				}
				got = [2]int{ep, rk}
			}
		}
	}
	if got[0] < 0 {
		t.Fatalf("no engine served the request: %v", after)
	}
	return got
}
