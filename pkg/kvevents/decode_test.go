package kvevents

import (
	"bytes"
	"errors"
	"slices"
	"testing"
)

func TestDecodeVLLMMapIntHashes(t *testing.T) {
	v := loadEventVectors(t, "vllm_event_vectors.json")["vllm_map_events_int_hashes"]
	_, _, payload := v.frames(t)
	var b Batch
	if err := NewDecoder(KeyLast8).Decode(payload, &b); err != nil {
		t.Fatal(err)
	}
	if b.TS != 1700000000.5 || b.Rank != 0 || len(b.Events) != 4 {
		t.Fatalf("batch = ts %v rank %d events %d", b.TS, b.Rank, len(b.Events))
	}
	e := b.Events[0]
	if e.Kind != KindStored || !slices.Equal(e.Hashes, []uint64{16300212363532267629, 8671309795006503672, 3527878332947511115}) {
		t.Fatalf("event 0 = %v %v", e.Kind, e.Hashes)
	}
	if e.HasParent || len(e.Tokens) != 48 || e.Tokens[47] != 48 || e.BlockSize != 16 || string(e.Medium) != "GPU" ||
		e.GroupIdx != 0 || string(e.SpecKind) != "full_attention" || !e.Plain() {
		t.Fatalf("event 0 fields = %+v", e)
	}
	e = b.Events[1]
	if e.Kind != KindStored || !e.HasParent || e.Parent != 8671309795006503672 || !slices.Equal(e.Hashes, []uint64{3527878332947511115}) || len(e.Tokens) != 16 || e.Tokens[0] != 33 {
		t.Fatalf("event 1 = %+v", e)
	}
	e = b.Events[2]
	if e.Kind != KindRemoved || !slices.Equal(e.Hashes, []uint64{3527878332947511115, 8671309795006503672}) || string(e.Medium) != "GPU" {
		t.Fatalf("event 2 = %+v", e)
	}
	if b.Events[3].Kind != KindCleared {
		t.Fatalf("event 3 = %+v", b.Events[3])
	}
}

func TestDecodeVLLMBytesHashes(t *testing.T) {
	v := loadEventVectors(t, "vllm_event_vectors.json")["vllm_map_events_bytes_hashes"]
	_, _, payload := v.frames(t)
	var b Batch
	if err := NewDecoder(KeyLast8).Decode(payload, &b); err != nil {
		t.Fatal(err)
	}
	// The raw digests end in the same 8 bytes the integer form publishes.
	want := []uint64{16300212363532267629, 8671309795006503672, 3527878332947511115}
	if len(b.Events) == 0 || !slices.Equal(b.Events[0].Hashes, want) {
		t.Fatalf("hashes = %v, want %v", b.Events, want)
	}
}

func TestDecodeVLLMLegacyArray(t *testing.T) {
	v := loadEventVectors(t, "vllm_event_vectors.json")["vllm_legacy_array_events"]
	_, _, payload := v.frames(t)
	var b Batch
	if err := NewDecoder(KeyLast8).Decode(payload, &b); err != nil {
		t.Fatal(err)
	}
	if len(b.Events) != 3 {
		t.Fatalf("events = %d", len(b.Events))
	}
	e := b.Events[0]
	if e.Kind != KindStored || len(e.Hashes) != 3 || e.HasParent || len(e.Tokens) != 48 || e.BlockSize != 16 || string(e.Medium) != "GPU" || !e.Plain() {
		t.Fatalf("event 0 = %+v", e)
	}
	if b.Events[1].Kind != KindRemoved || !slices.Equal(b.Events[1].Hashes, []uint64{3527878332947511115}) {
		t.Fatalf("event 1 = %+v", b.Events[1])
	}
	if b.Events[2].Kind != KindCleared {
		t.Fatal("event 2 not cleared")
	}
}

func TestDecodeSGLangVectors(t *testing.T) {
	vs := loadEventVectors(t, "sglang_event_vectors.json")
	var b Batch
	d := NewDecoder(KeyFirst8)

	_, _, p := vs["sglang_tagged_array_events_rank0"].frames(t)
	if err := d.Decode(p, &b); err != nil {
		t.Fatal(err)
	}
	if b.Rank != 0 || len(b.Events) != 5 {
		t.Fatalf("rank %d events %d", b.Rank, len(b.Events))
	}
	wantKeys := []uint64{8635429971592222890, 1256577331724852459, 5689809685380680247}
	for i, k := range wantKeys {
		e := b.Events[i]
		if e.Kind != KindStored || !slices.Equal(e.Hashes, []uint64{k}) || len(e.Tokens) != 16 || !e.Plain() {
			t.Fatalf("event %d = %+v", i, e)
		}
		if i > 0 && (!e.HasParent || e.Parent != wantKeys[i-1]) {
			t.Fatalf("event %d parent = %v %d", i, e.HasParent, e.Parent)
		}
	}
	if b.Events[3].Kind != KindRemoved || b.Events[4].Kind != KindCleared {
		t.Fatal("tail events wrong")
	}

	_, _, p = vs["sglang_tagged_array_salted_rank1"].frames(t)
	if err := d.Decode(p, &b); err != nil {
		t.Fatal(err)
	}
	if b.Rank != 1 || len(b.Events) != 1 || !b.Events[0].HasCacheSalt || b.Events[0].Plain() {
		t.Fatalf("salted = rank %d %+v", b.Rank, b.Events)
	}

	_, _, p = vs["sglang_old_tagged_array_events"].frames(t)
	if err := d.Decode(p, &b); err != nil {
		t.Fatal(err)
	}
	if b.Rank != -1 || len(b.Events) != 2 || b.Events[0].Kind != KindStored || b.Events[1].Kind != KindRemoved ||
		b.Events[1].Hashes[0] != 8635429971592222890 || b.Events[0].Medium != nil {
		t.Fatalf("old = rank %d %+v", b.Rank, b.Events)
	}
}

// mp is a tiny msgpack encoder for hand-built test payloads.
type mp struct{ bytes.Buffer }

func (m *mp) arr(n int) *mp {
	if n < 16 {
		m.WriteByte(0x90 | byte(n))
	} else {
		m.WriteByte(0xdc)
		m.WriteByte(byte(n >> 8))
		m.WriteByte(byte(n))
	}
	return m
}
func (m *mp) mapN(n int) *mp { m.WriteByte(0x80 | byte(n)); return m }
func (m *mp) str(s string) *mp {
	m.WriteByte(0xd9)
	m.WriteByte(byte(len(s)))
	m.WriteString(s)
	return m
}
func (m *mp) bin(b []byte) *mp { m.WriteByte(0xc4); m.WriteByte(byte(len(b))); m.Write(b); return m }
func (m *mp) nil_() *mp        { m.WriteByte(0xc0); return m }
func (m *mp) u64(v uint64) *mp {
	m.WriteByte(0xcf)
	for i := 7; i >= 0; i-- {
		m.WriteByte(byte(v >> (8 * i)))
	}
	return m
}
func (m *mp) i64(v int64) *mp {
	m.WriteByte(0xd3)
	for i := 7; i >= 0; i-- {
		m.WriteByte(byte(uint64(v) >> (8 * i)))
	}
	return m
}
func (m *mp) f64(v float64) *mp { m.WriteByte(0xcb); m.Write(make([]byte, 8)); return m }
func (m *mp) fix(v int) *mp     { m.WriteByte(byte(v)); return m }

func TestDecodeOuterMapAndSignedHashes(t *testing.T) {
	var m mp
	m.mapN(3).str("ts").f64(1).str("events").arr(2)
	// Map-form SGLang event with a negative int64 key and cache_salt.
	m.mapN(5).str("type").str("BlockStored").str("block_hashes").arr(1).i64(-2360060374177730597).
		str("parent_block_hash").nil_().str("token_ids").arr(1).fix(0).str("cache_salt").str("x")
	// An event type from the future.
	m.arr(2).str("BlockPinned").arr(1).fix(7)
	m.str("attn_dp_rank").fix(2)
	var b Batch
	if err := NewDecoder(KeyFirst8).Decode(m.Bytes(), &b); err != nil {
		t.Fatal(err)
	}
	if b.Rank != 2 || len(b.Events) != 2 {
		t.Fatalf("batch = %+v", b)
	}
	if got := b.Events[0].Hashes[0]; got != uint64(0xdf3f619804a92fdb) {
		t.Fatalf("signed key = %#x", got)
	}
	if !b.Events[0].HasCacheSalt {
		t.Fatal("cache_salt not flagged")
	}
	if b.Events[1].Kind != KindUnknown || string(b.Events[1].Tag) != "BlockPinned" {
		t.Fatalf("unknown event = %+v", b.Events[1])
	}
}

func TestDecodeLongLegacyArrayAndBin(t *testing.T) {
	var m mp
	digest := make([]byte, 32)
	for i := range digest {
		digest[i] = byte(i)
	}
	m.arr(3).f64(0).arr(1)
	// 13 elements: every known positional field plus one from the future.
	m.arr(13).str("BlockStored").arr(1).bin(digest).bin(digest).arr(0).fix(16).nil_().str("CPU").str("lora-a").
		arr(1).arr(1).str("salt").fix(1).str("sliding_window").fix(0).str("extra")
	m.fix(0)
	var b Batch
	if err := NewDecoder(KeyLast8).Decode(m.Bytes(), &b); err != nil {
		t.Fatal(err)
	}
	e := b.Events[0]
	if e.Hashes[0] != 0x18191a1b1c1d1e1f || e.Parent != 0x18191a1b1c1d1e1f || !e.HasLoRA || !e.HasExtraKeys ||
		e.GroupIdx != 1 || string(e.SpecKind) != "sliding_window" || string(e.Medium) != "CPU" {
		t.Fatalf("event = %+v", e)
	}
	if err := NewDecoder(KeyFirst8).Decode(m.Bytes(), &b); err != nil || b.Events[0].Hashes[0] != 0x0001020304050607 {
		t.Fatalf("first8: %v %+v", err, b.Events)
	}
}

func TestDecodeErrors(t *testing.T) {
	cases := map[string][]byte{
		"empty":          {},
		"not container":  {0x01},
		"short array":    {0x91, 0xcb},
		"huge array":     {0xdd, 0xff, 0xff, 0xff, 0xff},
		"float hash":     append(append([]byte{0x93, 0x00, 0x91, 0x92, 0xab}, "BlockStored"...), 0x91, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0),
		"trailing bytes": {0x92, 0x00, 0x90, 0x00},
		"map no events":  {0x81, 0xa2, 't', 's', 0x00},
		"short bin key":  append(append([]byte{0x92, 0x00, 0x91, 0x92, 0xab}, "BlockStored"...), 0x91, 0xc4, 0x01, 0x01),
	}
	d := NewDecoder(KeyFirst8)
	var b Batch
	for name, p := range cases {
		if err := d.Decode(p, &b); !errors.Is(err, ErrBadPayload) {
			t.Errorf("%s: err = %v, want ErrBadPayload", name, err)
		} else if len(b.Events) != 0 {
			t.Errorf("%s: events left in batch", name)
		}
	}
}

func TestDecodeTRTLLMVector(t *testing.T) {
	evs, errs, err := DecodeTRTLLMBody(loadTRTBody(t))
	if err != nil || len(errs) != 0 {
		t.Fatal(err, errs)
	}
	if len(evs) != 4 {
		t.Fatalf("events = %d", len(evs))
	}
	if evs[0].Kind != TRTCreated || evs[0].WindowSize != 4096 || evs[0].Rank != -1 {
		t.Fatalf("created = %+v", evs[0])
	}
	s := evs[1]
	if s.Kind != TRTStored || s.HasParent || len(s.Blocks) != 2 || s.Blocks[0].Hash != 13373336404899918911 ||
		s.Blocks[1].Hash != 15666736886184129505 || len(s.Blocks[1].Tokens) != 32 || s.Blocks[1].Tokens[31] != 64 || !s.Blocks[0].Plain {
		t.Fatalf("stored = %+v", s)
	}
	if evs[2].Kind != TRTUpdated {
		t.Fatalf("updated = %+v", evs[2])
	}
	if evs[3].Kind != TRTRemoved || !slices.Equal(evs[3].Removed, []uint64{15666736886184129505}) || evs[3].EventID != 3 {
		t.Fatalf("removed = %+v", evs[3])
	}
}

func TestDecodeTRTLLMExactAndErrors(t *testing.T) {
	body := []byte(`[
	 {"event_id": 18446744073709551615, "attention_dp_rank": 1, "hash_algo": "v1_block_key", "data": {"type":"stored","parent_hash": 9007199254740993,
	   "blocks":[{"type":"stored_block","block_hash":9007199254740993,"tokens":[{"type":"unique_token","token_id":5,"token_extra_id":3}],"mm_keys":[]}]}},
	 {"event_id": 1.5, "data": {"type":"created"}},
	 {"event_id": 2, "data": {"type":"removed","block_hashes":[-1]}},
	 {"event_id": 3, "data": {"type":"future_kind","x":1}},
	 {"event_id": 4}
	]`)
	evs, errs, err := DecodeTRTLLMBody(body)
	if err != nil {
		t.Fatal(err)
	}
	if len(errs) != 3 || len(evs) != 2 {
		t.Fatalf("evs %d errs %v", len(evs), errs)
	}
	e := evs[0]
	// 2^53+1 survives exactly: a float64 decode would give 2^53.
	if e.EventID != 18446744073709551615 || e.ParentHash != 9007199254740993 || e.Blocks[0].Hash != 9007199254740993 || e.Rank != 1 || e.Blocks[0].Plain {
		t.Fatalf("exact = %+v", e)
	}
	if evs[1].Kind != TRTUnknown || evs[1].Type != "future_kind" {
		t.Fatalf("unknown = %+v", evs[1])
	}
	if _, _, err := DecodeTRTLLMBody([]byte(`{"not":"array"}`)); !errors.Is(err, ErrBadPayload) {
		t.Fatalf("object body err = %v", err)
	}
}
