package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// fakeBackend keeps records in memory with one owner per name, as etcd
// leases do.
type fakeBackend struct {
	mu      sync.Mutex
	recs    map[string][]byte
	owner   map[string]*fakeReg
	readErr error
}

type fakeReg struct {
	b    *fakeBackend
	name string
	lost chan struct{}
	once sync.Once
}

func newFake() *fakeBackend {
	return &fakeBackend{recs: map[string][]byte{}, owner: map[string]*fakeReg{}}
}

func (b *fakeBackend) Register(_ context.Context, name string, v []byte, _ time.Duration) (Registration, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, held := b.recs[name]; held {
		return nil, errors.New("node name " + name + " is held by another live lease")
	}
	r := &fakeReg{b: b, name: name, lost: make(chan struct{})}
	b.recs[name], b.owner[name] = v, r
	return r, nil
}

func (b *fakeBackend) Members(context.Context) (map[string][]byte, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.readErr != nil {
		return nil, b.readErr
	}
	out := map[string][]byte{}
	for k, v := range b.recs {
		out[k] = v
	}
	return out, nil
}

// expire ends name's lease as etcd does when keepalives stop.
func (b *fakeBackend) expire(name string) {
	b.mu.Lock()
	r := b.owner[name]
	delete(b.recs, name)
	delete(b.owner, name)
	b.mu.Unlock()
	if r != nil {
		r.once.Do(func() { close(r.lost) })
	}
}

func (b *fakeBackend) values() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var s []string
	for k, v := range b.recs {
		s = append(s, k+"="+string(v))
	}
	return strings.Join(s, "\n")
}

func (r *fakeReg) Update(_ context.Context, v []byte) error {
	r.b.mu.Lock()
	defer r.b.mu.Unlock()
	if o, ok := r.b.owner[r.name]; ok && o != r {
		return errors.New("held by another lease")
	}
	r.b.recs[r.name], r.b.owner[r.name] = v, r
	return nil
}

func (r *fakeReg) Lost() <-chan struct{} { return r.lost }

func (r *fakeReg) Close() error {
	r.b.mu.Lock()
	if r.b.owner[r.name] == r {
		delete(r.b.recs, r.name)
		delete(r.b.owner, r.name)
	}
	r.b.mu.Unlock()
	return nil
}

type node struct {
	m      *Membership
	mu     sync.Mutex
	seed   string // its fingerprint
	cancel context.CancelFunc
	done   chan struct{}
	reg    *prometheus.Registry
}

// setSeed changes the node's seed fingerprint.
func (n *node) setSeed(fp string) {
	n.mu.Lock()
	n.seed = fp
	n.mu.Unlock()
}

// startNode runs a member announcing seedFP as its seed fingerprint.
func startNode(t *testing.T, b Backend, name, seedFP string) *node {
	t.Helper()
	n := &node{done: make(chan struct{}), reg: prometheus.NewRegistry()}
	n.setSeed(seedFP)
	m, err := New(Config{Self: Member{Name: name, Address: "127.0.0.1:1", Peer: name + ":7946", Version: "test", Started: time.Now()},
		Local: func() map[string]string {
			n.mu.Lock()
			defer n.mu.Unlock()
			return map[string]string{SettingSeed: n.seed, "LOXILB_KV_SPILL_MIN_LOAD": "2"}
		}, Backend: b, TTL: 3 * time.Second, Interval: 5 * time.Millisecond}, nil, n.reg)
	if err != nil {
		t.Fatal(err)
	}
	n.m = m
	ctx, cancel := context.WithCancel(context.Background())
	n.cancel = cancel
	go func() { defer close(n.done); _ = m.Run(ctx) }()
	t.Cleanup(n.stop)
	return n
}

func (n *node) stop() { n.cancel(); <-n.done }

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("never: %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestSingleNodeView(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := New(Config{Self: Member{Name: "solo"}, Local: func() map[string]string { return map[string]string{SettingSeed: "f"} }}, nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	v := m.View()
	if v.Backend != "single" || len(v.Nodes) != 1 || !v.Nodes[0].Self || v.Nodes[0].State != StateOK || v.Drifted || !v.Registered || v.Drift == nil {
		t.Fatalf("single-node view: %+v", v)
	}
	if got := testutil.ToFloat64(collector(t, reg, "loxilb_cluster_nodes")); got != 1 {
		t.Fatalf("loxilb_cluster_nodes %v", got)
	}
}

// collector finds one registered gauge by name.
func collector(t *testing.T, reg *prometheus.Registry, name string) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: "copy"}, func() float64 { return mf.GetMetric()[0].GetGauge().GetValue() })
		}
	}
	t.Fatalf("no metric %s", name)
	return nil
}

func metric(t *testing.T, n *node, name string) float64 {
	t.Helper()
	return testutil.ToFloat64(collector(t, n.reg, name))
}

func TestTwoNodesDriftAndRecovery(t *testing.T) {
	b := newFake()
	const seedA, seedB = "4242424242", "1717171717"
	fpA := SeedFingerprint(seedA)
	a := startNode(t, b, "a", fpA)
	bn := startNode(t, b, "b", SeedFingerprint(seedB))
	eventually(t, "both nodes see each other and the seed drift", func() bool {
		va, vb := a.m.View(), bn.m.View()
		return len(va.Nodes) == 2 && len(vb.Nodes) == 2 && va.Drifted && vb.Drifted
	})
	v := a.m.View()
	if len(v.Drift) != 1 || v.Drift[0].Setting != SettingSeed || strings.Join(v.Drift[0].Drifting, ",") != "a,b" {
		t.Fatalf("drift: %+v", v.Drift)
	}
	if deg, why := v.Degraded(); !deg || !strings.Contains(why, SettingSeed) {
		t.Fatalf("a not degraded: %v %q", deg, why)
	}
	for _, n := range v.Nodes {
		if n.State != StateDegraded {
			t.Fatalf("node %s state %s with a two-way seed drift", n.Name, n.State)
		}
	}
	if metric(t, a, "loxilb_cluster_nodes") != 2 || metric(t, a, "loxilb_cluster_drift") != 1 || metric(t, a, "loxilb_cluster_self_degraded") != 1 {
		t.Fatal("metrics do not show two nodes and one drifting setting")
	}
	// Neither seed is announced or shown.
	out, _ := json.Marshal(v)
	for _, s := range []string{seedA, seedB} {
		if strings.Contains(string(out), s) || strings.Contains(b.values(), s) {
			t.Fatalf("seed %s appears in the view or the stored records", s)
		}
	}

	// The operator fixes b: the drift clears on both nodes.
	bn.setSeed(fpA)
	eventually(t, "drift cleared", func() bool { return !a.m.View().Drifted && !bn.m.View().Drifted })
	if deg, _ := a.m.View().Degraded(); deg {
		t.Fatal("a still degraded")
	}

	// b stops: its record is withdrawn and a sees one node.
	bn.stop()
	eventually(t, "b gone", func() bool { return len(a.m.View().Nodes) == 1 })
}

func TestThirdNodeMinorityDrifts(t *testing.T) {
	b := newFake()
	a, bb, c := startNode(t, b, "a", "s"), startNode(t, b, "b", "s"), startNode(t, b, "c", "other")
	eventually(t, "three nodes", func() bool { return len(a.m.View().Nodes) == 3 && len(c.m.View().Nodes) == 3 })
	if deg, _ := a.m.View().Degraded(); deg {
		t.Fatal("a holds the majority seed and is degraded")
	}
	if deg, _ := bb.m.View().Degraded(); deg {
		t.Fatal("b holds the majority seed and is degraded")
	}
	if deg, why := c.m.View().Degraded(); !deg || !strings.Contains(why, "a=") {
		t.Fatalf("c: %v %q", deg, why)
	}
}

func TestNameTakenAndLeaseLost(t *testing.T) {
	b := newFake()
	a := startNode(t, b, "a", "s")
	eventually(t, "a registered", func() bool { return a.m.View().Registered })
	dup := startNode(t, b, "a", "s")
	eventually(t, "duplicate name reported", func() bool {
		v := dup.m.View()
		return !v.Registered && strings.Contains(v.Reason, "held by another live lease")
	})
	if metric(t, dup, "loxilb_cluster_registered") != 0 {
		t.Fatal("loxilb_cluster_registered is 1 for a node whose name is taken")
	}
	dup.stop()
	// The lease ends under a (the store was unreachable too long): it
	// registers again.
	b.expire("a")
	eventually(t, "a registered again", func() bool {
		_, held := must(b.Members(context.Background()))["a"]
		return held && a.m.View().Registered
	})
	// A record deleted behind a's back is put back.
	b.mu.Lock()
	delete(b.recs, "a")
	b.mu.Unlock()
	eventually(t, "record restored", func() bool { _, ok := must(b.Members(context.Background()))["a"]; return ok })
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func TestInvalidRecordsCounted(t *testing.T) {
	b := newFake()
	b.recs["evil"] = []byte(`{"name":"evil","settings":{"k":` + strings.Repeat("[", 1000) + `}}`)
	b.recs["liar"] = []byte(`{"name":"someone-else"}`)
	a := startNode(t, b, "a", "s")
	eventually(t, "invalid records reported", func() bool { return len(a.m.View().Invalid) == 2 })
	if v := a.m.View(); len(v.Nodes) != 1 || v.Drifted {
		t.Fatalf("invalid records became nodes: %+v", v)
	}
	if metric(t, a, "loxilb_cluster_invalid_records") != 2 {
		t.Fatal("invalid records not counted")
	}
	// The others unreadable: the last read stays, with the reason.
	b.mu.Lock()
	b.readErr = errors.New("etcd down")
	b.mu.Unlock()
	eventually(t, "read error reported", func() bool { return strings.Contains(a.m.View().Reason, "etcd down") })
}

func TestSeedFingerprint(t *testing.T) {
	f := SeedFingerprint("0")
	if len(f) != 16 || f != SeedFingerprint("0") || f == SeedFingerprint("1") {
		t.Fatalf("fingerprint %q", f)
	}
	if SeedFingerprint("") != SeedUnset {
		t.Fatal("unset seed")
	}
	// Pinned (python3: hashlib.pbkdf2_hmac("sha256", b"12345", salt,
	// 100000, 8)): nodes of different builds must agree.
	if got := SeedFingerprint("12345"); got != "d3b6617bdb11fc5c" {
		t.Fatalf("fingerprint of 12345 is %s, want d3b6617bdb11fc5c", got)
	}
}

func TestTokenizerChecksums(t *testing.T) {
	dir := t.TempDir()
	write := func(p, s string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(filepath.Join(dir, "org__m", "tokenizer.json"), `{"model":{}}`)
	write(filepath.Join(dir, "empty", "README"), "no tokenizer here")
	// A directory name longer than a record allows is left out rather
	// than making the record unannounceable.
	write(filepath.Join(dir, strings.Repeat("x", 250), "tokenizer.json"), `{}`)
	tk := NewTokenizers(dir)
	s1 := tk.Settings()
	if len(s1) != 1 || len(s1[TokenizerPrefix+"org/m"]) != 16 {
		t.Fatalf("settings %v", s1)
	}
	// A chat template staged beside it changes the sum.
	write(filepath.Join(dir, "org__m", "tokenizer_config.json"), `{"chat_template":"x"}`)
	s2 := tk.Settings()
	if s2[TokenizerPrefix+"org/m"] == s1[TokenizerPrefix+"org/m"] {
		t.Fatal("tokenizer_config.json did not change the checksum")
	}
	// The same files elsewhere give the same sum (what two nodes compare).
	other := t.TempDir()
	write(filepath.Join(other, "org__m", "tokenizer.json"), `{"model":{}}`)
	write(filepath.Join(other, "org__m", "tokenizer_config.json"), `{"chat_template":"x"}`)
	if got := NewTokenizers(other).Settings(); got[TokenizerPrefix+"org/m"] != s2[TokenizerPrefix+"org/m"] {
		t.Fatalf("same files, different sums: %v %v", got, s2)
	}
	// Removed: no longer announced.
	if err := os.RemoveAll(filepath.Join(dir, "org__m")); err != nil {
		t.Fatal(err)
	}
	if got := tk.Settings(); len(got) != 0 {
		t.Fatalf("after removal: %v", got)
	}
}

// Each node sends prefill announcements to the others' peer addresses,
// never to its own; a node that leaves is no longer a peer.
func TestPeerAddrs(t *testing.T) {
	b := newFake()
	a, c := startNode(t, b, "a", "f"), startNode(t, b, "c", "f")
	eventually(t, "each node reading the other's peer address", func() bool {
		pa, pc := a.m.PeerAddrs(), c.m.PeerAddrs()
		return len(pa) == 1 && pa[0] == "c:7946" && len(pc) == 1 && pc[0] == "a:7946"
	})
	c.stop()
	eventually(t, "the stopped node no longer a peer", func() bool { return len(a.m.PeerAddrs()) == 0 })
}
