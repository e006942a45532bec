package store

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
)

// TestSurvivesReopen: records, deletes and the id counter outlive the
// store being closed and opened again (a daemon restart), on every backend.
func TestSurvivesReopen(t *testing.T) { forEachBackend(t, testSurvivesReopen) }

func testSurvivesReopen(t *testing.T, open func() Store) {
	s := open()
	id1, _ := s.NextID()
	id2, _ := s.NextID()
	if id1 != 1 || id2 != 2 {
		t.Fatalf("ids %d %d", id1, id2)
	}
	now := time.Now().UTC().Truncate(time.Second)
	rec := Record{ID: id1, Rule: json.RawMessage(`{"a":1}`), CreateBody: json.RawMessage(`{"raw":true}`), CreatedAt: now, UpdatedAt: now}
	if err := s.Put(rec); err != nil {
		t.Fatal(err)
	}
	if err := s.Put(Record{ID: id2, Rule: json.RawMessage(`{"b":2}`), CreateBody: json.RawMessage(`{}`)}); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(id2); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(99); err != nil {
		t.Fatal("deleting a missing id must not fail")
	}
	s.Close()

	s = open()
	defer s.Close()
	got, err := s.List()
	if err != nil || len(got) != 1 {
		t.Fatalf("list %v %v", got, err)
	}
	if string(got[0].Rule) != `{"a":1}` || string(got[0].CreateBody) != `{"raw":true}` || !got[0].CreatedAt.Equal(now) {
		t.Errorf("record changed across restart: %+v", got[0])
	}
	if id, _ := s.NextID(); id != 3 {
		t.Errorf("ids reused after restart: %d", id)
	}
	if err := s.Put(Record{}); err == nil {
		t.Error("id 0 accepted")
	}
}

func TestBoltCorruptIsAnError(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "rules.db"), []byte("this is not a bolt file, just garbage bytes........"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := OpenBolt(dir)
	if !errors.Is(err, ErrCorrupt) {
		t.Fatalf("want ErrCorrupt, got %v", err)
	}
}

func TestBoltCorruptRecord(t *testing.T) {
	dir := t.TempDir()
	s, err := OpenBolt(dir)
	if err != nil {
		t.Fatal(err)
	}
	// A record whose body is not JSON, written behind Put's back.
	if err := s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketRules).Put(be32(7), []byte("{not json")) }); err != nil {
		t.Fatal(err)
	}
	s.Close()
	if _, err := OpenBolt(dir); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("want ErrCorrupt naming the record, got %v", err)
	}
}

type settings interface {
	Setting(name string) ([]byte, error)
	PutSetting(name string, value []byte) error
}

// TestSettingsSurviveReopen: a stored setting is read back after the
// store is closed and opened again, as across a daemon restart.
func TestSettingsSurviveReopen(t *testing.T) { forEachBackend(t, testSettingsSurviveReopen) }

func testSettingsSurviveReopen(t *testing.T, open func() Store) {
	b := open().(settings)
	if v, err := b.Setting("metrics_enabled"); err != nil || v != nil {
		t.Fatalf("unset setting: %q %v", v, err)
	}
	if err := b.PutSetting("metrics_enabled", []byte("on")); err != nil {
		t.Fatal(err)
	}
	if err := b.PutSetting("", []byte("x")); err == nil {
		t.Fatal("empty setting name accepted")
	}
	b.(Store).Close()
	b = open().(settings)
	defer b.(Store).Close()
	if v, err := b.Setting("metrics_enabled"); err != nil || string(v) != "on" {
		t.Fatalf("after reopen: %q %v", v, err)
	}
}

// TestCreateBodyExactBytes: the create body comes back byte for byte across
// a reopen (whitespace, key order, escapes), and a record whose body an
// older build stored as a compacted JSON value still reads.
func TestCreateBodyExactBytes(t *testing.T) {
	dir := t.TempDir()
	s, err := OpenBolt(dir)
	if err != nil {
		t.Fatal(err)
	}
	body := "\n  {\"endpoints\" : [ ],\t\"serviceArguments\":{ \"name\":\"a<b>&\\u0063\" }\r\n}\n"
	id, _ := s.NextID()
	if err := s.Put(Record{ID: id, Rule: json.RawMessage(`{}`), CreateBody: json.RawMessage(body)}); err != nil {
		t.Fatal(err)
	}
	legacy := []byte(`{"id":2,"rule":{},"createBody":{"x":1},"createdAt":"2026-01-01T00:00:00Z","updatedAt":"2026-01-01T00:00:00Z"}`)
	if err := s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketRules).Put(be32(2), legacy) }); err != nil {
		t.Fatal(err)
	}
	s.Close()
	s, err = OpenBolt(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	got, err := s.List()
	if err != nil || len(got) != 2 {
		t.Fatalf("list %v %v", got, err)
	}
	if string(got[0].CreateBody) != body {
		t.Errorf("create body changed across reopen:\n got %q\nwant %q", got[0].CreateBody, body)
	}
	if string(got[1].CreateBody) != `{"x":1}` {
		t.Errorf("legacy create body: %q", got[1].CreateBody)
	}
}
