package gateway

import (
	"context"
	"runtime"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/outlier"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

// pickAllocs measures the allocations of one Pick, Done included, for a
// small completion request on rule 1.
func pickAllocs(t *testing.T, f fixture, r *proxy.Request) float64 {
	t.Helper()
	one := func() { pickDone(t, f, r) }
	for range 20 {
		one()
	}
	return testing.AllocsPerRun(200, one)
}

// pickDone picks r and completes the request as the proxy does.
func pickDone(t *testing.T, f fixture, r *proxy.Request) proxy.Plan {
	t.Helper()
	p, err := f.g.Pick(context.Background(), r)
	if err != nil {
		t.Fatal(err)
	}
	if p.FirstByte != nil {
		p.FirstByte()
	}
	if p.Done != nil {
		p.Done(proxy.Result{Status: 200, Endpoint: p.Candidates[0].Idx})
	}
	return p
}

// maxPickAllocsRR bounds the allocations of a round-robin rule's Pick: no
// tokenizing, no key, no prefix index.
const maxPickAllocsRR = 3

func TestPickRoundRobinAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector drops sync.Pool items at random; `make test-allocs` checks allocations without it")
	}
	// As the daemon runs it: outlier detection on.
	det, err := outlier.New(outlier.Config{}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	f := newFixtureConfig(t, Config{Seed: "1", Outliers: det}, rule(0, ""))
	got := pickAllocs(t, f, req(`{"model":"m","prompt":"hello","max_tokens":1}`))
	t.Logf("%.1f allocations per round-robin Pick", got)
	if got > maxPickAllocsRR {
		t.Errorf("%.1f allocations per round-robin Pick, want at most %d", got, maxPickAllocsRR)
	}
}

func BenchmarkPickRoundRobin(b *testing.B) {
	f := newFixture(b, rule(0, ""))
	r := req(`{"model":"m","prompt":"hello","max_tokens":1}`)
	b.ReportAllocs()
	for b.Loop() {
		p, err := f.g.Pick(context.Background(), r)
		if err != nil {
			b.Fatal(err)
		}
		if p.Done != nil {
			p.Done(proxy.Result{Status: 200})
		}
	}
}

// maxPickBytesChat2k bounds the bytes one Pick of the ~2k-token chat
// allocates when its prompt was seen before: the rendered prompt, the
// unquoted message and the template's own work, not the token ids, whose
// array is reused from one request to the next (~47 KB without that).
const maxPickBytesChat2k = 40 << 10

// The prompt's token ids go back to the pool after Pick, and reusing
// their array changes no decision: two prompts picked in turn keep their
// own match depth.
func TestPickChatReusesTokenIDs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector drops sync.Pool items at random; `make test-allocs` checks allocations without it")
	}
	r := rule(3, "Qwen/Qwen3-0.6B")
	f := newFixture(t, r)
	bodies := [][]byte{chatBodyVariant(2000, "", ""), chatBodyVariant(1000, "", "")}
	tok, err := f.g.tok.Get("Qwen/Qwen3-0.6B")
	if err != nil {
		t.Fatal(err)
	}
	rt, err := tok.EncodeRequest("vllm", "/v1/chat/completions", bodies[0])
	if err != nil {
		t.Fatal(err)
	}
	st := f.g.lookup(1)
	f.ix.Store(1, 0, 0, st.hasher.Keys(nil, rt.IDs)) // endpoint 0 holds the first prompt
	pick := func(body []byte) string {
		return pickDone(t, f, &proxy.Request{Service: 1, Method: "POST", Path: "/v1/chat/completions",
			Body: body, Model: "Qwen/Qwen3-0.6B"}).Receipt
	}
	// A first pick stores its prompt's blocks speculatively on the chosen
	// endpoint; from the second on, each prompt's receipt stays the same.
	pick(bodies[0])
	pick(bodies[1])
	want := []string{pick(bodies[0]), pick(bodies[1])}
	if want[0] == want[1] {
		t.Fatalf("both prompts got receipt %q; the test needs them to differ", want[0])
	}
	for i := range 6 {
		if got := pick(bodies[i%2]); got != want[i%2] {
			t.Fatalf("pick %d: receipt %q, want %q", i, got, want[i%2])
		}
	}
	var m0, m1 runtime.MemStats
	const n = 20
	runtime.ReadMemStats(&m0)
	for range n {
		pick(bodies[0])
	}
	runtime.ReadMemStats(&m1)
	per := (m1.TotalAlloc - m0.TotalAlloc) / n
	t.Logf("%d bytes allocated per Pick of the 2k-token chat", per)
	if per > maxPickBytesChat2k {
		t.Errorf("%d bytes allocated per Pick of the 2k-token chat, want at most %d", per, maxPickBytesChat2k)
	}
}
