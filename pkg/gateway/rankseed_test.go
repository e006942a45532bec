package gateway

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/kvindex"
)

// agentStart is an agent's first request: a shared 64-block system prompt
// and tool definitions, then 14 blocks of its own task.
func agentStart(sys []uint64, a int) []uint64 {
	k := append([]uint64(nil), sys...)
	for b := range 14 {
		k = append(k, uint64(9_000_000*(a+1)+b))
	}
	return k
}

// promptOnRank0 returns an inventory where only rank 0 of endpoint 0 of
// service 1 holds a 64-block system prompt, and that prompt.
func promptOnRank0(t *testing.T) (*kvindex.Index, []uint64) {
	t.Helper()
	ix, err := kvindex.New(kvindex.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	sys := make([]uint64, 64)
	for i := range sys {
		sys[i] = uint64(i + 1)
	}
	ix.Store(1, 0, 0, sys)
	return ix, sys
}

// Agents whose shared system prompt is long against their own task: with
// only rank 0 holding the prompt, no other rank ties, and before seeding
// every agent went to rank 0 however busy it was (on the SGLang bench
// fleet over 90% of agent-loop's requests sat on one rank per engine).
// A busier rank 0 now seeds the idle rank 1, once; later agents tie and
// spread by load.
func TestChooseRankSeedsIdleRank(t *testing.T) {
	ix, sys := promptOnRank0(t)
	var rl rankLoad
	now := time.Unix(1000, 0)
	rl.begin(1, 0, 0, agentStart(sys, 0), 64, now) // agent 0 in flight on rank 0
	var lv rankSnapshot
	rl.snapshot(1, 0, 2, 5*time.Second, now, nil, &lv)
	lv.seedLoss = 64
	first := agentStart(sys, 1)
	if ch := chooseRank(ix, 1, 0, 2, first, &lv); ch.rank != 1 || ch.best != 64 || ch.held != 0 || !lv.seeded {
		t.Fatalf("agent 1 went to rank %d (best %d, held %d, seeded %v) next to a busy rank 0 and an idle, cold rank 1", ch.rank, ch.best, ch.held, lv.seeded)
	}
	// Once rank 1 holds the prompt too, the agents tie and spread.
	ix.Store(1, 0, 1, first)
	per := [2]int{}
	for a := 2; a < 10; a++ {
		r, _ := place(&rl, ix, nil, agentStart(sys, a), now)
		per[r]++
	}
	if per[0] == 0 || per[1] == 0 || per[0]-per[1] > 2 || per[1]-per[0] > 2 {
		t.Fatalf("8 agents after both ranks hold the prompt: per rank %v", per)
	}
}

// The seed throws away only a typical prefix, only for a rank with a
// queue, and only onto a rank holding none of the request.
func TestChooseRankSeedGates(t *testing.T) {
	ix, sys := promptOnRank0(t)
	req := agentStart(sys, 1)
	cases := []struct {
		name     string
		load     [2]int
		placed   [2]int
		seedLoss int
		want     int
	}{
		{"busier holder, typical prefix", [2]int{2, 1}, [2]int{0, 0}, 64, 1},
		{"prefix longer than the typical one", [2]int{2, 0}, [2]int{0, 0}, 63, 0},
		{"no estimate yet", [2]int{2, 0}, [2]int{0, 0}, 0, 0},
		{"equal queues", [2]int{1, 1}, [2]int{0, 0}, 64, 0},
		{"only more recent placements", [2]int{0, 0}, [2]int{5, 0}, 64, 0},
	}
	for _, c := range cases {
		lv := rankSnapshot{seedLoss: c.seedLoss}
		lv.load[0], lv.load[1] = c.load[0], c.load[1]
		lv.placed[0], lv.placed[1] = c.placed[0], c.placed[1]
		if r := chooseRank(ix, 1, 0, 2, req, &lv).rank; r != c.want || lv.seeded != (c.want == 1) {
			t.Errorf("%s: rank %d (seeded %v), want %d", c.name, r, lv.seeded, c.want)
		}
	}
	// A rank holding part of the request is not cold for it: a session
	// whose history is on rank 0 and whose system prompt rank 1 also
	// holds stays, however busy rank 0 is.
	ix.Store(1, 0, 1, sys[:8])
	lv := rankSnapshot{seedLoss: 1000}
	lv.load[0] = 9
	if r := chooseRank(ix, 1, 0, 2, req, &lv).rank; r != 0 {
		t.Fatalf("a session left its history for rank %d holding only a prefix of it", r)
	}
	// No load known: the rank holding the prefix.
	if r := chooseRank(ix, 1, 0, 2, agentStart(sys, 5), nil).rank; r != 0 {
		t.Fatalf("rank %d without load", r)
	}
}

// P/D prefill legs read the ranks' load as mode-4 requests do: with rank 0
// of every prefill engine busy (as its per-rank gauges say) and no rank
// holding anything of the prompts, every leg goes to rank 1 and is
// counted there until its request ends. Before, the hash of the prompt
// alone chose, and about half the legs went to the busy rank.
func TestPDPrefillRankReadsRankLoad(t *testing.T) {
	b := newPDBenchRanks(t, "sglang", 1, 78, 2)
	b.g.rankEngine = fakeRankMetrics{running: []int{2, 0}, waiting: []int{3, 0}}
	for i := range 8 {
		rc, _ := b.chat(t, fmt.Sprintf("Prompt %d: %s", i, longDoc(3+i)), i%2 == 0)
		if !strings.HasSuffix(rc, "prefill_rank=1") {
			t.Fatalf("prompt %d: receipt %q, want prefill rank 1 (rank 0 has 5 requests)", i, rc)
		}
	}
	placed := 0
	for ep := range 2 {
		for _, l := range b.g.ranks.ranks(1, ep, 2, time.Hour, time.Now(), nil) {
			if l.InFlight != 0 {
				t.Fatalf("prefill %d rank %d still counts %d legs after their requests ended", ep, l.Rank, l.InFlight)
			}
			if l.Rank == 1 {
				placed += l.Placed
			}
		}
	}
	if placed != 8 {
		t.Fatalf("%d of 8 legs remembered on rank 1", placed)
	}
}
