package kvevents

import (
	"slices"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/blockhash"
)

// tokenBatch is a vLLM batch storing root-anchored blocks of 16 tokens
// starting at token first, with the keys the rule's contract gives them
// (forged: other keys for the same tokens). It returns the keys sent.
func tokenBatch(t *testing.T, spec Spec, first, blocks int, forged bool) ([]byte, []uint64) {
	t.Helper()
	h, err := blockhash.New(blockhash.Config{Algo: spec.algo(), BlockSize: spec.BlockSize, Seed: spec.Seed})
	if err != nil {
		t.Fatal(err)
	}
	var toks []uint32
	var keys []uint64
	var d blockhash.Digest
	for b := 0; b < blocks; b++ {
		blk := make([]uint32, spec.BlockSize)
		for i := range blk {
			blk[i] = uint32(first + b*spec.BlockSize + i)
		}
		var k uint64
		d, k = h.Next(d, blk)
		if forged {
			k = 0xf0f0f0f0 + uint64(first+b)
		}
		keys = append(keys, k)
		toks = append(toks, blk...)
	}
	var m mp
	m.arr(2).f64(0).arr(1)
	m.mapN(4).str("type").str("BlockStored").str("block_hashes").arr(len(keys))
	for _, k := range keys {
		m.u64(k)
	}
	m.str("token_ids").arr(len(toks))
	for _, tk := range toks {
		m.u64(uint64(tk))
	}
	m.str("block_size").fix(spec.BlockSize)
	return m.Bytes(), keys
}

// TestForgedPublisherQuarantined: a publisher whose blocks do not hash from
// their tokens gets its endpoint quarantined: the inventory is cleared and
// stays empty (no Tier-1.5 credit), the state shows in the status, the
// parity report and the metrics, and only consecutive verified blocks lift
// it; a forged block meanwhile starts the count again.
func TestForgedPublisherQuarantined(t *testing.T) {
	p := newPublisher(t)
	spec := vllmSpec(p.port)
	cfg := fastConfig()
	cfg.QuarantineVerifyBlocks = 4
	h := startManager(t, cfg, spec)
	l := map[string]string{"service": "7", "ep_idx": "2"}

	good, goodKeys := tokenBatch(t, spec, 1000, 2, false)
	p.handshake(h, 7, 2, 0, 0, good)
	if got := h.sink.keys(7, 2, -1); !slices.Equal(got, sorted(goodKeys...)) {
		t.Fatalf("inventory = %v, want %v", got, goodKeys)
	}
	if !h.m.ParityOK(7, 2) || h.m.ParityOK(7, 3) {
		t.Fatalf("ParityOK(7,2)=%v (verdict %s), ParityOK of an unknown endpoint=%v", h.m.ParityOK(7, 2), h.status(7, 2).Parity.Verdict, h.m.ParityOK(7, 3))
	}

	forged, _ := tokenBatch(t, spec, 5000, 2, true)
	p.send(1, forged)
	waitFor(t, "quarantine", func() bool { return h.metric("loxilb_kv_quarantined", l) == 1 })
	if got := h.sink.keys(7, 2, -1); len(got) != 0 {
		t.Fatalf("quarantined inventory = %v, want empty", got)
	}
	st := h.status(7, 2)
	if !st.Parity.Quarantine.Quarantined || st.Parity.Verdict != VerdictHashMismatch || st.Parity.Quarantine.Entered != 1 {
		t.Fatalf("parity = %+v", st.Parity)
	}
	if h.m.ParityOK(7, 2) {
		t.Fatal("ParityOK while quarantined with a hash mismatch")
	}
	if rep := h.m.Parity(); len(rep) != 1 || !rep[0].Quarantined || rep[0].QuarantineReason == "" {
		t.Fatalf("parity report = %+v", rep)
	}
	if h.metric("loxilb_kv_quarantines_total", l) != 1 {
		t.Fatal("quarantine not counted")
	}

	// Three verified blocks, then a forged one: still quarantined, nothing stored.
	b, _ := tokenBatch(t, spec, 2000, 3, false)
	p.send(2, b)
	p.send(3, forged)
	b, _ = tokenBatch(t, spec, 3000, 3, false)
	p.send(4, b)
	waitFor(t, "seq 4", func() bool { return h.status(7, 2).Ranks[0].LastSeq == 4 })
	if !h.status(7, 2).Parity.Quarantine.Quarantined || len(h.sink.keys(7, 2, -1)) != 0 {
		t.Fatalf("after 3 verified, 1 forged, 3 verified: %+v, inventory %v", h.status(7, 2).Parity, h.sink.keys(7, 2, -1))
	}
	if h.metric("loxilb_kv_events_skipped_total", map[string]string{"service": "7", "ep_idx": "2", "reason": skipQuarantined}) != 4 {
		t.Fatal("quarantined events not counted as skipped")
	}

	// A fourth consecutive verified block lifts it; later blocks store.
	b, _ = tokenBatch(t, spec, 4000, 1, false)
	p.send(5, b)
	waitFor(t, "lift", func() bool { return h.metric("loxilb_kv_quarantined", l) == 0 })
	b, keys := tokenBatch(t, spec, 6000, 2, false)
	p.send(6, b)
	waitFor(t, "stored after lift", func() bool { return slices.Equal(h.sink.keys(7, 2, -1), sorted(keys...)) })
	if st := h.status(7, 2); st.Parity.Quarantine.Quarantined || st.Parity.Verdict != VerdictOK {
		t.Fatalf("parity after lift = %+v", st.Parity)
	}
	if !h.m.ParityOK(7, 2) {
		t.Fatal("ParityOK false after the quarantine lifted")
	}
}

// TestMisconfiguredSeedQuarantined: an engine with another seed publishes
// keys no request can match; it is quarantined like a forger (nothing of
// value is lost) and its verdict stays hash_mismatch.
func TestMisconfiguredSeedQuarantined(t *testing.T) {
	p := newPublisher(t)
	spec := vllmSpec(p.port)
	other := spec
	other.Seed = "31337"
	b, _ := tokenBatch(t, other, 100, 2, false)
	h := startManager(t, fastConfig(), spec)
	p.handshake(h, 7, 2, 0, 0, b)
	waitFor(t, "quarantine", func() bool { return h.status(7, 2).Parity.Quarantine.Quarantined })
	if st := h.status(7, 2); st.Parity.Verdict != VerdictHashMismatch || len(h.sink.keys(7, 2, -1)) != 0 {
		t.Fatalf("status = %+v inventory %v", st.Parity, h.sink.keys(7, 2, -1))
	}
}
