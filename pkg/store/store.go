// Package store persists load-balancer rules so they survive a daemon restart.
//
// In: accepted, normalized rules from control (with the raw create body that
// produced them). Out: the same records at start-up, in rule-id order.
// The default backend is an embedded bbolt file, so one binary runs alone; the
// Store interface lets a distributed backend serve several nodes later.
package store

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
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
	CreateBody json.RawMessage `json:"createBody"`
	CreatedAt  time.Time       `json:"createdAt"`
	UpdatedAt  time.Time       `json:"updatedAt"`
}

// Store is the persistence contract. Implementations are safe for concurrent
// use; Put and Delete are durable when they return.
type Store interface {
	// List returns every record ordered by ID.
	List() ([]Record, error)
	// Put inserts or replaces the record with rec.ID.
	Put(rec Record) error
	// Delete removes the record; deleting a missing ID is not an error.
	Delete(id uint32) error
	// NextID allocates a fresh rule ID, never reused, starting at 1.
	NextID() (uint32, error)
	Close() error
}

// ErrCorrupt marks a store file that exists but cannot be read back; the
// daemon refuses to start rather than run with silently lost rules.
var ErrCorrupt = errors.New("rule store is corrupt")

var (
	bucketRules = []byte("rules")
	bucketMeta  = []byte("meta")
	keyNextID   = []byte("next_id")
	keyVersion  = []byte("schema_version")
)

const schemaVersion = 1

// Bolt is the embedded default Store.
type Bolt struct {
	db *bolt.DB
}

var _ Store = (*Bolt)(nil)

// OpenBolt opens (creating if needed) dir/rules.db. It fails with a clear
// error when the directory is unwritable, another daemon holds the lock, or
// the file or any record in it is corrupt.
func OpenBolt(dir string) (*Bolt, error) {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("create state dir %s: %w", dir, err)
	}
	path := filepath.Join(dir, "rules.db")
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 2 * time.Second})
	if err != nil {
		if errors.Is(err, bolt.ErrTimeout) {
			return nil, fmt.Errorf("open %s: locked by another process (is another daemon running with the same --state-dir?)", path)
		}
		return nil, fmt.Errorf("open %s: %w: %v", path, ErrCorrupt, err)
	}
	b := &Bolt{db: db}
	if err := b.init(); err != nil {
		db.Close()
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	if _, err := b.List(); err != nil {
		db.Close()
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	return b, nil
}

func (b *Bolt) init() error {
	return b.db.Update(func(tx *bolt.Tx) error {
		if _, err := tx.CreateBucketIfNotExists(bucketRules); err != nil {
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
func (b *Bolt) Put(rec Record) error {
	if rec.ID == 0 {
		return errors.New("store: record id 0 is not allocated")
	}
	v, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("store: encode record %d: %w", rec.ID, err)
	}
	return b.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketRules).Put(be32(rec.ID), v)
	})
}

// Delete implements Store.
func (b *Bolt) Delete(id uint32) error {
	return b.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketRules).Delete(be32(id))
	})
}

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

// Close implements Store.
func (b *Bolt) Close() error { return b.db.Close() }
