package dispatch

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/enginesim"
	"github.com/loxilb-llm/loxilb/testbed/wait"
)

// TestConfigDefaults: zero fields take the documented defaults; a
// negative queue depth is "no waiting".
func TestConfigDefaults(t *testing.T) {
	c := Config{PrefillTimeout: 2500 * time.Millisecond, QueueDepthPerEP: -1}.WithDefaults()
	if c.PrefillTimeout != 2500*time.Millisecond || c.QueueDepthPerEP != 0 || c.MaxPark != 5*time.Second {
		t.Fatalf("config %+v", c)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if c := (Config{}).WithDefaults(); c.QueueDepthPerEP != 16 || c.DecodeFirstByteTimeout != 60*time.Second {
		t.Fatalf("defaults %+v", c)
	}
	if _, err := New(Config{QueueDepthPerEP: 65}, nil, nil); err == nil {
		t.Fatal("queue depth 65 accepted")
	}
}

func TestSessionsBoundAndTTL(t *testing.T) {
	now := time.Unix(1000, 0)
	s := newSessions(time.Minute, 3, func() time.Time { return now })
	for i := 0; i < 5; i++ {
		s.put(1, fmt.Sprint(i), i, 10+i)
	}
	if s.len() != 3 {
		t.Fatalf("len %d, want the bound 3", s.len())
	}
	if _, _, ok := s.get(1, "0"); ok {
		t.Fatal("oldest session survived the bound")
	}
	if p, d, ok := s.get(1, "4"); !ok || p != 4 || d != 14 {
		t.Fatalf("session 4: %d %d %v", p, d, ok)
	}
	if _, _, ok := s.get(2, "4"); ok {
		t.Fatal("sessions leak across services")
	}
	now = now.Add(2 * time.Minute)
	if _, _, ok := s.get(1, "4"); ok {
		t.Fatal("expired session returned")
	}
	s.put(1, "x", 0, 0)
	if s.len() != 1 {
		t.Fatalf("expired entries not swept: len %d", s.len())
	}
	s.forget(1)
	if s.len() != 0 {
		t.Fatal("forget left entries")
	}
}

func TestPrefixIndexBound(t *testing.T) {
	p := newPrefixIndex(100)
	keys := func(base, n int) []uint64 {
		out := make([]uint64, n)
		for i := range out {
			out[i] = uint64(base + i)
		}
		return out
	}
	p.insert(1, keys(0, 60), 2)
	if ep, depth := p.match(1, keys(0, 80)); ep != 2 || depth != 60 {
		t.Fatalf("match %d/%d", ep, depth)
	}
	p.insert(1, keys(1000, 60), 3) // evicts the 20 oldest of the first prefix
	if p.keys() != 100 {
		t.Fatalf("keys %d, want the bound 100", p.keys())
	}
	if _, depth := p.match(1, keys(0, 60)); depth != 0 {
		t.Fatalf("the evicted head still matches %d keys", depth)
	}
	if ep, depth := p.match(1, keys(1000, 60)); ep != 3 || depth != 60 {
		t.Fatalf("second prefix %d/%d", ep, depth)
	}
	for i := 0; i < 50; i++ { // many rounds keep the bound
		p.insert(1, keys(5000+i*7, 30), i%4)
	}
	if p.keys() != 100 {
		t.Fatalf("keys %d after churn", p.keys())
	}
	p.forget(1)
	if p.keys() != 0 {
		t.Fatal("forget left keys")
	}
}

func TestSGLangBody(t *testing.T) {
	m, _ := parseBody([]byte(`{"text":["a","b","c"],"sampling_params":{}}`))
	var out struct {
		Host []string `json:"bootstrap_host"`
		Port []int    `json:"bootstrap_port"`
		Room []uint64 `json:"bootstrap_room"`
	}
	if err := json.Unmarshal(sglangBody(m, "10.1.1.1", 8998, 1<<63-1), &out); err != nil {
		t.Fatal(err)
	}
	if len(out.Host) != 3 || out.Port[2] != 8998 || out.Room[0] != 1<<63-1 || out.Room[1] != 0 {
		t.Fatalf("batched bootstrap fields %+v", out)
	}
	m, _ = parseBody([]byte(`{"prompt":[1,2,3]}`))
	var one struct {
		Room uint64 `json:"bootstrap_room"`
	}
	if err := json.Unmarshal(sglangBody(m, "h", 1, 42), &one); err != nil || one.Room != 42 {
		t.Fatalf("token-id prompt is one request: %v %+v", err, one)
	}
}

func TestVLLMPrefillBody(t *testing.T) {
	m, _ := parseBody([]byte(`{"model":"m","messages":[],"stream":true,"stream_options":{"include_usage":true},"max_tokens":50,"max_completion_tokens":50,"min_tokens":5}`))
	var p map[string]any
	if err := json.Unmarshal(vllmPrefillBody(m), &p); err != nil {
		t.Fatal(err)
	}
	kv := p["kv_transfer_params"].(map[string]any)
	if p["stream"] != false || p["max_tokens"] != 1.0 || p["max_completion_tokens"] != 1.0 || p["stream_options"] != nil ||
		p["min_tokens"] != nil || kv["do_remote_decode"] != true || kv["do_remote_prefill"] != false {
		t.Fatalf("prefill body %v", p)
	}
	if _, ok := m["min_tokens"]; !ok {
		t.Fatal("the original body was modified")
	}
	params, reported, err := vllmParams([]byte(`{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1],"remote_engine_id":"e","remote_host":"10.9.9.9","remote_port":5600,"tp_size":1,"future_key":{"x":1}}}`),
		Endpoint{Host: "127.0.0.9", Port: 8000, NixlPort: 5601}, 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	_ = json.Unmarshal(params, &got)
	if got["remote_host"] != "127.0.0.9" || got["remote_port"] != 5601.0 || got["future_key"] == nil || got["tp_size"] != 1.0 {
		t.Fatalf("decode params %v", got)
	}
	if reported != 5600 {
		t.Fatalf("reported side channel %d, want the engine's 5600", reported)
	}
	params, _, _ = vllmParams([]byte(`{"kv_transfer_params":{"remote_block_ids":[]}}`), Endpoint{Host: "h", Port: 8000}, 1<<16)
	_ = json.Unmarshal(params, &got)
	if got["remote_port"] != 8000.0 {
		t.Fatalf("nixl_port 0 must use the target port: %v", got)
	}
}

// TestDecodeStallMidStream: a decode leg that goes silent after its first
// bytes is cut after DecodeIdleTimeout; the client sees a truncated stream.
func TestDecodeStallMidStream(t *testing.T) {
	f := newFleet(t, fleetOpts{engine: "vllm", nPrefill: 1, nDec: 1, cfg: Config{DecodeIdleTimeout: 150 * time.Millisecond}})
	// A slow decode worker: the chat role chunk comes at once, every token
	// takes two seconds.
	slow := startEngine(t, enginesim.Config{Engine: "vllm", Role: enginesim.RoleDecode, Listen: f.pool.Decode[0].Host + ":0",
		DecodeUsPerToken: 2e6, TimeScale: 1, TimeScaleSet: true})
	f.pool.Decode = []Endpoint{endpointOf(t, slow, 5)}
	r := f.post(t, "/v1/chat/completions", bodyFor(flowCases[3], prompt("stall", 3), 4))
	if r.status != 200 || (r.err == nil && strings.Contains(string(r.body), "[DONE]")) {
		t.Fatalf("status %d err %v body %s", r.status, r.err, r.body)
	}
	if got := metricSum(t, f.reg, "loxilb_pd_leg_timeouts_total", "leg", "decode"); got != 1 {
		t.Fatalf("decode timeouts %v", got)
	}
	if got := metricSum(t, f.reg, "loxilb_pd_decode_stream_aborted_total"); got != 1 {
		t.Fatalf("stream aborted %v", got)
	}
}

// TestClientGoneCancelsLegs: a client that disconnects while the decode leg
// streams ends both the relay and the upstream request.
func TestClientGoneCancelsLegs(t *testing.T) {
	f := newFleet(t, fleetOpts{engine: "sglang", nPrefill: 1, nDec: 1})
	slow := startEngine(t, enginesim.Config{Engine: "sglang", Role: enginesim.RoleDecode, Listen: f.pool.Decode[0].Host + ":0",
		DecodeUsPerToken: 5e5, TimeScale: 1, TimeScaleSet: true})
	f.pool.Decode = []Endpoint{endpointOf(t, slow, 5)}
	ctx, cancel := context.WithCancel(context.Background())
	b, _ := json.Marshal(bodyFor(flowCases[1], prompt("gone", 3), 50))
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, f.srv.URL+"/v1/completions", strings.NewReader(string(b)))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	if _, err := resp.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	cancel()
	resp.Body.Close()
	wait.Eventually(t, "the dispatcher to notice the client left", func() bool {
		return metricSum(t, f.reg, "loxilb_ai_pd_requests_total", "outcome", "client_canceled") == 1
	})
	wait.Eventually(t, "the decode leg to stop after the client left", func() bool { return slow.Stats().Running == 0 })
	if errors.Is(ctx.Err(), context.Canceled) && f.d.InFlight(7, 5) != 0 {
		t.Fatal("decode slot not released")
	}
}

// TestNIXLSideChannel: a vLLM prefill engine whose side channel is not its
// HTTP port fails the decode leg under nixl_port 0 (the gateway names the
// HTTP port), the dispatcher remembers the remote_port the engine
// reported, and nixl_port set to it makes the transfer work.
func TestNIXLSideChannel(t *testing.T) {
	f := newFleet(t, fleetOpts{engine: enginesim.EngineVLLM, nPrefill: 1, nDec: 1, nixlSide: true})
	side := f.prefill[0].NIXLSidePort()
	body := map[string]any{"model": "sim-model", "prompt": "a prompt long enough to fill a couple of blocks of sixteen tokens each", "max_tokens": 3}
	if _, ok := f.d.SidePort(7, 0); ok {
		t.Fatal("a side port before any prefill")
	}
	if r := f.post(t, "/v1/completions", body); r.status == 200 {
		t.Fatalf("nixl_port 0 with a separate side channel succeeded: %s", r.body)
	}
	if got, ok := f.d.SidePort(7, 0); !ok || got != side || side == f.pool.Prefill[0].Port {
		t.Fatalf("reported side port %d %v, engine's %d, HTTP %d", got, ok, side, f.pool.Prefill[0].Port)
	}
	f.pool.Prefill[0].NixlPort = side
	if r := f.post(t, "/v1/completions", body); r.status != 200 {
		t.Fatalf("nixl_port %d: %d %s", side, r.status, r.body)
	}
	f.d.Forget(7)
	if _, ok := f.d.SidePort(7, 0); ok {
		t.Fatal("Forget kept the side port")
	}
}
