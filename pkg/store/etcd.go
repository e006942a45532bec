package store

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// EtcdConfig says how to reach the etcd cluster that several nodes share.
type EtcdConfig struct {
	// Endpoints are host:port of the cluster's client URLs.
	Endpoints []string
	// Prefix is the key prefix every key of this store lives under, so
	// one etcd can hold several gateway clusters. Default "/loxilb/".
	Prefix string
	// Username and Password authenticate (etcd auth); empty: none.
	Username, Password string
	// TLS, when set, is used for every connection (server verification
	// and, with a certificate, client authentication).
	TLS *tls.Config
	// DialTimeout bounds the first connection; OpTimeout every request.
	// Defaults 5s and 2s.
	DialTimeout, OpTimeout time.Duration
}

// ParseEtcdURL reads the --store value etcd://host:port[,host:port...].
func ParseEtcdURL(s string) ([]string, error) {
	rest, ok := strings.CutPrefix(s, "etcd://")
	if !ok {
		return nil, fmt.Errorf("store %q: want bolt or etcd://host:port[,host:port...]", s)
	}
	var eps []string
	for _, ep := range strings.Split(rest, ",") {
		h, p, err := splitHostPort(ep)
		if err != nil {
			return nil, fmt.Errorf("store %q: endpoint %q: %w", s, ep, err)
		}
		eps = append(eps, h+":"+p)
	}
	return eps, nil
}

func splitHostPort(ep string) (string, string, error) {
	i := strings.LastIndexByte(ep, ':')
	if i <= 0 || i == len(ep)-1 {
		return "", "", errors.New("want host:port")
	}
	h, p := ep[:i], ep[i+1:]
	if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
		return "", "", fmt.Errorf("port %q: want 1..65535", p)
	}
	if strings.ContainsAny(h, "/ ") {
		return "", "", fmt.Errorf("host %q: want a host name or address", h)
	}
	return h, p, nil
}

// Etcd is the shared Store: rules, claims, the id counter and settings
// live in one etcd cluster, and every write is one transaction, so two
// nodes never both win a claim and never draw the same id.
type Etcd struct {
	cli    *clientv3.Client
	prefix string
	where  string
	opTO   time.Duration

	// monitored is set while Watch runs: its probe then keeps up current
	// and requests fail at once while the cluster is known unreachable.
	monitored atomic.Bool
	mu        sync.Mutex
	up        bool
	since     time.Time
	lastErr   error

	// leases are the member leases this process registered, by node
	// name (Register).
	leasesMu sync.Mutex
	leases   map[string]*Lease
}

var _ Store = (*Etcd)(nil)
var _ Watcher = (*Etcd)(nil)

// OpenEtcd connects to the cluster and checks it answers (a read), so a
// wrong address, bad credentials or a TLS mismatch stop the daemon at
// start, named, rather than at the first write.
func OpenEtcd(cfg EtcdConfig) (*Etcd, error) {
	if len(cfg.Endpoints) == 0 {
		return nil, errors.New("etcd store: no endpoints")
	}
	if cfg.Prefix == "" {
		cfg.Prefix = "/loxilb/"
	}
	if !strings.HasSuffix(cfg.Prefix, "/") {
		cfg.Prefix += "/"
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = 5 * time.Second
	}
	if cfg.OpTimeout <= 0 {
		cfg.OpTimeout = 2 * time.Second
	}
	where := strings.Join(cfg.Endpoints, ",")
	cli, err := clientv3.New(clientv3.Config{Endpoints: cfg.Endpoints, DialTimeout: cfg.DialTimeout, TLS: cfg.TLS,
		Username: cfg.Username, Password: cfg.Password, Logger: zap.NewNop(),
		DialKeepAliveTime: 2 * time.Second, DialKeepAliveTimeout: 2 * time.Second,
		// A reply (the whole rule set) is bounded: etcd's default would
		// accept 2 GiB before decoding it.
		MaxCallRecvMsgSize: maxReplyBytes})
	if err != nil {
		return nil, fmt.Errorf("etcd store %s: %w", where, err)
	}
	e := &Etcd{cli: cli, prefix: cfg.Prefix, where: where, opTO: cfg.OpTimeout, up: true, since: time.Now()}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.DialTimeout)
	defer cancel()
	if _, err := cli.Get(ctx, e.prefix+"meta/next_id"); err != nil {
		cli.Close()
		return nil, fmt.Errorf("etcd store %s: not reachable (check the address, --store-tls-* and --store-user): %w", where, err)
	}
	return e, nil
}

func (e *Etcd) ruleKey(id uint32) string { return fmt.Sprintf("%srules/%08x", e.prefix, id) }
func (e *Etcd) claimKey(c string) string { return e.prefix + "claims/" + c }
func (e *Etcd) idKey() string            { return e.prefix + "meta/next_id" }

// op runs f with the request timeout, failing at once while the cluster
// is known to be unreachable, and keeps the health current.
func (e *Etcd) op(f func(ctx context.Context) error) error {
	if e.monitored.Load() {
		if h := e.Health(); !h.Up {
			return &UnavailableError{Backend: "etcd " + e.where, Since: h.Since, Err: errors.New(h.Err)}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), e.opTO)
	defer cancel()
	err := f(ctx)
	var ce *ClaimError
	var cor *CorruptError
	switch {
	case err == nil:
		e.setUp(nil)
		return nil
	case errors.As(err, &ce), errors.As(err, &cor), errors.Is(err, errIDSpace):
		e.setUp(nil)
		return err
	case errors.Is(err, rpctypes.ErrRequestTooLarge), status.Code(err) == codes.ResourceExhausted:
		// The cluster answered: it refuses this request, not every one.
		e.setUp(nil)
		return fmt.Errorf("%w: etcd %s: %w (raise etcd's --max-request-bytes, or make the rule smaller)", ErrTooLarge, e.where, err)
	}
	e.setUp(err)
	return &UnavailableError{Backend: "etcd " + e.where, Err: err}
}

// setUp records the outcome of a request or probe; it reports whether
// the cluster just came back.
func (e *Etcd) setUp(err error) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	up := err == nil
	back := up && !e.up
	if up != e.up {
		e.up, e.since = up, time.Now()
	}
	e.lastErr = err
	return back
}

// Health implements Store.
func (e *Etcd) Health() Health {
	e.mu.Lock()
	defer e.mu.Unlock()
	h := Health{Backend: "etcd", Where: e.where, Up: e.up, Since: e.since}
	if !e.up && e.lastErr != nil {
		h.Err = e.lastErr.Error()
	}
	return h
}

// List implements Store.
func (e *Etcd) List() ([]Record, error) {
	var out []Record
	err := e.op(func(ctx context.Context) error {
		resp, err := e.cli.Get(ctx, e.prefix+"rules/", clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
		if err != nil {
			return err
		}
		out = out[:0]
		for _, kv := range resp.Kvs {
			key := string(kv.Key)
			id, perr := strconv.ParseUint(strings.TrimPrefix(key, e.prefix+"rules/"), 16, 32)
			if perr != nil || id == 0 || key != e.ruleKey(uint32(id)) {
				return &CorruptError{Path: "etcd " + e.where + " key " + key, Reason: "not a rule key"}
			}
			var rec Record
			if err := json.Unmarshal(kv.Value, &rec); err != nil || rec.ID != uint32(id) {
				// One record another writer damaged must not hide the
				// others: it is handed on as it is, and control reports
				// it as unreadable (logged, counted) and applies the rest.
				rec = Record{ID: uint32(id), Rule: json.RawMessage(kv.Value)}
			}
			out = append(out, rec)
		}
		return nil
	})
	return out, err
}

// maxReplyBytes bounds one etcd reply: 256 rules of the largest size etcd
// takes in one request by default (1.5 MiB).
const maxReplyBytes = 384 << 20

// maxTxnTries bounds the optimistic retries of one write: each retry means
// another node changed the same keys in between.
const maxTxnTries = 16

var errRetry = errors.New("etcd store: keys changed under the transaction")

// claimsOf reads every claim with its holder and mod revision.
func (e *Etcd) claimsOf(ctx context.Context) (map[string]uint32, map[string]int64, error) {
	resp, err := e.cli.Get(ctx, e.prefix+"claims/", clientv3.WithPrefix())
	if err != nil {
		return nil, nil, err
	}
	holder, rev := map[string]uint32{}, map[string]int64{}
	for _, kv := range resp.Kvs {
		c := strings.TrimPrefix(string(kv.Key), e.prefix+"claims/")
		id, err := strconv.ParseUint(string(kv.Value), 10, 32)
		if err != nil {
			return nil, nil, &CorruptError{Path: "etcd " + e.where + " key " + string(kv.Key), Reason: "holder is not a rule id"}
		}
		holder[c], rev[c] = uint32(id), kv.ModRevision
	}
	return holder, rev, nil
}

// Put implements Store: one transaction writes the record, takes its
// claims and releases the ones it no longer lists, on the condition that
// none of those claim keys changed since they were read (compare mod
// revision; 0 for a key that does not exist). Of two nodes creating the
// same rule at once, one transaction fails its compare, re-reads, and
// finds the claim held: a *ClaimError.
func (e *Etcd) Put(rec Record, claims ...string) error {
	if rec.ID == 0 {
		return errors.New("store: record id 0 is not allocated")
	}
	v, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("store: encode record %d: %w", rec.ID, err)
	}
	return e.retry(func(ctx context.Context) error {
		holder, rev, err := e.claimsOf(ctx)
		if err != nil {
			return err
		}
		var cmps []clientv3.Cmp
		ops := []clientv3.Op{clientv3.OpPut(e.ruleKey(rec.ID), string(v))}
		want := map[string]bool{}
		for _, c := range claims {
			if h, ok := holder[c]; ok && h != rec.ID {
				return &ClaimError{Claim: c, Holder: h}
			}
			if want[c] {
				continue
			}
			want[c] = true
			cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(e.claimKey(c)), "=", rev[c]))
			if _, held := holder[c]; !held {
				ops = append(ops, clientv3.OpPut(e.claimKey(c), strconv.FormatUint(uint64(rec.ID), 10)))
			}
		}
		for c, h := range holder {
			if h == rec.ID && !want[c] {
				cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(e.claimKey(c)), "=", rev[c]))
				ops = append(ops, clientv3.OpDelete(e.claimKey(c)))
			}
		}
		return e.commit(ctx, cmps, ops)
	})
}

// Delete implements Store.
func (e *Etcd) Delete(id uint32) error {
	return e.retry(func(ctx context.Context) error {
		holder, rev, err := e.claimsOf(ctx)
		if err != nil {
			return err
		}
		var cmps []clientv3.Cmp
		ops := []clientv3.Op{clientv3.OpDelete(e.ruleKey(id))}
		for c, h := range holder {
			if h == id {
				cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(e.claimKey(c)), "=", rev[c]))
				ops = append(ops, clientv3.OpDelete(e.claimKey(c)))
			}
		}
		return e.commit(ctx, cmps, ops)
	})
}

var errIDSpace = errors.New("store: rule id space exhausted")

// NextID implements Store: the counter is advanced by a transaction that
// holds only if nobody advanced it since it was read.
func (e *Etcd) NextID() (uint32, error) {
	var out uint32
	err := e.retry(func(ctx context.Context) error {
		resp, err := e.cli.Get(ctx, e.idKey())
		if err != nil {
			return err
		}
		next, rev := uint64(1), int64(0)
		if len(resp.Kvs) == 1 {
			rev = resp.Kvs[0].ModRevision
			if next, err = strconv.ParseUint(string(resp.Kvs[0].Value), 10, 32); err != nil {
				return &CorruptError{Path: "etcd " + e.where + " key " + e.idKey(), Reason: "not a rule id"}
			}
		}
		if next == 0 {
			return errIDSpace
		}
		if err := e.commit(ctx, []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(e.idKey()), "=", rev)},
			[]clientv3.Op{clientv3.OpPut(e.idKey(), strconv.FormatUint((next+1)&(1<<32-1), 10))}); err != nil {
			return err
		}
		out = uint32(next)
		return nil
	})
	return out, err
}

// retry runs one optimistic transaction until it commits, fails for a
// reason other than a concurrent change, or has been tried maxTxnTries
// times.
func (e *Etcd) retry(f func(ctx context.Context) error) error {
	return e.op(func(ctx context.Context) error {
		for range maxTxnTries {
			if err := f(ctx); !errors.Is(err, errRetry) {
				return err
			}
		}
		return fmt.Errorf("%w %d times in a row", errRetry, maxTxnTries)
	})
}

// commit runs ops if every compare holds, and errRetry otherwise.
func (e *Etcd) commit(ctx context.Context, cmps []clientv3.Cmp, ops []clientv3.Op) error {
	resp, err := e.cli.Txn(ctx).If(cmps...).Then(ops...).Commit()
	if err != nil {
		return err
	}
	if !resp.Succeeded {
		return errRetry
	}
	return nil
}

// Setting implements api.Settings: settings are shared by every node.
func (e *Etcd) Setting(name string) ([]byte, error) {
	var out []byte
	err := e.op(func(ctx context.Context) error {
		resp, err := e.cli.Get(ctx, e.prefix+"settings/"+name)
		if err == nil && len(resp.Kvs) == 1 {
			out = resp.Kvs[0].Value
		}
		return err
	})
	return out, err
}

// PutSetting implements api.Settings.
func (e *Etcd) PutSetting(name string, value []byte) error {
	if name == "" || len(value) > MaxSettingBytes {
		return fmt.Errorf("store: setting %q of %d bytes: want a name and at most %d bytes", name, len(value), MaxSettingBytes)
	}
	return e.op(func(ctx context.Context) error {
		_, err := e.cli.Put(ctx, e.prefix+"settings/"+name, string(value))
		return err
	})
}

// probeEvery is how often Watch checks the cluster answers.
const probeEvery = 500 * time.Millisecond

// Watch implements Watcher. It watches the rule keys and, beside that,
// reads one key every probeEvery so Health (and through it the API's 503
// and the metric) follows the cluster within a second; when the cluster
// comes back it reports a change, since events may have been missed.
func (e *Etcd) Watch(ctx context.Context, changed func()) error {
	e.monitored.Store(true)
	defer e.monitored.Store(false)
	go func() {
		t := time.NewTicker(probeEvery)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			pctx, cancel := context.WithTimeout(ctx, e.opTO)
			_, err := e.cli.Get(pctx, e.idKey())
			cancel()
			if ctx.Err() != nil {
				return
			}
			if e.setUp(err) {
				changed()
			}
		}
	}()
	for ctx.Err() == nil {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		wch := e.cli.Watch(wctx, e.prefix+"rules/", clientv3.WithPrefix())
		changed() // (re)watching: whatever happened meanwhile is re-read
		for resp := range wch {
			if resp.Err() != nil {
				break
			}
			if len(resp.Events) > 0 {
				changed()
			}
		}
		cancel()
		select {
		case <-ctx.Done():
		case <-time.After(probeEvery):
		}
	}
	return nil
}

// Close implements Store.
func (e *Etcd) Close() error { return e.cli.Close() }
