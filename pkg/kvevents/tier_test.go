package kvevents

import (
	"slices"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/kvindex"
	"github.com/prometheus/client_golang/prometheus"
)

// mediumBatch builds a map-encoded vLLM batch of one event of type typ
// (BlockStored or BlockRemoved) on medium.
func mediumBatch(typ, medium string, keys ...uint64) []byte {
	var m mp
	m.arr(3).f64(0).arr(1)
	m.mapN(3).str("type").str(typ).str("medium").str(medium).str("block_hashes").arr(len(keys))
	for _, k := range keys {
		m.u64(k)
	}
	m.fix(0)
	return m.Bytes()
}

func TestMediumTier(t *testing.T) {
	for _, c := range []struct {
		in   string
		tier kvindex.Tier
		ok   bool
	}{
		{"", kvindex.TierGPU, true}, {"GPU", kvindex.TierGPU, true}, {"gpu", kvindex.TierGPU, true},
		{"CPU", kvindex.TierCPU, true}, {"cpu", kvindex.TierCPU, true}, {"CPU_PINNED", kvindex.TierCPU, true},
		{"LMCache", kvindex.TierCPU, true}, {"LocalCPUBackend", kvindex.TierCPU, true}, {"DISK", kvindex.TierCPU, true},
		{"LIES", kvindex.TierGPU, false}, {"HBM3", kvindex.TierGPU, false},
	} {
		if tier, ok := mediumTier([]byte(c.in)); tier != c.tier || ok != c.ok {
			t.Errorf("mediumTier(%q) = %v %v, want %v %v", c.in, tier, ok, c.tier, c.ok)
		}
	}
}

// TestCPUMediumIntoKVIndex feeds vLLM events with media through a real
// subscription into the real inventory: CPU copies land on the CPU tier, a
// GPU removal leaves the CPU copy, and an undocumented medium is skipped
// and counted.
func TestCPUMediumIntoKVIndex(t *testing.T) {
	ix, err := kvindex.New(kvindex.Config{}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	p := newPublisher(t)
	spec := Spec{Service: 12, EPIdx: 0, Engine: EngineVLLM, Host: "127.0.0.1", ZmqPort: p.port, BlockSize: 16}
	reg := prometheus.NewRegistry()
	m := New(fastConfig(), ix, testLogger(t), reg)
	if err := m.Sync([]Spec{spec}); err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, m: m, reg: reg}
	go m.Run(t.Context())
	p.handshake(h, 12, 0, 0, 0, emptyBatch(0))
	keys := []uint64{101, 102, 103, 104}
	p.send(1, mediumBatch("BlockStored", "GPU", keys[:2]...))
	p.send(2, mediumBatch("BlockStored", "CPU", keys...))
	p.send(3, mediumBatch("BlockRemoved", "GPU", keys[0]))
	p.send(4, mediumBatch("BlockStored", "LIES", 999))
	waitFor(t, "events", func() bool { st := h.status(12, 0); return st.Ranks[0].LastSeq == 4 })
	out, cpu := make([]int, 1), make([]int, 1)
	ix.PrefixMatchTiered(12, keys, []int{0}, out, cpu)
	// Block 0: GPU copy removed, CPU copy left; block 1 GPU (and CPU);
	// blocks 2 and 3 CPU only.
	if out[0] != 4 || cpu[0] != 3 {
		t.Fatalf("depth %d cpu %d, want 4 3", out[0], cpu[0])
	}
	if got, _ := ix.Snapshot(12, 0, 0); slices.Contains(got, 999) {
		t.Fatal("block on an undocumented medium was stored")
	}
	l := map[string]string{"service": "12", "ep_idx": "0", "reason": skipMedium}
	if n := h.metric("loxilb_kv_events_skipped_total", l); n != 1 {
		t.Fatalf("skipped{reason=medium} = %v, want 1", n)
	}
}

// TestCPUMediumPlainSink: a sink without tiers never sees offloaded
// copies, so they cannot pass for GPU-resident blocks.
func TestCPUMediumPlainSink(t *testing.T) {
	p := newPublisher(t)
	spec := Spec{Service: 13, EPIdx: 1, Engine: EngineVLLM, Host: "127.0.0.1", ZmqPort: p.port, BlockSize: 16}
	h := startManager(t, fastConfig(), spec)
	p.handshake(h, 13, 1, 0, 0, emptyBatch(0))
	p.send(1, mediumBatch("BlockStored", "CPU", 7, 8))
	p.send(2, mediumBatch("BlockStored", "GPU", 9))
	waitFor(t, "gpu block", func() bool { return len(h.sink.keys(13, 1, -1)) == 1 })
	if k := h.sink.keys(13, 1, -1); !slices.Equal(k, []uint64{9}) {
		t.Fatalf("plain sink holds %v, want [9]", k)
	}
}
