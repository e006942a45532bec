package enginesim

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

const vectorDir = "../../testdata/vectors"

func loadJSON(t *testing.T, name string, v any) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(vectorDir, name))
	if err != nil {
		t.Fatalf("read vectors: %v", err)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	if err := dec.Decode(v); err != nil {
		t.Fatalf("decode %s: %v", name, err)
	}
}

func u32s(t *testing.T, ns []json.Number) []uint32 {
	t.Helper()
	out := make([]uint32, len(ns))
	for i, n := range ns {
		v, err := n.Int64()
		if err != nil {
			t.Fatalf("token %q: %v", n, err)
		}
		out[i] = uint32(v)
	}
	return out
}

func TestVLLMHashVectors(t *testing.T) {
	var f struct {
		Cases []struct {
			Name, Algo, Seed string
			NoneHashHex      string `json:"none_hash_hex"`
			BlockSize        int    `json:"block_size"`
			Tokens           []json.Number
			Blocks           []struct {
				ExtraKeys json.RawMessage `json:"extra_keys"`
				CBORHex   string          `json:"cbor_hex"`
				DigestHex string          `json:"digest_hex"`
				U64       json.Number
			}
		}
	}
	loadJSON(t, "vllm_hash_vectors.json", &f)
	ran, extras := 0, 0
	for _, c := range f.Cases {
		var x blockExtras
		if len(c.Blocks) > 0 && string(c.Blocks[0].ExtraKeys) != "null" {
			var k0, k1 []any
			json.Unmarshal(c.Blocks[0].ExtraKeys, &k0)
			if len(c.Blocks) > 1 {
				json.Unmarshal(c.Blocks[1].ExtraKeys, &k1)
			}
			strs := func(v []any) bool {
				for _, e := range v {
					if _, ok := e.(string); !ok {
						return false
					}
				}
				return true
			}
			if !strs(k0) || !strs(k1) {
				continue // multimodal extra keys are not emulated
			}
			if len(k1) > 0 {
				x.lora = &loraRef{name: k1[0].(string), id: 1}
			}
			if len(k0) > len(k1) {
				x.cacheSalt = k0[len(k0)-1].(string)
			}
			extras++
		}
		h, err := newHasher(EngineVLLM, c.Algo, c.Seed, c.BlockSize)
		if err != nil {
			t.Fatalf("%s: %v", c.Name, err)
		}
		vh := h.(*vllmHasher)
		if got := hex.EncodeToString(vh.noneHash); got != c.NoneHashHex {
			t.Errorf("%s: none hash %s, want %s", c.Name, got, c.NoneHashHex)
		}
		hbs := vh.hashBlocksExtra(u32s(t, c.Tokens), x)
		if len(hbs) != len(c.Blocks) {
			t.Fatalf("%s: %d blocks, want %d", c.Name, len(hbs), len(c.Blocks))
		}
		parent := vh.noneHash
		for i, b := range c.Blocks {
			if got := hex.EncodeToString(vllmBlockCBOR(nil, parent, hbs[i].tokens, hbs[i].extra)); got != b.CBORHex {
				t.Errorf("%s block %d: cbor %s, want %s", c.Name, i, got, b.CBORHex)
			}
			if got := hex.EncodeToString(hbs[i].digest); got != b.DigestHex {
				t.Errorf("%s block %d: digest %s, want %s", c.Name, i, got, b.DigestHex)
			}
			if got := hbs[i].key; b.U64.String() != u64s(got) {
				t.Errorf("%s block %d: key %d, want %s", c.Name, i, got, b.U64)
			}
			parent = hbs[i].digest
		}
		ran++
	}
	if ran < 42 || extras != 2 {
		t.Fatalf("only %d vLLM cases ran (%d with LoRA/salt extra keys)", ran, extras)
	}
}

func u64s(v uint64) string { return json.Number(formatU(v)).String() }

func formatU(v uint64) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func TestSGLangHashVectors(t *testing.T) {
	var f struct {
		Cases []struct {
			Name     string
			PageSize int `json:"page_size"`
			Tokens   []json.Number
			Pages    []struct {
				Partial   bool
				DigestHex string `json:"digest_hex"`
				Int64     json.Number
				Uint64    json.Number
			}
		}
	}
	loadJSON(t, "sglang_hash_vectors.json", &f)
	for _, c := range f.Cases {
		h, err := newHasher(EngineSGLang, AlgoSHA256SGLang, "", c.PageSize)
		if err != nil {
			t.Fatal(err)
		}
		toks := u32s(t, c.Tokens)
		hbs := h.hashBlocks(toks)
		full := 0
		for _, p := range c.Pages {
			if p.Partial {
				pp, ok := h.(*sglangHasher).partialPage(toks, hbs)
				if !ok || hex.EncodeToString(pp.digest) != p.DigestHex || formatU(pp.key) != p.Uint64.String() {
					t.Errorf("%s partial page: %x key %d, want %s %s", c.Name, pp.digest, pp.key, p.DigestHex, p.Uint64)
				}
				continue
			}
			if full >= len(hbs) {
				t.Fatalf("%s: only %d pages hashed", c.Name, len(hbs))
			}
			hb := hbs[full]
			if got := hex.EncodeToString(hb.digest); got != p.DigestHex {
				t.Errorf("%s page %d: digest %s, want %s", c.Name, full, got, p.DigestHex)
			}
			if formatU(hb.key) != p.Uint64.String() {
				t.Errorf("%s page %d: key %d, want %s", c.Name, full, hb.key, p.Uint64)
			}
			if got, _ := json.Marshal(int64(hb.key)); string(got) != p.Int64.String() {
				t.Errorf("%s page %d: int64 %s, want %s", c.Name, full, got, p.Int64)
			}
			full++
		}
		if full != len(hbs) {
			t.Errorf("%s: hashed %d full pages, vectors have %d", c.Name, len(hbs), full)
		}
	}
}

func TestTRTLLMHashVectors(t *testing.T) {
	var f struct {
		Cases []struct {
			Name           string
			TokensPerBlock int `json:"tokens_per_block"`
			Tokens         []json.Number
			Blocks         []struct {
				BlockHash json.Number `json:"block_hash"`
			}
		}
	}
	loadJSON(t, "trtllm_v1_block_key_vectors.json", &f)
	for _, c := range f.Cases {
		h, err := newHasher(EngineTRTLLM, AlgoBlockHashTRTLLM, "", c.TokensPerBlock)
		if err != nil {
			t.Fatal(err)
		}
		hbs := h.hashBlocks(u32s(t, c.Tokens))
		if len(hbs) != len(c.Blocks) {
			t.Fatalf("%s: %d blocks, want %d", c.Name, len(hbs), len(c.Blocks))
		}
		for i, b := range c.Blocks {
			if formatU(hbs[i].key) != b.BlockHash.String() {
				t.Errorf("%s block %d: %d, want %s", c.Name, i, hbs[i].key, b.BlockHash)
			}
		}
	}
}

// eventVectors reads the event vectors of one engine, keyed by name.
type eventVector struct {
	Name      string
	Decoded   json.RawMessage
	ZMQFrames struct {
		TopicHex   string `json:"topic_hex"`
		SeqHex     string `json:"seq_hex"`
		PayloadHex string `json:"payload_hex"`
	} `json:"zmq_frames"`
}

func loadEventVectors(t *testing.T, file string) map[string]eventVector {
	var f struct{ Vectors []json.RawMessage }
	loadJSON(t, file, &f)
	out := map[string]eventVector{}
	for _, raw := range f.Vectors {
		var v eventVector
		if err := json.Unmarshal(raw, &v); err != nil {
			t.Fatal(err)
		}
		out[v.Name] = v
	}
	return out
}

// eventsFromDecoded rebuilds kvEvents from a vector's decoded JSON, the same
// inputs the vector generator encoded.
func eventsFromDecoded(t *testing.T, raw json.RawMessage) (float64, []kvEvent, int) {
	t.Helper()
	var outer []json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	if err := dec.Decode(&outer); err != nil {
		t.Fatal(err)
	}
	var ts float64
	if err := json.Unmarshal(outer[0], &ts); err != nil {
		t.Fatal(err)
	}
	rank := 0
	if len(outer) > 2 {
		json.Unmarshal(outer[2], &rank)
	}
	var items []json.RawMessage
	json.Unmarshal(outer[1], &items)
	var evs []kvEvent
	for _, it := range items {
		var m map[string]json.RawMessage
		var arr []json.RawMessage
		var tag string
		get := func(name string, idx int) json.RawMessage {
			if m != nil {
				return m[name]
			}
			if idx < len(arr) {
				return arr[idx]
			}
			return nil
		}
		if json.Unmarshal(it, &m) == nil {
			json.Unmarshal(m["type"], &tag)
		} else {
			m = nil
			json.Unmarshal(it, &arr)
			json.Unmarshal(arr[0], &tag)
		}
		hashes := func(r json.RawMessage) ([]uint64, [][]byte) {
			var hs []json.RawMessage
			json.Unmarshal(r, &hs)
			var keys []uint64
			var digs [][]byte
			for _, h := range hs {
				var s string
				if json.Unmarshal(h, &s) == nil {
					d, _ := hex.DecodeString(s)
					digs = append(digs, d)
					keys = append(keys, beU64(d[len(d)-8:]))
					continue
				}
				var n json.Number
				json.Unmarshal(h, &n)
				keys = append(keys, parseKey(t, n))
				digs = append(digs, nil)
			}
			return keys, digs
		}
		switch tag {
		case "BlockStored":
			e := kvEvent{kind: evStored}
			e.keys, e.digests = hashes(get("block_hashes", 1))
			if p := get("parent_block_hash", 2); string(p) != "null" {
				e.hasParent = true
				var n json.Number
				json.Unmarshal(p, &n)
				e.parent = parseKey(t, n)
			}
			var toks []json.Number
			json.Unmarshal(get("token_ids", 3), &toks)
			e.tokens = u32s(t, toks)
			json.Unmarshal(get("block_size", 4), &e.blockSize)
			evs = append(evs, e)
		case "BlockRemoved":
			e := kvEvent{kind: evRemoved}
			e.keys, e.digests = hashes(get("block_hashes", 1))
			evs = append(evs, e)
		case "AllBlocksCleared":
			evs = append(evs, kvEvent{kind: evCleared})
		default:
			t.Fatalf("unknown tag %q", tag)
		}
	}
	return ts, evs, rank
}

func beU64(b []byte) uint64 {
	var v uint64
	for _, c := range b {
		v = v<<8 | uint64(c)
	}
	return v
}

func parseKey(t *testing.T, n json.Number) uint64 {
	t.Helper()
	var u uint64
	if err := json.Unmarshal([]byte(n), &u); err == nil {
		return u
	}
	var i int64
	if err := json.Unmarshal([]byte(n), &i); err != nil {
		t.Fatalf("key %q: %v", n, err)
	}
	return uint64(i)
}

func TestEventVectorsByteExact(t *testing.T) {
	cases := []struct {
		file, name string
		enc        zmqEncoder
	}{
		{"vllm_event_vectors.json", "vllm_map_events_int_hashes", zmqEncoder{EngineVLLM, EncodingMap, true}},
		{"vllm_event_vectors.json", "vllm_map_events_bytes_hashes", zmqEncoder{EngineVLLM, EncodingMap, false}},
		{"vllm_event_vectors.json", "vllm_legacy_array_events", zmqEncoder{EngineVLLM, EncodingArray, true}},
		{"sglang_event_vectors.json", "sglang_tagged_array_events_rank0", zmqEncoder{EngineSGLang, EncodingArray, true}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			v, ok := loadEventVectors(t, c.file)[c.name]
			if !ok {
				t.Fatalf("vector %s missing", c.name)
			}
			ts, evs, rank := eventsFromDecoded(t, v.Decoded)
			got := hex.EncodeToString(c.enc.batch(ts, evs, rank))
			if got != v.ZMQFrames.PayloadHex {
				t.Fatalf("payload mismatch\n got %s\nwant %s", got, v.ZMQFrames.PayloadHex)
			}
		})
	}
}

// TestMsgpackIndependentDecode checks the encoder against a generic msgpack
// decoder for values at every format boundary.
func TestMsgpackIndependentDecode(t *testing.T) {
	ints := []int64{0, 1, 127, 128, 255, 256, 65535, 65536, 1<<32 - 1, 1 << 32, -1, -32, -33, -128, -129, -32768, -32769, -1 << 31, -1<<31 - 1, -1 << 63}
	for _, v := range ints {
		var got int64
		if err := msgpack.Unmarshal(mpInt(nil, v), &got); err != nil || got != v {
			t.Errorf("int %d: got %d err %v", v, got, err)
		}
	}
	for _, v := range []uint64{1<<63 + 5, 1<<64 - 1} {
		var got uint64
		if err := msgpack.Unmarshal(mpUint(nil, v), &got); err != nil || got != v {
			t.Errorf("uint %d: got %d err %v", v, got, err)
		}
	}
	for _, n := range []int{0, 31, 32, 255, 256, 70000} {
		s := string(bytes.Repeat([]byte("x"), n))
		var got string
		if err := msgpack.Unmarshal(mpStr(nil, s), &got); err != nil || got != s {
			t.Errorf("str len %d: err %v", n, err)
		}
		var gb []byte
		if err := msgpack.Unmarshal(mpBin(nil, []byte(s)), &gb); err != nil || string(gb) != s {
			t.Errorf("bin len %d: err %v", n, err)
		}
	}
	for _, n := range []int{0, 15, 16, 70000} {
		b := mpArray(nil, n)
		for i := 0; i < n; i++ {
			b = mpNil(b)
		}
		var got []any
		if err := msgpack.Unmarshal(b, &got); err != nil || len(got) != n {
			t.Errorf("array %d: len %d err %v", n, len(got), err)
		}
		m := mpMap(nil, n)
		for i := 0; i < n; i++ {
			m = mpStr(mpUint(m, uint64(i)), "v")
		}
		var gm map[any]any
		if err := msgpack.Unmarshal(m, &gm); err != nil || len(gm) != n {
			t.Errorf("map %d: len %d err %v", n, len(gm), err)
		}
	}
	var f float64
	if err := msgpack.Unmarshal(mpFloat64(nil, 1700000000.5), &f); err != nil || f != 1700000000.5 {
		t.Errorf("float: %v %v", f, err)
	}
}

// TestTRTEventVectors encodes the sample body's stored and removed events and
// compares them structurally with the vector.
func TestTRTEventVectors(t *testing.T) {
	var f struct {
		SampleBody []json.RawMessage `json:"sample_body"`
	}
	loadJSON(t, "trtllm_event_vectors.json", &f)
	h, _ := newHasher(EngineTRTLLM, AlgoBlockHashTRTLLM, "", 32)
	toks := make([]uint32, 64)
	for i := range toks {
		toks[i] = uint32(i + 1)
	}
	hbs := h.hashBlocks(toks)
	q := newTRTQueue(100, 4096, 4096, false, &faultState{}, 1)
	c := newBlockCache(16, 32, false)
	held, evs := c.insert(hbs, nil)
	q.push(evs, 0)
	c.release(held)
	q.push([]kvEvent{{kind: evRemoved, keys: []uint64{hbs[1].key}}}, 0)
	got, _ := json.Marshal(q.drain("test"))
	var gotEvents []map[string]any
	json.Unmarshal(got, &gotEvents)
	want := []json.RawMessage{f.SampleBody[0], f.SampleBody[1], f.SampleBody[3]}
	if len(gotEvents) != 3 {
		t.Fatalf("got %d events: %s", len(gotEvents), got)
	}
	for i := range want {
		var w map[string]any
		json.Unmarshal(want[i], &w)
		g := gotEvents[i]
		delete(w, "event_id")
		delete(g, "event_id")
		if !reflect.DeepEqual(g, w) {
			gb, _ := json.Marshal(g)
			t.Errorf("event %d:\n got %s\nwant %s", i, gb, want[i])
		}
	}
	// Exact uint64 on the wire: the vector's hash text must appear verbatim.
	if !bytes.Contains(got, []byte("15666736886184129505")) {
		t.Errorf("block hash not encoded exactly: %s", got)
	}
	if again := q.drain("test"); len(again) != 0 {
		t.Errorf("second drain returned %d events, want 0 (destructive)", len(again))
	}
}
