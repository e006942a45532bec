package store

import (
	"context"
	"sync"
	"testing"
	"time"
)

// ownerLog records one node's reports for one key.
type ownerLog struct {
	mu    sync.Mutex
	owner string
	self  bool
	n     int
}

func (o *ownerLog) report(owner string, self bool) {
	o.mu.Lock()
	o.owner, o.self = owner, self
	o.n++
	o.mu.Unlock()
}

func (o *ownerLog) get() (string, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.owner, o.self
}

func waitOwner(t *testing.T, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for time.Since(start) < 60*time.Second {
		if cond() {
			return time.Since(start)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("timed out waiting for %s", what)
	return 0
}

// TestDrainElection: two nodes on one etcd agree on one owner per key; a
// node that stops gives its key up at once (revoked lease), one that
// vanishes without a word gives it up when its lease expires, and an
// owner that cannot reach etcd stops calling itself the owner.
func TestDrainElection(t *testing.T) {
	srv := sharedEtcd(t)
	const prefix = "/test/election/"
	a, b := openEtcd(t, srv.Endpoint, prefix), openEtcd(t, srv.Endpoint, prefix)
	ea, eb := a.DrainElection(time.Second), b.DrainElection(time.Second) // raised to 2s
	if ea.ttl != 2 {
		t.Fatalf("ttl %d, want the 2s minimum", ea.ttl)
	}
	var la, lb, lb2 ownerLog
	ctxA, stopA := context.WithCancel(context.Background())
	doneA := make(chan struct{})
	go func() { ea.Follow(ctxA, "10.0.0.1:8000", "A", la.report); close(doneA) }()
	waitOwner(t, "A owns", func() bool { o, s := la.get(); return o == "A" && s })
	ctxB, stopB := context.WithCancel(context.Background())
	defer stopB()
	doneB := make(chan struct{})
	go func() { eb.Follow(ctxB, "10.0.0.1:8000", "B", lb.report); close(doneB) }()
	// A second key is independent: B is alone on it and owns it.
	go eb.Follow(ctxB, "10.0.0.2:8000", "B", lb2.report)
	waitOwner(t, "B sees A as the owner", func() bool { o, s := lb.get(); return o == "A" && !s })
	waitOwner(t, "B owns the second key", func() bool { o, s := lb2.get(); return o == "B" && s })
	if o, s := la.get(); o != "A" || !s {
		t.Fatalf("A's view changed to %q %v", o, s)
	}

	// A stops: its lease is revoked and B takes over without waiting TTL.
	stopA()
	<-doneA
	took := waitOwner(t, "B owns after A stopped", func() bool { o, s := lb.get(); return o == "B" && s })
	t.Logf("after a graceful stop, B owned the key in %v", took.Round(time.Millisecond))

	// A comes back and waits behind B; then B vanishes (its client
	// closed: no revoke), and A takes over once B's lease expires.
	ctxA2, stopA2 := context.WithCancel(context.Background())
	defer stopA2()
	var la2 ownerLog
	go ea.Follow(ctxA2, "10.0.0.1:8000", "A", la2.report)
	waitOwner(t, "A follows B", func() bool { o, s := la2.get(); return o == "B" && !s })
	b.cli.Close()
	took = waitOwner(t, "A owns after B vanished", func() bool { o, s := la2.get(); return o == "A" && s })
	t.Logf("after B vanished, A owned the key in %v (lease TTL 2s)", took.Round(time.Millisecond))
	stopB()
	<-doneB

	// etcd gone: the owner stops calling itself the owner.
	srv.Stop()
	took = waitOwner(t, "A gives up ownership without etcd", func() bool { _, s := la2.get(); return !s })
	t.Logf("with etcd stopped, A gave the key up after %v", took.Round(time.Millisecond))
}
