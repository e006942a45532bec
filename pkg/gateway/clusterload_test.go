package gateway

import (
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/kvindex"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/pkg/selector"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
	"github.com/prometheus/client_golang/prometheus"
)

// fakeOthers serves fixed engine metrics and other nodes' load.
type fakeOthers struct {
	m      map[int]selector.EngineMetrics
	others map[int]int
}

func (f *fakeOthers) Metrics(_ uint32, ep int) (selector.EngineMetrics, bool) {
	m, ok := f.m[ep]
	return m, ok
}

func (f *fakeOthers) Others(_ uint32, ep int) (int, bool) {
	o, ok := f.others[ep]
	return o, ok
}

var _ OtherNodesLoad = (*fakeOthers)(nil)

// With ClusterLoad the candidates' in-flight counts carry what other nodes
// sent (as of the last scrape); without it they are this node's alone.
func TestClusterLoadBlendsOtherNodes(t *testing.T) {
	eng := &fakeOthers{m: map[int]selector.EngineMetrics{0: {Running: 4, Valid: true}}, others: map[int]int{0: 4, 1: 2}}
	signals := EngineSignals{Load: eng, Others: eng}
	off := newFixtureConfig(t, Config{Seed: "1", Engine: signals}, rule(3, ""))
	st := off.g.lookup(1)
	for _, c := range off.g.candidates(st) {
		if c.InFlight != 0 {
			t.Fatalf("off: %+v", c)
		}
	}
	on := newFixtureConfig(t, Config{Seed: "1", ClusterLoad: true, Engine: signals}, rule(3, ""))
	cs := on.g.candidates(on.g.lookup(1))
	if cs[0].InFlight != 4 || cs[1].InFlight != 2 {
		t.Fatalf("on: %+v", cs)
	}
	// Endpoint 0's load is max(4 in flight, 4 running): the engine's
	// count is not added twice.
	if l := selector.Load(cs[0], selector.DefaultLoadWeights); l != 4 {
		t.Fatalf("load %v, want 4", l)
	}
}

// ClusterLoad without a source of the other nodes' load is refused at
// construction rather than silently off.
func TestClusterLoadNeedsOthers(t *testing.T) {
	reg := prometheus.NewRegistry()
	ix, _ := kvindex.New(kvindex.Config{}, reg)
	rt, err := router.New(router.DefaultConfig(), ix, nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	toks, err := tokenizer.NewRegistry(t.TempDir(), nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	_, err = New(Config{ClusterLoad: true, Engine: EngineSignals{Load: &fakeOthers{}}}, toks, ix, rt, nil, new(proxy.InFlightTable), nil, reg)
	if err == nil || !strings.Contains(err.Error(), "Engine.Others") {
		t.Fatalf("ClusterLoad without Engine.Others: %v", err)
	}
}
