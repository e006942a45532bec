package kvevents

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/blockhash"
)

// fakeElection is an in-memory DrainOwnership: the test names the owner.
type fakeElection struct {
	mu      sync.Mutex
	owner   string
	reports map[string]func(string, bool) // by value
}

func (f *fakeElection) Follow(ctx context.Context, key, value string, report func(string, bool)) {
	f.mu.Lock()
	if f.reports == nil {
		f.reports = make(map[string]func(string, bool))
	}
	f.reports[value] = report
	report(f.owner, f.owner == value && value != "")
	f.mu.Unlock()
	<-ctx.Done()
	f.mu.Lock()
	delete(f.reports, value)
	f.mu.Unlock()
}

func (f *fakeElection) set(owner string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.owner = owner
	for v, r := range f.reports {
		r(owner, owner == v && v != "")
	}
}

// relayNode is one gateway node of the test: a Manager with its relay
// stream served over HTTP.
func relayNode(t *testing.T, name string, el *fakeElection, spec Spec) (*harness, string) {
	t.Helper()
	var m *Manager
	var ready sync.WaitGroup
	ready.Add(1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { ready.Wait(); m.ServeRelay(w, r) }))
	t.Cleanup(srv.Close)
	cfg := fastConfig()
	cfg.Drain, cfg.RelayURL, cfg.NodeName, cfg.RelayHeartbeat = el, srv.URL+"/relay", name, 50*time.Millisecond
	h := startManager(t, cfg, spec)
	m = h.m
	ready.Done()
	return h, cfg.RelayURL
}

func (ts *trtServer) drainsBy() map[string]int {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	out := make(map[string]int, len(ts.nodes))
	for k, v := range ts.nodes {
		out[k] = v
	}
	return out
}

// TestRelayTwoNodes: with two nodes on one election, only the owner drains
// the engine, the follower's inventory converges through the relay, and
// after the ownership moves the new owner drains with the chains it built
// from the relay (a child of a block it only saw relayed is stored).
func TestRelayTwoNodes(t *testing.T) {
	ts := newTRTServer(t, `{"disaggregated_params":{}}`)
	spec := trtSpec(ts.port(t), 32)
	el := &fakeElection{}
	a, urlA := relayNode(t, "A", el, spec)
	b, urlB := relayNode(t, "B", el, spec)
	waitFor(t, "both nodes electing", func() bool {
		return a.status(4, 1).Drain.Role == DrainElecting && b.status(4, 1).Drain.Role == DrainElecting
	})
	if n := ts.drainsBy(); len(n) != 0 {
		t.Fatalf("drains before any owner: %v", n)
	}
	el.set(urlA)
	ts.push(string(loadTRTBody(t)))

	bh, err := blockhash.New(blockhash.Config{Algo: blockhash.BlockHashTRTLLM, BlockSize: 32})
	if err != nil {
		t.Fatal(err)
	}
	d1, k1 := bh.Next(blockhash.Digest{}, seqTokens(1, 32))
	for _, h := range []*harness{a, b} {
		waitFor(t, "vector applied on both nodes", func() bool { return slices.Equal(h.sink.keys(4, 1, 0), []uint64{k1}) })
	}
	if n := ts.drainsBy(); n["A"] == 0 || len(n) != 1 {
		t.Fatalf("drains by node: %v, want only A", n)
	}
	sa, sb := a.status(4, 1), b.status(4, 1)
	if sa.Drain.Role != DrainOwner || sb.Drain.Role != DrainFollower || sb.Drain.Owner != urlA || sb.Drain.RelayFrames == 0 {
		t.Fatalf("drain status A %+v B %+v", sa.Drain, sb.Drain)
	}
	if !sb.Connected || sb.Parity.Verdict != VerdictOK {
		t.Fatalf("follower status %+v", sb)
	}
	lbl := map[string]string{"service": "4", "ep_idx": "1"}
	if a.metric("loxilb_kv_trtllm_drain_owner", lbl) != 1 || b.metric("loxilb_kv_trtllm_drain_owner", lbl) != 0 {
		t.Fatal("loxilb_kv_trtllm_drain_owner: want 1 on A, 0 on B")
	}

	// Ownership moves to B: B drains from now on, A follows B.
	el.set(urlB)
	waitFor(t, "B owns, A follows", func() bool {
		sa, sb := a.status(4, 1), b.status(4, 1)
		return sb.Drain.Role == DrainOwner && sa.Drain.Role == DrainFollower && sa.Drain.Owner == urlB && sa.Connected
	})
	before := ts.drainsBy()["A"]
	ts.push(fmt.Sprintf(`[{"event_id":4,"window_size":4096,"data":{"type":"stored","parent_hash":13373336404899918911,
	  "blocks":[{"type":"stored_block","block_hash":77,"tokens":%s,"cache_level":0,"priority":35}]}}]`, tokensJSON(65, 32)))
	_, k3 := bh.Next(d1, seqTokens(65, 32))
	want := sorted(k1, k3)
	for _, h := range []*harness{a, b} {
		waitFor(t, "child applied on both nodes", func() bool { return slices.Equal(sorted(h.sink.keys(4, 1, 0)...), want) })
	}
	if n := ts.drainsBy(); n["B"] == 0 || n["A"] != before {
		t.Fatalf("drains by node after the move: %v (A had %d)", n, before)
	}
	if st := b.status(4, 1); st.EventsSkipped != 0 || st.Gaps != 0 {
		t.Fatalf("new owner skipped events or saw gaps: %+v", st)
	}
	if a.metric("loxilb_kv_trtllm_drain_owner_changes_total", lbl) != 2 {
		t.Fatalf("owner changes on A = %v, want 2", a.metric("loxilb_kv_trtllm_drain_owner_changes_total", lbl))
	}
	// No owner: nobody drains.
	el.set("")
	waitFor(t, "both electing", func() bool {
		return a.status(4, 1).Drain.Role == DrainElecting && b.status(4, 1).Drain.Role == DrainElecting
	})
	n := ts.drainsBy()
	time.Sleep(50 * time.Millisecond)
	if m := ts.drainsBy(); m["A"] != n["A"] || m["B"] != n["B"] {
		t.Fatalf("drains while no node owns the endpoint: %v -> %v", n, m)
	}
}

// TestRelaySingleNode: without an election the node drains alone and
// says so.
func TestRelaySingleNode(t *testing.T) {
	ts := newTRTServer(t, `{"disaggregated_params":{}}`)
	h := startManager(t, fastConfig(), trtSpec(ts.port(t), 32))
	waitFor(t, "drained", func() bool { return ts.drainsBy()[""] > 0 })
	st := h.status(4, 1)
	if st.Drain == nil || st.Drain.Role != DrainSingle {
		t.Fatalf("drain status %+v", st.Drain)
	}
	if h.metric("loxilb_kv_trtllm_drain_owner", map[string]string{"service": "4", "ep_idx": "1"}) != 1 {
		t.Fatal("single node: loxilb_kv_trtllm_drain_owner != 1")
	}
	// The relay answers 409: this node owns nothing to re-serve.
	rec := httptest.NewRecorder()
	h.m.ServeRelay(rec, httptest.NewRequest(http.MethodGet, fmt.Sprintf("/relay?endpoint=127.0.0.1:%d", ts.port(t)), nil))
	if rec.Code != http.StatusConflict {
		t.Fatalf("relay of a single node: %d %s", rec.Code, rec.Body)
	}
}

func frame(seq uint64, body []byte) []byte {
	return append(appendFrameHeader(nil, seq, len(body)), body...)
}

// hostileOwner serves raw bytes as a relay stream, then ends the
// response (close) or hangs.
func hostileOwner(t *testing.T, raw []byte, close bool) string {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(RelayEpochHeader, "e1")
		w.WriteHeader(http.StatusOK)
		w.Write(raw)
		w.(http.Flusher).Flush()
		if close {
			return
		}
		<-r.Context().Done()
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// TestRelayHostileStream: lying lengths, garbage, truncation and silence
// end the stream with an ErrRelay naming the reason; nothing is applied
// from a frame that is not whole.
func TestRelayHostileStream(t *testing.T) {
	good := frame(1, []byte("[]"))
	lying := appendFrameHeader(nil, 2, 0)
	lying[12], lying[13], lying[14], lying[15] = 0x7f, 0xff, 0xff, 0xff
	cases := []struct {
		name, reason string
		raw          []byte
		close        bool // end the response after raw
	}{
		{"garbage", relayErrMagic, []byte("HTTP/1.1 200 OK\r\n\r\n"), false},
		{"lying length", relayErrTooLarge, append(slices.Clone(good), lying...), false},
		{"huge announced", relayErrTooLarge, appendFrameHeader(nil, 1, 1<<31), false},
		{"heartbeat with payload", relayErrMagic, frame(0, []byte("x")), false},
		{"seq backwards", relayErrGap, slices.Concat(good, frame(2, []byte("[]")), frame(2, []byte("[]"))), false},
		{"truncated payload", relayErrTruncated, append(appendFrameHeader(nil, 1, 100), "0123456789"...), true},
		{"truncated header", relayErrTruncated, slices.Concat(good, []byte("KVR1\x00")), true},
		{"idle", relayErrIdle, good, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			srvURL := hostileOwner(t, c.raw, c.close)
			var applied [][]byte
			r := relayReader{cl: http.DefaultClient, base: srvURL, endpoint: "127.0.0.1:1", maxBody: 1 << 20, idle: 200 * time.Millisecond,
				onOpen: func() {}, apply: func(b []byte) { applied = append(applied, slices.Clone(b)) }, gap: func(uint64) {}}
			cur := relayCursor{}
			err := r.read(context.Background(), &cur)
			if !errors.Is(err, ErrRelay) || relayReason(err) != c.reason {
				t.Fatalf("err = %v (reason %s), want reason %s", err, relayReason(err), c.reason)
			}
			for _, b := range applied {
				if string(b) != "[]" {
					t.Fatalf("applied a partial or foreign payload %q", b)
				}
			}
		})
	}
}

// TestRelayHostileOwnerCounted: a follower whose owner sends a lying
// length drops the stream, counts it, and keeps running.
func TestRelayHostileOwnerCounted(t *testing.T) {
	ts := newTRTServer(t, `{"disaggregated_params":{}}`)
	spec := trtSpec(ts.port(t), 32)
	owner := hostileOwner(t, appendFrameHeader(nil, 1, 0xffffffff), false)
	el := &fakeElection{owner: owner}
	h, _ := relayNode(t, "A", el, spec)
	lbl := map[string]string{"service": "4", "ep_idx": "1", "reason": relayErrTooLarge}
	waitFor(t, "frame_too_large counted twice (reconnected)", func() bool {
		return h.metric("loxilb_kv_trtllm_relay_errors_total", lbl) >= 2
	})
	st := h.status(4, 1)
	if st.Drain.Role != DrainFollower || st.Drain.RelayErrors[relayErrTooLarge] < 2 || st.Connected {
		t.Fatalf("status %+v drain %+v", st, st.Drain)
	}
	if n := ts.drainsBy(); len(n) != 0 {
		t.Fatalf("a follower drained the engine: %v", n)
	}
}

// TestRelayHubBounds: the hub keeps at most maxFrames frames and maxBytes
// bytes (the newest frame always), serves from the oldest kept when a
// follower asks for older ones, and nothing across epochs.
func TestRelayHubBounds(t *testing.T) {
	h := newRelayHub(4, 10)
	if h.publish([]byte("x")) {
		t.Fatal("published while not owning")
	}
	h.setOwning(true)
	ep, _ := h.open()
	h.close()
	for i := 0; i < 10; i++ {
		h.publish([]byte{byte(i)})
	}
	fr, _, ok := h.since(0, ep)
	if !ok || len(fr) != 4 || fr[0].seq != 7 || fr[3].seq != 10 {
		t.Fatalf("since(0) = %v %v", fr, ok)
	}
	if fr, _, _ := h.since(8, ep); len(fr) != 2 || fr[0].seq != 9 {
		t.Fatalf("since(8) = %v", fr)
	}
	if fr, _, _ := h.since(10, ep); len(fr) != 0 {
		t.Fatalf("since(10) = %v", fr)
	}
	h.publish(make([]byte, 10)) // 10 bytes: only it fits in 10
	if fr, _, _ := h.since(0, ep); len(fr) != 1 || fr[0].seq != 11 {
		t.Fatalf("byte bound: %v", fr)
	}
	h.publish(make([]byte, 50)) // over the bound alone: still kept
	if fr, _, _ := h.since(0, ep); len(fr) != 1 || fr[0].seq != 12 {
		t.Fatalf("oversized newest frame: %v", fr)
	}
	h.setOwning(false)
	if h.publish([]byte("late")) {
		t.Fatal("published after losing ownership")
	}
	// A stream still gets what was published before the loss, then ends.
	if fr, _, ok := h.since(11, ep); !ok || len(fr) != 1 || fr[0].seq != 12 {
		t.Fatalf("frames published before the loss: %v %v", fr, ok)
	}
	if _, _, ok := h.since(12, ep); ok {
		t.Fatal("stream not over after losing ownership")
	}
	if _, ok := h.open(); ok {
		t.Fatal("stream opened after losing ownership")
	}
	h.setOwning(true)
	ep2, _ := h.open()
	h.close()
	if _, _, ok := h.since(0, ep); ok || ep2 == ep {
		t.Fatal("old epoch served after regaining ownership")
	}
}

// FuzzRelayStream: any bytes from an owner end in an error, never a panic,
// and no payload larger than the limit is allocated.
func FuzzRelayStream(f *testing.F) {
	f.Add(frame(1, []byte("[]")))
	f.Add(appendFrameHeader(nil, 1, 1<<30))
	f.Add([]byte("KVR1"))
	f.Add(append(frame(1, []byte("[]")), frame(1, []byte("[]"))...))
	f.Fuzz(func(t *testing.T, raw []byte) {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusOK)
			w.Write(raw)
		}))
		defer srv.Close()
		r := relayReader{cl: http.DefaultClient, base: srv.URL, endpoint: "x", maxBody: 64, idle: time.Second,
			onOpen: func() {}, apply: func(b []byte) {
				if len(b) > 64 {
					t.Fatalf("payload of %d bytes over the limit", len(b))
				}
			}, gap: func(uint64) {}}
		if err := r.read(context.Background(), &relayCursor{}); err == nil {
			t.Fatal("stream ended without an error")
		}
	})
}

// TestDrainCompletesAfterCancel: a drain already sent when its context
// ends (ownership lost) is still read: the engine gave those events away.
func TestDrainCompletesAfterCancel(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(100 * time.Millisecond)
		w.Write([]byte(`[{"event_id":1}]`))
	}))
	t.Cleanup(srv.Close)
	m := New(fastConfig(), newFakeSink(), nil, nil)
	s := newSubscription(m, trtSpec(1, 32))
	rs := s.ranks[0]
	rs.st.Endpoint = srv.URL
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(10*time.Millisecond, cancel)
	body, err := s.drainTRT(ctx, rs)
	if err != nil || string(body) != `[{"event_id":1}]` {
		t.Fatalf("drain cut by its context: %q %v", body, err)
	}
}
