package api_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/api/client"
	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/store"
)

type fakeKV struct{}

func (fakeKV) Snapshot(uint32, int, int) ([]uint64, int) { return []uint64{1234567890123456789}, 42 }
func (fakeKV) Subscriber(uint32, int) (any, bool)        { return map[string]any{"connected": true}, true }

type fakePrefill struct{}

func (fakePrefill) PrefillBudget(_ uint32, ep int) (int, string) { return 8 + ep, "server_info" }

// newServer serves the API over a fresh store with the daemon's vLLM seed
// set to seed ("" is unset).
func newServer(t *testing.T, token, seed string) *httptest.Server {
	t.Helper()
	st, err := store.OpenBolt(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	settings := lbrule.Settings{VLLMSeed: seed}
	ctl := control.New(st, settings, nil)
	reg := prometheus.NewRegistry()
	reg.MustRegister(prometheus.NewCounter(prometheus.CounterOpts{Name: "loxilb_test_total", Help: "t"}))
	srv, err := api.New(api.Config{Token: token, Version: "test"}, api.Deps{Rules: ctl, KV: fakeKV{}, Prefill: fakePrefill{}, Gatherer: reg,
		RankLoad: func(_ uint32, ep int) []api.RankLoad {
			if ep != 1 {
				return nil
			}
			return []api.RankLoad{{Rank: 0, InFlight: 2, PlacedRecently: 5, Running: 1, Waiting: -1}, {Rank: 1, Running: -1, Waiting: -1}}
		},
		Capabilities: func() []api.Capability {
			c := api.Capability{Name: "kv_exact_vllm", Ready: true}
			if e := lbrule.SeedPrecondition(settings); e != nil {
				c.Ready, c.ReasonCode, c.Reason = false, e.Reason, e.Msg
			}
			return []api.Capability{c}
		}})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(ts.Close)
	return ts
}

func do(t *testing.T, ts *httptest.Server, method, path, body string, hdr ...string) (int, map[string]any) {
	t.Helper()
	req, _ := http.NewRequest(method, ts.URL+api.BasePath+path, strings.NewReader(body))
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var m map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&m)
	return resp.StatusCode, m
}

func readSeed(t *testing.T, name string) string {
	b, err := os.ReadFile("../pkg/lbrule/testdata/" + name)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestSpecBodiesAndReadBack(t *testing.T) {
	ts := newServer(t, "", "")
	vllm := readSeed(t, "seed_vllm_pd.json")
	code, body := do(t, ts, "POST", "/config/loadbalancer", vllm)
	if code != http.StatusPreconditionFailed || body["reason_code"] != "KV_EXACT_SEED_UNSET" {
		t.Fatalf("vLLM KV-exact without seed: %d %v", code, body)
	}
	_, caps := do(t, ts, "GET", "/status/capabilities", "")
	if c := caps["capabilities"].([]any)[0].(map[string]any); c["ready"] != false || c["reason_code"] != "KV_EXACT_SEED_UNSET" {
		t.Fatalf("capability should be not ready: %v", c)
	}
	ts = newServer(t, "", strings.Repeat("s", 24))
	if code, body = do(t, ts, "POST", "/config/loadbalancer", vllm); code != 412 || body["reason_code"] != "KV_EXACT_SEED_TOO_LONG" {
		t.Fatalf("too long: %d %v", code, body)
	}
	ts = newServer(t, "", "12345")
	if code, body = do(t, ts, "POST", "/config/loadbalancer", vllm); code != 200 || body["result"] != "Success" {
		t.Fatalf("with seed: %d %v", code, body)
	}
	_, caps = do(t, ts, "GET", "/status/capabilities", "")
	if c := caps["capabilities"].([]any)[0].(map[string]any); c["ready"] != true {
		t.Fatalf("capability should be ready: %v", c)
	}
	for _, f := range []string{"seed_sglang_single.json", "seed_sglang_ranks.json"} {
		if code, body = do(t, ts, "POST", "/config/loadbalancer", readSeed(t, f)); code != 200 {
			t.Fatalf("%s: %d %v", f, code, body)
		}
	}
	code, all := do(t, ts, "GET", "/config/loadbalancer/all", "")
	if code != 200 {
		t.Fatal(code)
	}
	rules := all["lbAttr"].([]any)
	if len(rules) != 3 {
		t.Fatalf("want 3 rules, got %d", len(rules))
	}
	sa := rules[0].(map[string]any)["serviceArguments"].(map[string]any)
	for k, want := range map[string]any{"kvExactMode": 1.0, "kvBlockSize": 16.0, "kvHashAlgo": "sha256_cbor", "kvZmqPort": 5557.0, "kvWarmupSec": 30.0, "pd_disagg_mode": true, "kvEngineType": "vllm"} {
		if sa[k] != want {
			t.Errorf("read-back %s = %v, want %v", k, sa[k], want)
		}
	}
	sg := rules[2].(map[string]any)["serviceArguments"].(map[string]any)
	if sg["kvEngineType"] != "sglang" || sg["kvDpRankCount"] != 3.0 || sg["kvHashAlgo"] != "sha256_sglang" {
		t.Errorf("sglang read-back: %v", sg)
	}
	// Duplicate and engine change are conflicts.
	if code, _ = do(t, ts, "POST", "/config/loadbalancer", readSeed(t, "seed_sglang_single.json")); code != 409 {
		t.Errorf("duplicate: %d", code)
	}
	changed := strings.Replace(readSeed(t, "seed_sglang_single.json"), `"kvEngineType": "sglang"`, `"kvEngineType": "trtllm"`, 1)
	changed = strings.Replace(changed, `"kvZmqPort": 5557,`, ``, 1)
	if code, body = do(t, ts, "POST", "/config/loadbalancer", changed); code != 409 || !strings.Contains(body["message"].(string), "delete and recreate") {
		t.Errorf("engine change: %d %v", code, body)
	}
	// Inventory.
	if code, body = do(t, ts, "GET", "/config/ai/kv/inventory?service_id=1&ep_idx=1", ""); code != 200 || body["total"] != 42.0 || body["hash_algo"] != "sha256_cbor" {
		t.Errorf("inventory: %d %v", code, body)
	}
	// The endpoint's prefill admission budget and where it was learned.
	if ps, _ := body["prefill_slots"].(map[string]any); ps["slots"] != 9.0 || ps["source"] != "server_info" {
		t.Errorf("inventory prefill_slots of ep 1: %v", body["prefill_slots"])
	}
	// The gateway's per-rank load of a rule whose requests name a rank.
	if rl, _ := body["rank_load"].([]any); len(rl) != 2 || rl[0].(map[string]any)["in_flight"] != 2.0 || rl[0].(map[string]any)["placed_recently"] != 5.0 || rl[1].(map[string]any)["running"] != -1.0 {
		t.Errorf("inventory rank_load of ep 1: %v", body["rank_load"])
	}
	for q, want := range map[string]int{"": 400, "?service_id=x&ep_idx=0": 400, "?service_id=1": 400, "?service_id=99&ep_idx=0": 404, "?service_id=1&ep_idx=6": 404, "?service_id=1&ep_idx=0&limit=-1": 400} {
		if code, _ = do(t, ts, "GET", "/config/ai/kv/inventory"+q, ""); code != want {
			t.Errorf("inventory%s: %d want %d", q, code, want)
		}
	}
	// Deletes.
	if code, _ = do(t, ts, "DELETE", "/config/loadbalancer/externalipaddress/127.0.0.254/port/8080/protocol/tcp", ""); code != 200 {
		t.Errorf("delete: %d", code)
	}
	if code, _ = do(t, ts, "DELETE", "/config/loadbalancer/externalipaddress/127.0.0.254/port/8080/protocol/tcp", ""); code != 404 {
		t.Errorf("delete again: %d", code)
	}
	if code, _ = do(t, ts, "DELETE", "/config/loadbalancer/externalipaddress/nonsense/port/8080/protocol/tcp", ""); code != 400 {
		t.Errorf("delete bad ip: %d", code)
	}
}

func TestRejectionStatuses(t *testing.T) {
	ts := newServer(t, "", "1")
	base := readSeed(t, "seed_sglang_single.json")
	cases := map[string]struct {
		body  string
		code  int
		field string
	}{
		"malformed":     {`{"serviceArguments":`, 400, ""},
		"unknown field": {strings.Replace(base, `"kvBlockSize"`, `"kvBlocksize2"`, 1), 400, "kvBlocksize2"},
		"wrong type":    {strings.Replace(base, `"port": 2090`, `"port": "2090"`, 1), 400, "serviceArguments.port"},
		"ranks":         {strings.Replace(base, `"kvDpRankCount": 1`, `"kvDpRankCount": 9`, 1), 400, "serviceArguments.kvDpRankCount"},
		"algo":          {strings.Replace(base, `"kvBlockSize": 16`, `"kvBlockSize": 16, "kvHashAlgo": "xxhash_cbor"`, 1), 400, "serviceArguments.kvHashAlgo"},
		"mode 2":        {strings.Replace(base, `"kvExactMode": 3`, `"kvExactMode": 2`, 1), 400, "serviceArguments.kvExactMode"},
	}
	for name, c := range cases {
		code, body := do(t, ts, "POST", "/config/loadbalancer", c.body)
		if code != c.code || (c.field != "" && body["field"] != c.field) || body["message"] == "" {
			t.Errorf("%s: %d %v", name, code, body)
		}
	}
}

func TestAuthAndMetrics(t *testing.T) {
	ts := newServer(t, "s3cret", "")
	if code, _ := do(t, ts, "GET", "/config/loadbalancer/all", ""); code != 401 {
		t.Errorf("no token: %d", code)
	}
	if code, _ := do(t, ts, "GET", "/config/loadbalancer/all", "", "Authorization", "Bearer wrong"); code != 403 {
		t.Errorf("wrong token: %d", code)
	}
	auth := []string{"Authorization", "Bearer s3cret"}
	if code, _ := do(t, ts, "GET", "/config/loadbalancer/all", "", auth...); code != 200 {
		t.Errorf("good token: %d", code)
	}
	if code, _ := do(t, ts, "GET", "/metrics", "", auth...); code != 503 {
		t.Errorf("metrics disabled by default: %d", code)
	}
	if code, body := do(t, ts, "POST", "/config/metrics", "", auth...); code != 200 || body["enabled"] != true {
		t.Errorf("enable: %d %v", code, body)
	}
	cl, _ := client.New(client.Config{Server: strings.Split(strings.TrimPrefix(ts.URL, "http://"), ":")[0], Port: port(ts), Token: "s3cret"})
	text, err := cl.Metrics(context.Background())
	if err != nil || !strings.Contains(text, "loxilb_test_total") {
		t.Errorf("metrics text: %v %q", err, text)
	}
	if code, _ := do(t, ts, "POST", "/config/metrics", ""); code != 401 {
		t.Errorf("metrics toggle needs auth: %d", code)
	}
}

func port(ts *httptest.Server) int {
	var p int
	_, _ = fmtSscanf(ts.URL[strings.LastIndex(ts.URL, ":")+1:], &p)
	return p
}

func TestNonLoopbackNeedsToken(t *testing.T) {
	st, _ := store.OpenBolt(t.TempDir())
	defer st.Close()
	_, err := api.New(api.Config{Addr: "0.0.0.0:11111"}, api.Deps{Rules: control.New(st, lbrule.Settings{}, nil)})
	if err == nil {
		t.Fatal("non-loopback bind without token accepted")
	}
	// A token in cleartext off loopback is refused unless accepted explicitly.
	if _, err := api.New(api.Config{Addr: "0.0.0.0:11111", Token: "x"}, api.Deps{Rules: control.New(st, lbrule.Settings{}, nil)}); !errors.Is(err, api.ErrCleartextToken) {
		t.Fatalf("want ErrCleartextToken, got %v", err)
	}
	if _, err := api.New(api.Config{Addr: "0.0.0.0:11111", Token: "x", AllowCleartext: true}, api.Deps{Rules: control.New(st, lbrule.Settings{}, nil)}); err != nil {
		t.Fatal(err)
	}
	if err := (api.Config{Addr: "[::]:11111", Token: "x", TLSCert: "c.pem", TLSKey: "k.pem"}).Validate(); err != nil {
		t.Fatal(err)
	}
	if err := (api.Config{Addr: "127.0.0.1:11111", Token: "x"}).Validate(); err != nil {
		t.Fatal(err)
	}
}

// TestOpenAPICoversRoutes keeps the document and the router in step.
func TestOpenAPICoversRoutes(t *testing.T) {
	var doc struct {
		Paths map[string]map[string]any `json:"paths"`
	}
	if err := json.Unmarshal(api.OpenAPI(), &doc); err != nil {
		t.Fatal(err)
	}
	routes := map[string][]string{
		"/config/loadbalancer": {"post"}, "/config/loadbalancer/all": {"get"},
		"/config/loadbalancer/externalipaddress/{ip}/port/{port}/protocol/{proto}": {"delete"},
		"/config/loadbalancer/name/{name}":                                         {"delete"}, "/status/capabilities": {"get"},
		"/config/metrics": {"get", "post", "delete"}, "/metrics": {"get"}, "/config/ai/kv/inventory": {"get"},
		"/config/ai/kv/trtllm/relay": {"get"},
		"/openapi.json":              {"get"}, "/version": {"get"}, "/diagnostics": {"get"}, "/cluster": {"get"},
		"/config/loadbalancer/externalipaddress/{ip}/port/{port}/protocol/{proto}/endpoint/{epip}/port/{epport}/drain": {"get", "post", "delete"},
	}
	for p, methods := range routes {
		for _, m := range methods {
			if _, ok := doc.Paths[p][m]; !ok {
				t.Errorf("OpenAPI lacks %s %s", m, p)
			}
		}
	}
	if len(doc.Paths) != len(routes) {
		t.Errorf("OpenAPI has %d paths, router %d", len(doc.Paths), len(routes))
	}
}

// TestMetricsSwitchSurvivesRestart: the metrics switch is kept in the
// settings store and restored by the next server over the same store.
func TestMetricsSwitchSurvivesRestart(t *testing.T) {
	dir := t.TempDir()
	var st *store.Bolt
	serve := func() *httptest.Server {
		if st != nil {
			st.Close()
		}
		var err error
		st, err = store.OpenBolt(dir)
		if err != nil {
			t.Fatal(err)
		}
		srv, err := api.New(api.Config{}, api.Deps{Rules: control.New(st, lbrule.Settings{}, nil),
			Gatherer: prometheus.NewRegistry(), Settings: st})
		if err != nil {
			t.Fatal(err)
		}
		ts := httptest.NewServer(srv.Handler())
		t.Cleanup(ts.Close)
		return ts
	}
	t.Cleanup(func() { st.Close() })
	ts := serve()
	if code, _ := do(t, ts, "GET", "/metrics", ""); code != 503 {
		t.Fatalf("metrics before enabling: %d", code)
	}
	if code, _ := do(t, ts, "POST", "/config/metrics", ""); code != 200 {
		t.Fatalf("enable: %d", code)
	}
	ts.Close()
	ts = serve()
	if code, m := do(t, ts, "GET", "/config/metrics", ""); code != 200 || m["enabled"] != true {
		t.Fatalf("after restart: %d %v", code, m)
	}
	if code, _ := do(t, ts, "DELETE", "/config/metrics", ""); code != 200 {
		t.Fatalf("disable: %d", code)
	}
	ts.Close()
	ts = serve()
	if code, m := do(t, ts, "GET", "/config/metrics", ""); code != 200 || m["enabled"] != false {
		t.Fatalf("after the second restart: %d %v", code, m)
	}
}
