package enginesim

import (
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"
)

// postBoth sends the same body to the prefill and the decode engine at
// once, as SGLang's routers do, and returns both answers.
func postBoth(t *testing.T, pre, dec *Engine, body any) (httpResult, httpResult) {
	t.Helper()
	var wg sync.WaitGroup
	var p, d httpResult
	wg.Add(2)
	go func() { defer wg.Done(); d = do(t, "POST", dec.URL()+"/generate", body) }()
	go func() { defer wg.Done(); p = do(t, "POST", pre.URL()+"/generate", body) }()
	wg.Wait()
	return p, d
}

func TestSGLangGeneratePD(t *testing.T) {
	pre := startEngine(t, Config{Engine: EngineSGLang, Role: RolePrefill}, Deps{})
	dec := startEngine(t, Config{Engine: EngineSGLang, Role: RoleDecode, PDTimeout: time.Minute}, Deps{})
	impatient := startEngine(t, Config{Engine: EngineSGLang, Role: RoleDecode, PDTimeout: 200 * time.Millisecond}, Deps{})
	bport := pre.BootstrapPort()

	// One prompt: scalar bootstrap fields.
	one := map[string]any{"input_ids": seqTokens(1, 40), "sampling_params": map[string]any{"max_new_tokens": 5},
		"bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": 77}
	p, d := postBoth(t, pre, dec, one)
	if p.status != 200 || d.status != 200 {
		t.Fatalf("single: prefill %d %s, decode %d %s", p.status, p.body, d.status, d.body)
	}
	if mi := d.json["meta_info"].(map[string]any); mi["completion_tokens"].(json.Number).String() != "5" || d.json["text"] == "" {
		t.Fatalf("single decode answer %s", d.body)
	}

	// A batch: one room per prompt.
	batch := map[string]any{"text": []string{"the first prompt", "a second, longer prompt", "third"},
		"sampling_params": map[string]any{"max_new_tokens": 3},
		"bootstrap_host":  []string{"127.0.0.1", "127.0.0.1", "127.0.0.1"},
		"bootstrap_port":  []int{bport, bport, bport}, "bootstrap_room": []uint64{10, 11, 12}}
	p, d = postBoth(t, pre, dec, batch)
	var outs []map[string]any
	if p.status != 200 || d.status != 200 || json.Unmarshal(d.body, &outs) != nil || len(outs) != 3 {
		t.Fatalf("batch: prefill %d %s, decode %d %s", p.status, p.body, d.status, d.body)
	}
	if got := pre.Stats().PDTransfers; got != 4 {
		t.Fatalf("prefill recorded %d transfers, want 4", got)
	}

	// Malformed batches: clear 400s naming the field.
	for name, mut := range map[string]func(m map[string]any){
		"scalar room":   func(m map[string]any) { m["bootstrap_room"] = 10 },
		"short rooms":   func(m map[string]any) { m["bootstrap_room"] = []int{10, 11} },
		"same room":     func(m map[string]any) { m["bootstrap_room"] = []int{10, 10, 12} },
		"short hosts":   func(m map[string]any) { m["bootstrap_host"] = []string{"127.0.0.1"} },
		"text and ids":  func(m map[string]any) { m["input_ids"] = []int{1, 2} },
		"empty batch":   func(m map[string]any) { m["text"] = []string{} },
		"list for one":  func(m map[string]any) { m["text"] = "one" },
		"mixed prompts": func(m map[string]any) { m["text"] = []any{"a", 5} },
	} {
		m := map[string]any{}
		for k, v := range batch {
			m[k] = v
		}
		mut(m)
		want := "bootstrap"
		switch name {
		case "text and ids", "empty batch", "mixed prompts":
			want = "text"
		}
		for _, e := range []*Engine{pre, impatient} {
			if r := do(t, "POST", e.URL()+"/generate", m); r.status != 400 || !strings.Contains(string(r.body), want) {
				t.Errorf("%s: %d %s", name, r.status, r.body)
			}
		}
	}
	// A decode leg whose room no prefill served fails, naming the room.
	one["bootstrap_room"] = 4242
	if r := do(t, "POST", impatient.URL()+"/generate", one); r.status != 400 || !strings.Contains(string(r.body), "4242") {
		t.Fatalf("decode without prefill: %d %s", r.status, r.body)
	}
}

func TestSGLangGenerateStream(t *testing.T) {
	e := startEngine(t, Config{Engine: EngineSGLang}, Deps{})
	r := do(t, "POST", e.URL()+"/generate", map[string]any{"text": []string{"x y", "z"}, "stream": true,
		"sampling_params": map[string]any{"max_new_tokens": 4}})
	evs := sseEvents(t, r.body)
	if r.status != 200 || len(evs) != 9 || evs[8] != "[DONE]" {
		t.Fatalf("stream %d: %q", r.status, evs)
	}
	var last struct {
		Index    int `json:"index"`
		MetaInfo struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"meta_info"`
	}
	if err := json.Unmarshal([]byte(evs[7]), &last); err != nil || last.Index != 1 || last.MetaInfo.CompletionTokens != 4 {
		t.Fatalf("last chunk %s: %v", evs[7], err)
	}
}
