package gateway

import (
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/selector"
)

// fakeOthers serves fixed engine metrics and other nodes' load, and keeps
// the self-count function the gateway hands it.
type fakeOthers struct {
	m      map[int]selector.EngineMetrics
	others map[int]int
	self   func(uint32, int) int
}

func (f *fakeOthers) Metrics(_ uint32, ep int) (selector.EngineMetrics, bool) {
	m, ok := f.m[ep]
	return m, ok
}

func (f *fakeOthers) Others(_ uint32, ep int) (int, bool) {
	o, ok := f.others[ep]
	return o, ok
}

func (f *fakeOthers) SetSelfInFlight(fn func(uint32, int) int) { f.self = fn }

var _ OtherNodesLoad = (*fakeOthers)(nil)

// With ClusterLoad the candidates' in-flight counts carry what other nodes
// sent (as of the last scrape); without it they are this node's alone.
func TestClusterLoadBlendsOtherNodes(t *testing.T) {
	eng := &fakeOthers{m: map[int]selector.EngineMetrics{0: {Running: 4, Valid: true}}, others: map[int]int{0: 4, 1: 2}}
	off := newFixtureEngine(t, Config{Seed: "1"}, eng, rule(3, ""))
	if eng.self != nil {
		t.Fatal("the self count is wired only with ClusterLoad")
	}
	st := off.g.lookup(1)
	for _, c := range off.g.candidates(st) {
		if c.InFlight != 0 {
			t.Fatalf("off: %+v", c)
		}
	}
	on := newFixtureEngine(t, Config{Seed: "1", ClusterLoad: true}, eng, rule(3, ""))
	if eng.self == nil || eng.self(1, 0) != 0 {
		t.Fatal("ClusterLoad should hand the source this node's in-flight count (0 without a proxy)")
	}
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
