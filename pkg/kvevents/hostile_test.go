package kvevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
)

// zmtpGreeting is a ZMTP 3.0 NULL greeting.
func zmtpGreeting() []byte {
	g := make([]byte, zmtpGreetingLen)
	g[0], g[9], g[10], g[11] = 0xff, 0x7f, 3, 0
	copy(g[12:], "NULL")
	return g
}

// zmtpReady is a READY command announcing socket type typ.
func zmtpReady(typ string) []byte {
	body := []byte{5}
	body = append(body, "READY"...)
	body = append(body, byte(len("Socket-Type")))
	body = append(body, "Socket-Type"...)
	body = binary.BigEndian.AppendUint32(body, uint32(len(typ)))
	body = append(body, typ...)
	return append([]byte{zmtpFlagCommand, byte(len(body))}, body...)
}

// longFrameHeader is a data frame header announcing size bytes.
func longFrameHeader(flags byte, size uint64) []byte {
	return binary.BigEndian.AppendUint64([]byte{flags | zmtpFlagLong}, size)
}

// hostilePeer is a TCP listener on loopback that answers every connection
// with script and then holds it open, reading and discarding what the
// subscriber sends.
type hostilePeer struct {
	ln    net.Listener
	port  int
	conns atomic.Int64
}

func newHostilePeer(t *testing.T, script []byte) *hostilePeer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hp := &hostilePeer{ln: ln, port: ln.Addr().(*net.TCPAddr).Port}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			hp.conns.Add(1)
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(20 * time.Second))
				if _, err := c.Write(script); err != nil {
					return
				}
				_, _ = io.Copy(io.Discard, c)
			}()
		}
	}()
	return hp
}

// TestHugeFrameHeaderOnLivePort: a peer answering on the publisher port
// with a frame header that announces 2^40 or 2^62 bytes (in the READY
// command or in the first data frame) used to make zmq4 allocate that much
// (makeslice panic or fatal out of memory in a zmq4 goroutine, killing the
// process). It is now refused before zmq4 reads the header, counted, and
// the subscriber keeps redialling with backoff.
func TestHugeFrameHeaderOnLivePort(t *testing.T) {
	for _, tc := range []struct {
		name   string
		script []byte
	}{
		{"data_2^40", append(append(zmtpGreeting(), zmtpReady("PUB")...), longFrameHeader(0, 1<<40)...)},
		{"data_2^62", append(append(zmtpGreeting(), zmtpReady("PUB")...), longFrameHeader(0, 1<<62)...)},
		{"more_2^62", append(append(append(zmtpGreeting(), zmtpReady("PUB")...), zmtpFlagMore, 3, 'k', 'v', '!'), longFrameHeader(0, 1<<62-1)...)},
		{"ready_2^62", append(zmtpGreeting(), longFrameHeader(zmtpFlagCommand, 1<<62)...)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hp := newHostilePeer(t, tc.script)
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			before := ms.TotalAlloc
			h := startManager(t, fastConfig(), vllmSpec(hp.port))
			l := map[string]string{"service": "7", "ep_idx": "2", "reason": rejectMessageTooLarge}
			waitFor(t, "two refusals", func() bool { return h.metric("loxilb_kv_rejected_total", l) >= 2 })
			if hp.conns.Load() < 2 {
				t.Fatalf("subscriber dialled %d times, want a redial", hp.conns.Load())
			}
			st := h.status(7, 2)
			if st.Rejected < 2 || st.Connected || !strings.Contains(st.Ranks[0].LastError, "size limit") {
				t.Fatalf("status = %+v", st)
			}
			runtime.ReadMemStats(&ms)
			if grown := ms.TotalAlloc - before; grown > 64<<20 {
				t.Fatalf("allocated %d MiB while refusing the peer", grown>>20)
			}
		})
	}
}

// TestHugeFrameHeaderOnReplayPort: the same attack from the replay ROUTER
// (a DEALER exchange on connect). The replay fails and is counted, and the
// live feed still applies.
func TestHugeFrameHeaderOnReplayPort(t *testing.T) {
	for _, size := range []uint64{1 << 40, 1 << 62} {
		t.Run(strconv.FormatUint(size, 10), func(t *testing.T) {
			hp := newHostilePeer(t, append(append(zmtpGreeting(), zmtpReady("ROUTER")...), longFrameHeader(0, size)...))
			p := newPublisher(t)
			spec := vllmSpec(p.port)
			spec.ReplayEndpoint = "tcp://127.0.0.1:" + strconv.Itoa(hp.port)
			h := startManager(t, fastConfig(), spec)
			p.handshake(h, 7, 2, 0, 0, storedBatch(11))
			l := map[string]string{"service": "7", "ep_idx": "2", "reason": rejectMessageTooLarge}
			waitFor(t, "replay refusal", func() bool { return h.metric("loxilb_kv_rejected_total", l) >= 1 })
			if h.metric("loxilb_kv_replays_total", map[string]string{"service": "7", "ep_idx": "2", "result": replayUnavailable}) < 1 {
				t.Fatal("replay not counted unavailable")
			}
			if got := h.sink.keys(7, 2, 0); len(got) != 1 || got[0] != 11 {
				t.Fatalf("inventory = %v", got)
			}
		})
	}
}

// TestTooManyFramesRefused: a message of many empty frames (each a slice
// header for zmq4) is refused at the frame cap.
func TestTooManyFramesRefused(t *testing.T) {
	script := append(zmtpGreeting(), zmtpReady("PUB")...)
	for i := 0; i < 100; i++ {
		script = append(script, zmtpFlagMore, 0)
	}
	hp := newHostilePeer(t, script)
	h := startManager(t, fastConfig(), vllmSpec(hp.port))
	l := map[string]string{"service": "7", "ep_idx": "2", "reason": rejectMessageTooLarge}
	waitFor(t, "refusal", func() bool { return h.metric("loxilb_kv_rejected_total", l) >= 1 })
}

// TestMalformedReadyRefused: zmq4's own READY parser indexes past the end
// of a property whose name length runs past the command.
func TestMalformedReadyRefused(t *testing.T) {
	body := append([]byte{5}, "READY"...)
	body = append(body, 200, 'x')
	script := append(zmtpGreeting(), append([]byte{zmtpFlagCommand, byte(len(body))}, body...)...)
	hp := newHostilePeer(t, script)
	h := startManager(t, fastConfig(), vllmSpec(hp.port))
	l := map[string]string{"service": "7", "ep_idx": "2", "reason": rejectBadFraming}
	waitFor(t, "refusal", func() bool { return h.metric("loxilb_kv_rejected_total", l) >= 1 })
}

// TestUnknownPeerSocketTypeRefused: zmq4 panics on a READY naming a
// socket type it does not know (found by FuzzZMTPPeer).
func TestUnknownPeerSocketTypeRefused(t *testing.T) {
	for _, typ := range []string{"", "BOGUS", "PULL"} {
		hp := newHostilePeer(t, append(zmtpGreeting(), zmtpReady(typ)...))
		h := startManager(t, fastConfig(), vllmSpec(hp.port))
		l := map[string]string{"service": "7", "ep_idx": "2", "reason": rejectBadFraming}
		waitFor(t, "refusal of "+typ, func() bool { return h.metric("loxilb_kv_rejected_total", l) >= 1 })
		h.stop()
	}
}

// panicSink panics on the first Store.
type panicSink struct {
	*fakeSink
	armed atomic.Bool
}

func (p *panicSink) Store(svc uint32, ep, rank int, keys []uint64) {
	if p.armed.CompareAndSwap(true, false) {
		panic("boom")
	}
	p.fakeSink.Store(svc, ep, rank, keys)
}

// TestSubscriberPanicRecovered: a panic while applying a batch drops the
// connection and clears the publisher's blocks; the process lives and the
// subscriber reconnects.
func TestSubscriberPanicRecovered(t *testing.T) {
	p := newPublisher(t)
	ps := &panicSink{fakeSink: newFakeSink()}
	ps.armed.Store(true)
	reg := newTestRegistry()
	m := New(fastConfig(), ps, testLogger(t), reg)
	if err := m.Sync([]Spec{vllmSpec(p.port)}); err != nil {
		t.Fatal(err)
	}
	h := runManager(t, m, ps.fakeSink, reg)
	waitFor(t, "panic counted", func() bool {
		p.send(0, storedBatch(5))
		time.Sleep(10 * time.Millisecond)
		return h.metric("loxilb_kv_subscriber_panics_total", map[string]string{"service": "7", "ep_idx": "2"}) == 1
	})
	p.handshake(h, 7, 2, 0, 1, storedBatch(6))
	if st := h.status(7, 2); st.Panics != 1 || !strings.Contains(st.Ranks[0].LastError, "") {
		t.Fatalf("status = %+v", st)
	}
	if got := h.sink.keys(7, 2, 0); len(got) == 0 {
		t.Fatal("nothing applied after the panic")
	}
}

// tinyEventsBatch is [ts, [[""] x n]]: n two-byte events.
func tinyEventsBatch(n int) []byte {
	var b bytes.Buffer
	b.Write([]byte{0x92, 0x00, 0xdd})
	_ = binary.Write(&b, binary.BigEndian, uint32(n))
	for i := 0; i < n; i++ {
		b.Write([]byte{0x91, 0xa0})
	}
	return b.Bytes()
}

// TestDecodeAmplificationBounded: 5M two-byte events (a 9.5 MiB payload)
// used to decode into about 1 GiB of Event structs (x100 the payload); the
// batch is now refused at its events header, before any is decoded.
func TestDecodeAmplificationBounded(t *testing.T) {
	payload := tinyEventsBatch(5_000_000)
	var b Batch
	d := NewDecoder(KeyLast8)
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	before := ms.TotalAlloc
	err := d.Decode(payload, &b)
	runtime.ReadMemStats(&ms)
	grown := ms.TotalAlloc - before
	if !errors.Is(err, ErrBatchLimit) || !errors.Is(err, ErrBadPayload) {
		t.Fatalf("err = %v", err)
	}
	if grown > 1<<20 {
		t.Fatalf("decoding a %d-byte payload allocated %d bytes", len(payload), grown)
	}
	t.Logf("payload %d bytes, allocated %d bytes while refusing it", len(payload), grown)

	// Under the caps the decoder still holds at most a bounded multiple.
	payload = tinyEventsBatch(DefaultMaxBatchEvents)
	runtime.ReadMemStats(&ms)
	before = ms.TotalAlloc
	if err := d.Decode(payload, &b); err != nil {
		t.Fatal(err)
	}
	runtime.ReadMemStats(&ms)
	grown = ms.TotalAlloc - before
	t.Logf("largest accepted batch of tiny events: payload %d bytes, allocated %d bytes", len(payload), grown)
	if limit := uint64(DefaultMaxBatchEvents) * uint64(unsafe.Sizeof(Event{})) * 11 / 10; grown > limit {
		t.Fatalf("accepted batch allocated %d bytes, bound %d", grown, limit)
	}
}

// batchStoredThenTokens is a batch whose first event stores key 1 and whose
// second announces ntok token ids.
func batchStoredThenTokens(ntok int) []byte {
	var m mp
	m.arr(2).f64(0).arr(2)
	m.mapN(2).str("type").str("BlockStored").str("block_hashes").arr(1).u64(1)
	m.mapN(3).str("type").str("BlockStored").str("block_hashes").arr(1).u64(2).str("token_ids").arr(ntok)
	for i := 0; i < ntok; i++ {
		m.fix(1)
	}
	return m.Bytes()
}

// TestBatchLimitIsAtomic: a batch over a cap applies nothing, not even
// the events decoded before the cap was hit; it is counted and the
// publisher marked degraded.
func TestBatchLimitIsAtomic(t *testing.T) {
	p := newPublisher(t)
	cfg := fastConfig()
	cfg.MaxBatchTokens = 64
	h := startManager(t, cfg, vllmSpec(p.port))
	p.handshake(h, 7, 2, 0, 0, storedBatch(9))
	p.send(1, batchStoredThenTokens(65))
	waitFor(t, "refusal", func() bool {
		return h.metric("loxilb_kv_rejected_total", map[string]string{"service": "7", "ep_idx": "2", "reason": rejectBatchLimit}) == 1
	})
	if got := h.sink.keys(7, 2, 0); len(got) != 1 || got[0] != 9 {
		t.Fatalf("inventory = %v, want [9]", got)
	}
	st := h.status(7, 2)
	if !st.Degraded || st.Ranks[0].LastSeq != 1 {
		t.Fatalf("status = %+v", st)
	}
	p.send(2, batchStoredThenTokens(64))
	waitFor(t, "batch at the cap applied", func() bool { return len(h.sink.keys(7, 2, 0)) == 3 })
}

// onesBody is a JSON array of n ones: n invalid events.
func onesBody(n int) []byte {
	b := make([]byte, 0, 2*n+1)
	b = append(b, '[')
	for i := 0; i < n; i++ {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, '1')
	}
	return append(b, ']')
}

// TestTRTDecodeAmplificationBounded: a drain body of [1,1,...] used to
// allocate a RawMessage and an error per element (x1688 its size); it is
// now walked one element at a time and refused at the events cap.
func TestTRTDecodeAmplificationBounded(t *testing.T) {
	body := onesBody(5 << 20) // 10 MiB
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	before := ms.TotalAlloc
	_, errs, _, err := DecodeTRTLLMBodyLimits(body, DecodeLimits{})
	runtime.ReadMemStats(&ms)
	grown := ms.TotalAlloc - before
	if !errors.Is(err, ErrBatchLimit) || errs != nil {
		t.Fatalf("err = %v, errs %d", err, len(errs))
	}
	if grown > 4*uint64(len(body)) {
		t.Fatalf("decoding a %d-byte body allocated %d bytes", len(body), grown)
	}
	t.Logf("body %d bytes, allocated %d bytes while refusing it", len(body), grown)
}

// TestTRTBodyOverLimitRefused: an engine answering the drain with 60 MiB
// is cut at the body limit, counted, and the endpoint marked degraded (the
// drained events are lost).
func TestTRTBodyOverLimitRefused(t *testing.T) {
	big := onesBody(30 << 20)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/server_info" {
			w.WriteHeader(http.StatusNotFound)
			return
		}
		_, _ = w.Write(big)
	}))
	t.Cleanup(srv.Close)
	port := srv.Listener.Addr().(*net.TCPAddr).Port
	h := startManager(t, fastConfig(), trtSpec(port, 4))
	l := map[string]string{"service": "4", "ep_idx": "1", "reason": rejectBodyTooLarge}
	waitFor(t, "refusal", func() bool { return h.metric("loxilb_kv_rejected_total", l) >= 1 })
	if st := h.status(4, 1); !st.Degraded {
		t.Fatalf("status = %+v", st)
	}
}

// TestTRTHugeResponseHeadersRefused: response headers over the limit fail
// the exchange (counted as a receive error) instead of being buffered.
func TestTRTHugeResponseHeadersRefused(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/server_info" {
			w.WriteHeader(http.StatusNotFound)
			return
		}
		w.Header().Set("X-Pad", strings.Repeat("a", 256<<10))
		_, _ = w.Write([]byte("[]"))
	}))
	t.Cleanup(srv.Close)
	port := srv.Listener.Addr().(*net.TCPAddr).Port
	h := startManager(t, fastConfig(), trtSpec(port, 4))
	waitFor(t, "receive error", func() bool {
		st := h.status(4, 1)
		return st.RecvErrors >= 1 && strings.Contains(st.Ranks[0].LastError, "header")
	})
}

func newTestRegistry() *prometheus.Registry { return prometheus.NewRegistry() }

// runManager runs m (already synced) like startManager does.
func runManager(t *testing.T, m *Manager, sink *fakeSink, reg *prometheus.Registry) *harness {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = m.Run(ctx); close(done) }()
	h := &harness{t: t, m: m, sink: sink, reg: reg, stop: func() { cancel(); <-done }}
	t.Cleanup(h.stop)
	return h
}

// TestReplayTooLongRefused: a replay ROUTER streaming more batches than
// ReplayMaxBatches is cut off (each one would be remembered in the
// duplicate window until live traffic passes it).
func TestReplayTooLongRefused(t *testing.T) {
	p := newPublisher(t)
	rsrv := newReplayServer(t, true)
	for s := uint64(0); s < 50; s++ {
		rsrv.put(s, storedBatch(100+s))
	}
	spec := vllmSpec(p.port)
	spec.ReplayEndpoint = "tcp://127.0.0.1:" + strconv.Itoa(rsrv.port)
	cfg := fastConfig()
	cfg.ReplayMaxBatches = 10
	h := startManager(t, cfg, spec)
	l := map[string]string{"service": "7", "ep_idx": "2", "reason": rejectReplayTooLong}
	waitFor(t, "refusal", func() bool { return h.metric("loxilb_kv_rejected_total", l) >= 1 })
	if got := len(h.sink.keys(7, 2, 0)); got > 10 {
		t.Fatalf("%d replayed batches applied, cap 10", got)
	}
}

// TestTRTRankOutOfRangeSkipped: events naming attention-DP ranks past
// MaxRanks are skipped and counted rather than each growing a chain map.
func TestTRTRankOutOfRangeSkipped(t *testing.T) {
	ts := newTRTServer(t, "")
	var b strings.Builder
	b.WriteString("[")
	for r := 0; r < 100; r++ {
		if r > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, `{"event_id":%d,"attention_dp_rank":%d,"data":{"type":"stored","parent_hash":null,"blocks":[{"type":"stored_block","block_hash":%d,"tokens":%s}]}}`,
			r, 8+r, r, tokensJSON(r, 4))
	}
	b.WriteString("]")
	ts.push(b.String())
	h := startManager(t, fastConfig(), trtSpec(ts.port(t), 4))
	l := map[string]string{"service": "4", "ep_idx": "1", "reason": skipRank}
	waitFor(t, "skipped", func() bool { return h.metric("loxilb_kv_events_skipped_total", l) == 100 })
	if n := len(h.sink.keys(4, 1, -1)); n != 0 {
		t.Fatalf("%d keys stored for out-of-range ranks", n)
	}
}

// TestTRTAnnouncedBodyOverLimitRefused: a drain whose Content-Length
// announces more than the limit is refused before any of it is read.
func TestTRTAnnouncedBodyOverLimitRefused(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/server_info" {
			w.WriteHeader(http.StatusNotFound)
			return
		}
		w.Header().Set("Content-Length", strconv.Itoa(1<<30))
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(srv.Close)
	port := srv.Listener.Addr().(*net.TCPAddr).Port
	h := startManager(t, fastConfig(), trtSpec(port, 4))
	l := map[string]string{"service": "4", "ep_idx": "1", "reason": rejectBodyTooLarge}
	waitFor(t, "refusal", func() bool { return h.metric("loxilb_kv_rejected_total", l) >= 1 })
	if st := h.status(4, 1); !strings.Contains(st.Ranks[0].LastError, "announced") {
		t.Fatalf("status = %+v", st)
	}
}
