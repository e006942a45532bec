// Package store persists load-balancer rules so they survive a daemon restart.
//
// In: accepted, normalized rules from control (with the raw create body that
// produced them). Out: the same records at start-up, in rule-id order.
// The default backend is an embedded bbolt file, so one binary runs alone;
// the etcd backend (OpenEtcd) lets several nodes share one rule set, each
// watching it (Watcher). A record holds claims (the rule's key, a mode-4
// VIP:port): no two records hold the same claim, which is how concurrent
// creates of one rule on two nodes resolve to one winner. The etcd backend
// also holds the nodes' membership records, each under its node's lease
// (Register, Members).
package store

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime/debug"
	"time"

	bolt "go.etcd.io/bbolt"
)

// Record is one stored rule.
type Record struct {
	ID uint32 `json:"id"`
	// Rule is the normalized rule as JSON (lbrule.Rule), kept opaque here so
	// the store does not depend on the rule model's Go types.
	Rule json.RawMessage `json:"rule"`
	// CreateBody is the last applied create body, byte for byte, for rollback:
	// replaying a read-back response is not the same as replaying the request.
	// It is stored as a byte string (createBodyBytes), so whitespace, key
	// order and escapes survive; a record written under "createBody" as a
	// JSON value (compacted by an older build) still reads back.
	CreateBody json.RawMessage `json:"-"`
	// Draining lists the endpoints ("ip:port", as lbrule renders them)
	// an operator put in maintenance: they take no new requests or flows
	// until put back, across restarts.
	Draining  []string  `json:"-"`
	CreatedAt time.Time `json:"createdAt"`
	UpdatedAt time.Time `json:"updatedAt"`
}

// recordWire is the stored form of a Record.
type recordWire struct {
	ID              uint32          `json:"id"`
	Rule            json.RawMessage `json:"rule"`
	CreateBodyBytes []byte          `json:"createBodyBytes,omitempty"`
	LegacyBody      json.RawMessage `json:"createBody,omitempty"`
	Draining        []string        `json:"draining,omitempty"`
	CreatedAt       time.Time       `json:"createdAt"`
	UpdatedAt       time.Time       `json:"updatedAt"`
}

// MarshalJSON stores the create body as exact bytes.
func (r Record) MarshalJSON() ([]byte, error) {
	return json.Marshal(recordWire{ID: r.ID, Rule: r.Rule, CreateBodyBytes: r.CreateBody, Draining: r.Draining, CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt})
}

// UnmarshalJSON reads both the exact and the older compacted create body.
func (r *Record) UnmarshalJSON(b []byte) error {
	var w recordWire
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	*r = Record{ID: w.ID, Rule: w.Rule, CreateBody: w.CreateBodyBytes, Draining: w.Draining, CreatedAt: w.CreatedAt, UpdatedAt: w.UpdatedAt}
	if r.CreateBody == nil {
		r.CreateBody = w.LegacyBody
	}
	return nil
}

// Store is the persistence contract. Implementations are safe for concurrent
// use; Put and Delete are durable when they return.
type Store interface {
	// List returns every record ordered by ID.
	List() ([]Record, error)
	// Put inserts or replaces the record with rec.ID, which then holds
	// exactly claims: each must be free or already held by rec.ID (else a
	// *ClaimError and nothing is written); claims it held before and are
	// not listed are released.
	Put(rec Record, claims ...string) error
	// Delete removes the record and releases its claims; deleting a
	// missing ID is not an error.
	Delete(id uint32) error
	// NextID allocates a fresh rule ID, never reused, starting at 1.
	NextID() (uint32, error)
	// Health reports whether the backend can be reached.
	Health() Health
	Close() error
}

// ErrCorrupt marks a store file that exists but cannot be read back; the
// daemon refuses to start rather than run with silently lost rules.
var ErrCorrupt = errors.New("rule store is corrupt")

// CorruptError names the damaged file, what is wrong with it and what the
// operator can do. It matches ErrCorrupt with errors.Is.
type CorruptError struct {
	Path   string
	Reason string
}

func (e *CorruptError) Error() string {
	return "rule store " + e.Path + " is corrupt: " + e.Reason + "; move it aside to start empty, or restore a backup"
}

// Is makes errors.Is(err, ErrCorrupt) hold.
func (e *CorruptError) Is(target error) bool { return target == ErrCorrupt }

var (
	bucketRules = []byte("rules")
	bucketMeta  = []byte("meta")
	// bucketSettings holds the daemon's own switches (the metrics
	// export), by name.
	bucketSettings = []byte("settings")
	// bucketClaims maps each claim to the id (4 bytes) holding it.
	bucketClaims = []byte("claims")
	keyNextID    = []byte("next_id")
	keyVersion   = []byte("schema_version")
)

const schemaVersion = 1

// Bolt is the embedded default Store.
type Bolt struct {
	db   *bolt.DB
	path string
}

var _ Store = (*Bolt)(nil)

// OpenBolt opens (creating if needed) dir/rules.db. It fails with a clear
// error when the directory is unwritable, another daemon holds the lock, or
// the file or any record in it is corrupt (a *CorruptError): an existing
// file is verified page by page before bbolt maps it, so a damaged file is
// reported, never trusted, never replaced by an empty store, and never a
// panic. Only a missing file starts a new store; an empty one is corrupt.
func OpenBolt(dir string) (*Bolt, error) {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("create state dir %s: %w", dir, err)
	}
	path := filepath.Join(dir, "rules.db")
	if err := verifyExisting(path); err != nil {
		return nil, err
	}
	var db *bolt.DB
	err := guard(path, func() (err error) {
		db, err = bolt.Open(path, 0o600, &bolt.Options{Timeout: 2 * time.Second})
		return err
	})
	if err != nil {
		var ce *CorruptError
		switch {
		case errors.As(err, &ce):
			return nil, err
		case errors.Is(err, bolt.ErrTimeout):
			return nil, fmt.Errorf("open %s: locked by another process (is another daemon running with the same --state-dir?)", path)
		case errors.Is(err, fs.ErrPermission):
			return nil, fmt.Errorf("open %s: %w", path, err)
		}
		return nil, &CorruptError{Path: path, Reason: err.Error()}
	}
	b := &Bolt{db: db, path: path}
	err = guard(path, func() error {
		if err := b.init(); err != nil {
			return err
		}
		if err := b.check(); err != nil {
			return err
		}
		_, err := b.List()
		return err
	})
	if err != nil {
		db.Close()
		var ce *CorruptError
		if !errors.As(err, &ce) && errors.Is(err, ErrCorrupt) {
			err = &CorruptError{Path: path, Reason: err.Error()}
		}
		if errors.As(err, &ce) {
			return nil, err
		}
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	return b, nil
}

// verifyExisting checks an existing store file before bbolt maps it. It
// holds the file's lock while reading, so a store another daemon is
// writing is reported as locked rather than as corrupt.
func verifyExisting(path string) error {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("open %s: %w", path, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("stat %s: %w", path, err)
	}
	if !fi.Mode().IsRegular() {
		return &CorruptError{Path: path, Reason: "not a regular file"}
	}
	unlock, err := lockFile(f, 2*time.Second)
	if err != nil {
		return fmt.Errorf("open %s: locked by another process (is another daemon running with the same --state-dir?)", path)
	}
	defer unlock()
	if err := verifyBoltFile(f, fi.Size()); err != nil {
		if reason, ok := asVerifyError(err); ok {
			return &CorruptError{Path: path, Reason: reason}
		}
		return fmt.Errorf("verify %s: %w", path, err)
	}
	return nil
}

// guard runs f, turning a panic, or a memory fault that the runtime turns
// into one, into a *CorruptError: bbolt asserts on what it reads and must
// not take the daemon down with it.
func guard(path string, f func() error) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err = &CorruptError{Path: path, Reason: fmt.Sprintf("bbolt failed reading it: %v", r)}
		}
	}()
	return f()
}

// check runs bbolt's own consistency check, a second opinion after
// verifyBoltFile (it also checks key order). Its panics are recovered by
// bbolt and arrive as errors.
func (b *Bolt) check() error {
	return b.db.View(func(tx *bolt.Tx) error {
		var errs []error
		for err := range tx.Check() {
			if len(errs) < 5 {
				errs = append(errs, err)
			}
		}
		if len(errs) > 0 {
			return fmt.Errorf("%w: consistency check: %w", ErrCorrupt, errors.Join(errs...))
		}
		return nil
	})
}

func (b *Bolt) init() error {
	return b.db.Update(func(tx *bolt.Tx) error {
		if _, err := tx.CreateBucketIfNotExists(bucketRules); err != nil {
			return err
		}
		if _, err := tx.CreateBucketIfNotExists(bucketSettings); err != nil {
			return err
		}
		if _, err := tx.CreateBucketIfNotExists(bucketClaims); err != nil {
			return err
		}
		meta, err := tx.CreateBucketIfNotExists(bucketMeta)
		if err != nil {
			return err
		}
		if v := meta.Get(keyVersion); v != nil {
			if len(v) != 4 || binary.BigEndian.Uint32(v) > schemaVersion {
				return fmt.Errorf("%w: schema version %x is newer than this build understands", ErrCorrupt, v)
			}
			return nil
		}
		return meta.Put(keyVersion, be32(schemaVersion))
	})
}

func be32(v uint32) []byte {
	var k [4]byte
	binary.BigEndian.PutUint32(k[:], v)
	return k[:]
}

// List implements Store.
func (b *Bolt) List() ([]Record, error) {
	var out []Record
	err := b.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketRules).ForEach(func(k, v []byte) error {
			var rec Record
			if err := json.Unmarshal(v, &rec); err != nil {
				return fmt.Errorf("%w: record %x: %v", ErrCorrupt, k, err)
			}
			if len(k) != 4 || binary.BigEndian.Uint32(k) != rec.ID {
				return fmt.Errorf("%w: record key %x does not match id %d", ErrCorrupt, k, rec.ID)
			}
			out = append(out, rec)
			return nil
		})
	})
	return out, err
}

// Put implements Store.
func (b *Bolt) Put(rec Record, claims ...string) error {
	if rec.ID == 0 {
		return errors.New("store: record id 0 is not allocated")
	}
	v, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("store: encode record %d: %w", rec.ID, err)
	}
	return b.db.Update(func(tx *bolt.Tx) error {
		cb := tx.Bucket(bucketClaims)
		want := map[string]bool{}
		for _, c := range claims {
			if v := cb.Get([]byte(c)); len(v) == 4 && binary.BigEndian.Uint32(v) != rec.ID {
				return &ClaimError{Claim: c, Holder: binary.BigEndian.Uint32(v)}
			}
			want[c] = true
		}
		if err := releaseClaims(cb, rec.ID, want); err != nil {
			return err
		}
		for c := range want {
			if err := cb.Put([]byte(c), be32(rec.ID)); err != nil {
				return err
			}
		}
		return tx.Bucket(bucketRules).Put(be32(rec.ID), v)
	})
}

// releaseClaims deletes the claims id holds that keep does not list.
func releaseClaims(cb *bolt.Bucket, id uint32, keep map[string]bool) error {
	var drop [][]byte
	err := cb.ForEach(func(k, v []byte) error {
		if len(v) == 4 && binary.BigEndian.Uint32(v) == id && !keep[string(k)] {
			drop = append(drop, bytes.Clone(k))
		}
		return nil
	})
	for _, k := range drop {
		if err == nil {
			err = cb.Delete(k)
		}
	}
	return err
}

// Delete implements Store.
func (b *Bolt) Delete(id uint32) error {
	return b.db.Update(func(tx *bolt.Tx) error {
		if err := releaseClaims(tx.Bucket(bucketClaims), id, nil); err != nil {
			return err
		}
		return tx.Bucket(bucketRules).Delete(be32(id))
	})
}

// Health implements Store: an open file is always reachable.
func (b *Bolt) Health() Health { return Health{Backend: "bbolt", Where: b.path, Up: true} }

// NextID implements Store.
func (b *Bolt) NextID() (uint32, error) {
	var id uint32
	err := b.db.Update(func(tx *bolt.Tx) error {
		meta := tx.Bucket(bucketMeta)
		id = 1
		if v := meta.Get(keyNextID); len(v) == 4 {
			id = binary.BigEndian.Uint32(v)
		}
		if id == 0 {
			return errors.New("store: rule id space exhausted")
		}
		return meta.Put(keyNextID, be32(id+1))
	})
	return id, err
}

// MaxSettingBytes bounds one stored setting.
const MaxSettingBytes = 4096

// Setting returns the stored value of a daemon setting, nil when it was
// never stored.
func (b *Bolt) Setting(name string) ([]byte, error) {
	var out []byte
	err := b.db.View(func(tx *bolt.Tx) error {
		if v := tx.Bucket(bucketSettings).Get([]byte(name)); v != nil {
			out = append([]byte{}, v...)
		}
		return nil
	})
	return out, err
}

// PutSetting stores a daemon setting durably.
func (b *Bolt) PutSetting(name string, value []byte) error {
	if name == "" || len(value) > MaxSettingBytes {
		return fmt.Errorf("store: setting %q of %d bytes: want a name and at most %d bytes", name, len(value), MaxSettingBytes)
	}
	return b.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketSettings).Put([]byte(name), value)
	})
}

// Close implements Store.
func (b *Bolt) Close() error { return b.db.Close() }
