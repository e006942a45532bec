package store

import (
	"context"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
)

// DrainElection elects, per key, the one node of a cluster sharing this
// etcd store that drains a TensorRT-LLM endpoint (kvevents.DrainOwnership).
// Each key is an etcd election under <prefix>trt-drain/<key>/ campaigned
// with a lease of its own: the owner's lease is kept alive while it runs,
// revoked when it stops (the next candidate takes over at once), and
// expires TTL after a crash or partition (the next candidate takes over
// then). A node that cannot renew its lease for TTL stops calling itself
// the owner, so two nodes drain at once only while the old owner's lease
// outlives its last renewal, never after.
type DrainElection struct {
	e   *Etcd
	ttl int
}

// MinDrainLeaseTTL is the shortest lease etcd grants with its default
// timing (1.5 election timeouts, rounded up to whole seconds).
const MinDrainLeaseTTL = 2 * time.Second

// DrainElection returns the elections of this store with leases of ttl
// (whole seconds, at least MinDrainLeaseTTL).
func (e *Etcd) DrainElection(ttl time.Duration) *DrainElection {
	ttl = max(ttl, MinDrainLeaseTTL)
	return &DrainElection{e: e, ttl: int((ttl + time.Second - 1) / time.Second)}
}

// Follow implements kvevents.DrainOwnership: it campaigns for key with
// value until ctx ends and reports every owner it observes. When the
// lease is lost (etcd unreachable for TTL) it starts over with a new
// lease; an owner then reports no owner (it must stop draining), while a
// node that did not own the key keeps the owner it last saw (its relay
// needs no etcd).
func (d *DrainElection) Follow(ctx context.Context, key, value string, report func(owner string, self bool)) {
	owned := false
	report = func(next func(string, bool)) func(string, bool) {
		return func(owner string, self bool) {
			if owner == "" && !owned {
				return
			}
			owned = self
			next(owner, self)
		}
	}(report)
	backoff := 200 * time.Millisecond
	for ctx.Err() == nil {
		sess, err := d.session(ctx)
		if err != nil {
			report("", false)
			t := time.NewTimer(backoff)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			backoff = min(2*backoff, time.Duration(d.ttl)*time.Second)
			continue
		}
		backoff = 200 * time.Millisecond
		d.campaign(ctx, sess, key, value, report)
		// Revoke (bounded by the session's TTL): a node that stops gives
		// its endpoints up at once instead of after TTL.
		_ = sess.Close()
	}
}

// session grants a lease within the store's request timeout (a session
// would wait for etcd without bound) and keeps it alive in the background.
func (d *DrainElection) session(ctx context.Context) (*concurrency.Session, error) {
	gctx, cancel := context.WithTimeout(ctx, d.e.opTO)
	lease, err := d.e.cli.Grant(gctx, int64(d.ttl))
	cancel()
	if err != nil {
		return nil, err
	}
	// The session's own context is not ctx: Close must still revoke
	// after ctx ends.
	return concurrency.NewSession(d.e.cli, concurrency.WithLease(lease.ID), concurrency.WithTTL(d.ttl),
		concurrency.WithContext(context.WithoutCancel(ctx)))
}

// campaign runs one lease's election until ctx ends or the lease is lost.
func (d *DrainElection) campaign(ctx context.Context, sess *concurrency.Session, key, value string, report func(string, bool)) {
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	el := concurrency.NewElection(sess, d.e.prefix+"trt-drain/"+key)
	won := make(chan error, 1)
	go func() { won <- el.Campaign(cctx, value) }()
	obs := el.Observe(cctx)
	for {
		select {
		case <-ctx.Done():
			return
		case <-sess.Done():
			report("", false)
			return
		case err := <-won:
			if err != nil {
				report("", false)
				return
			}
			won = nil // elected: Observe reports this node next
		case resp, ok := <-obs:
			if !ok {
				report("", false)
				return
			}
			if len(resp.Kvs) == 0 {
				continue
			}
			kv := resp.Kvs[0]
			report(string(kv.Value), clientv3.LeaseID(kv.Lease) == sess.Lease())
		}
	}
}
