package e2e

import (
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// gatewayInventory returns the gateway's block keys for one endpoint.
func (p *pool) gatewayInventory(t *testing.T, ep int) []uint64 {
	t.Helper()
	var inv struct {
		Blocks []struct {
			Hash uint64 `json:"hash_uint64"`
		}
		Total int
	}
	getJSON(t, p.d.URL(fmt.Sprintf("/config/ai/kv/inventory?service_id=1&ep_idx=%d&limit=100000", ep)), &inv)
	out := make([]uint64, 0, len(inv.Blocks))
	for _, b := range inv.Blocks {
		out = append(out, b.Hash)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// engineInventory is the union of the engine's resident blocks over its ranks.
func engineInventory(e *enginesim.Engine) []uint64 {
	seen := map[uint64]bool{}
	for _, r := range e.Cache().Ranks {
		for _, b := range r.Blocks {
			seen[b.Hash] = true
		}
	}
	out := make([]uint64, 0, len(seen))
	for k := range seen {
		out = append(out, k)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

func sameKeys(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// waitSameInventory waits until the gateway holds exactly the engine's
// blocks. TensorRT-LLM is compared by count: the gateway re-hashes the
// drained token lists into its own blockhash_trtllm keys, while the engine
// lists its internal block hashes (routing hits prove those keys right).
func (p *pool) waitSameInventory(t *testing.T, ep int, what string) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	byCount := p.engines[ep].Config().Engine == "trtllm"
	var gw, eng []uint64
	for time.Now().Before(deadline) {
		gw, eng = p.gatewayInventory(t, ep), engineInventory(p.engines[ep])
		if sameKeys(gw, eng) || (byCount && len(gw) == len(eng)) {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("%s: endpoint %d inventory holds %d blocks, engine %d", what, ep, len(gw), len(eng))
}

// TestInventoryMatchesEngines: after a workload that evicts, and after an
// engine restart, the gateway's inventory of every endpoint is exactly the
// engine's own cache, for each event encoding and transport.
func TestInventoryMatchesEngines(t *testing.T) {
	cases := []struct {
		name string
		o    poolOpts
	}{
		{"vllm-map", poolOpts{n: 2, net: 71, engine: func(_ int, c *enginesim.Config) { c.CapacityBlocks, c.EventEncoding = 96, "map" }}},
		{"vllm-array", poolOpts{n: 2, net: 72, engine: func(_ int, c *enginesim.Config) { c.CapacityBlocks, c.EventEncoding = 96, "array" }}},
		{"sglang-3-ranks", poolOpts{n: 2, net: 73, kvEngine: "sglang", ranks: 3, engine: func(_ int, c *enginesim.Config) { c.CapacityBlocks = 64 }}},
		{"trtllm-drain", poolOpts{n: 2, net: 74, kvEngine: "trtllm", bs: 32, engine: func(_ int, c *enginesim.Config) { c.CapacityBlocks = 48 }}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := newPool(t, c.o)
			// Enough distinct prefixes to overflow each cache several times.
			for i := 0; i < 24; i++ {
				complete(t, p.vip, longPrompt(fmt.Sprintf("%s-topic-%d", c.name, i), i))
			}
			evicted := false
			for ep := range p.engines {
				p.waitSameInventory(t, ep, "after the workload")
				for _, r := range p.engines[ep].Stats().Ranks {
					evicted = evicted || r.Evictions > 0
				}
			}
			if !evicted {
				t.Fatalf("the workload did not evict anything; the test proves nothing")
			}
			p.engines[0].Restart()
			p.waitSameInventory(t, 0, "after a restart")
			if n := len(p.gatewayInventory(t, 0)); n != 0 {
				t.Fatalf("restarted engine is empty but the gateway holds %d blocks", n)
			}
			first := complete(t, p.vip, longPrompt(c.name+"-after-restart", 99))
			for ep := range p.engines {
				p.waitSameInventory(t, ep, "after traffic following the restart")
			}
			time.Sleep(5500 * time.Millisecond) // speculative entries expire: the next hit comes from events
			// (With several DP ranks the engine may serve it on another rank,
			// so its cached_tokens are only checked for single-rank engines.)
			r := complete(t, p.vip, longPrompt(c.name+"-after-restart", 100))
			if r.tier != "tier1.5" || r.ep != first.ep || (c.o.ranks <= 1 && r.cached == 0) {
				t.Fatalf("repeated prefix after the restart: %+v (first went to %d)", r, first.ep)
			}
		})
	}
}

// TestParityVerdicts: a deliberately mismatched seed, hash algorithm or
// block size on the engine gives its own verdict within seconds; a matched
// engine reports ok.
func TestParityVerdicts(t *testing.T) {
	cases := []struct {
		name, want string
		net        int
		mod        func(*enginesim.Config)
	}{
		{"matched", "ok", 81, func(*enginesim.Config) {}},
		{"seed", "hash_mismatch", 82, func(c *enginesim.Config) { c.Seed = "31337" }},
		{"algorithm", "hash_algo_mismatch", 83, func(c *enginesim.Config) { c.HashAlgo = "xxhash_cbor" }},
		{"block size", "block_size_mismatch", 84, func(c *enginesim.Config) { c.BlockSize = 32 }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := newPool(t, poolOpts{n: 1, net: c.net, engine: func(_ int, cfg *enginesim.Config) { c.mod(cfg) }})
			complete(t, p.vip, longPrompt("parity", 0))
			var verdict string
			waitFor(t, "parity verdict "+c.want, 10*time.Second, func() bool {
				var caps struct {
					Capabilities []struct {
						Name       string
						ReasonCode string `json:"reason_code"`
					}
				}
				getJSON(t, p.d.URL("/status/capabilities"), &caps)
				for _, cp := range caps.Capabilities {
					if strings.HasPrefix(cp.Name, "kv_parity:") {
						verdict = cp.ReasonCode
					}
				}
				return verdict == c.want
			})
		})
	}
}
