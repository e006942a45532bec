package kvevents

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

func vllmSpec(port int) Spec {
	return Spec{Service: 7, ServiceName: "svc7", EPIdx: 2, Engine: EngineVLLM, Host: "127.0.0.1", TargetPort: 8000,
		ZmqPort: port, HashAlgo: "sha256_cbor", BlockSize: 16, Seed: "42"}
}

func TestVLLMVectorsEndToEnd(t *testing.T) {
	vs := loadEventVectors(t, "vllm_event_vectors.json")
	p := newPublisher(t)
	h := startManager(t, fastConfig(), vllmSpec(p.port))
	p.handshake(h, 7, 2, 0, 0, emptyBatch(0))

	// Map events: store 3, store 1 (child), remove 2, clear.
	topic, _, payload := vs["vllm_map_events_int_hashes"].frames(t)
	p.topic = topic
	p.send(1, payload)
	waitFor(t, "map batch", func() bool { return h.status(7, 2).Ranks[0].LastSeq == 1 })
	if got := h.sink.keys(7, 2, -1); len(got) != 0 {
		t.Fatalf("after AllBlocksCleared inventory = %v", got)
	}
	if h.sink.callCount("store") != 2 || h.sink.callCount("remove") != 1 || h.sink.callCount("clear_rank") != 1 {
		t.Fatalf("sink calls = %v", h.sink.calls)
	}

	// Raw-bytes hashes map to the same keys.
	_, _, payload = vs["vllm_map_events_bytes_hashes"].frames(t)
	p.send(2, payload)
	want := sorted(16300212363532267629, 8671309795006503672, 3527878332947511115)
	waitFor(t, "bytes batch", func() bool { return slices.Equal(h.sink.keys(7, 2, 0), want) })

	// Legacy positional events: store 3 (already there), remove 1, clear.
	_, _, payload = vs["vllm_legacy_array_events"].frames(t)
	p.send(3, payload)
	waitFor(t, "legacy batch", func() bool { return h.status(7, 2).Ranks[0].LastSeq == 3 })
	if got := h.sink.keys(7, 2, -1); len(got) != 0 {
		t.Fatalf("after legacy batch inventory = %v", got)
	}

	st := h.status(7, 2)
	if !st.Connected || st.DecodeErrors != 0 || st.Gaps != 0 || st.BlocksStored != 10 || st.BlocksRemoved != 3 {
		t.Fatalf("status = %+v", st)
	}
	if st.Parity.Verdict != VerdictOK {
		t.Fatalf("parity = %+v", st.Parity)
	}
	l := map[string]string{"service": "7", "ep_idx": "2"}
	if h.metric("loxilb_kv_subscriber_connected", l) != 1 {
		t.Fatal("connected gauge not 1")
	}
	if h.metric("loxilb_kv_block_events_applied_total", map[string]string{"service": "7", "ep_idx": "2", "op": "stored"}) != 10 {
		t.Fatal("stored block counter wrong")
	}
	if h.metric("loxilb_kv_parity_verdict", map[string]string{"service": "7", "ep_idx": "2", "verdict": "ok"}) != 1 {
		t.Fatal("parity gauge not ok")
	}
	if rep := h.m.Parity(); len(rep) != 1 || rep[0].Verdict != VerdictOK || rep[0].Service != 7 || rep[0].EPIdx != 2 {
		t.Fatalf("parity report = %+v", rep)
	}
}

func TestSGLangThreeRanksPerRankClear(t *testing.T) {
	vs := loadEventVectors(t, "sglang_event_vectors.json")
	ps := consecutivePublishers(t, 3)
	spec := Spec{Service: 3, EPIdx: 0, Engine: EngineSGLang, Host: "127.0.0.1", ZmqPort: ps[0].port, Ranks: 3, BlockSize: 16}
	h := startManager(t, fastConfig(), spec)
	for r, p := range ps {
		p.handshake(h, 3, 0, r, 0, emptyBatch(r))
	}
	st := h.status(3, 0)
	if len(st.Ranks) != 3 || st.Ranks[2].Endpoint != "tcp://127.0.0.1:"+strconv.Itoa(ps[0].port+2) || !st.Connected {
		t.Fatalf("status = %+v", st)
	}
	ps[0].send(1, storedBatch(1, 2))
	_, _, salted := vs["sglang_tagged_array_salted_rank1"].frames(t)
	ps[1].send(1, salted)
	ps[2].send(1, storedBatch(2, 5))
	waitFor(t, "three ranks", func() bool { return slices.Equal(h.sink.keys(3, 0, -1), sorted(1, 2, 5, 8635429971592222890)) })
	if got := h.sink.keys(3, 0, 1); !slices.Equal(got, []uint64{8635429971592222890}) {
		t.Fatalf("rank 1 = %v", got)
	}

	// AllBlocksCleared on rank 1 leaves ranks 0 and 2, including key 2
	// that both of them hold.
	var m mp
	m.arr(3).f64(0).arr(1).arr(1).str("AllBlocksCleared").fix(1)
	ps[1].send(2, m.Bytes())
	waitFor(t, "rank 1 cleared", func() bool { return slices.Equal(h.sink.keys(3, 0, -1), sorted(1, 2, 5)) })

	// The full rank-0 vector: three chained pages, one removal, a clear.
	_, _, p0 := vs["sglang_tagged_array_events_rank0"].frames(t)
	ps[0].send(2, p0)
	waitFor(t, "rank 0 vector", func() bool { return h.status(3, 0).Ranks[0].LastSeq == 2 })
	if got := h.sink.keys(3, 0, -1); !slices.Equal(got, sorted(2, 5)) {
		t.Fatalf("after rank 0 clear = %v", got)
	}
	if v := h.status(3, 0).Parity; v.Verdict != VerdictOK || v.VerifiedBlocks != 3 {
		t.Fatalf("sglang parity = %+v", v)
	}
}

func TestGapWithoutReplay(t *testing.T) {
	p := newPublisher(t)
	h := startManager(t, fastConfig(), vllmSpec(p.port))
	p.handshake(h, 7, 2, 0, 0, emptyBatch(0))
	p.send(1, storedBatch(10))
	p.send(3, storedBatch(30)) // seq 2 lost
	waitFor(t, "seq 3", func() bool { return h.status(7, 2).Ranks[0].LastSeq == 3 })
	st := h.status(7, 2)
	if st.Gaps != 1 || !st.Degraded || !st.Ranks[0].Degraded || st.Resets != 0 {
		t.Fatalf("small gap status = %+v", st)
	}
	if got := h.sink.keys(7, 2, 0); !slices.Equal(got, []uint64{10, 30}) {
		t.Fatalf("small gap keeps blocks, got %v", got)
	}
	if h.metric("loxilb_kv_subscriber_degraded", map[string]string{"service": "7", "ep_idx": "2"}) != 1 {
		t.Fatal("degraded gauge not set")
	}
	p.send(200, storedBatch(40)) // 196 lost: more than GapKeepWindow
	waitFor(t, "seq 200", func() bool { return h.status(7, 2).Ranks[0].LastSeq == 200 })
	st = h.status(7, 2)
	if st.Gaps != 2 || st.Resets != 1 || !st.Degraded {
		t.Fatalf("large gap status = %+v", st)
	}
	if got := h.sink.keys(7, 2, 0); !slices.Equal(got, []uint64{40}) {
		t.Fatalf("large gap clears blocks, got %v", got)
	}
	// An AllBlocksCleared makes the inventory exact again.
	var m mp
	m.arr(3).f64(0).arr(1).arr(1).str("AllBlocksCleared").fix(0)
	p.send(201, m.Bytes())
	waitFor(t, "not degraded", func() bool { return !h.status(7, 2).Degraded })
}

func TestGapWithReplay(t *testing.T) {
	for _, withTopic := range []bool{true, false} {
		t.Run(fmt.Sprintf("topic=%v", withTopic), func(t *testing.T) {
			p := newPublisher(t)
			rs := newReplayServer(t, withTopic)
			// History from before the gateway subscribed.
			rs.put(1, storedBatch(1))
			rs.put(2, storedBatch(2))
			rs.put(3, storedBatch(3))
			spec := vllmSpec(p.port)
			spec.ReplayEndpoint = fmt.Sprintf("tcp://127.0.0.1:%d", rs.port)
			h := startManager(t, fastConfig(), spec)
			waitFor(t, "initial replay", func() bool { return slices.Equal(h.sink.keys(7, 2, 0), []uint64{1, 2, 3}) })

			rs.put(4, storedBatch(4))
			p.handshake(h, 7, 2, 0, 4, storedBatch(4))
			// 5 and 6 are lost on the SUB but the replay buffer has them.
			rs.put(5, storedBatch(5))
			rs.put(6, removedBatch(1))
			rs.put(7, storedBatch(7))
			p.send(7, storedBatch(7))
			waitFor(t, "gap repaired", func() bool { return h.status(7, 2).Ranks[0].LastSeq == 7 })
			if got := h.sink.keys(7, 2, 0); !slices.Equal(got, []uint64{2, 3, 4, 5, 7}) {
				t.Fatalf("inventory = %v", got)
			}
			st := h.status(7, 2)
			if st.Gaps != 1 || st.Degraded || st.Replays < 2 || st.ReplayFailures != 0 || st.Resets != 0 {
				t.Fatalf("status = %+v", st)
			}
			if reqs := rs.requests(); len(reqs) < 2 || reqs[0] != 0 || reqs[len(reqs)-1] != 5 {
				t.Fatalf("replay requests = %v", reqs)
			}
		})
	}
}

func TestGapReplayUnavailable(t *testing.T) {
	p := newPublisher(t)
	dead := newPublisher(t) // a port nobody answers replays on
	port := dead.port
	dead.sock.Close()
	spec := vllmSpec(p.port)
	spec.ReplayEndpoint = fmt.Sprintf("tcp://127.0.0.1:%d", port)
	h := startManager(t, fastConfig(), spec)
	p.handshake(h, 7, 2, 0, 0, emptyBatch(0))
	p.send(1, storedBatch(1))
	p.send(5, storedBatch(5))
	waitFor(t, "seq 5", func() bool { return h.status(7, 2).Ranks[0].LastSeq == 5 })
	st := h.status(7, 2)
	if st.Gaps != 1 || !st.Degraded || st.ReplayFailures == 0 {
		t.Fatalf("status = %+v", st)
	}
	if h.metric("loxilb_kv_replays_total", map[string]string{"service": "7", "ep_idx": "2", "result": "unavailable"}) == 0 {
		t.Fatal("unavailable replay not counted")
	}
	if got := h.sink.keys(7, 2, 0); !slices.Equal(got, []uint64{1, 5}) {
		t.Fatalf("inventory = %v", got)
	}
}

func TestEngineRestartSeqBackwards(t *testing.T) {
	p := newPublisher(t)
	h := startManager(t, fastConfig(), vllmSpec(p.port))
	p.handshake(h, 7, 2, 0, 0, emptyBatch(0))
	p.send(1, storedBatch(1))
	p.send(2, storedBatch(2))
	waitFor(t, "seq 2", func() bool { return h.status(7, 2).Ranks[0].LastSeq == 2 })
	// The engine restarted behind a live connection: seq starts over.
	p.send(0, storedBatch(100))
	waitFor(t, "restart", func() bool { return slices.Equal(h.sink.keys(7, 2, 0), []uint64{100}) })
	st := h.status(7, 2)
	if st.Resets != 1 || st.Ranks[0].LastSeq != 0 || st.Degraded {
		t.Fatalf("status = %+v", st)
	}
	if h.metric("loxilb_kv_resets_total", map[string]string{"service": "7", "ep_idx": "2", "reason": resetSeqBackwards}) != 1 {
		t.Fatal("reset not counted")
	}
}

func TestPublisherDownAndBack(t *testing.T) {
	p := newPublisher(t)
	port := p.port
	h := startManager(t, fastConfig(), vllmSpec(port))
	p.handshake(h, 7, 2, 0, 0, emptyBatch(0))
	p.send(1, storedBatch(1))
	waitFor(t, "seq 1", func() bool { return h.status(7, 2).Ranks[0].LastSeq == 1 })

	p.sock.Close()
	waitFor(t, "disconnect", func() bool { return !h.status(7, 2).Connected })
	if h.metric("loxilb_kv_subscriber_connected", map[string]string{"service": "7", "ep_idx": "2"}) != 0 {
		t.Fatal("connected gauge still 1")
	}
	time.Sleep(50 * time.Millisecond) // a few failed redials

	// The same publisher process comes back (seq continues).
	var p2 *publisher
	waitFor(t, "rebind", func() bool {
		var err error
		p2, err = newPublisherOn(t, port)
		return err == nil
	})
	p2.handshake(h, 7, 2, 0, 2, storedBatch(2))
	if got := h.sink.keys(7, 2, 0); !slices.Equal(got, []uint64{1, 2}) {
		t.Fatalf("inventory after reconnect = %v", got)
	}
	st := h.status(7, 2)
	if st.Reconnects != 1 || st.RecvErrors == 0 || st.Resets != 0 {
		t.Fatalf("status = %+v", st)
	}

	// Now a restarted engine on that port: seq goes back to 0.
	p2.sock.Close()
	waitFor(t, "disconnect 2", func() bool { return !h.status(7, 2).Connected })
	var p3 *publisher
	waitFor(t, "rebind 2", func() bool {
		var err error
		p3, err = newPublisherOn(t, port)
		return err == nil
	})
	waitFor(t, "reset after restart", func() bool {
		p3.send(0, storedBatch(9))
		time.Sleep(10 * time.Millisecond)
		return slices.Equal(h.sink.keys(7, 2, 0), []uint64{9})
	})
	if st := h.status(7, 2); st.Reconnects != 2 || st.Resets != 1 {
		t.Fatalf("status = %+v", st)
	}
}

func TestReconnectWithReplayDetectsRestart(t *testing.T) {
	p := newPublisher(t)
	port := p.port
	rs := newReplayServer(t, true)
	spec := vllmSpec(port)
	spec.ReplayEndpoint = fmt.Sprintf("tcp://127.0.0.1:%d", rs.port)
	h := startManager(t, fastConfig(), spec)
	rs.put(0, storedBatch(1))
	p.handshake(h, 7, 2, 0, 0, storedBatch(1))
	rs.put(1, storedBatch(2))
	p.send(1, storedBatch(2))
	waitFor(t, "seq 1", func() bool { return h.status(7, 2).Ranks[0].LastSeq == 1 })

	// The engine restarts: its new replay buffer holds different batches
	// under seq 0 and 1.
	p.sock.Close()
	rs.mu.Lock()
	rs.buf = map[uint64][]byte{0: storedBatch(50), 1: storedBatch(51), 2: storedBatch(52)}
	rs.mu.Unlock()
	waitFor(t, "disconnect", func() bool { return !h.status(7, 2).Connected })
	waitFor(t, "rebind", func() bool {
		var err error
		p, err = newPublisherOn(t, port)
		return err == nil
	})
	waitFor(t, "rebuilt from replay", func() bool { return slices.Equal(h.sink.keys(7, 2, 0), []uint64{50, 51, 52}) })
	st := h.status(7, 2)
	if st.Resets != 1 || st.Degraded || st.Ranks[0].LastSeq != 2 {
		t.Fatalf("status = %+v", st)
	}
}

func TestGarbageFrames(t *testing.T) {
	p := newPublisher(t)
	h := startManager(t, fastConfig(), vllmSpec(p.port))
	p.handshake(h, 7, 2, 0, 0, emptyBatch(0))
	p.sendRaw([]byte("kv"), seqFrame(1))                      // two frames
	p.sendRaw([]byte("kv"), []byte{1, 2, 3}, storedBatch(1))  // short seq
	p.send(1, []byte{0xc1, 0xff, 0x00})                       // not msgpack
	p.send(2, append(storedBatch(2), 0x00))                   // trailing byte
	p.sendRaw([]byte("kv"), seqFrame(3), storedBatch(3), nil) // four frames
	p.send(3, storedBatch(4))
	waitFor(t, "seq 3", func() bool { return h.status(7, 2).Ranks[0].LastSeq == 3 })
	st := h.status(7, 2)
	if st.DecodeErrors != 5 || !st.Connected || st.Gaps != 0 {
		t.Fatalf("status = %+v", st)
	}
	if got := h.sink.keys(7, 2, 0); !slices.Equal(got, []uint64{4}) {
		t.Fatalf("inventory = %v", got)
	}
	if h.metric("loxilb_kv_decode_errors_total", map[string]string{"service": "7", "ep_idx": "2"}) != 5 {
		t.Fatal("decode errors metric")
	}
}

func TestSyncLifecycle(t *testing.T) {
	p := newPublisher(t)
	spec := vllmSpec(p.port)
	h := startManager(t, fastConfig(), spec)
	p.handshake(h, 7, 2, 0, 0, emptyBatch(0))
	p.send(1, storedBatch(1))
	waitFor(t, "seq 1", func() bool { return len(h.sink.keys(7, 2, 0)) == 1 })

	// A changed spec restarts the subscription from an empty inventory.
	spec.BlockSize = 32
	if err := h.m.Sync([]Spec{spec}); err != nil {
		t.Fatal(err)
	}
	if got := h.sink.keys(7, 2, -1); len(got) != 0 || h.sink.callCount("clear_ep") != 1 {
		t.Fatalf("after change inventory = %v calls %v", got, h.sink.calls)
	}
	if st := h.status(7, 2); st.BlockSize != 32 || st.BlocksStored != 0 {
		t.Fatalf("status = %+v", st)
	}
	p.handshake(h, 7, 2, 0, 2, storedBatch(2))

	// Invalid specs are refused, valid ones still applied.
	bad := []Spec{spec, {Service: 9, Engine: "llamacpp", Host: "127.0.0.1", BlockSize: 16}, {Service: 10, Engine: EngineVLLM, Host: "localhost", ZmqPort: 1, BlockSize: 16}}
	if err := h.m.Sync(bad); err == nil {
		t.Fatal("invalid specs accepted")
	}
	if _, ok := h.m.Status(7, 2); !ok {
		t.Fatal("valid spec dropped")
	}

	// Removal stops it, clears the inventory and deletes its series.
	if err := h.m.Sync(nil); err != nil {
		t.Fatal(err)
	}
	if _, ok := h.m.Status(7, 2); ok {
		t.Fatal("status still present")
	}
	if h.sink.callCount("clear_ep") != 2 || len(h.sink.keys(7, 2, -1)) != 0 {
		t.Fatalf("calls %v", h.sink.calls)
	}
	if n := h.seriesCount(map[string]string{"service": "7", "ep_idx": "2"}); n != 0 {
		t.Fatalf("%d series left", n)
	}
}

// countingHandler counts slog records containing a message substring.
type countingHandler struct {
	mu   *sync.Mutex
	msgs *[]string
}

func (c countingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (c countingHandler) Handle(_ context.Context, r slog.Record) error {
	c.mu.Lock()
	*c.msgs = append(*c.msgs, r.Message)
	c.mu.Unlock()
	return nil
}
func (c countingHandler) WithAttrs([]slog.Attr) slog.Handler { return c }
func (c countingHandler) WithGroup(string) slog.Handler      { return c }

func TestParityMismatchEndToEnd(t *testing.T) {
	vs := loadEventVectors(t, "vllm_event_vectors.json")
	p := newPublisher(t)
	spec := vllmSpec(p.port)
	spec.Seed = "0" // the engine ran with PYTHONHASHSEED=42
	var mu sync.Mutex
	var msgs []string
	sink := newFakeSink()
	reg := prometheus.NewRegistry()
	m := New(fastConfig(), sink, slog.New(countingHandler{&mu, &msgs}), reg)
	if err := m.Sync([]Spec{spec}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = m.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	h := &harness{t: t, m: m, sink: sink, reg: reg}
	p.handshake(h, 7, 2, 0, 0, emptyBatch(0))
	_, _, payload := vs["vllm_map_events_int_hashes"].frames(t)
	for seq := uint64(1); seq <= 3; seq++ {
		p.send(seq, payload)
	}
	waitFor(t, "verdict", func() bool { return h.status(7, 2).Parity.Verdict == VerdictHashMismatch })
	waitFor(t, "seq 3", func() bool { return h.status(7, 2).Ranks[0].LastSeq == 3 })
	if h.metric("loxilb_kv_parity_verdict", map[string]string{"ep_idx": "2", "verdict": VerdictHashMismatch}) != 1 ||
		h.metric("loxilb_kv_parity_verdict", map[string]string{"ep_idx": "2", "verdict": VerdictOK}) != 0 {
		t.Fatal("parity gauges")
	}
	mu.Lock()
	defer mu.Unlock()
	n := 0
	for _, msg := range msgs {
		if strings.Contains(msg, "parity broken") {
			n++
		}
	}
	if n != 1 {
		t.Fatalf("%d parity warnings logged, want exactly 1", n)
	}
}

func TestGapReplayTimeout(t *testing.T) {
	p := newPublisher(t)
	rs := newReplayServer(t, true)
	rs.mu.Lock()
	rs.silence = true
	rs.mu.Unlock()
	spec := vllmSpec(p.port)
	spec.ReplayEndpoint = fmt.Sprintf("tcp://127.0.0.1:%d", rs.port)
	cfg := fastConfig()
	cfg.ReplayTimeout = 100 * time.Millisecond
	h := startManager(t, cfg, spec)
	p.handshake(h, 7, 2, 0, 1, storedBatch(1))
	p.send(3, storedBatch(3))
	waitFor(t, "seq 3", func() bool { return h.status(7, 2).Ranks[0].LastSeq == 3 })
	st := h.status(7, 2)
	if !st.Degraded || st.Gaps != 1 || st.ReplayFailures < 2 || !strings.Contains(st.Ranks[0].LastError, "timed out") {
		t.Fatalf("status = %+v", st)
	}
	if got := h.sink.keys(7, 2, 0); !slices.Equal(got, []uint64{1, 3}) {
		t.Fatalf("inventory = %v", got)
	}
}
