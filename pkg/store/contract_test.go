package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/store/etcdtest"
)

// forEachBackend runs a contract test on every backend. open returns the
// store at one persistent location, fresh each call, so a test can close
// and reopen it as a daemon restart does.
func forEachBackend(t *testing.T, f func(t *testing.T, open func() Store)) {
	t.Run("bbolt", func(t *testing.T) {
		dir := t.TempDir()
		f(t, func() Store {
			s, err := OpenBolt(dir)
			if err != nil {
				t.Fatal(err)
			}
			return s
		})
	})
	t.Run("etcd", func(t *testing.T) {
		srv := sharedEtcd(t)
		prefix := fmt.Sprintf("/test/%s/%d/", t.Name(), time.Now().UnixNano())
		f(t, func() Store { return openEtcd(t, srv.Endpoint, prefix) })
	})
}

// sharedEtcd starts an etcd for one test; it is killed when the test ends.
func sharedEtcd(t *testing.T) *etcdtest.Server {
	t.Helper()
	return etcdtest.Start(t)
}

func openEtcd(t *testing.T, ep, prefix string) *Etcd {
	t.Helper()
	return openEtcdTimeout(t, ep, prefix, 0)
}

// openEtcdTimeout opens the store with request timeout op (0: default).
func openEtcdTimeout(t *testing.T, ep, prefix string, op time.Duration) *Etcd {
	t.Helper()
	s, err := OpenEtcd(EtcdConfig{Endpoints: []string{ep}, Prefix: prefix, OpTimeout: op})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// TestClaims: a claim is held by one record at a time, moves with Put and
// is released by Delete, on every backend.
func TestClaims(t *testing.T) { forEachBackend(t, testClaims) }

func testClaims(t *testing.T, open func() Store) {
	s := open()
	defer s.Close()
	a, _ := s.NextID()
	b, _ := s.NextID()
	if err := s.Put(Record{ID: a, Rule: json.RawMessage(`{}`)}, "key:x", "listen:x"); err != nil {
		t.Fatal(err)
	}
	// Re-putting the holder with the same claims is an update, not a conflict.
	if err := s.Put(Record{ID: a, Rule: json.RawMessage(`{"v":2}`)}, "key:x", "listen:x"); err != nil {
		t.Fatalf("update by the holder: %v", err)
	}
	err := s.Put(Record{ID: b, Rule: json.RawMessage(`{}`)}, "key:y", "listen:x")
	var ce *ClaimError
	if !errors.As(err, &ce) || !errors.Is(err, ErrClaimed) || ce.Holder != a || ce.Claim != "listen:x" {
		t.Fatalf("second holder of listen:x: %v", err)
	}
	if recs, _ := s.List(); len(recs) != 1 {
		t.Fatalf("a refused put wrote something: %d records", len(recs))
	}
	// The holder drops listen:x; b can take it now.
	if err := s.Put(Record{ID: a, Rule: json.RawMessage(`{"v":3}`)}, "key:x"); err != nil {
		t.Fatal(err)
	}
	if err := s.Put(Record{ID: b, Rule: json.RawMessage(`{}`)}, "key:y", "listen:x"); err != nil {
		t.Fatalf("released claim not free: %v", err)
	}
	if err := s.Delete(a); err != nil {
		t.Fatal(err)
	}
	c, _ := s.NextID()
	if err := s.Put(Record{ID: c, Rule: json.RawMessage(`{}`)}, "key:x"); err != nil {
		t.Fatalf("deleted record's claim not free: %v", err)
	}
}

// TestCreateBodyBytes: the create body comes back byte for byte across a
// reopen (whitespace, key order, escapes), on every backend.
func TestCreateBodyBytes(t *testing.T) { forEachBackend(t, testCreateBodyBytes) }

func testCreateBodyBytes(t *testing.T, open func() Store) {
	s := open()
	body := "\n  {\"endpoints\" : [ ],\t\"serviceArguments\":{ \"name\":\"a<b>&\\u0063\" }\r\n}\n"
	id, _ := s.NextID()
	if err := s.Put(Record{ID: id, Rule: json.RawMessage(`{}`), CreateBody: json.RawMessage(body)}); err != nil {
		t.Fatal(err)
	}
	s.Close()
	s = open()
	defer s.Close()
	got, err := s.List()
	if err != nil || len(got) != 1 || string(got[0].CreateBody) != body {
		t.Fatalf("create body changed across reopen: %v %v", got, err)
	}
}

// TestConcurrentClaims: nodes (separate clients) race to create the same
// rule; exactly one wins, every other gets a ClaimError naming the winner,
// and no id is drawn twice.
func TestConcurrentClaims(t *testing.T) {
	forEachBackend(t, func(t *testing.T, open func() Store) {
		nodes := []Store{open()}
		if _, ok := nodes[0].(*Etcd); ok {
			nodes = append(nodes, open(), open(), open())
		}
		const racers = 8
		var wg sync.WaitGroup
		errs := make([]error, racers)
		ids := make([]uint32, racers)
		// Ids are drawn at once too, then every racer puts at once, so
		// the puts meet between reading the claims and committing.
		var drawn, start sync.WaitGroup
		drawn.Add(racers)
		start.Add(1)
		for i := range racers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				st := nodes[i%len(nodes)]
				id, err := st.NextID()
				ids[i] = id
				drawn.Done()
				start.Wait()
				if err != nil {
					errs[i] = err
					return
				}
				errs[i] = st.Put(Record{ID: id, Rule: json.RawMessage(`{}`)}, "key:10.1.1.1:80/tcp")
			}()
		}
		drawn.Wait()
		start.Done()
		wg.Wait()
		seen := map[uint32]bool{}
		winners := 0
		var winner uint32
		for i, err := range errs {
			if seen[ids[i]] {
				t.Fatalf("id %d drawn twice", ids[i])
			}
			seen[ids[i]] = true
			if err == nil {
				winners++
				winner = ids[i]
			}
		}
		if winners != 1 {
			t.Fatalf("%d winners: %v", winners, errs)
		}
		for i, err := range errs {
			var ce *ClaimError
			if ids[i] != winner && (!errors.As(err, &ce) || ce.Holder != winner) {
				t.Fatalf("racer %d: want a ClaimError naming rule %d, got %v", i, winner, err)
			}
		}
		recs, err := nodes[0].List()
		if err != nil || len(recs) != 1 || recs[0].ID != winner {
			t.Fatalf("stored: %v %v", recs, err)
		}
	})
}

// TestEtcdUnavailable: with etcd gone, writes fail with an
// UnavailableError (the API's 503) and Health says down; when Watch
// monitors, it notices without a write and writes fail at once.
func TestEtcdUnavailable(t *testing.T) {
	srv := etcdtest.Start(t)
	s, err := OpenEtcd(EtcdConfig{Endpoints: []string{srv.Endpoint}, OpTimeout: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	changed := make(chan struct{}, 64)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.Watch(ctx, func() { changed <- struct{}{} })
	<-changed // the first (re)watch
	if !s.Health().Up {
		t.Fatal("down while etcd runs")
	}
	srv.Stop()
	waitUntil(t, "health down", func() bool { return !s.Health().Up })
	_, err = s.NextID()
	var ue *UnavailableError
	if !errors.As(err, &ue) || !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), srv.Endpoint) {
		t.Fatalf("write with etcd down: %v", err)
	}
	if err := s.Put(Record{ID: 1, Rule: json.RawMessage(`{}`)}, "k"); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("put with etcd down: %v", err)
	}
	if h := s.Health(); h.Up || h.Err == "" || h.Backend != "etcd" {
		t.Fatalf("health: %+v", h)
	}
}

// TestEtcdRecordTooLarge: a record over etcd's request limit is refused
// as ErrTooLarge (the API's 413), and the store stays up.
func TestEtcdRecordTooLarge(t *testing.T) {
	srv := etcdtest.Start(t)
	// Megabytes through gRPC under the race detector on a busy machine can
	// take longer than the default 2 s request timeout.
	s := openEtcdTimeout(t, srv.Endpoint, "/big/", 30*time.Second)
	// 1.9 MiB passes the client's send limit and meets the server's
	// request limit; 4.7 MiB meets the client's.
	for _, n := range []int{800 << 10, 2 << 20} {
		big := json.RawMessage(`{"x":"` + strings.Repeat("a", n) + `"}`)
		err := s.Put(Record{ID: 1, Rule: big, CreateBody: big})
		if !errors.Is(err, ErrTooLarge) || errors.Is(err, ErrUnavailable) {
			t.Fatalf("record of twice %d bytes: %v", n, err)
		}
	}
	if !s.Health().Up {
		t.Fatal("a refused large record marked the store down")
	}
	if recs, err := s.List(); err != nil || len(recs) != 0 {
		t.Fatalf("after the refused put: %v %v", recs, err)
	}
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for i := 0; i < 400; i++ {
		if cond() {
			return
		}
		time.Sleep(25 * time.Millisecond)
	}
	t.Fatalf("timed out waiting for %s", what)
}

func TestParseEtcdURL(t *testing.T) {
	eps, err := ParseEtcdURL("etcd://127.0.0.1:2379,[::1]:2380,node-b:1")
	if err != nil || strings.Join(eps, " ") != "127.0.0.1:2379 [::1]:2380 node-b:1" {
		t.Fatalf("%v %v", eps, err)
	}
	for _, bad := range []string{"", "bolt", "etcd://", "etcd://h", "etcd://h:0", "etcd://h:99999", "etcd://a:1,", "http://h:1", "etcd://a/b:1"} {
		if _, err := ParseEtcdURL(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
