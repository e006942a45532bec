package gateway

import (
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/kvindex"
	"github.com/loxilb-llm/loxilb/pkg/peerprefill"
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

// fakePeerLoad serves fixed other-node counts and records the address
// hashes it was asked about.
type fakePeerLoad struct {
	n      map[int]int
	ok     bool
	hashes map[int]uint64
}

func (f *fakePeerLoad) PeerInFlight(_ uint32, ep int, h uint64) (int, bool) {
	f.hashes[ep] = h
	return f.n[ep], f.ok
}

// The other nodes' load snapshots, when every node's is fresh, replace
// the scraped estimate; otherwise the scraped estimate is used.
func TestClusterLoadPrefersPeerSnapshots(t *testing.T) {
	eng := &fakeOthers{others: map[int]int{0: 4, 1: 2}}
	peers := &fakePeerLoad{n: map[int]int{1: 7}, ok: true, hashes: map[int]uint64{}}
	f := newFixtureConfig(t, Config{Seed: "1", ClusterLoad: true, PeerLoad: peers, Engine: EngineSignals{Others: eng}}, rule(3, ""))
	st := f.g.lookup(1)
	f.g.inflight.Counter(1, 1).Add(2)
	cs := f.g.candidates(st)
	if cs[0].InFlight != 0 || cs[1].InFlight != 2+7 {
		t.Fatalf("with fresh snapshots: %+v", cs)
	}
	if peers.hashes[1] != peerprefill.EndpointHash(st.addrs[1]) {
		t.Fatalf("asked for hash %x, endpoint's is %x", peers.hashes[1], peerprefill.EndpointHash(st.addrs[1]))
	}
	peers.ok = false
	cs = f.g.candidates(st)
	if cs[0].InFlight != 4 || cs[1].InFlight != 2+2 {
		t.Fatalf("without fresh snapshots: %+v", cs)
	}
}

// A node's snapshot is its own open, held and queued requests per
// endpoint, the loaded endpoints only.
func TestLocalLoad(t *testing.T) {
	f := newFixtureConfig(t, Config{Seed: "1"}, rule(3, ""))
	if got := f.g.LocalLoad(nil); len(got) != 0 {
		t.Fatalf("idle node: %+v", got)
	}
	f.g.inflight.Counter(1, 1).Add(3)
	got := f.g.LocalLoad(nil)
	want := peerprefill.Load{Service: 1, EP: 1, EPHash: peerprefill.EndpointHash("127.0.0.79:8000"), InFlight: 3}
	if len(got) != 1 || got[0] != want {
		t.Fatalf("got %+v, want %+v", got, want)
	}
}

// Two gateways routing to the same engines each count the requests the
// other has in flight on an endpoint, within a few load intervals, with
// no engine metrics at all, and see them end.
func TestClusterLoadSeesOtherGatewaysInFlight(t *testing.T) {
	a, b, _, _ := linkedGatewaysLoad(t, 2*time.Millisecond)
	inflight := func(f fixture, ep int) int { return f.g.candidates(f.g.lookup(1))[ep].InFlight }
	a.g.inflight.Counter(1, 0).Add(3)
	waitUntil(t, "b counting a's 3 requests on endpoint 0", func() bool { return inflight(b, 0) == 3 })
	b.g.inflight.Counter(1, 0).Add(2)
	waitUntil(t, "a counting its 3 and b's 2", func() bool { return inflight(a, 0) == 5 })
	waitUntil(t, "b counting its 2 and a's 3", func() bool { return inflight(b, 0) == 5 })
	if inflight(a, 1) != 0 || inflight(b, 1) != 0 {
		t.Fatal("load on an endpoint neither node sent to")
	}
	a.g.inflight.Counter(1, 0).Add(-3)
	waitUntil(t, "a's requests ended at b", func() bool { return inflight(b, 0) == 2 })
}
