package control

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/store"
)

type recorder struct {
	last []Service
	fail bool
}

func (r *recorder) Name() string { return "recorder" }
func (r *recorder) Reconcile(_ context.Context, s []Service) error {
	if r.fail {
		return errors.New("bind 127.0.0.10:2090: address already in use")
	}
	r.last = s
	return nil
}

const body = `{"serviceArguments":{"externalIP":"127.0.0.10","port":2090,"protocol":"tcp","mode":4,"sel":8,"kvExactMode":3,"kvEngineType":"sglang","name":"chat"},
"endpoints":[{"endpointIP":"127.0.0.11","targetPort":30000,"weight":1},{"endpointIP":"127.0.0.12","targetPort":30000,"weight":1}]}`

func newCtl(t *testing.T, dir string) (*Controller, *recorder, store.Store) {
	st, err := store.OpenBolt(dir)
	if err != nil {
		t.Fatal(err)
	}
	c := New(st, lbrule.Settings{}, nil)
	rec := &recorder{}
	c.AddReconciler(rec)
	if err := c.Load(context.Background()); err != nil {
		t.Fatal(err)
	}
	return c, rec, st
}

func TestLifecycle(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	c, rec, st := newCtl(t, dir)
	svc, created, err := c.Create(ctx, []byte(body))
	if err != nil || !created || svc.ID != 1 {
		t.Fatalf("create: %v %v %+v", err, created, svc)
	}
	if len(rec.last) != 1 {
		t.Fatalf("reconciler saw %d services", len(rec.last))
	}
	if _, _, err := c.Create(ctx, []byte(body)); !errors.Is(err, lbrule.ErrConflict) {
		t.Fatalf("duplicate: %v", err)
	}
	changed := strings.Replace(body, `"kvEngineType":"sglang"`, `"kvEngineType":"trtllm"`, 1)
	if _, _, err := c.Create(ctx, []byte(changed)); !errors.Is(err, lbrule.ErrConflict) || !strings.Contains(err.Error(), "delete and recreate") {
		t.Fatalf("engine change: %v", err)
	}
	updated := strings.Replace(body, `"sel":8`, `"sel":0`, 1)
	svc2, created, err := c.Create(ctx, []byte(updated))
	if err != nil || created || svc2.ID != 1 || svc2.Rule.Service.Sel != 0 {
		t.Fatalf("update: %v %v %+v", err, created, svc2)
	}
	// A failing stage rolls the change back.
	rec.fail = true
	other := strings.Replace(body, `"port":2090`, `"port":2091`, 1)
	if _, _, err := c.Create(ctx, []byte(other)); !errors.Is(err, ErrApply) {
		t.Fatalf("apply failure: %v", err)
	}
	rec.fail = false
	if n := len(c.List()); n != 1 {
		t.Fatalf("rolled-back rule kept: %d rules", n)
	}
	st.Close()

	// Restart: the rule is back, unchanged.
	c2, rec2, st2 := newCtl(t, dir)
	defer st2.Close()
	got := c2.List()
	if len(got) != 1 || got[0].ID != 1 || got[0].Rule.Service.Sel != 0 || len(rec2.last) != 1 {
		t.Fatalf("after restart: %+v", got)
	}
	if _, err := c2.DeleteByName(ctx, "nope"); !errors.Is(err, lbrule.ErrNotFound) {
		t.Fatalf("delete unknown name: %v", err)
	}
	if n, err := c2.DeleteByName(ctx, "chat"); err != nil || n != 1 {
		t.Fatalf("delete by name: %d %v", n, err)
	}
	if err := c2.Delete(ctx, lbrule.Key{IP: "127.0.0.10", Port: 2090, Proto: "tcp"}); !errors.Is(err, lbrule.ErrNotFound) {
		t.Fatalf("delete twice: %v", err)
	}
	if len(rec2.last) != 0 {
		t.Fatal("reconciler still has the rule")
	}
}

// TestSecondListenerOnVIPPortIsConflict: two mode-4 rules that differ only
// by block mark would need the same listener; the second is a 409, not a
// proxy configuration error (500).
func TestSecondListenerOnVIPPortIsConflict(t *testing.T) {
	ctx := context.Background()
	c, _, st := newCtl(t, t.TempDir())
	defer st.Close()
	if _, _, err := c.Create(ctx, []byte(body)); err != nil {
		t.Fatal(err)
	}
	marked := strings.Replace(body, `"name":"chat"`, `"name":"chat","block":7`, 1)
	_, _, err := c.Create(ctx, []byte(marked))
	var re *lbrule.RuleError
	if !errors.As(err, &re) || !errors.Is(err, lbrule.ErrConflict) || re.Field != "serviceArguments.block" {
		t.Fatalf("want 409 on serviceArguments.block, got %v", err)
	}
	// An update of the same rule is not a conflict with itself.
	updated := strings.Replace(body, `"sel":8`, `"sel":0`, 1)
	if _, created, err := c.Create(ctx, []byte(updated)); err != nil || created {
		t.Fatalf("update: %v %v", created, err)
	}
}
