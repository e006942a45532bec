package api_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/cluster"
	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/diag"
	"github.com/loxilb-llm/loxilb/pkg/kvevents"
	"github.com/loxilb-llm/loxilb/pkg/kvindex"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/reconcilers"
	"github.com/loxilb-llm/loxilb/pkg/store"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
	"github.com/loxilb-llm/loxilb/testbed/fleet"
)

// diagFleet runs the daemon's diagnostics wiring over real subscriptions:
// one vLLM emulator, and a rule whose second endpoint (127.0.0.2, where
// nothing listens) has its ZMQ port closed.
func diagFleet(t *testing.T, sim enginesim.Config, ep2 string) (*httptest.Server, *fleet.Member, uint32) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	const seed = "diag-seed"
	sim.Engine, sim.Seed, sim.TimeScaleSet = enginesim.EngineVLLM, seed, true
	f, err := fleet.Start(ctx, []enginesim.Config{sim}, fleet.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Stop() })
	m := f.Members[0]
	st, err := store.OpenBolt(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	ctl := control.New(st, lbrule.Settings{VLLMSeed: seed}, nil)
	index, err := kvindex.New(kvindex.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	events := kvevents.New(kvevents.Config{ReplayPortOffset: kvevents.DefaultReplayPortOffset}, index, nil, nil)
	go events.Run(ctx)
	ctl.AddReconciler(&reconcilers.KVEvents{Subs: events, Inv: index, Seed: seed})
	tokDir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(tokDir, "sim-model"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(tokDir, "sim-model", "tokenizer.json"), []byte("{}"), 0o644); err != nil {
		t.Fatal(err)
	}
	host, port, _ := strings.Cut(m.Addr, ":")
	body := fmt.Sprintf(`{"serviceArguments":{"externalIP":"127.0.0.30","port":2096,"protocol":"tcp","mode":4,"sel":0,"kvExactMode":3,`+
		`"kvEngineType":"vllm","kvZmqPort":%d,"kvBlockSize":16,"model_name":"sim-model","name":"diag"},`+
		`"endpoints":[{"endpointIP":%q,"targetPort":%s,"weight":1}%s]}`, m.ZMQPorts[0], host, port, ep2)
	svc, _, err := ctl.Create(ctx, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	srv, err := api.New(api.Config{}, api.Deps{Rules: ctl,
		Diagnose: diag.Sources{Rules: ctl.List, Events: events.Status, SeedFingerprint: cluster.SeedFingerprint(seed), TokenizerDir: tokDir,
			Timeout: 300 * time.Millisecond}.Run})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(ts.Close)
	// Events flow once a prompt is served.
	prompt := make([]int, 40)
	for i := range prompt {
		prompt[i] = 100 + i
	}
	b, _ := json.Marshal(map[string]any{"model": "sim-model", "prompt": prompt, "max_tokens": 1})
	deadline := time.Now().Add(20 * time.Second)
	for {
		es, ok := events.Status(svc.ID, 0)
		if ok && es.Connected && es.Parity.Verdict == kvevents.VerdictOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("endpoint 0 never attested: %+v", es)
		}
		if ok && es.Connected {
			resp, err := http.Post(m.URL+"/v1/completions", "application/json", strings.NewReader(string(b)))
			if err == nil {
				resp.Body.Close()
			}
			prompt[0]++
			b, _ = json.Marshal(map[string]any{"model": "sim-model", "prompt": prompt, "max_tokens": 1})
		}
		time.Sleep(50 * time.Millisecond)
	}
	return ts, m, svc.ID
}

func getDiagnostics(t *testing.T, ts *httptest.Server, query string) (int, api.Diagnostics) {
	t.Helper()
	resp, err := http.Get(ts.URL + api.BasePath + api.DiagnosticsPath + query)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out api.Diagnostics
	_ = json.NewDecoder(resp.Body).Decode(&out)
	return resp.StatusCode, out
}

func find(cs []diag.Check, ep int, check string) diag.Check {
	for _, c := range cs {
		if c.EPIdx == ep && c.Check == check {
			return c
		}
	}
	return diag.Check{Result: "missing " + check}
}

// TestDiagnosticsFleet: the healthy endpoint passes every check, the one
// whose ZMQ port is closed fails with a fix, and the report is failed.
func TestDiagnosticsFleet(t *testing.T) {
	// Nothing listens on 127.0.0.2: its ZMQ (and HTTP) ports are closed.
	ts, _, id := diagFleet(t, enginesim.Config{}, `,{"endpointIP":"127.0.0.2","targetPort":8000,"weight":1}`)
	code, d := getDiagnostics(t, ts, fmt.Sprintf("?service=%d", id))
	if code != 200 {
		t.Fatalf("status %d", code)
	}
	for _, c := range d.Checks {
		t.Logf("%s %s %d/%d %s: %s | %s", c.Result, c.Check, c.ServiceID, c.EPIdx, c.Endpoint, c.Found, c.Fix)
	}
	for _, check := range []string{diag.CheckZMQ, diag.CheckReplay, diag.CheckEvents, diag.CheckParity, diag.CheckBlockSize, diag.CheckSeed, diag.CheckTokenizer} {
		if c := find(d.Checks, 0, check); c.Result != diag.Pass {
			t.Errorf("healthy endpoint %s: %+v", check, c)
		}
	}
	if c := find(d.Checks, 1, diag.CheckZMQ); c.Result != diag.Fail || c.Fix == "" || !strings.HasPrefix(c.Endpoint, "127.0.0.2:") {
		t.Errorf("closed ZMQ port: %+v", c)
	}
	if !d.Failed || d.Fail == 0 || d.Pass == 0 {
		t.Errorf("report counts %d pass %d warn %d fail, failed %v", d.Pass, d.Warn, d.Fail, d.Failed)
	}
	if code, _ := getDiagnostics(t, ts, "?service=99"); code != 404 {
		t.Errorf("unknown service: %d", code)
	}
	if code, _ := getDiagnostics(t, ts, "?service=x"); code != 400 {
		t.Errorf("bad service: %d", code)
	}
}
