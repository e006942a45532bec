package store

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Node membership lives beside the rules, under <prefix>members/<name>,
// each key attached to its node's lease: when a node stops renewing it
// (the process died, or it lost etcd for a whole TTL), etcd deletes the
// key. The values are opaque here (pkg/cluster encodes them).

// ErrNameTaken: another live lease holds the node name.
var ErrNameTaken = errors.New("node name is held by another live node")

// maxMembers bounds one read of the member keys.
const maxMembers = 1024

func (e *Etcd) memberKey(name string) string { return e.prefix + "members/" + name }

// Lease is one node's announcement, kept alive until Close.
type Lease struct {
	e    *Etcd
	id   clientv3.LeaseID
	key  string
	stop context.CancelFunc
	lost chan struct{}
	once sync.Once
	// ended is set once keepalives stopped (lost or closed): the lease
	// may still exist in etcd if it could not be revoked.
	ended atomic.Bool
}

// Register puts value under the node name with a lease of ttl (whole
// seconds) kept alive in the background; it fails with ErrNameTaken while
// another lease holds the name (another node, or this node's previous
// process until its lease expires).
func (e *Etcd) Register(ctx context.Context, name string, value []byte, ttl time.Duration) (*Lease, error) {
	if name == "" || strings.ContainsAny(name, "/") {
		return nil, fmt.Errorf("store: node name %q", name)
	}
	ctx, cancel := context.WithTimeout(ctx, e.opTO)
	defer cancel()
	g, err := e.cli.Grant(ctx, int64(ttl/time.Second))
	if err != nil {
		return nil, fmt.Errorf("etcd %s: grant a lease: %w", e.where, err)
	}
	key := e.memberKey(name)
	put := func() (*clientv3.TxnResponse, error) {
		return e.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
			Then(clientv3.OpPut(key, string(value), clientv3.WithLease(g.ID))).
			Else(clientv3.OpGet(key)).Commit()
	}
	resp, err := put()
	if err == nil && !resp.Succeeded {
		// The holder may be this process's own earlier lease, which it
		// could not revoke while etcd was away: take the name back now
		// rather than wait for that lease to run out.
		if kvs := resp.Responses[0].GetResponseRange().GetKvs(); len(kvs) == 1 && e.ownLease(name, clientv3.LeaseID(kvs[0].Lease)) {
			if _, err = e.cli.Revoke(ctx, clientv3.LeaseID(kvs[0].Lease)); err == nil {
				resp, err = put()
			}
		}
	}
	if err == nil && !resp.Succeeded {
		err = fmt.Errorf("%w: %s (a node that died frees it within the lease ttl)", ErrNameTaken, name)
	}
	if err != nil {
		rctx, rcancel := context.WithTimeout(context.Background(), e.opTO)
		_, _ = e.cli.Revoke(rctx, g.ID)
		rcancel()
		return nil, err
	}
	kctx, stop := context.WithCancel(context.Background())
	ka, err := e.cli.KeepAlive(kctx, g.ID)
	if err != nil {
		stop()
		return nil, fmt.Errorf("etcd %s: keep the lease alive: %w", e.where, err)
	}
	l := &Lease{e: e, id: g.ID, key: key, stop: stop, lost: make(chan struct{})}
	e.leasesMu.Lock()
	if e.leases == nil {
		e.leases = map[string]*Lease{}
	}
	e.leases[name] = l
	e.leasesMu.Unlock()
	go func() {
		for range ka {
		}
		// The channel closes when the lease expired or was revoked, or
		// on Close; only the first two are a loss.
		l.ended.Store(true)
		if kctx.Err() == nil {
			l.once.Do(func() { close(l.lost) })
		}
	}()
	return l, nil
}

// ownLease reports whether id is the last lease this process registered
// name under, and no longer kept alive.
func (e *Etcd) ownLease(name string, id clientv3.LeaseID) bool {
	e.leasesMu.Lock()
	defer e.leasesMu.Unlock()
	l := e.leases[name]
	return id != 0 && l != nil && l.id == id && l.ended.Load()
}

// Update replaces the value under the lease, and puts it back if the key
// was deleted while the lease lives.
func (l *Lease) Update(ctx context.Context, value []byte) error {
	ctx, cancel := context.WithTimeout(ctx, l.e.opTO)
	defer cancel()
	put := clientv3.OpPut(l.key, string(value), clientv3.WithLease(l.id))
	resp, err := l.e.cli.Txn(ctx).If(clientv3.Compare(clientv3.LeaseValue(l.key), "=", l.id)).Then(put).
		Else(clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(l.key), "=", 0)}, []clientv3.Op{put}, nil)).Commit()
	if err != nil {
		return fmt.Errorf("etcd %s: %w", l.e.where, err)
	}
	if !resp.Succeeded && !resp.Responses[0].GetResponseTxn().Succeeded {
		return fmt.Errorf("%w: %s", ErrNameTaken, strings.TrimPrefix(l.key, l.e.prefix+"members/"))
	}
	return nil
}

// Lost is closed when the lease ended without Close.
func (l *Lease) Lost() <-chan struct{} { return l.lost }

// Close stops the keepalive and revokes the lease, deleting the key.
func (l *Lease) Close() error {
	l.ended.Store(true)
	l.stop()
	ctx, cancel := context.WithTimeout(context.Background(), l.e.opTO)
	defer cancel()
	_, err := l.e.cli.Revoke(ctx, l.id)
	return err
}

// Members returns every member record by node name (at most maxMembers).
func (e *Etcd) Members(ctx context.Context) (map[string][]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, e.opTO)
	defer cancel()
	resp, err := e.cli.Get(ctx, e.prefix+"members/", clientv3.WithPrefix(), clientv3.WithLimit(maxMembers))
	if err != nil {
		return nil, fmt.Errorf("etcd %s: %w", e.where, err)
	}
	out := make(map[string][]byte, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		out[strings.TrimPrefix(string(kv.Key), e.prefix+"members/")] = kv.Value
	}
	return out, nil
}
