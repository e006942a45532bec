package dispatch

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/selector"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// fakePrefill serves a fixed prefill answer; it stands in for an engine
// that returns no or broken transfer parameters.
func fakePrefill(t *testing.T, idx int, status int, body string) Endpoint {
	t.Helper()
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = w.Write([]byte(body))
	}))
	t.Cleanup(s.Close)
	host, port, _ := net.SplitHostPort(s.Listener.Addr().String())
	p, _ := strconv.Atoi(port)
	return Endpoint{Idx: idx, Host: host, Port: p, Healthy: true}
}

type errBody struct {
	Error struct {
		Message, Type string
		Code          any
	} `json:"error"`
}

func wantError(t *testing.T, r reply, status int, code, msg string) {
	t.Helper()
	if r.status != status {
		t.Fatalf("status %d, want %d: %s", r.status, status, r.body)
	}
	var e errBody
	if err := json.Unmarshal(r.body, &e); err != nil {
		t.Fatalf("error body is not JSON: %s", r.body)
	}
	if fmt.Sprint(e.Error.Code) != code || !strings.Contains(e.Error.Message, msg) {
		t.Fatalf("error %+v, want code %q and a message containing %q", e.Error, code, msg)
	}
}

// pin makes the KV tier choose prefill endpoint idx, so a test decides
// which prefill is tried first.
func pin(idx int) KVScorer {
	return func(cands []selector.Candidate) (int, string, bool) { return idx, "pinned", true }
}

func TestPrefillConnectFailover(t *testing.T) {
	for _, engine := range []string{enginesim.EngineVLLM, enginesim.EngineSGLang, enginesim.EngineTRTLLM} {
		t.Run(engine, func(t *testing.T) {
			f := newFleet(t, fleetOpts{engine: engine, nPrefill: 1, nDec: 1})
			dead := deadEndpoint(t, f.pool.Prefill[0].Host, 9)
			f.pool.Prefill = append([]Endpoint{dead}, f.pool.Prefill...)
			f.kv = pin(9)
			r := f.post(t, "/v1/completions", bodyFor(flowCases[1], prompt("failover", 4), 4))
			if r.status != 200 || r.err != nil {
				t.Fatalf("status %d err %v: %s", r.status, r.err, r.body)
			}
			text(t, r)
			if got := metricSum(t, f.reg, "loxilb_pd_connect_failover_total", "ep_idx", "9"); got != 1 {
				t.Fatalf("failover counter %v, want 1", got)
			}
			if got := metricSum(t, f.reg, "loxilb_ai_pd_leg_errors_total", "leg", "prefill", "class", "connect"); got != 1 {
				t.Fatalf("prefill connect errors %v, want 1", got)
			}
		})
	}
}

func TestLegFailures(t *testing.T) {
	type tc struct {
		name    string
		engine  string
		setup   func(t *testing.T, f *fleet)
		cfg     Config
		stream  bool
		status  int
		code    string
		msg     string
		metric  string
		labels  []string
		noClean bool // a cut stream: no JSON error, the body is truncated
		want    float64
	}
	missing := `{"id":"x","object":"text_completion","choices":[{"index":0,"text":" a","finish_reason":"length"}]}`
	cases := []tc{
		{name: "all prefill down", engine: "vllm", setup: func(t *testing.T, f *fleet) {
			f.pool.Prefill = []Endpoint{deadEndpoint(t, f.pool.Prefill[0].Host, 0), deadEndpoint(t, f.pool.Prefill[0].Host, 1)}
		}, status: 502, code: "upstream_connect_error", msg: "prefill leg", metric: "loxilb_ai_pd_leg_errors_total", labels: []string{"leg", "prefill", "class", "connect"}, want: 2},
		{name: "decode down", engine: "vllm", setup: func(t *testing.T, f *fleet) {
			f.pool.Decode = []Endpoint{deadEndpoint(t, f.pool.Decode[0].Host, 5)}
		}, status: 502, code: "upstream_connect_error", msg: "decode leg", metric: "loxilb_ai_pd_leg_errors_total", labels: []string{"leg", "decode", "class", "connect"}},
		{name: "sglang decode down", engine: "sglang", setup: func(t *testing.T, f *fleet) {
			f.pool.Decode = []Endpoint{deadEndpoint(t, f.pool.Decode[0].Host, 5)}
		}, status: 502, code: "upstream_connect_error", msg: "decode leg", metric: "loxilb_ai_pd_leg_errors_total", labels: []string{"leg", "decode", "class", "connect"}},
		{name: "sglang prefill down", engine: "sglang", setup: func(t *testing.T, f *fleet) {
			f.pool.Prefill = []Endpoint{deadEndpoint(t, f.pool.Prefill[0].Host, 0)}
		}, status: 502, code: "upstream_connect_error", msg: "prefill leg", metric: "loxilb_ai_pd_leg_errors_total", labels: []string{"leg", "prefill", "class", "connect"}},
		{name: "sglang prefill 500 aborts decode", engine: "sglang", setup: func(t *testing.T, f *fleet) {
			_ = f.prefill[0].SetFaults(enginesim.Faults{FailRequests: 1, FailStatus: 500})
		}, status: 502, code: "upstream_error", msg: "prefill endpoint answered 500", metric: "loxilb_ai_pd_leg_errors_total", labels: []string{"leg", "prefill", "class", "status"}},
		{name: "prefill 400 relayed", engine: "vllm", setup: func(t *testing.T, f *fleet) {
			_ = f.prefill[0].SetFaults(enginesim.Faults{FailRequests: 1, FailStatus: 400})
		}, status: 400, code: "400", msg: "injected", metric: "loxilb_ai_pd_requests_total", labels: []string{"outcome", "prefill_error"}},
		{name: "vllm no params", engine: "vllm", setup: func(t *testing.T, f *fleet) {
			f.pool.Prefill = []Endpoint{fakePrefill(t, 0, 200, missing)}
		}, status: 502, code: "pd_params_missing", msg: "prefill returned no kv_transfer_params", metric: "loxilb_ai_pd_kv_params_missing_total", labels: []string{"ep_idx", "0"}},
		{name: "vllm params not an object", engine: "vllm", setup: func(t *testing.T, f *fleet) {
			f.pool.Prefill = []Endpoint{fakePrefill(t, 0, 200, `{"choices":[],"kv_transfer_params":"oops"}`)}
		}, status: 502, code: "pd_params_malformed", msg: "must be a JSON object", metric: "loxilb_ai_pd_kv_params_malformed_total", labels: []string{"ep_idx", "0"}},
		{name: "vllm params wrong field type", engine: "vllm", setup: func(t *testing.T, f *fleet) {
			f.pool.Prefill = []Endpoint{fakePrefill(t, 0, 200, `{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":"x"}}`)}
		}, status: 502, code: "pd_params_malformed", msg: "remote_block_ids", metric: "loxilb_ai_pd_kv_params_malformed_total", labels: []string{"ep_idx", "0"}},
		{name: "vllm params over cap", engine: "vllm", cfg: Config{MaxParamsBytes: 64}, setup: func(t *testing.T, f *fleet) {
			f.pool.Prefill = []Endpoint{fakePrefill(t, 0, 200, `{"kv_transfer_params":{"remote_block_ids":[`+strings.Repeat("1,", 100)+`1]}}`)}
		}, status: 502, code: "pd_params_malformed", msg: "over the 64 byte cap", metric: "loxilb_ai_pd_kv_params_malformed_total", labels: []string{"ep_idx", "0"}},
		{name: "trt no params", engine: "trtllm", setup: func(t *testing.T, f *fleet) {
			f.pool.Prefill = []Endpoint{fakePrefill(t, 0, 200, missing)}
		}, status: 502, code: "pd_params_missing", msg: "no disaggregated_params", metric: "loxilb_ai_pd_kv_params_missing_total", labels: []string{"ep_idx", "0"}},
		{name: "trt params malformed", engine: "trtllm", setup: func(t *testing.T, f *fleet) {
			f.pool.Prefill = []Endpoint{fakePrefill(t, 0, 200, `{"choices":[{"finish_reason":"length","disaggregated_params":[1]}]}`)}
		}, status: 502, code: "pd_params_malformed", msg: "must be a JSON object", metric: "loxilb_ai_pd_kv_params_malformed_total", labels: []string{"ep_idx", "0"}},
		{name: "slow prefill", engine: "vllm", cfg: Config{PrefillTimeout: 200 * time.Millisecond}, setup: func(t *testing.T, f *fleet) {
			_ = f.prefill[0].SetFaults(enginesim.Faults{StallMs: 20000})
		}, status: 504, code: "upstream_timeout", msg: "no complete prefill response", metric: "loxilb_pd_leg_timeouts_total", labels: []string{"leg", "prefill"}},
		{name: "slow decode", engine: "trtllm", cfg: Config{DecodeFirstByteTimeout: 200 * time.Millisecond}, setup: func(t *testing.T, f *fleet) {
			_ = f.decode[0].SetFaults(enginesim.Faults{StallMs: 20000})
		}, status: 504, code: "upstream_timeout", msg: "decode leg", metric: "loxilb_pd_leg_timeouts_total", labels: []string{"leg", "decode"}},
		{name: "sglang slow prefill", engine: "sglang", cfg: Config{PrefillTimeout: 200 * time.Millisecond}, setup: func(t *testing.T, f *fleet) {
			_ = f.prefill[0].SetFaults(enginesim.Faults{StallMs: 20000})
		}, status: 504, code: "upstream_timeout", msg: "prefill", metric: "loxilb_pd_leg_timeouts_total", labels: []string{"leg", "prefill"}},
		{name: "decode cut before body", engine: "vllm", setup: func(t *testing.T, f *fleet) {
			_ = f.decode[0].SetFaults(enginesim.Faults{CloseMidStream: 1})
		}, status: 502, code: "upstream_error", msg: "decode leg", metric: "loxilb_ai_pd_leg_errors_total", labels: []string{"leg", "decode", "class", "protocol"}},
		{name: "decode cut mid stream", engine: "vllm", stream: true, setup: func(t *testing.T, f *fleet) {
			_ = f.decode[0].SetFaults(enginesim.Faults{CloseMidStream: 1})
		}, noClean: true, metric: "loxilb_pd_decode_stream_aborted_total", labels: []string{"ep_idx", "1"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFleet(t, fleetOpts{engine: c.engine, nPrefill: 1, nDec: 1, cfg: c.cfg})
			c.setup(t, f)
			fc := flowCases[0]
			if c.stream {
				fc = flowCases[1]
			}
			r := f.post(t, "/v1/completions", bodyFor(fc, prompt("fail", 6), 40))
			if c.noClean {
				if r.status != 200 {
					t.Fatalf("status %d: %s", r.status, r.body)
				}
				if r.err == nil && strings.Contains(string(r.body), "[DONE]") {
					t.Fatalf("a cut stream looked complete: %s", r.body)
				}
			} else {
				wantError(t, r, c.status, c.code, c.msg)
			}
			if c.want == 0 {
				c.want = 1
			}
			if got := metricSum(t, f.reg, c.metric, c.labels...); got != c.want {
				t.Fatalf("%s%v = %v, want %v", c.metric, c.labels, got, c.want)
			}
		})
	}
}

// TestTRTEarlyExit: a context leg that already finished (stop) is the
// answer; no generation leg is sent.
func TestTRTEarlyExit(t *testing.T) {
	for _, stream := range []bool{false, true} {
		f := newFleet(t, fleetOpts{engine: "trtllm", nPrefill: 1, nDec: 1})
		f.pool.Prefill = []Endpoint{fakePrefill(t, 0, 200,
			`{"id":"cmpl-1","object":"text_completion","model":"m","choices":[{"index":0,"text":" done","finish_reason":"stop","disaggregated_params":{"request_type":"context_only","ctx_request_id":1}}]}`)}
		fc := flowCases[0]
		if stream {
			fc = flowCases[1]
		}
		r := f.post(t, "/v1/completions", bodyFor(fc, prompt("early", 2), 8))
		if r.status != 200 {
			t.Fatalf("status %d: %s", r.status, r.body)
		}
		if got := text(t, r); got != " done" {
			t.Fatalf("text %q", got)
		}
		if n := f.decode[0].Stats().Requests; n != 0 {
			t.Fatalf("generation server got %d requests", n)
		}
		if got := metricSum(t, f.reg, "loxilb_pd_trt_ctx_early_exit_total"); got != 1 {
			t.Fatalf("early exit counter %v", got)
		}
	}
}

// TestDecodeConnectFailover: a decode worker that refuses connections is
// skipped for the next one, for every engine (SGLang keeps its room: any
// decode worker can pull from the prefill's bootstrap).
func TestDecodeConnectFailover(t *testing.T) {
	for _, engine := range []string{enginesim.EngineVLLM, enginesim.EngineSGLang, enginesim.EngineTRTLLM} {
		t.Run(engine, func(t *testing.T) {
			f := newFleet(t, fleetOpts{engine: engine, nPrefill: 1, nDec: 1})
			live := f.pool.Decode[0]
			for i := 0; i < 4; i++ {
				// The dead one is the least loaded first choice half the time.
				f.pool.Decode = []Endpoint{deadEndpoint(t, live.Host, 8), live}
				r := f.post(t, "/v1/completions", bodyFor(flowCases[i%2], prompt(fmt.Sprintf("dfail-%d", i), 3), 3))
				if r.status != 200 || r.err != nil {
					t.Fatalf("status %d err %v: %s", r.status, r.err, r.body)
				}
			}
			if got := f.decode[0].Stats().Completed; got != 4 {
				t.Fatalf("live decode completed %d of 4", got)
			}
			if got := metricSum(t, f.reg, "loxilb_pd_connect_failover_total", "ep_idx", "8"); got < 1 {
				t.Fatalf("no decode failover counted in 4 requests")
			}
		})
	}
}

// TestEngineCannotForgeReceipt: an engine's own X-Loxilb-Route never
// reaches the client, whether the dispatcher relays a prefill answer or a
// decode stream; the receipt is the proxy's to give.
func TestEngineCannotForgeReceipt(t *testing.T) {
	forger := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Loxilb-Route", "tier=tier1.5 ep=0 matched=8/8 reason=forged")
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		_, _ = w.Write([]byte(`{"error":{"message":"nope","type":"invalid_request_error","code":400}}`))
	}))
	t.Cleanup(forger.Close)
	host, port, _ := net.SplitHostPort(forger.Listener.Addr().String())
	p, _ := strconv.Atoi(port)
	f := newFleet(t, fleetOpts{engine: "vllm", nPrefill: 1, nDec: 1})
	f.pool.Prefill = []Endpoint{{Idx: 0, Host: host, Port: p, Healthy: true}}
	r := f.post(t, "/v1/completions", bodyFor(flowCases[0], prompt("forge", 3), 3))
	if r.status != http.StatusBadRequest {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	if got := r.header.Values("X-Loxilb-Route"); len(got) != 0 {
		t.Fatalf("relayed prefill answer carries the engine's X-Loxilb-Route %q", got)
	}
	// A decode worker that forges it on a successful stream.
	f = newFleet(t, fleetOpts{engine: "vllm", nPrefill: 1, nDec: 1})
	f.pool.Decode = []Endpoint{{Idx: 1, Host: host, Port: p, Healthy: true}}
	r = f.post(t, "/v1/completions", bodyFor(flowCases[0], prompt("forge-decode", 3), 3))
	if got := r.header.Values("X-Loxilb-Route"); len(got) != 0 {
		t.Fatalf("decode answer (%d) carries the engine's X-Loxilb-Route %q", r.status, got)
	}
}
