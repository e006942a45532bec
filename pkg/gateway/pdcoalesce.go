package gateway

import (
	"context"
	"fmt"

	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
)

// Prefill coalescing of P/D flows.
//
// A P/D request's prompt is computed by its prefill leg, on the prefill
// endpoint the dispatcher chose; its decode leg only receives the KV cache.
// Identical or overlapping prompts arriving while that leg still computes
// (best-of-N, agent fan-out) are routed to the same prefill endpoint by
// the leader's speculative entry, and without coalescing each computes
// the prompt again there. So a P/D plan takes part in coalescing as a
// single-pool request does (coalesce.go): its prefill leg registers as
// the leader of the blocks it computes on its prefill endpoint (announced
// to the other nodes too, remote.go), released by the plan's first byte
// (the proxy fires it at the flow's first client-facing body byte, when
// the prefill is over) or its end; a later request whose prefill leg goes
// to blocks in flight there waits for it in Pick, before its flow runs and
// takes any dispatcher slot. Requests that are not tokenized (no KV-exact
// mode 1, or no tokenizer) neither lead nor wait, as in a single pool.

// pdPrefill is what a P/D flow's prefill leg computes: its endpoint, the
// prompt's block keys, how many of them the endpoint held (or was
// computing) when it was chosen, and the predicted uncached tokens. The
// zero value (no keys) is a leg that takes no part in coalescing.
type pdPrefill struct {
	ep       int
	keys     []uint64
	matched  int
	uncached int64
}

// prefillLeg describes the prefill leg of a prompt of tokens tokens, keys
// its block keys, sent to endpoint ep. Called before the leg's own
// speculative entry is stored, so matched is what was there before it.
func (g *Gateway) prefillLeg(st *service, ep int, keys []uint64, tokens int) pdPrefill {
	if len(keys) == 0 || g.cfg.CoalesceWait <= 0 {
		return pdPrefill{}
	}
	eps, out := [1]int{ep}, [1]int{}
	g.inv.PrefixMatch(st.id, keys, eps[:], out[:])
	n := min(max(out[0], 0), len(keys))
	// The engine recomputes at least the prompt's last token.
	return pdPrefill{ep: ep, keys: keys, matched: n, uncached: int64(max(tokens-n*st.hasher.BlockSize(), 1))}
}

// coalescePD makes plan's prefill leg the leader of the blocks it
// computes (ended by plan's FirstByte or Done) and, when an earlier
// request is still computing the blocks it shares on the leg's endpoint,
// waits for that one's first byte, bounded by CoalesceWait. It fails only
// when the client went away while waiting.
func (g *Gateway) coalescePD(ctx context.Context, st *service, plan *proxy.Plan, leg pdPrefill) error {
	if len(leg.keys) == 0 {
		return nil
	}
	d := router.Decision{EP: leg.ep, MatchedBlocks: leg.matched, BlockSize: st.hasher.BlockSize()}
	follow := g.leaderFor(st, d, leg.keys)
	computed := leg.keys[leg.matched:]
	lead, _ := g.lead(st, leg.ep, computed, leg.uncached)
	plan.FirstByte = lead
	plan.Done = func(proxy.Result) { lead() }
	if follow != nil && g.follow(ctx, st, leg.ep, follow) == waitCancelled {
		lead()
		return fmt.Errorf("%w: client went away while waiting for a shared prefill", proxy.ErrClientCanceled)
	}
	return nil
}
