package gateway

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

// TestPickClientModelNamesAreBounded: on a rule without model_name every
// model string a client sends reaches the tokenizer registry and the
// metrics. Thousands of names must leave one metric series and no
// registry state; a name past the bound gets 400 and is counted.
func TestPickClientModelNamesAreBounded(t *testing.T) {
	f := newFixture(t, rule(3, ""))
	for i := range 2000 {
		body := fmt.Sprintf(`{"model":"client/model-%d","prompt":"hello"}`, i)
		if _, err := f.g.Pick(context.Background(), req(body)); err != nil {
			t.Fatalf("name %d: %v", i, err)
		}
	}
	long := req(`{"model":"` + strings.Repeat("m", 1<<20) + `","prompt":"hello"}`)
	_, err := f.g.Pick(context.Background(), long)
	if !errors.Is(err, proxy.ErrBadRequest) || proxy.StatusFor(err) != http.StatusBadRequest || !strings.Contains(err.Error(), "model name is 1048576 bytes") {
		t.Fatalf("1 MiB model name: %v", err)
	}
	atBound := req(`{"model":"` + strings.Repeat("m", DefaultMaxModelNameBytes) + `","prompt":"hello"}`)
	if _, err := f.g.Pick(context.Background(), atBound); err != nil {
		t.Fatalf("a name at the bound is served: %v", err)
	}
	if n := testutil.CollectAndCount(f.g.m.tokMissing); n != 2 { // not_staged and invalid_model_name (256 bytes > NAME_MAX)
		t.Errorf("%d tokenizer_unavailable series after 2,001 client-chosen names, want 2", n)
	}
	if v := testutil.ToFloat64(f.g.m.tokMissing.WithLabelValues("1", modelOther, "not_staged")); v != 2000 {
		t.Errorf("unknown models counted %v, want 2000", v)
	}
	if v := testutil.ToFloat64(f.g.m.rejectedC.WithLabelValues("1", rejectModelName)); v != 1 {
		t.Errorf("long name rejections %v, want 1", v)
	}
	if st := f.g.tok.(*tokenizer.Registry).Status(); len(st) != 2 {
		t.Errorf("registry status has %d rows, want the 2 staged tokenizers: %+v", len(st), st)
	}
}

// TestPickTokenizationBounds: a prompt past the byte bound is refused
// before tokenizing, one past the token bound once encoding crosses it
// (by default the model's staged context length); both 400 and counted.
// With every tokenization slot taken a request waits, counted, and leaves
// as soon as its client does. One fixture: loading the tokenizer is the
// slow part under the race detector.
func TestPickTokenizationBounds(t *testing.T) {
	f := newFixtureConfig(t, Config{Seed: "1", MaxPromptBytes: 64 << 10, MaxPromptTokens: 500, TokenizeConcurrency: 1}, rule(3, ""))
	if _, err := f.g.tok.Get("Qwen/Qwen3-0.6B"); err != nil { // loaded before the clock starts
		t.Fatal(err)
	}
	for _, c := range []struct{ name, body string }{
		{"16 MiB of spaces", `{"model":"Qwen/Qwen3-0.6B","prompt":"` + strings.Repeat(" ", 16<<20) + `"}`},
		{"over the token bound", `{"model":"Qwen/Qwen3-0.6B","prompt":"` + strings.Repeat("alpha beta ", 400) + `"}`},
		{"chat over the token bound", `{"model":"Qwen/Qwen3-0.6B","messages":[{"role":"user","content":"` + strings.Repeat("alpha beta ", 400) + `"}]}`},
	} {
		r := req(c.body)
		if strings.Contains(c.body, "messages") {
			r.Path = "/v1/chat/completions"
		}
		start := time.Now()
		_, err := f.g.Pick(context.Background(), r)
		if proxy.StatusFor(err) != http.StatusBadRequest || !strings.Contains(err.Error(), "prompt too long") {
			t.Errorf("%s: %v", c.name, err)
		}
		t.Logf("%s: refused in %v", c.name, time.Since(start))
	}
	if v := testutil.ToFloat64(f.g.m.rejectedC.WithLabelValues("1", rejectPrompt)); v != 3 {
		t.Errorf("prompt rejections %v, want 3", v)
	}
	if _, err := f.g.Pick(context.Background(), req(prompt)); err != nil {
		t.Errorf("a prompt within the bounds: %v", err)
	}

	// No configured token bound: Qwen3's staged model_max_length, 131072.
	f.g.cfg.MaxPromptBytes, f.g.cfg.MaxPromptTokens = DefaultMaxPromptBytes, 0
	ids := strings.TrimSuffix(strings.Repeat("1,", 131073), ",")
	_, err := f.g.Pick(context.Background(), req(`{"model":"Qwen/Qwen3-0.6B","prompt":[`+ids+`]}`))
	if proxy.StatusFor(err) != http.StatusBadRequest || !strings.Contains(err.Error(), "more than 131072") {
		t.Fatalf("131073 token ids: %v", err)
	}

	f.g.tokSlots <- struct{}{} // a long tokenization holds the only slot
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { _, err := f.g.Pick(ctx, req(prompt)); done <- err }()
	deadline := time.Now().Add(10 * time.Second)
	for testutil.ToFloat64(f.g.m.tokWaiting) != 1 {
		if time.Now().After(deadline) {
			t.Fatal("the request never waited for a slot")
		}
		time.Sleep(time.Millisecond)
	}
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, proxy.ErrClientCanceled) {
			t.Fatalf("cancelled while waiting: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a cancelled request kept waiting for a tokenization slot")
	}
	if v := testutil.ToFloat64(f.g.m.tokWaiting); v != 0 {
		t.Fatalf("waiting gauge %v after the request left", v)
	}
	<-f.g.tokSlots
	if _, err := f.g.Pick(context.Background(), req(prompt)); err != nil {
		t.Fatalf("with the slot free: %v", err)
	}
}

func TestLogLimiter(t *testing.T) {
	l := logLimiter{every: time.Second}
	now := time.Unix(100, 0)
	if ok, _ := l.allow(now); !ok {
		t.Fatal("first line held")
	}
	for range 5 {
		if ok, _ := l.allow(now.Add(time.Millisecond)); ok {
			t.Fatal("line within the interval let through")
		}
	}
	if ok, held := l.allow(now.Add(time.Second)); !ok || held != 5 {
		t.Fatalf("after the interval: ok=%v held=%d, want true 5", ok, held)
	}
}
