package gateway

import (
	"context"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/outlier"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

// pickAllocs measures the allocations of one Pick, Done included, for a
// small completion request on rule 1.
func pickAllocs(t *testing.T, f fixture, r *proxy.Request) float64 {
	t.Helper()
	one := func() {
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
	}
	for range 20 {
		one()
	}
	return testing.AllocsPerRun(200, one)
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
