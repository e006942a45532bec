package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

// chatBody returns a chat request of roughly n tokens (system prompt, a few
// turns, a long user message) for the Qwen3 tokenizer.
func chatBody(n int) []byte { return chatBodyVariant(n, "", "") }

// chatBodyVariant is chatBody with suffix appended to the long message
// (a new prompt sharing the conversation's start) and, when next is set,
// one more exchange after it (the conversation's next turn).
func chatBodyVariant(n int, suffix, next string) []byte {
	var long strings.Builder
	for i := 0; long.Len() < n*5; i++ {
		fmt.Fprintf(&long, "Paragraph %d: the service routes each request to the worker that already holds its prefix, ", i)
		long.WriteString("so prefill is skipped and time to first token drops. Ünïcödé, 中文, emoji 🚀 and code `x := y[i]`. ")
	}
	long.WriteString(suffix)
	msgs := []map[string]string{
		{"role": "system", "content": "You are a precise assistant for platform engineers."},
		{"role": "user", "content": "Summarise the design."},
		{"role": "assistant", "content": "It is a KV-cache-aware load balancer."},
		{"role": "user", "content": long.String()},
	}
	if next != "" {
		msgs = append(msgs, map[string]string{"role": "assistant", "content": "Understood: routing follows the cached prefix."},
			map[string]string{"role": "user", "content": next})
	}
	b, _ := json.Marshal(map[string]any{"model": "Qwen/Qwen3-0.6B", "messages": msgs})
	return b
}

// BenchmarkRoutingDecisionChat2k measures the whole routing decision for a
// ~2k-token chat request: render the chat template, tokenize, hash every
// full block, look up 8 endpoints' inventories (one warm) and score. It
// reports p50 and p99 per decision.
//
// Every iteration sends the same body (a client retrying, or many clients
// sending one prompt): caches keyed by the prompt's text all hit.
func BenchmarkRoutingDecisionChat2k(b *testing.B) {
	benchmarkRoutingDecisionChat2k(b, false, false, nil)
}

// BenchmarkRoutingDecisionChat2kNew sends a new prompt every iteration:
// the long message ends differently each time, so its text was never seen
// (the word cache is warm, as it is in a running gateway).
func BenchmarkRoutingDecisionChat2kNew(b *testing.B) {
	benchmarkRoutingDecisionChat2k(b, false, false, func(i int) []byte { return chatBodyVariant(2000, fmt.Sprintf(" Request %d.", i), "") })
}

// BenchmarkRoutingDecisionChat2kNextTurn sends the next turn of one
// conversation every iteration: the ~2k-token history and a new question.
func BenchmarkRoutingDecisionChat2kNextTurn(b *testing.B) {
	benchmarkRoutingDecisionChat2k(b, false, false, func(i int) []byte {
		return chatBodyVariant(2000, "", fmt.Sprintf("Follow-up %d: how does the gateway pick an endpoint when two hold the same prefix?", i))
	})
}

// BenchmarkRoutingDecisionChat2kBodyCache is the repeated body with the
// body cache on, as the daemon runs by default: after its second sighting
// the body is served from the cache (bodycache.go).
func BenchmarkRoutingDecisionChat2kBodyCache(b *testing.B) {
	benchmarkRoutingDecisionChat2k(b, false, true, nil)
}

// BenchmarkRoutingDecisionChat2kNewBodyCache is the new prompt with the
// body cache on: every body is seen once, so this is what the cache costs
// when it never hits.
func BenchmarkRoutingDecisionChat2kNewBodyCache(b *testing.B) {
	benchmarkRoutingDecisionChat2k(b, false, true, func(i int) []byte { return chatBodyVariant(2000, fmt.Sprintf(" Request %d.", i), "") })
}

// BenchmarkRoutingDecisionChat2kStrict is the same decision with strict
// attestation on (every verdict ok): its cost is one verdict read per
// healthy candidate.
func BenchmarkRoutingDecisionChat2kStrict(b *testing.B) {
	benchmarkRoutingDecisionChat2k(b, true, false, nil)
}

// benchmarkRoutingDecisionChat2k times Pick on chatBody(2000), or on
// vary(i) in iteration i when vary is set (bodies built before timing).
func benchmarkRoutingDecisionChat2k(b *testing.B, strict, bodyCache bool, vary func(i int) []byte) {
	r := rule(3, "Qwen/Qwen3-0.6B")
	r.Endpoints = nil
	for i := 0; i < 8; i++ {
		r.Endpoints = append(r.Endpoints, lbrule.Endpoint{IP: fmt.Sprintf("127.0.0.%d", 100+i), Port: 8000, Weight: 1})
	}
	f := newFixture(b, r)
	body := chatBody(2000)
	rq := &proxy.Request{Service: 1, Method: "POST", Path: "/v1/chat/completions", Body: body, Model: "Qwen/Qwen3-0.6B"}
	tok, err := f.g.tok.Get("Qwen/Qwen3-0.6B")
	if err != nil {
		b.Fatal(err)
	}
	rt, err := tok.EncodeRequest("vllm", rq.Path, body)
	if err != nil {
		b.Fatal(err)
	}
	st := f.g.lookup(1)
	keys := st.hasher.Keys(nil, rt.IDs)
	// Endpoint 3 is warm with the whole prompt, the others with unrelated blocks.
	f.ix.Store(1, 3, 0, keys)
	for ep := 0; ep < 8; ep++ {
		if ep != 3 {
			f.ix.Store(1, ep, 0, st.hasher.Keys(nil, tokenizerNoise(tok, ep)))
		}
	}
	f.g.cfg.SpeculativeTTL = -1 // measure the decision, not the speculative write
	if bodyCache {
		f.g.bodies = newBodyCache(DefaultBodyCacheBytes)
	}
	if strict {
		f.g.cfg.KVParityStrict, f.g.cfg.Parity = true, verdicts{}
	}
	ctx := context.Background()
	bodies := make([][]byte, b.N)
	for i := range bodies {
		bodies[i] = body
		if vary != nil {
			bodies[i] = vary(i)
		}
	}
	lat := make([]time.Duration, 0, b.N)
	cpu := make([]time.Duration, 0, b.N)
	// The thread's CPU clock counts what one decision costs even when a
	// loaded machine preempts the benchmark (the wall clock does not).
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	runtime.GC()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		rq.Body = bodies[i]
		t0, c0 := time.Now(), threadCPU(b)
		p, err := f.g.Pick(ctx, rq)
		cpu = append(cpu, threadCPU(b)-c0)
		lat = append(lat, time.Since(t0))
		if err != nil || p.Candidates[0].Idx != 3 {
			b.Fatalf("decision: %v %+v", err, p)
		}
	}
	b.StopTimer()
	reportPercentiles(b, lat, "")
	reportPercentiles(b, cpu, "cpu-")
	b.ReportMetric(float64(len(rt.IDs)), "tokens")
}

// reportPercentiles reports the p50 and p99 of ds in µs (fractional: the
// goals are a fraction of a millisecond).
func reportPercentiles(b *testing.B, ds []time.Duration, prefix string) {
	slices.Sort(ds)
	us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
	b.ReportMetric(us(ds[len(ds)/2]), prefix+"p50-µs")
	b.ReportMetric(us(ds[len(ds)*99/100]), prefix+"p99-µs")
}

// threadCPU is the calling thread's CPU time (the caller locks its OS
// thread).
func threadCPU(b *testing.B) time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ts.Nano())
}

func tokenizerNoise(tok *tokenizer.Tokenizer, seed int) []uint32 {
	return tok.Encode(strings.Repeat(fmt.Sprintf("unrelated text number %d about gardening. ", seed), 100), false)
}
