package kvevents

import (
	"slices"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/kvindex"
	"github.com/prometheus/client_golang/prometheus"
)

// The inventory is the production Sink.
var _ Sink = (*kvindex.Index)(nil)

// TestIntoKVIndex feeds the SGLang vectors through a real subscription into
// the real inventory and asks it the routing question: how long a prefix
// of the request's keys each endpoint holds.
func TestIntoKVIndex(t *testing.T) {
	vs := loadEventVectors(t, "sglang_event_vectors.json")
	ix, err := kvindex.New(kvindex.Config{}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	ps := consecutivePublishers(t, 2)
	spec := Spec{Service: 11, EPIdx: 1, Engine: EngineSGLang, Host: "127.0.0.1", ZmqPort: ps[0].port, Ranks: 2, BlockSize: 16}
	m := New(fastConfig(), ix, testLogger(t), prometheus.NewRegistry())
	if err := m.Sync([]Spec{spec}); err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, m: m}
	ctx := t.Context()
	go m.Run(ctx)
	for r, p := range ps {
		p.handshake(h, 11, 1, r, 0, emptyBatch(r))
	}
	// Both ranks store pages of tokens 1..48 (rank 1 only the first).
	_, _, p0 := vs["sglang_tagged_array_events_rank0"].frames(t)
	keys := []uint64{8635429971592222890, 1256577331724852459, 5689809685380680247}
	ps[0].send(1, storedBatch(keys...))
	ps[1].send(1, storedBatch(keys[0]))
	waitFor(t, "inventory", func() bool { return ix.Len(11, 1) == 3 })
	out := make([]int, 1)
	ix.PrefixMatch(11, keys, []int{1}, out)
	if out[0] != 3 {
		t.Fatalf("prefix = %d, want 3", out[0])
	}
	// The rank-0 vector ends in AllBlocksCleared, which leaves rank 1's
	// copy of the first page.
	ps[0].send(2, p0)
	waitFor(t, "rank 0 cleared", func() bool { return ix.Len(11, 1) == 1 })
	ix.PrefixMatch(11, keys, []int{1}, out)
	if out[0] != 1 {
		t.Fatalf("prefix after rank clear = %d, want 1", out[0])
	}
	blocks, total := ix.Snapshot(11, 1, 10)
	if total != 1 || !slices.Equal(blocks, keys[:1]) {
		t.Fatalf("snapshot = %v %d", blocks, total)
	}
	// Removing the subscription empties the endpoint.
	if err := m.Sync(nil); err != nil {
		t.Fatal(err)
	}
	if ix.Len(11, 1) != 0 {
		t.Fatal("inventory left after the subscription stopped")
	}
}
