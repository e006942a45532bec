package fleet

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

func post(t *testing.T, url, body string) map[string]any {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("%s: %d %s", url, resp.StatusCode, raw)
	}
	var m map[string]any
	json.Unmarshal(raw, &m)
	return m
}

func checkFleet(t *testing.T, f *Fleet) {
	t.Helper()
	seen := map[int]bool{}
	for _, m := range f.Members {
		for r, p := range m.ZMQPorts {
			if p != m.ZMQPorts[0]+r || m.ReplayPorts[r] != p+1000 {
				t.Fatalf("%s ports not contiguous: %v %v", m.Name, m.ZMQPorts, m.ReplayPorts)
			}
			if seen[p] {
				t.Fatalf("port %d used twice", p)
			}
			seen[p] = true
		}
		post(t, m.URL+"/v1/completions", `{"prompt": [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17], "max_tokens": 2}`)
	}
	stats, err := f.Stats(context.Background())
	if err != nil || len(stats) != len(f.Members) {
		t.Fatalf("stats: %v", err)
	}
	for i, s := range stats {
		if s.Requests != 1 || s.PromptTokens != 17 {
			t.Fatalf("member %d stats %+v", i, s)
		}
	}
}

func TestStartInProcess(t *testing.T) {
	cfgs := append(Uniform(3, enginesim.Config{Engine: enginesim.EngineVLLM, TimeScaleSet: true}),
		enginesim.Config{Engine: enginesim.EngineSGLang, DPRanks: 2, TimeScaleSet: true},
		enginesim.Config{Engine: enginesim.EngineSGLang, Role: enginesim.RolePrefill, TimeScaleSet: true},
		enginesim.Config{Engine: enginesim.EngineTRTLLM, TimeScaleSet: true})
	f, err := Start(context.Background(), cfgs, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(f.Members) != 6 || len(f.Members[3].ZMQPorts) != 2 || f.Members[4].BootstrapPort == 0 || len(f.Members[5].ZMQPorts) != 0 {
		t.Fatalf("members %+v", f.Members)
	}
	if f.Members[4].Sim == nil || len(f.ByRole(enginesim.RolePrefill)) != 1 {
		t.Fatal("member accessors")
	}
	// The prefill needs a bootstrap room; others take a plain prompt.
	pre := f.Members[4]
	f.Members = append(f.Members[:4], f.Members[5])
	checkFleet(t, f)
	f.Members = append(f.Members, pre)
	if err := f.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := f.Stop(); err != nil {
		t.Fatal("second stop:", err)
	}
	if _, err := http.Get(f.Members[0].URL + "/health"); err == nil {
		t.Fatal("engine still serving after Stop")
	}
}

func TestStartRejectsBadConfig(t *testing.T) {
	_, err := Start(context.Background(), []enginesim.Config{{Engine: "nope"}}, Options{})
	if err == nil {
		t.Fatal("bad engine accepted")
	}
}

func TestArgsRoundTripThroughBinaryFlags(t *testing.T) {
	a := Args(enginesim.Config{Engine: enginesim.EngineSGLang, DPRanks: 2, Faults: enginesim.Faults{DropProb: 0.5, FailStatus: 503}})
	joined := strings.Join(a, " ")
	for _, want := range []string{"--engine sglang", "--dp-ranks 2", "--fault-drop-prob 0.5", "--fault-fail-status 503", "--event-encoding array", "--hash-algo sha256_sglang"} {
		if !strings.Contains(joined, want) {
			t.Errorf("args lack %q: %s", want, joined)
		}
	}
}

func TestStartProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the engine-sim binary")
	}
	bin := filepath.Join(t.TempDir(), "engine-sim")
	build := exec.Command("go", "build", "-o", bin, "../cmd/engine-sim")
	build.Stderr = os.Stderr
	if err := build.Run(); err != nil {
		t.Fatalf("build engine-sim: %v", err)
	}
	cfgs := []enginesim.Config{
		{Engine: enginesim.EngineVLLM, TimeScaleSet: true},
		{Engine: enginesim.EngineSGLang, DPRanks: 2, TimeScaleSet: true},
		{Engine: enginesim.EngineTRTLLM, TimeScaleSet: true},
	}
	f, err := StartProcesses(context.Background(), bin, cfgs, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Stop()
	if f.Members[0].Sim != nil || len(f.Members[1].ZMQPorts) != 2 {
		t.Fatalf("members %+v", f.Members)
	}
	checkFleet(t, f)
	if err := f.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
}
