package control

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/store"
	"github.com/loxilb-llm/loxilb/pkg/store/etcdtest"
)

// lockedRecorder is a stage that Follow's goroutine and the test read.
type lockedRecorder struct {
	mu   sync.Mutex
	last []Service
}

func (r *lockedRecorder) Name() string { return "recorder" }
func (r *lockedRecorder) Reconcile(_ context.Context, s []Service) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.last = append([]Service(nil), s...)
	return nil
}

func (r *lockedRecorder) ports() []int {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []int
	for _, s := range r.last {
		out = append(out, s.Rule.Service.Port)
	}
	return out
}

// node is one gateway's controller on the shared etcd store.
type node struct {
	ctl *Controller
	rec *lockedRecorder
	st  *store.Etcd
}

func newNode(t *testing.T, ep, prefix string) *node {
	t.Helper()
	st, err := store.OpenEtcd(store.EtcdConfig{Endpoints: []string{ep}, Prefix: prefix, OpTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	n := &node{ctl: New(st, lbrule.Settings{}, nil), rec: &lockedRecorder{}, st: st}
	n.ctl.AddReconciler(n.rec)
	if err := n.ctl.Load(context.Background()); err != nil {
		t.Fatal(err)
	}
	return n
}

func (n *node) follow(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = n.ctl.Follow(ctx, n.st); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for i := 0; i < 400; i++ {
		if cond() {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("timed out waiting for %s", what)
}

func withPort(p int) []byte {
	return []byte(strings.Replace(body, `"port":2090`, fmt.Sprintf(`"port":%d`, p), 1))
}

// TestSharedStoreFollow: a rule created, updated and deleted on node A is
// applied, updated and removed on node B by B's watch alone; A's own
// writes, read back by A's watch, change nothing on A.
func TestSharedStoreFollow(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b := newNode(t, srv.Endpoint, "/sync/"), newNode(t, srv.Endpoint, "/sync/")
	a.follow(t)
	b.follow(t)
	ctx := context.Background()
	svc, _, err := a.ctl.Create(ctx, withPort(3001))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	eventually(t, "rule on B", func() bool { p := b.rec.ports(); return len(p) == 1 && p[0] == 3001 })
	t.Logf("created on A, applied on B after %v", time.Since(start))
	got, ok := b.ctl.Get(svc.ID)
	if !ok || got.Status.State != StateApplied || string(got.CreateBody) != string(withPort(3001)) {
		t.Fatalf("on B: %+v", got)
	}
	updated := strings.Replace(string(withPort(3001)), `"sel":8`, `"sel":0`, 1)
	if _, created, err := b.ctl.Create(ctx, []byte(updated)); err != nil || created {
		t.Fatalf("update on B: %v %v", created, err)
	}
	eventually(t, "update on A", func() bool { s, _ := a.ctl.Get(svc.ID); return s.Rule.Service.Sel == 0 })
	if err := a.ctl.Delete(ctx, svc.Rule.Key()); err != nil {
		t.Fatal(err)
	}
	eventually(t, "delete on B", func() bool { return len(b.rec.ports()) == 0 && len(b.ctl.List()) == 0 })
}

// TestSharedStoreCreateRace: both nodes create the same rule before either
// saw the other's: one wins, the other gets a conflict (409) and, after its
// watch, serves the winner's rule; never both, never neither.
func TestSharedStoreCreateRace(t *testing.T) {
	srv := etcdtest.Start(t)
	for round := range 5 {
		prefix := fmt.Sprintf("/race/%d/", round)
		a, b := newNode(t, srv.Endpoint, prefix), newNode(t, srv.Endpoint, prefix)
		var wg sync.WaitGroup
		errs := make([]error, 2)
		for i, n := range []*node{a, b} {
			wg.Add(1)
			go func() { defer wg.Done(); _, _, errs[i] = n.ctl.Create(context.Background(), withPort(3002)) }()
		}
		wg.Wait()
		if (errs[0] == nil) == (errs[1] == nil) {
			t.Fatalf("round %d: want one winner, got %v / %v", round, errs[0], errs[1])
		}
		loser, lerr := b, errs[1]
		if errs[0] != nil {
			loser, lerr = a, errs[0]
		}
		var re *lbrule.RuleError
		if !errors.Is(lerr, lbrule.ErrConflict) || !errors.As(lerr, &re) || re.Reason != ReasonDuplicate {
			t.Fatalf("round %d: loser's error %v, want a conflict", round, lerr)
		}
		if len(loser.ctl.List()) != 0 || len(loser.rec.ports()) != 0 {
			t.Fatalf("round %d: the loser kept its own rule", round)
		}
		if err := loser.ctl.Resync(context.Background()); err != nil || len(loser.rec.ports()) != 1 {
			t.Fatalf("round %d: loser does not serve the winner's rule: %v", round, err)
		}
		recs, _ := a.st.List()
		if len(recs) != 1 {
			t.Fatalf("round %d: %d stored rules", round, len(recs))
		}
	}
}

// TestSharedStoreDamagedRecord: a record another writer damaged is
// reported, and the node still applies every other rule.
func TestSharedStoreDamagedRecord(t *testing.T) {
	srv := etcdtest.Start(t)
	a := newNode(t, srv.Endpoint, "/damaged/")
	if _, _, err := a.ctl.Create(context.Background(), withPort(3006)); err != nil {
		t.Fatal(err)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{srv.Endpoint}})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	if _, err := cli.Put(context.Background(), "/damaged/rules/00000009", "{not json"); err != nil {
		t.Fatal(err)
	}
	st, err := store.OpenEtcd(store.EtcdConfig{Endpoints: []string{srv.Endpoint}, Prefix: "/damaged/"})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	b := New(st, lbrule.Settings{}, nil)
	rec := &lockedRecorder{}
	b.AddReconciler(rec)
	if err := b.Load(context.Background()); err == nil || !strings.Contains(err.Error(), "stored rule 9 cannot be read") {
		t.Fatalf("load: %v", err)
	}
	if p := rec.ports(); len(p) != 1 || p[0] != 3006 {
		t.Fatalf("applied beside the damaged record: %v", p)
	}
}

// TestSharedStoreDown: with etcd gone, the node keeps its rules applied,
// refuses creates, updates and deletes with ErrUnavailable (the API's
// 503), and a resync changes nothing.
func TestSharedStoreDown(t *testing.T) {
	srv := etcdtest.Start(t)
	a := newNode(t, srv.Endpoint, "/down/")
	a.follow(t)
	ctx := context.Background()
	svc, _, err := a.ctl.Create(ctx, withPort(3003))
	if err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	eventually(t, "store down", func() bool { return !a.st.Health().Up })
	if _, _, err := a.ctl.Create(ctx, withPort(3004)); !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("create with etcd down: %v", err)
	}
	updated := strings.Replace(string(withPort(3003)), `"sel":8`, `"sel":0`, 1)
	if _, _, err := a.ctl.Create(ctx, []byte(updated)); !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("update with etcd down: %v", err)
	}
	if err := a.ctl.Delete(ctx, svc.Rule.Key()); !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("delete with etcd down: %v", err)
	}
	if err := a.ctl.Resync(ctx); !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("resync with etcd down: %v", err)
	}
	if p := a.rec.ports(); len(p) != 1 || p[0] != 3003 {
		t.Fatalf("rules served with etcd down: %v", p)
	}
	if s, _ := a.ctl.Get(svc.ID); s.Rule.Service.Sel != 8 || s.Status.State != StateApplied {
		t.Fatalf("the refused update changed the rule: %+v", s)
	}
}
