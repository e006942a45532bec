package kvevents

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"
)

// fakeSink is an in-memory Sink keeping per-rank block sets.
type fakeSink struct {
	mu     sync.Mutex
	blocks map[subKey]map[int]map[uint64]struct{}
	calls  map[string]int
}

var _ Sink = (*fakeSink)(nil)

func newFakeSink() *fakeSink {
	return &fakeSink{blocks: make(map[subKey]map[int]map[uint64]struct{}), calls: make(map[string]int)}
}

func (f *fakeSink) rank(svc uint32, ep, rank int) map[uint64]struct{} {
	k := subKey{svc, ep}
	if f.blocks[k] == nil {
		f.blocks[k] = make(map[int]map[uint64]struct{})
	}
	if f.blocks[k][rank] == nil {
		f.blocks[k][rank] = make(map[uint64]struct{})
	}
	return f.blocks[k][rank]
}

func (f *fakeSink) Store(svc uint32, ep, rank int, keys []uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls["store"]++
	m := f.rank(svc, ep, rank)
	for _, k := range keys {
		m[k] = struct{}{}
	}
}

func (f *fakeSink) Remove(svc uint32, ep, rank int, keys []uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls["remove"]++
	m := f.rank(svc, ep, rank)
	for _, k := range keys {
		delete(m, k)
	}
}

func (f *fakeSink) ClearRank(svc uint32, ep, rank int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls["clear_rank"]++
	delete(f.blocks[subKey{svc, ep}], rank)
}

func (f *fakeSink) ClearEndpoint(svc uint32, ep int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls["clear_ep"]++
	delete(f.blocks, subKey{svc, ep})
}

// keys returns the sorted keys of one rank (rank -1: union of all ranks).
func (f *fakeSink) keys(svc uint32, ep, rank int) []uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []uint64
	for r, m := range f.blocks[subKey{svc, ep}] {
		if rank >= 0 && r != rank {
			continue
		}
		for k := range m {
			if !slices.Contains(out, k) {
				out = append(out, k)
			}
		}
	}
	slices.Sort(out)
	return out
}

func (f *fakeSink) callCount(name string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[name]
}

func sorted(k ...uint64) []uint64 { s := slices.Clone(k); slices.Sort(s); return s }

// waitFor polls cond until it holds. The deadline only bounds a broken
// test; nothing asserts on timing.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func testLogger(t *testing.T) *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// fastConfig shortens the backoffs so fault tests run quickly.
func fastConfig() Config {
	return Config{
		ReconnectMin:        20 * time.Millisecond,
		ReconnectMax:        100 * time.Millisecond,
		ReplayTimeout:       2 * time.Second,
		TRTPollMin:          time.Millisecond,
		TRTPollMax:          5 * time.Millisecond,
		TRTAdmissionRetry:   20 * time.Millisecond,
		TRTAdmissionRecheck: 50 * time.Millisecond,
	}
}

type harness struct {
	t    *testing.T
	m    *Manager
	sink *fakeSink
	reg  *prometheus.Registry
	stop func()
}

func startManager(t *testing.T, cfg Config, specs ...Spec) *harness {
	t.Helper()
	sink := newFakeSink()
	reg := prometheus.NewRegistry()
	m := New(cfg, sink, testLogger(t), reg)
	if err := m.Sync(specs); err != nil {
		t.Fatalf("sync: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = m.Run(ctx); close(done) }()
	h := &harness{t: t, m: m, sink: sink, reg: reg, stop: func() { cancel(); <-done }}
	t.Cleanup(h.stop)
	return h
}

func (h *harness) status(svc uint32, ep int) EndpointStatus {
	st, ok := h.m.Status(svc, ep)
	if !ok {
		h.t.Fatalf("no status for %d/%d", svc, ep)
	}
	return st
}

// metric returns the value of one series (0 when absent).
func (h *harness) metric(name string, labels map[string]string) float64 {
	mfs, err := h.reg.Gather()
	if err != nil {
		h.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, lp := range m.GetLabel() {
				have[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue next
				}
			}
			if m.Counter != nil {
				return m.Counter.GetValue()
			}
			return m.Gauge.GetValue()
		}
	}
	return 0
}

// seriesCount counts series of a metric family with the given labels.
func (h *harness) seriesCount(labels map[string]string) int {
	mfs, _ := h.reg.Gather()
	n := 0
	for _, mf := range mfs {
	next:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, lp := range m.GetLabel() {
				have[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue next
				}
			}
			n++
		}
	}
	return n
}

// publisher is a test ZMQ PUB speaking the engines' 3-frame protocol.
type publisher struct {
	t     *testing.T
	sock  zmq4.Socket
	port  int
	topic []byte
}

func newPublisherOn(t *testing.T, port int) (*publisher, error) {
	sock := zmq4.NewPub(context.Background())
	if err := sock.Listen("tcp://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(port))); err != nil {
		sock.Close()
		return nil, err
	}
	p := &publisher{t: t, sock: sock}
	p.port = sock.Addr().(*net.TCPAddr).Port
	t.Cleanup(func() { sock.Close() })
	return p, nil
}

func newPublisher(t *testing.T) *publisher {
	p, err := newPublisherOn(t, 0)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// consecutivePublishers binds n PUBs on consecutive ports (SGLang ranks).
func consecutivePublishers(t *testing.T, n int) []*publisher {
	for attempt := 0; attempt < 100; attempt++ {
		base := 20000 + rand.IntN(30000)
		var ps []*publisher
		for i := 0; i < n; i++ {
			p, err := newPublisherOn(t, base+i)
			if err != nil {
				break
			}
			ps = append(ps, p)
		}
		if len(ps) == n {
			return ps
		}
		for _, p := range ps {
			p.sock.Close()
		}
	}
	t.Fatal("no free consecutive ports")
	return nil
}

func seqFrame(seq uint64) []byte {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], seq)
	return b[:]
}

func (p *publisher) send(seq uint64, payload []byte) {
	p.t.Helper()
	if err := p.sock.SendMulti(zmq4.NewMsgFrom(p.topic, seqFrame(seq), payload)); err != nil {
		p.t.Fatalf("publish: %v", err)
	}
}

func (p *publisher) sendRaw(frames ...[]byte) {
	p.t.Helper()
	if err := p.sock.SendMulti(zmq4.NewMsgFrom(frames...)); err != nil {
		p.t.Fatalf("publish: %v", err)
	}
}

// emptyBatch is [ts, [], rank].
func emptyBatch(rank int) []byte { return []byte{0x93, 0x00, 0x90, byte(rank)} }

// handshake repeats batch seq until the rank has applied it: a SUB only
// receives messages published after its subscription reached the PUB.
func (p *publisher) handshake(h *harness, svc uint32, ep, rank int, seq uint64, payload []byte) {
	p.t.Helper()
	waitFor(p.t, fmt.Sprintf("rank %d to receive seq %d", rank, seq), func() bool {
		st := h.status(svc, ep)
		if st.Ranks[rank].HasSeq && st.Ranks[rank].LastSeq >= seq {
			return true
		}
		p.send(seq, payload)
		time.Sleep(10 * time.Millisecond)
		return false
	})
}

// storedBatch builds a map-encoded vLLM batch storing keys (no tokens).
func storedBatch(keys ...uint64) []byte {
	var m mp
	m.arr(3).f64(0).arr(1)
	m.mapN(2).str("type").str("BlockStored").str("block_hashes").arr(len(keys))
	for _, k := range keys {
		m.u64(k)
	}
	m.fix(0)
	return m.Bytes()
}

func removedBatch(keys ...uint64) []byte {
	var m mp
	m.arr(3).f64(0).arr(1)
	m.mapN(2).str("type").str("BlockRemoved").str("block_hashes").arr(len(keys))
	for _, k := range keys {
		m.u64(k)
	}
	m.fix(0)
	return m.Bytes()
}

// replayServer is a test replay ROUTER holding a buffer of batches.
type replayServer struct {
	t       *testing.T
	sock    zmq4.Socket
	port    int
	mu      sync.Mutex
	buf     map[uint64][]byte
	topic   bool // current vLLM form (topic frame) vs older form
	reqs    []uint64
	silence bool // never answer (timeout)
}

func newReplayServer(t *testing.T, withTopic bool) *replayServer {
	sock := zmq4.NewRouter(context.Background(), zmq4.WithLogger(nil))
	if err := sock.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	r := &replayServer{t: t, sock: sock, buf: map[uint64][]byte{}, topic: withTopic}
	r.port = sock.Addr().(*net.TCPAddr).Port
	go r.serve()
	t.Cleanup(func() { sock.Close() })
	return r
}

func (r *replayServer) put(seq uint64, payload []byte) {
	r.mu.Lock()
	r.buf[seq] = payload
	r.mu.Unlock()
}

func (r *replayServer) requests() []uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.reqs)
}

func (r *replayServer) serve() {
	for {
		msg, err := r.sock.Recv()
		if err != nil {
			return
		}
		f := msg.Frames
		if len(f) != 3 || len(f[1]) != 0 || len(f[2]) != 8 {
			continue // like vLLM: anything else is ignored
		}
		id, start := f[0], binary.BigEndian.Uint64(f[2])
		r.mu.Lock()
		r.reqs = append(r.reqs, start)
		silence := r.silence
		var seqs []uint64
		for s := range r.buf {
			if s >= start {
				seqs = append(seqs, s)
			}
		}
		slices.Sort(seqs)
		var out []zmq4.Msg
		for _, s := range seqs {
			if r.topic {
				out = append(out, zmq4.NewMsgFrom(id, []byte{}, []byte("kv"), seqFrame(s), r.buf[s]))
			} else {
				out = append(out, zmq4.NewMsgFrom(id, []byte{}, seqFrame(s), r.buf[s]))
			}
		}
		r.mu.Unlock()
		if silence {
			continue
		}
		for _, m := range out {
			_ = r.sock.SendMulti(m)
		}
		end := seqFrame(^uint64(0))
		if r.topic {
			_ = r.sock.SendMulti(zmq4.NewMsgFrom(id, []byte{}, []byte{}, end, []byte{}))
		} else {
			_ = r.sock.SendMulti(zmq4.NewMsgFrom(id, []byte{}, end, []byte{}))
		}
	}
}
