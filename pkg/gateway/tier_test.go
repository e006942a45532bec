package gateway

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/dispatch"
	"github.com/loxilb-llm/loxilb/pkg/kvindex"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// engineChat sends a chat request straight to an engine, bypassing the
// gateway, so the test decides which engine computes (and caches) what.
func engineChat(t *testing.T, e *enginesim.Engine, content string) {
	t.Helper()
	req := map[string]any{"model": pdModel, "max_tokens": 1,
		"messages": []map[string]string{{"role": "system", "content": "You are a careful assistant."}, {"role": "user", "content": content}}}
	raw, _ := json.Marshal(req)
	resp, err := http.Post("http://"+e.Addr()+"/v1/chat/completions", "application/json", bytes.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("engine status %d", resp.StatusCode)
	}
}

func gpuKeys(e *enginesim.Engine) []uint64 {
	var out []uint64
	for _, bl := range e.Cache().Ranks[0].Blocks {
		out = append(out, bl.Hash)
	}
	return out
}

// TestPDTier15CPUTier: the emulators offload evicted blocks to a CPU tier
// and report them with medium CPU. A prefix on GPU at prefill 1 and only on
// CPU at prefill 0 goes to 1 (unweighted, the tie goes to the lower
// index); once prefill 1 forgets it, the CPU copy still wins Tier 1.5.
func TestPDTier15CPUTier(t *testing.T) {
	b := newPDBenchWith(t, "vllm", lbrule.KVExactPD, 73, 1, func(c *enginesim.Config) {
		c.CapacityBlocks, c.CPUOffloadBlocks = 48, 1024
	})
	gpuAt, cpuAt := b.prefill[1], b.prefill[0]
	doc := longDoc(30)
	engineChat(t, gpuAt, doc+" Warm-up?")
	engineChat(t, cpuAt, doc+" Warm-up?")
	docKeys := gpuKeys(gpuAt)
	if len(docKeys) < 10 {
		t.Fatalf("prefill cache holds %d blocks", len(docKeys))
	}
	// Unrelated documents push the prefix out of cpuAt's GPU pool into its
	// CPU tier.
	for i := 0; i < 3; i++ {
		engineChat(t, cpuAt, strings.Repeat(fmt.Sprintf("Unrelated filler %d about shipping schedules. ", i), 40))
	}
	snap := cpuAt.Cache().Ranks[0]
	for _, k := range docKeys {
		if !slices.Contains(snap.CPU, k) || slices.ContainsFunc(snap.Blocks, func(bl enginesim.BlockInfo) bool { return bl.Hash == k }) {
			t.Fatalf("prefix block %d not offloaded to CPU only at prefill 0", k)
		}
	}
	// Deliver both inventories as the event feed would (medium GPU and CPU).
	b.index.Store(1, 1, 0, docKeys)
	b.index.Store(1, 0, 0, gpuKeys(cpuAt))
	b.index.StoreTier(1, 0, 0, kvindex.TierCPU, snap.CPU)

	b.newPD(t, dispatch.Config{TrieMinPercent: 100})
	rc, _ := b.chat(t, doc+" Question two?", false)
	if !strings.Contains(rc, "tier=tier1.5") || !strings.Contains(rc, "prefill=1") {
		t.Fatalf("receipt %q: want Tier 1.5 to the GPU copy at prefill 1", rc)
	}
	b.index.ClearEndpoint(1, 1)
	b.newPD(t, dispatch.Config{TrieMinPercent: 100})
	rc, _ = b.chat(t, doc+" Question three?", false)
	if !strings.Contains(rc, "tier=tier1.5") || !strings.Contains(rc, "prefill=0") {
		t.Fatalf("receipt %q: want Tier 1.5 to the CPU copy at prefill 0", rc)
	}
}
