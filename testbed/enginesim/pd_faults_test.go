package enginesim

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
)

// replay asks the ROUTER for every batch from start and returns the reply
// frames after the empty delimiter, end marker included.
func replay(t *testing.T, port int, start uint64) [][][]byte {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	d := zmq4.NewDealer(ctx)
	defer d.Close()
	if err := d.Dial(fmt.Sprintf("tcp://127.0.0.1:%d", port)); err != nil {
		t.Fatal(err)
	}
	seq := make([]byte, 8)
	binary.BigEndian.PutUint64(seq, start)
	if err := d.SendMulti(zmq4.NewMsgFrom([]byte{}, seq)); err != nil {
		t.Fatal(err)
	}
	var out [][][]byte
	for {
		m, err := d.Recv()
		if err != nil {
			t.Fatalf("replay recv: %v", err)
		}
		if len(m.Frames[0]) != 0 {
			t.Fatalf("missing empty delimiter: %q", m.Frames)
		}
		f := m.Frames[1:]
		out = append(out, f)
		if len(f[len(f)-1]) == 0 && binary.BigEndian.Uint64(f[len(f)-2]) == ^uint64(0) {
			return out
		}
	}
}

func TestReplayFormats(t *testing.T) {
	for _, c := range []struct {
		engine    string
		withTopic bool
	}{{EngineVLLM, true}, {EngineSGLang, false}} {
		e := startEngine(t, Config{Engine: c.engine, Topic: "kv"}, Deps{})
		sub := subscribe(t, e, 0, "kv")
		for i := 0; i < 3; i++ {
			cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(100*i+1, 16)}))
			sub.next(t)
		}
		got := replay(t, e.ReplayPorts()[0], 1)
		if len(got) != 3 {
			t.Fatalf("%s: %d replies, want 2 batches and the end marker", c.engine, len(got))
		}
		width := 2
		if c.withTopic {
			width = 3
		}
		for i, f := range got {
			if len(f) != width {
				t.Fatalf("%s reply %d has %d frames, want %d", c.engine, i, len(f), width)
			}
			if c.withTopic && i < 2 && string(f[0]) != "kv" {
				t.Fatalf("topic frame %q", f[0])
			}
			if i < 2 {
				if s := binary.BigEndian.Uint64(f[width-2]); s != uint64(i+1) {
					t.Fatalf("replayed seq %d, want %d", s, i+1)
				}
				decodeBatch(t, f[width-1])
			}
		}
	}
}

func TestVLLMPrefillDecode(t *testing.T) {
	pre := startEngine(t, Config{Engine: EngineVLLM, Role: RolePrefill}, Deps{})
	dec := startEngine(t, Config{Engine: EngineVLLM, Role: RoleDecode}, Deps{})
	prompt := seqTokens(1, 40)
	// A decode without its prefill is refused.
	r := do(t, "POST", dec.URL()+"/v1/completions", map[string]any{"prompt": prompt})
	if r.status != 400 || !strings.Contains(string(r.body), "kv_transfer_params") {
		t.Fatalf("decode without prefill: %d %s", r.status, r.body)
	}
	// Prefill leg as the toy proxy sends it.
	r = do(t, "POST", pre.URL()+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 1, "stream": false,
		"kv_transfer_params": map[string]any{"do_remote_decode": true, "do_remote_prefill": false,
			"remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil}})
	cachedTokens(t, r)
	kvp, ok := r.json["kv_transfer_params"].(map[string]any)
	if !ok || kvp["do_remote_prefill"] != true || kvp["remote_host"] != "127.0.0.1" {
		t.Fatalf("prefill response %s", r.body)
	}
	// A decode leg for another prompt is refused.
	r = do(t, "POST", dec.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(2, 40), "kv_transfer_params": kvp})
	if r.status != 400 {
		t.Fatalf("mismatched decode: %d %s", r.status, r.body)
	}
	// The wrong-prompt attempt claimed the record: a real transfer is one-shot.
	r = do(t, "POST", pre.URL()+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 1,
		"kv_transfer_params": map[string]any{"do_remote_decode": true}})
	kvp = r.json["kv_transfer_params"].(map[string]any)
	r = do(t, "POST", dec.URL()+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 7, "stream": true, "kv_transfer_params": kvp})
	if evs := sseEvents(t, r.body); r.status != 200 || evs[len(evs)-1] != "[DONE]" || len(evs) != 8 {
		t.Fatalf("decode leg: %d %q", r.status, evs)
	}
	// Replaying the same params fails: the transfer was consumed.
	r = do(t, "POST", dec.URL()+"/v1/completions", map[string]any{"prompt": prompt, "kv_transfer_params": kvp})
	if r.status != 400 {
		t.Fatalf("second decode with the same params: %d", r.status)
	}
	if s := dec.Stats(); s.BlocksUsed != 2 {
		t.Fatalf("decode cache %+v", s)
	}
}

func TestSGLangPrefillDecodeConcurrent(t *testing.T) {
	pre := startEngine(t, Config{Engine: EngineSGLang, Role: RolePrefill}, Deps{})
	dec := startEngine(t, Config{Engine: EngineSGLang, Role: RoleDecode, PDTimeout: time.Minute}, Deps{})
	// A second decode engine gives up quickly, for the refusal cases.
	impatient := startEngine(t, Config{Engine: EngineSGLang, Role: RoleDecode, PDTimeout: 200 * time.Millisecond}, Deps{})
	info := do(t, "GET", pre.URL()+"/get_server_info", nil)
	bport, _ := info.json["disaggregation_bootstrap_port"].(json.Number).Int64()
	if bport == 0 || info.json["disaggregation_mode"] != "prefill" {
		t.Fatalf("server info %s", info.body)
	}
	body := map[string]any{"prompt": seqTokens(1, 40), "max_tokens": 5,
		"bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": uint64(1) << 62}
	// Decode first, prefill second: the decode leg waits for its room.
	var wg sync.WaitGroup
	var decRes httpResult
	wg.Add(1)
	go func() { defer wg.Done(); decRes = do(t, "POST", dec.URL()+"/v1/completions", body) }()
	time.Sleep(20 * time.Millisecond)
	preRes := do(t, "POST", pre.URL()+"/v1/completions", body)
	wg.Wait()
	cachedTokens(t, preRes)
	if cachedTokens(t, decRes); decRes.json["usage"].(map[string]any)["completion_tokens"].(json.Number).String() != "5" {
		t.Fatalf("decode %s", decRes.body)
	}
	// Without the bootstrap fields, or with a room nobody prefilled.
	if r := do(t, "POST", dec.URL()+"/v1/completions", map[string]any{"prompt": "hi"}); r.status != 400 {
		t.Fatalf("decode without bootstrap: %d", r.status)
	}
	body["bootstrap_room"] = 12345
	if r := do(t, "POST", impatient.URL()+"/v1/completions", body); r.status != 400 || !strings.Contains(string(r.body), "12345") {
		t.Fatalf("decode without prefill leg: %d %s", r.status, r.body)
	}
	if r := do(t, "POST", pre.URL()+"/v1/completions", map[string]any{"prompt": "hi"}); r.status != 400 {
		t.Fatalf("prefill without room: %d", r.status)
	}
}

func TestTRTLLMContextGeneration(t *testing.T) {
	ctxS := startEngine(t, Config{Engine: EngineTRTLLM, Role: RolePrefill}, Deps{})
	gen := startEngine(t, Config{Engine: EngineTRTLLM, Role: RoleDecode}, Deps{})
	prompt := seqTokens(1, 70)
	if r := do(t, "POST", gen.URL()+"/v1/completions", map[string]any{"prompt": prompt}); r.status != 400 {
		t.Fatalf("generation without context: %d", r.status)
	}
	r := do(t, "POST", ctxS.URL()+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 1, "stream": false,
		"disaggregated_params": map[string]any{"request_type": "context_only"}})
	cachedTokens(t, r)
	ch := r.json["choices"].([]any)[0].(map[string]any)
	dp, ok := ch["disaggregated_params"].(map[string]any)
	if !ok || dp["request_type"] != "context_only" || dp["encoded_opaque_state"] == "" {
		t.Fatalf("context response %s", r.body)
	}
	dp["request_type"] = "generation_only"
	r = do(t, "POST", gen.URL()+"/v1/chat/completions", map[string]any{"messages": []any{map[string]any{"role": "user", "content": "x"}},
		"disaggregated_params": dp})
	if r.status != 400 {
		t.Fatalf("generation for another prompt: %d %s", r.status, r.body)
	}
	r = do(t, "POST", ctxS.URL()+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 1,
		"disaggregated_params": map[string]any{"request_type": "context_only"}})
	dp = r.json["choices"].([]any)[0].(map[string]any)["disaggregated_params"].(map[string]any)
	dp["request_type"] = "generation_only"
	r = do(t, "POST", gen.URL()+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 3, "disaggregated_params": dp})
	cachedTokens(t, r)
	dp["encoded_opaque_state"] = "!!"
	if r := do(t, "POST", gen.URL()+"/v1/completions", map[string]any{"prompt": prompt, "disaggregated_params": dp}); r.status != 400 {
		t.Fatalf("bad opaque state: %d", r.status)
	}
}

func TestFaultDropReorderReplayRestart(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineVLLM, Faults: Faults{DropBatches: 1}}, Deps{})
	sub := subscribe(t, e, 0, "")
	post := func(i int) {
		cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1000*i+1, 16)}))
	}
	seqOf := func(m zmq4.Msg) uint64 { return binary.BigEndian.Uint64(m.Frames[1]) }
	post(1) // seq 0, dropped
	post(2) // seq 1
	if s := seqOf(sub.next(t)); s != 1 {
		t.Fatalf("first delivered seq %d, want 1 after a drop", s)
	}
	// The gap is repairable through replay.
	if got := replay(t, e.ReplayPorts()[0], 0); len(got) != 3 || binary.BigEndian.Uint64(got[0][1]) != 0 {
		t.Fatalf("replay after drop: %d replies", len(got))
	}
	r := do(t, "POST", e.URL()+"/sim/fault", map[string]any{"reorder_batches": 1, "reorder_hold_ms": 600000})
	if r.status != 200 {
		t.Fatalf("fault: %d %s", r.status, r.body)
	}
	post(3) // seq 2, held
	post(4) // seq 3, sent before 2
	if a, b := seqOf(sub.next(t)), seqOf(sub.next(t)); a != 3 || b != 2 {
		t.Fatalf("reordered seqs %d,%d want 3,2", a, b)
	}
	r = do(t, "POST", e.URL()+"/sim/fault", map[string]any{"restart": true})
	if r.status != 200 {
		t.Fatal(r.status)
	}
	m := sub.next(t)
	b := decodeBatch(t, m.Frames[2])
	if seqOf(m) != 0 || len(b.events) != 1 || evType(b.events[0]) != "AllBlocksCleared" {
		t.Fatalf("restart batch seq %d %v", seqOf(m), b.events)
	}
	if e.Stats().BlocksUsed != 0 {
		t.Fatal("cache survived restart")
	}
	post(3)
	if s := seqOf(sub.next(t)); s != 1 {
		t.Fatalf("seq after restart %d, want 1", s)
	}
	if s := e.Stats().Ranks[0]; s.Dropped != 1 || s.Reordered != 1 {
		t.Fatalf("fault counters %+v", s)
	}
	if r := do(t, "POST", e.URL()+"/sim/fault", map[string]any{"drop_prob": 2}); r.status != 400 {
		t.Fatalf("invalid fault accepted: %d", r.status)
	}
	if r := do(t, "POST", e.URL()+"/sim/fault", map[string]any{"bogus": 1}); r.status != 400 {
		t.Fatalf("unknown fault field accepted: %d", r.status)
	}
}

func TestFaultDropProbability(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineVLLM, Faults: Faults{DropProb: 1}}, Deps{})
	sub := subscribe(t, e, 0, "")
	cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1, 16)}))
	waitFor(t, "drop", func() bool { return e.Stats().Ranks[0].Dropped == 1 })
	do(t, "POST", e.URL()+"/sim/fault", map[string]any{"clear": true})
	cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(100, 16)}))
	if s := binary.BigEndian.Uint64(sub.next(t).Frames[1]); s != 1 {
		t.Fatalf("seq %d", s)
	}
}

func TestFaultRequestFailures(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineSGLang}, Deps{})
	do(t, "POST", e.URL()+"/sim/fault", map[string]any{"fail_requests": 2, "fail_status": 503})
	for i := 0; i < 2; i++ {
		if r := do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": "hi"}); r.status != 503 || r.json["object"] != "error" {
			t.Fatalf("injected failure %d: %d %s", i, r.status, r.body)
		}
	}
	cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": "hi"}))

	do(t, "POST", e.URL()+"/sim/fault", map[string]any{"health_fail": true})
	if r := do(t, "GET", e.URL()+"/health", nil); r.status != 503 {
		t.Fatalf("health %d", r.status)
	}
	do(t, "POST", e.URL()+"/sim/fault", map[string]any{"clear": true})
	if r := do(t, "GET", e.URL()+"/health", nil); r.status != 200 {
		t.Fatalf("health %d", r.status)
	}

	// close mid-stream: the stream ends without [DONE] and with a read error.
	do(t, "POST", e.URL()+"/sim/fault", map[string]any{"close_mid_stream": 1})
	resp, err := http.Post(e.URL()+"/v1/completions", "application/json",
		strings.NewReader(`{"prompt": "hello there", "stream": true, "max_tokens": 10}`))
	if err != nil {
		t.Fatal(err)
	}
	body, rerr := io.ReadAll(resp.Body)
	resp.Body.Close()
	if rerr == nil || strings.Contains(string(body), "[DONE]") || !strings.Contains(string(body), "data: ") {
		t.Fatalf("close mid-stream: err %v body %q", rerr, body)
	}
	if _, err := http.Post(e.URL()+"/v1/completions", "application/json", strings.NewReader(`{"prompt": "x"}`)); err != nil {
		t.Fatalf("fault did not clear after one response: %v", err)
	}

	// stall: a client with a short deadline gives up while the request is held.
	do(t, "POST", e.URL()+"/sim/fault", map[string]any{"stall_ms": 60000})
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", e.URL()+"/v1/completions", strings.NewReader(`{"prompt":"x"}`))
	if _, err := http.DefaultClient.Do(req); err == nil {
		t.Fatal("stalled request completed")
	}
	do(t, "POST", e.URL()+"/sim/fault", map[string]any{"clear": true})
}

func TestTRTFaultDropAndRestart(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineTRTLLM, BlockSize: 16}, Deps{})
	do(t, "POST", e.URL()+"/kv_cache_events", nil)
	do(t, "POST", e.URL()+"/sim/fault", map[string]any{"drop_batches": 1})
	cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(1, 16)}))
	cachedTokens(t, do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": seqTokens(100, 16)}))
	var evs []trtEvent
	json.Unmarshal(do(t, "POST", e.URL()+"/kv_cache_events", nil).body, &evs)
	if len(evs) != 1 || evs[0].EventID != 2 {
		t.Fatalf("after a dropped batch: %+v (want only event_id 2)", evs)
	}
	do(t, "POST", e.URL()+"/sim/fault", map[string]any{"restart": true})
	json.Unmarshal(do(t, "POST", e.URL()+"/kv_cache_events", nil).body, &evs)
	if len(evs) != 1 || evs[0].EventID != 0 {
		t.Fatalf("after restart: %+v", evs)
	}
}

func TestQueueBoundAndTimeModel(t *testing.T) {
	// One slot, no queue: a second request while the first decodes is refused.
	e := startEngine(t, Config{Engine: EngineVLLM, MaxRunning: 1, MaxQueue: 1, DecodeUsPerToken: 1e6, TimeScale: 1, TimeScaleSet: true}, Deps{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		req, _ := http.NewRequestWithContext(ctx, "POST", e.URL()+"/v1/completions", strings.NewReader(`{"prompt":"a","max_tokens":100}`))
		http.DefaultClient.Do(req)
	}()
	waitFor(t, "running", func() bool { return e.Stats().Running == 1 })
	go func() {
		req, _ := http.NewRequestWithContext(ctx, "POST", e.URL()+"/v1/completions", strings.NewReader(`{"prompt":"b","max_tokens":100}`))
		http.DefaultClient.Do(req)
	}()
	waitFor(t, "waiting", func() bool { return e.Stats().Waiting == 1 })
	if r := do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": "c"}); r.status != 503 {
		t.Fatalf("over queue bound: %d", r.status)
	}
	m := do(t, "GET", e.URL()+"/metrics", nil)
	if !strings.Contains(string(m.body), `vllm:num_requests_waiting{engine="0",model_name="sim-model"} 1`) {
		t.Fatalf("metrics:\n%s", m.body)
	}
}

// TestResetRequestsFault: the request is read whole, then the connection
// is reset with no answer; the fault counts down.
func TestResetRequestsFault(t *testing.T) {
	e := startEngine(t, Config{Engine: "vllm", Listen: "127.0.0.1:0", ZMQPort: -1}, Deps{})
	do(t, "POST", e.URL()+"/sim/fault", map[string]any{"reset_requests": 1})
	_, err := http.Post(e.URL()+"/v1/completions", "application/json", strings.NewReader(`{"prompt": "hello", "max_tokens": 2}`))
	if err == nil || !strings.Contains(err.Error(), "reset") && !strings.Contains(err.Error(), "EOF") {
		t.Fatalf("reset fault: err %v, want a connection reset", err)
	}
	if r := do(t, "POST", e.URL()+"/v1/completions", map[string]any{"prompt": "hello", "max_tokens": 2}); r.status != 200 {
		t.Fatalf("fault did not clear after one request: %d", r.status)
	}
}

// TestVLLMNIXLSideChannel: with NIXLSidePort the prefill engine names its
// side channel, not its HTTP port, in remote_port, and a decode leg sent to
// the HTTP port (a gateway with nixl_port 0) fails the transfer.
func TestVLLMNIXLSideChannel(t *testing.T) {
	pre := startEngine(t, Config{Engine: EngineVLLM, Role: RolePrefill, NIXLSidePort: -1}, Deps{})
	dec := startEngine(t, Config{Engine: EngineVLLM, Role: RoleDecode, PDTimeout: time.Second}, Deps{})
	side, httpPort := pre.NIXLSidePort(), tcpPort(pre.ln.Addr())
	if side == 0 || side == httpPort {
		t.Fatalf("side channel %d, HTTP %d", side, httpPort)
	}
	prompt := seqTokens(1, 40)
	prefill := func() map[string]any {
		r := do(t, "POST", pre.URL()+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 1,
			"kv_transfer_params": map[string]any{"do_remote_decode": true}})
		kvp, _ := r.json["kv_transfer_params"].(map[string]any)
		if p, _ := kvp["remote_port"].(json.Number).Int64(); int(p) != side {
			t.Fatalf("remote_port %v, want the side channel %d", kvp["remote_port"], side)
		}
		return kvp
	}
	kvp := prefill()
	kvp["remote_port"] = httpPort // what nixl_port 0 does
	if r := do(t, "POST", dec.URL()+"/v1/completions", map[string]any{"prompt": prompt, "kv_transfer_params": kvp}); r.status == 200 {
		t.Fatalf("a decode leg pointed at the HTTP port succeeded: %s", r.body)
	}
	kvp = prefill()
	if r := do(t, "POST", dec.URL()+"/v1/completions", map[string]any{"prompt": prompt, "kv_transfer_params": kvp}); r.status != 200 {
		t.Fatalf("decode leg on the side channel: %d %s", r.status, r.body)
	}
}
