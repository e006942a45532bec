package enginesim

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestVLLMRepeatedPromptPublishesVectorBytes drives a vLLM emulator with the
// vector's inputs (seed 42, block 16, tokens 1..48, topic kv-events) and
// checks the published frames against the vector byte for byte, then checks
// that a repeated prompt is a cache hit.
func TestVLLMRepeatedPromptPublishesVectorBytes(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineVLLM, Seed: "42", Topic: "kv-events", ZMQPort: 0}, Deps{Now: fixedNow})
	sub := subscribe(t, e, 0, "kv-events")
	vec := loadEventVectors(t, "vllm_event_vectors.json")["vllm_map_events_int_hashes"]
	want, _ := hex.DecodeString(vec.ZMQFrames.PayloadHex)

	r := do(t, "POST", e.URL()+"/v1/completions", map[string]any{"model": "sim-model", "prompt": seqTokens(1, 48), "max_tokens": 4})
	if got := cachedTokens(t, r); got != 0 {
		t.Fatalf("first call cached_tokens=%d, want 0", got)
	}
	m := sub.next(t)
	if len(m.Frames) != 3 || string(m.Frames[0]) != "kv-events" || binary.BigEndian.Uint64(m.Frames[1]) != 0 {
		t.Fatalf("frames: %q", m.Frames)
	}
	got := m.Frames[2]
	// The vector batch holds four events ([ts, [e0..e3], 0]); ours holds e0.
	if !bytes.Equal(got[:10], want[:10]) || got[10] != 0x91 || want[10] != 0x94 ||
		!bytes.HasPrefix(want[11:], got[11:len(got)-1]) || got[len(got)-1] != 0x00 {
		t.Fatalf("payload is not the vector's first event\n got %x\nwant %x", got, want)
	}
	b := decodeBatch(t, got)
	if b.ts != 1700000000.5 || b.rank != 0 || len(b.events) != 1 || evType(b.events[0]) != "BlockStored" {
		t.Fatalf("decoded batch %+v", b)
	}
	wantKeys := []uint64{16300212363532267629, 8671309795006503672, 3527878332947511115}
	if k := evKeys(b.events[0]); !reflect.DeepEqual(k, wantKeys) {
		t.Fatalf("keys %v, want %v", k, wantKeys)
	}

	r = do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1, 48), "max_tokens": 4})
	if got := cachedTokens(t, r); got != 32 {
		t.Fatalf("repeat cached_tokens=%d, want 32 (the last block is recomputed)", got)
	}
	r = do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1, 64), "max_tokens": 4})
	if got := cachedTokens(t, r); got != 48 {
		t.Fatalf("extended prompt cached_tokens=%d, want 48", got)
	}
	m = sub.next(t)
	if seq := binary.BigEndian.Uint64(m.Frames[1]); seq != 1 {
		t.Fatalf("seq %d, want 1 (the repeat stored nothing)", seq)
	}
	ev := decodeBatch(t, m.Frames[2]).events[0]
	if p := toU64(evField(ev, "parent_block_hash", 2)); p != 3527878332947511115 {
		t.Fatalf("parent %d", p)
	}
	if toks := evField(ev, "token_ids", 3).([]any); len(toks) != 16 || toI64(toks[0]) != 49 {
		t.Fatalf("token_ids %v", toks)
	}
	s := e.Stats()
	if s.PromptTokens != 160 || s.HitTokens != 80 || s.BlocksUsed != 4 {
		t.Fatalf("stats %+v", s)
	}
	var snap CacheSnapshot
	json.Unmarshal(do(t, "GET", e.URL()+"/sim/cache", nil).body, &snap)
	if len(snap.Ranks) != 1 || len(snap.Ranks[0].Blocks) != 4 {
		t.Fatalf("cache snapshot %+v", snap)
	}
}

func TestSGLangPublishesOnePagePerEvent(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineSGLang}, Deps{Now: fixedNow})
	sub := subscribe(t, e, 0, "")
	vec := loadEventVectors(t, "sglang_event_vectors.json")["sglang_tagged_array_events_rank0"]
	want, _ := hex.DecodeString(vec.ZMQFrames.PayloadHex)
	r := do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1, 48)})
	cachedTokens(t, r)
	got := sub.next(t).Frames[2]
	// vector: [ts, [s0, s1, s2, removed, cleared], 0]; ours: [ts, [s0, s1, s2], 0].
	if !bytes.Equal(got[:10], want[:10]) || got[10] != 0x93 || want[10] != 0x95 ||
		!bytes.HasPrefix(want[11:], got[11:len(got)-1]) {
		t.Fatalf("payload mismatch\n got %x\nwant %x", got, want)
	}
	b := decodeBatch(t, got)
	if len(b.events) != 3 {
		t.Fatalf("%d events, want one per page", len(b.events))
	}
}

func TestSGLangMapEncodingAndDPRanks(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineSGLang, EventEncoding: EncodingMap, DPRanks: 2, BlockSize: 4}, Deps{})
	sub1 := subscribe(t, e, 1, "")
	r := do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1, 8), "routed_dp_rank": 1})
	cachedTokens(t, r)
	b := decodeBatch(t, sub1.next(t).Frames[2])
	if b.rank != 1 || len(b.events) != 2 {
		t.Fatalf("batch %+v", b)
	}
	ev, ok := b.events[1].(map[string]any)
	if !ok || ev["type"] != "BlockStored" || ev["medium"] != "GPU" {
		t.Fatalf("event %#v", b.events[1])
	}
	h, _ := newHasher(EngineSGLang, AlgoSHA256SGLang, "", 4)
	hbs := h.hashBlocks([]uint32{1, 2, 3, 4, 5, 6, 7, 8})
	// SGLang keys are signed int64 on the wire.
	if k := toI64(ev["block_hashes"].([]any)[0]); k != int64(hbs[1].key) {
		t.Fatalf("key %d, want %d", k, int64(hbs[1].key))
	}
	if p := toI64(ev["parent_block_hash"]); p != int64(hbs[0].key) {
		t.Fatalf("parent %d", p)
	}
	snap := e.Cache()
	if len(snap.Ranks[0].Blocks) != 0 || len(snap.Ranks[1].Blocks) != 2 {
		t.Fatalf("per-rank cache %+v", snap)
	}
	if r := do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": "x", "routed_dp_rank": 2}); r.status != 400 {
		t.Fatalf("rank out of range: %d", r.status)
	}
	info := do(t, "GET", e.URL()+"/get_server_info", nil)
	if info.json["page_size"].(json.Number).String() != "4" || info.json["dp_size"].(json.Number).String() != "2" {
		t.Fatalf("server info %s", info.body)
	}
}

func TestEvictionEmitsBlockRemoved(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineVLLM, CapacityBlocks: 4}, Deps{})
	sub := subscribe(t, e, 0, "")
	cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1, 64)}))
	stored := decodeBatch(t, sub.next(t).Frames[2]).events[0]
	aKeys := evKeys(stored)
	cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1000, 48)}))
	b := decodeBatch(t, sub.next(t).Frames[2])
	if len(b.events) != 2 || evType(b.events[0]) != "BlockRemoved" || evType(b.events[1]) != "BlockStored" {
		t.Fatalf("events %v", b.events)
	}
	// The deepest blocks of the old prefix go first.
	if got, want := evKeys(b.events[0]), []uint64{aKeys[3], aKeys[2], aKeys[1]}; !reflect.DeepEqual(got, want) {
		t.Fatalf("removed %v, want %v", got, want)
	}
	// The surviving first block still hits.
	if got := cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1, 64)})); got != 16 {
		t.Fatalf("cached_tokens %d, want 16", got)
	}
	if s := e.Stats(); s.Ranks[0].Evictions < 3 || s.BlocksUsed != 4 {
		t.Fatalf("stats %+v", s)
	}
}

func TestStreamingChunksAndUsage(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineVLLM}, Deps{})
	for _, chat := range []bool{false, true} {
		body := map[string]any{"stream": true, "max_tokens": 5, "stream_options": map[string]any{"include_usage": true}}
		path := "/v1/completions"
		if chat {
			path = "/v1/chat/completions"
			body["messages"] = []any{map[string]any{"role": "user", "content": strings.Repeat("hello world ", 20)}}
		} else {
			body["prompt"] = strings.Repeat("hello world ", 20)
		}
		r := do(t, "POST", e.URL()+path, body)
		evs := sseEvents(t, r.body)
		if r.status != 200 || len(evs) < 7 || evs[len(evs)-1] != "[DONE]" {
			t.Fatalf("chat=%v stream: %d %q", chat, r.status, evs)
		}
		var usage struct {
			Choices []any
			Usage   usage
		}
		json.Unmarshal([]byte(evs[len(evs)-2]), &usage)
		if usage.Usage.CompletionTokens != 5 || len(usage.Choices) != 0 {
			t.Fatalf("usage chunk %s", evs[len(evs)-2])
		}
		var last map[string]any
		json.Unmarshal([]byte(evs[len(evs)-3]), &last)
		ch := last["choices"].([]any)[0].(map[string]any)
		if ch["finish_reason"] != "length" {
			t.Fatalf("last chunk %s", evs[len(evs)-3])
		}
		if chat && last["object"] != "chat.completion.chunk" || !chat && last["object"] != "text_completion" {
			t.Fatalf("object %v", last["object"])
		}
	}
}

func TestBadRequestsUseEngineErrorStyle(t *testing.T) {
	for _, eng := range []string{EngineVLLM, EngineSGLang, EngineTRTLLM, EngineLlamaCpp} {
		e := startEngine(t, Config{Engine: eng}, Deps{})
		cases := []struct {
			body   string
			status int
		}{
			{`{"prompt": `, 400},
			{`{"prompt": "hi", "max_tokens": 0}`, 400},
			{`{"prompt": 7}`, 400},
			{`{"prompt": [1, -2]}`, 400},
			{`{"max_tokens": 3}`, 400},
			{`{"prompt": [[1,2],[3,4]]}`, 400},
			{fmt.Sprintf(`{"prompt": %s, "max_tokens": 32768}`, mustJSON(seqTokens(1, 10))), 400},
		}
		if eng == EngineVLLM {
			cases = append(cases, struct {
				body   string
				status int
			}{`{"model": "other", "prompt": "hi"}`, 404})
		}
		for _, c := range cases {
			r := do(t, "POST", e.URL()+"/v1/completions", c.body)
			if r.status != c.status {
				t.Errorf("%s %s: status %d, want %d (%s)", eng, c.body, r.status, c.status, r.body)
				continue
			}
			var msg any
			switch eng {
			case EngineVLLM, EngineLlamaCpp:
				inner, _ := r.json["error"].(map[string]any)
				msg = inner["message"]
			default:
				if r.json["object"] != "error" {
					t.Errorf("%s: body %s", eng, r.body)
				}
				msg = r.json["message"]
			}
			if s, _ := msg.(string); s == "" {
				t.Errorf("%s %s: no error message in %s", eng, c.body, r.body)
			}
		}
		if r := do(t, "POST", e.URL()+"/v1/chat/completions", `{"messages": []}`); r.status != 400 {
			t.Errorf("%s empty messages: %d", eng, r.status)
		}
	}
}

func mustJSON(v any) string { b, _ := json.Marshal(v); return string(b) }

func TestVLLMSurface(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineVLLM, Model: "Qwen/Qwen3-0.6B"}, Deps{})
	if r := do(t, "GET", e.URL()+"/health", nil); r.status != 200 || len(r.body) != 0 {
		t.Fatalf("health %d %q", r.status, r.body)
	}
	r := do(t, "GET", e.URL()+"/v1/models", nil)
	if !strings.Contains(string(r.body), `"id":"Qwen/Qwen3-0.6B"`) {
		t.Fatalf("models %s", r.body)
	}
	r = do(t, "POST", e.URL()+"/tokenize", map[string]any{"model": "Qwen/Qwen3-0.6B", "prompt": "a b, c"})
	if r.json["count"].(json.Number).String() != "4" {
		t.Fatalf("tokenize %s", r.body)
	}
	cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1, 40)}))
	r = do(t, "GET", e.URL()+"/metrics", nil)
	for _, name := range []string{"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
		"vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", `model_name="Qwen/Qwen3-0.6B"`} {
		if !strings.Contains(string(r.body), name) {
			t.Errorf("metrics lack %s", name)
		}
	}
	r = do(t, "GET", e.URL()+"/sim/stats", nil)
	if r.json["prompt_tokens"].(json.Number).String() != "40" {
		t.Fatalf("stats %s", r.body)
	}
}

func TestTRTLLMDrain(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineTRTLLM}, Deps{})
	drain := func() []map[string]any {
		r := do(t, "POST", e.URL()+"/kv_cache_events", nil)
		var evs []map[string]any
		dec := json.NewDecoder(bytes.NewReader(r.body))
		dec.UseNumber()
		if err := dec.Decode(&evs); err != nil || r.status != 200 {
			t.Fatalf("drain: %d %s", r.status, r.body)
		}
		return evs
	}
	evs := drain()
	if len(evs) != 1 || evs[0]["data"].(map[string]any)["type"] != "created" {
		t.Fatalf("first drain %v", evs)
	}
	cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1, 64)}))
	evs = drain()
	if len(evs) != 1 {
		t.Fatalf("drain %v", evs)
	}
	data := evs[0]["data"].(map[string]any)
	blocks := data["blocks"].([]any)
	if data["type"] != "stored" || data["parent_hash"] != nil || len(blocks) != 2 {
		t.Fatalf("stored %v", data)
	}
	if h := blocks[1].(map[string]any)["block_hash"].(json.Number).String(); h != "15666736886184129505" {
		t.Fatalf("block hash %s", h)
	}
	if len(drain()) != 0 {
		t.Fatal("drain is not destructive")
	}
	r := do(t, "GET", e.URL()+"/server_info", nil)
	if r.json["tokens_per_block"].(json.Number).String() != "32" || r.json["kv_cache_hash_algo"] != "v1_block_key" {
		t.Fatalf("server_info %s", r.body)
	}
	if r := do(t, "GET", e.URL()+"/kv_cache_events", nil); r.status != http.StatusMethodNotAllowed {
		t.Fatalf("GET drain: %d", r.status)
	}
}

func TestLlamaCppHasNoEvents(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineLlamaCpp}, Deps{})
	if len(e.ZMQPorts()) != 0 {
		t.Fatal("llama.cpp publishes no events")
	}
	r := do(t, "GET", e.URL()+"/health", nil)
	if r.json["status"] != "ok" {
		t.Fatalf("health %s", r.body)
	}
	cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1, 40)}))
	if got := cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1, 40)})); got != 32 {
		t.Fatalf("llama.cpp prompt cache: cached %d", got)
	}
}

// TestRealTokenizer checks text prompts go through the model's tokenizer and
// chat template when one is configured.
func TestRealTokenizer(t *testing.T) {
	tok, err := LoadTokenizer("../../testdata/tokenizers/Qwen__Qwen3-0.6B")
	if err != nil {
		t.Fatalf("load: %v", err)
	}
	e := startEngine(t, Config{Engine: EngineVLLM}, Deps{Tokenizer: tok})
	r := do(t, "POST", e.URL()+"/tokenize", map[string]any{"prompt": "Hello world"})
	if got := string(mustJSONRaw(r.json["tokens"])); got != "[9707,1879]" {
		t.Fatalf("tokens %s", got)
	}
	msgs := []any{map[string]any{"role": "system", "content": strings.Repeat("You are a careful assistant. ", 20)},
		map[string]any{"role": "user", "content": "hi"}}
	cachedTokens(t, do(t, "POST", e.URL()+"/v1/chat/completions", map[string]any{"messages": msgs}))
	msgs[1] = map[string]any{"role": "user", "content": "something else"}
	if got := cachedTokens(t, do(t, "POST", e.URL()+"/v1/chat/completions", map[string]any{"messages": msgs})); got < 96 {
		t.Fatalf("shared system prompt cached_tokens=%d", got)
	}
}

func mustJSONRaw(v any) []byte { b, _ := json.Marshal(v); return b }

// sleepRecorder records the modelled delays instead of waiting them out.
type sleepRecorder struct {
	mu sync.Mutex
	ds []time.Duration
}

func (s *sleepRecorder) sleep(_ context.Context, d time.Duration) error {
	s.mu.Lock()
	s.ds = append(s.ds, d)
	s.mu.Unlock()
	return nil
}

func (s *sleepRecorder) take() []time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := s.ds
	s.ds = nil
	return out
}

func TestTimeModel(t *testing.T) {
	rec := &sleepRecorder{}
	e := startEngine(t, Config{Engine: EngineVLLM, PrefillUsPerToken: 10, DecodeUsPerToken: 1000,
		DecodeUsPerActiveBlock: 100, TimeScale: 0.5, TimeScaleSet: true}, Deps{Sleep: rec.sleep})
	cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1, 64), "max_tokens": 3}))
	// 64 uncached tokens x 10us x 0.5; then 3 decode steps with 4 pinned blocks.
	step := (1000 + 4*100) * time.Microsecond / 2
	if got, want := rec.take(), []time.Duration{320 * time.Microsecond, 3 * step}; !reflect.DeepEqual(got, want) {
		t.Fatalf("delays %v, want %v", got, want)
	}
	// 48 of 64 tokens hit: only 16 are prefilled.
	if r := do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1, 64), "max_tokens": 1, "stream": true}); r.status != 200 {
		t.Fatalf("stream: %d", r.status)
	}
	if got, want := rec.take(), []time.Duration{80 * time.Microsecond, step}; !reflect.DeepEqual(got, want) {
		t.Fatalf("delays %v, want %v", got, want)
	}
}

func TestSGLangPartialPages(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineSGLang, SGLangPartialPages: true}, Deps{})
	sub := subscribe(t, e, 0, "")
	cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1, 20)}))
	b := decodeBatch(t, sub.next(t).Frames[2])
	if len(b.events) != 2 {
		t.Fatalf("events %v", b.events)
	}
	last := b.events[1]
	if bs := toI64(evField(last, "block_size", 4)); bs != 4 {
		t.Fatalf("partial page block_size %d, want 4", bs)
	}
	if p := toU64(evField(last, "parent_block_hash", 2)); p != evKeys(b.events[0])[0] {
		t.Fatalf("partial page parent %d", p)
	}
	if got := cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1, 20)})); got != 16 {
		t.Fatalf("cached %d: only full pages match", got)
	}
	if n := e.Stats().BlocksUsed; n != 2 {
		t.Fatalf("blocks %d", n)
	}
}

func TestRoundRobinRanks(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineVLLM, DPRanks: 2}, Deps{})
	for i := 0; i < 4; i++ {
		cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1000*i, 16)}))
	}
	for _, r := range e.Cache().Ranks {
		if len(r.Blocks) != 2 {
			t.Fatalf("rank %d holds %d blocks, want 2 (round robin)", r.Rank, len(r.Blocks))
		}
	}
}

// TestVLLMLoRAAndCacheSalt checks a LoRA request with a cache salt hashes
// and publishes exactly as the reference vector (seed 42, block 16).
func TestVLLMLoRAAndCacheSalt(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineVLLM, Seed: "42", LoRAModules: []string{"other", "my-lora"}}, Deps{})
	sub := subscribe(t, e, 0, "")
	r := do(t, "POST", e.URL()+"/v1/completions", map[string]any{"model": "my-lora", "prompt": seqTokens(1, 48), "cache_salt": "tenant-a"})
	cachedTokens(t, r)
	ev := decodeBatch(t, sub.next(t).Frames[2]).events[0].(map[string]any)
	want := []uint64{11988454098528493374, 5279212012238077059, 12551227964529826862}
	if got := evKeys(ev); !reflect.DeepEqual(got, want) {
		t.Fatalf("keys %v, want %v", got, want)
	}
	if ev["lora_name"] != "my-lora" || toI64(ev["lora_id"]) != 2 {
		t.Fatalf("lora fields %v %v", ev["lora_name"], ev["lora_id"])
	}
	if got := fmt.Sprint(ev["extra_keys"]); got != "[[my-lora tenant-a] [my-lora] [my-lora]]" {
		t.Fatalf("extra_keys %s", got)
	}
	// The same tokens without the salt or the adapter share nothing.
	if got := cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1, 48)})); got != 0 {
		t.Fatalf("plain request hit salted blocks: %d", got)
	}
	if got := cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"model": "my-lora", "prompt": seqTokens(1, 48), "cache_salt": "tenant-a"})); got != 32 {
		t.Fatalf("same tenant cached %d", got)
	}
	if r := do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": "x", "cache_salt": ""}); r.status != 400 {
		t.Fatalf("empty salt: %d", r.status)
	}
	if m := do(t, "GET", e.URL()+"/v1/models", nil); !strings.Contains(string(m.body), `"id":"my-lora"`) {
		t.Fatalf("models %s", m.body)
	}
}

// TestRankSelection: each engine's balancer round-robins over its ranks
// unless the request names one the way that engine reads it (SGLang: body
// routed_dp_rank, else data_parallel_rank; vLLM: the X-data-parallel-rank
// header only).
func TestRankSelection(t *testing.T) {
	send := func(t *testing.T, e *Engine, body map[string]any, hdr string) {
		t.Helper()
		raw, _ := json.Marshal(body)
		req, _ := http.NewRequest("POST", e.URL()+"/v1/completions", bytes.NewReader(raw))
		req.Header.Set("Content-Type", "application/json")
		if hdr != "" {
			req.Header.Set("X-data-parallel-rank", hdr)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	served := func(e *Engine) (out []uint64) {
		for _, r := range e.Stats().Ranks {
			out = append(out, r.Served)
		}
		return out
	}
	t.Run("sglang", func(t *testing.T) {
		e := startEngine(t, Config{Engine: EngineSGLang, DPRanks: 2, BlockSize: 4, ZMQPort: -1}, Deps{})
		for range 4 {
			send(t, e, map[string]any{"prompt": seqTokens(1, 8), "routed_dp_rank": 1, "data_parallel_rank": 0}, "")
		}
		send(t, e, map[string]any{"prompt": seqTokens(1, 8), "data_parallel_rank": 1}, "")
		send(t, e, map[string]any{"prompt": seqTokens(1, 8)}, "0") // a header SGLang does not read
		send(t, e, map[string]any{"prompt": seqTokens(1, 8)}, "0")
		if got := served(e); got[0] != 1 || got[1] != 6 {
			t.Fatalf("served per rank %v, want [1 6]", got)
		}
	})
	t.Run("vllm", func(t *testing.T) {
		e := startEngine(t, Config{Engine: EngineVLLM, DPRanks: 2, BlockSize: 4, ZMQPort: -1}, Deps{})
		for range 3 {
			send(t, e, map[string]any{"prompt": seqTokens(1, 8)}, "1")
		}
		send(t, e, map[string]any{"prompt": seqTokens(1, 8), "routed_dp_rank": 1}, "") // a field vLLM does not read
		send(t, e, map[string]any{"prompt": seqTokens(1, 8)}, "x")                     // malformed: ignored, as vLLM does
		if got := served(e); got[0] != 1 || got[1] != 4 {
			t.Fatalf("served per rank %v, want [1 4]", got)
		}
		if r := e.Stats().Ranks[1]; r.Targeted != 3 {
			t.Fatalf("targeted %d", r.Targeted)
		}
	})
}
