package store

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestMembersLeases runs against a real etcd: a node name is held by one
// live lease, Close removes the record at once, and a node that stops
// renewing (its client gone, as when the process is killed) is removed
// by etcd within the TTL.
func TestMembersLeases(t *testing.T) {
	srv := sharedEtcd(t)
	ctx := context.Background()
	a, b := openEtcd(t, srv.Endpoint, "/m1/"), openEtcd(t, srv.Endpoint, "/m1/")
	la, err := a.Register(ctx, "node-a", []byte("v1"), 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Register(ctx, "node-a", []byte("x"), 2*time.Second); !errors.Is(err, ErrNameTaken) {
		t.Fatalf("second holder of node-a: %v, want ErrNameTaken", err)
	}
	if err := la.Update(ctx, []byte("v2")); err != nil {
		t.Fatal(err)
	}
	got, err := b.Members(ctx)
	if err != nil || len(got) != 1 || string(got["node-a"]) != "v2" {
		t.Fatalf("members %q %v", got, err)
	}
	// Deleted behind its back, the record is put back by Update.
	if _, err := b.cli.Delete(ctx, "/m1/members/node-a"); err != nil {
		t.Fatal(err)
	}
	if err := la.Update(ctx, []byte("v3")); err != nil {
		t.Fatal(err)
	}
	if got, _ := b.Members(ctx); string(got["node-a"]) != "v3" {
		t.Fatalf("after delete and update: %q", got)
	}
	// Renewed past its TTL, the lease keeps the record.
	time.Sleep(3 * time.Second)
	if got, _ := b.Members(ctx); string(got["node-a"]) != "v3" {
		t.Fatalf("record expired although renewed: %q", got)
	}
	if err := la.Close(); err != nil {
		t.Fatal(err)
	}
	if got, _ := b.Members(ctx); len(got) != 0 {
		t.Fatalf("after Close: %q", got)
	}
	select {
	case <-la.Lost():
		t.Fatal("Close reported as a lost lease")
	default:
	}

	// This process's own earlier lease, which it could not revoke (etcd
	// was away when its keepalives stopped), is taken over at once; a
	// live one never is.
	ld, err := a.Register(ctx, "node-d", []byte("d1"), 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Register(ctx, "node-d", []byte("d2"), 2*time.Second); !errors.Is(err, ErrNameTaken) {
		t.Fatalf("live lease of node-d taken over: %v", err)
	}
	ld.stop() // keepalives end, the lease stays in etcd
	ld.ended.Store(true)
	if _, err := b.Register(ctx, "node-d", []byte("d2"), 2*time.Second); !errors.Is(err, ErrNameTaken) {
		t.Fatalf("another process took node-d over: %v", err)
	}
	ld2, err := a.Register(ctx, "node-d", []byte("d2"), 2*time.Second)
	if err != nil {
		t.Fatalf("own ended lease not taken over: %v", err)
	}
	if got, _ := b.Members(ctx); string(got["node-d"]) != "d2" {
		t.Fatalf("node-d after take-over: %q", got)
	}
	ld2.Close()

	// A node that dies without revoking: the record goes when the lease
	// expires, and the name is free again.
	lb, err := b.Register(ctx, "node-b", []byte("b"), 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer lb.Close()
	c := openEtcd(t, srv.Endpoint, "/m1/")
	if _, err := c.Register(ctx, "node-c", []byte("c"), 2*time.Second); err != nil {
		t.Fatal(err)
	}
	c.cli.Close() // no revoke: as kill -9
	died := time.Now()
	for {
		got, err := b.Members(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := got["node-c"]; !ok {
			break
		}
		if time.Since(died) > 30*time.Second {
			t.Fatal("node-c's record outlived its lease by far")
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("dead node's record removed %v after its client went (ttl 2s)", time.Since(died).Round(time.Millisecond))
	if got, _ := b.Members(ctx); string(got["node-b"]) != "b" {
		t.Fatalf("live node's record: %q", got)
	}
}
