package enginesim

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// pubItem is one unit of the publisher queue: a batch payload, or a reset
// marker that restarts the sequence (an emulated engine restart).
type pubItem struct {
	payload []byte
	reset   bool
}

type bufEntry struct {
	seq     uint64
	payload []byte
}

// zmqPublisher is one rank's KV-event publisher: a PUB socket sending
// [topic, seq(8B BE), payload] and an optional ROUTER replay socket serving
// buffered batches. Sequence numbers are assigned in queue order, so they
// follow the order of cache mutations.
type zmqPublisher struct {
	log             *slog.Logger
	topic           []byte
	replayWithTopic bool
	bufferSteps     int
	faults          *faultState
	rng             *rand.Rand

	pub    zmq4.Socket
	router zmq4.Socket
	cancel context.CancelFunc
	ch     chan pubItem
	done   chan struct{}

	mu  sync.Mutex // guards seq and buf
	seq uint64
	buf []bufEntry

	qmu    sync.RWMutex // guards closed against sends on a closed queue
	closed bool

	enqueued, published, dropped, reordered, replays, lost atomic.Uint64
}

type pubConfig struct {
	endpoint        string // tcp://host:port for the PUB socket
	replayEndpoint  string // empty: no replay socket
	topic           string
	replayWithTopic bool
	bufferSteps     int
}

func newZMQPublisher(log *slog.Logger, cfg pubConfig, faults *faultState, seed uint64) (*zmqPublisher, error) {
	ctx, cancel := context.WithCancel(context.Background())
	p := &zmqPublisher{
		log: log, topic: []byte(cfg.topic), replayWithTopic: cfg.replayWithTopic,
		bufferSteps: cfg.bufferSteps, faults: faults, rng: rand.New(rand.NewPCG(seed, 0x6b76)),
		cancel: cancel, ch: make(chan pubItem, 4096), done: make(chan struct{}),
	}
	p.pub = zmq4.NewPub(ctx)
	if err := p.pub.Listen(cfg.endpoint); err != nil {
		cancel()
		p.pub.Close()
		return nil, fmt.Errorf("kv events PUB on %s: %w", cfg.endpoint, err)
	}
	if cfg.replayEndpoint != "" {
		p.router = zmq4.NewRouter(ctx, zmq4.WithTimeout(5*time.Second))
		if err := p.router.Listen(cfg.replayEndpoint); err != nil {
			cancel()
			p.pub.Close()
			p.router.Close()
			return nil, fmt.Errorf("kv events replay ROUTER on %s: %w", cfg.replayEndpoint, err)
		}
		go p.serveReplay()
	}
	go p.run()
	return p, nil
}

// enqueue hands a batch to the publisher. It blocks when the queue is full
// rather than lose a batch silently; after close (a request still running
// at shutdown) the batch is counted as lost.
func (p *zmqPublisher) enqueue(it pubItem) {
	p.qmu.RLock()
	defer p.qmu.RUnlock()
	if p.closed {
		p.lost.Add(1)
		return
	}
	if !it.reset {
		p.enqueued.Add(1)
	}
	p.ch <- it
}

func seqBytes(seq uint64) []byte {
	b := make([]byte, 8)
	binary.BigEndian.PutUint64(b, seq)
	return b
}

func (p *zmqPublisher) send(e bufEntry) {
	if err := p.pub.Send(zmq4.NewMsgFrom(p.topic, seqBytes(e.seq), e.payload)); err != nil {
		p.log.Warn("kv events publish failed", "seq", e.seq, "err", err)
		return
	}
	p.published.Add(1)
}

func (p *zmqPublisher) run() {
	defer close(p.done)
	var held *bufEntry
	// A held (reordered) batch is released after the next one, or after
	// the hold time if no batch follows, so reordering never becomes loss.
	flush := time.NewTimer(time.Hour)
	defer flush.Stop()
	for {
		var it pubItem
		var ok bool
		select {
		case it, ok = <-p.ch:
			if !ok {
				if held != nil {
					p.send(*held)
				}
				return
			}
		case <-flush.C:
			if held != nil {
				p.send(*held)
				held = nil
			}
			continue
		}
		if it.reset {
			p.mu.Lock()
			p.seq = 0
			p.buf = nil
			p.mu.Unlock()
			held = nil
			continue
		}
		p.mu.Lock()
		e := bufEntry{seq: p.seq, payload: it.payload}
		p.seq++
		p.buf = append(p.buf, e)
		if len(p.buf) > p.bufferSteps {
			p.buf = append(p.buf[:0:0], p.buf[len(p.buf)-p.bufferSteps:]...)
		}
		p.mu.Unlock()

		act := p.faults.batchAction(p.rng)
		if act.delay > 0 {
			time.Sleep(act.delay)
		}
		switch {
		case act.drop:
			// The sequence number is consumed and the batch stays in the
			// replay buffer: a subscriber sees a gap it can repair.
			p.dropped.Add(1)
		case act.reorder && held == nil:
			held = &e
			p.reordered.Add(1)
			flush.Reset(act.hold)
		default:
			p.send(e)
			if held != nil {
				p.send(*held)
				held = nil
			}
		}
	}
}

// serveReplay answers replay requests: a 3-frame [identity, "", start_seq]
// gets every buffered batch with seq >= start, then the end marker.
func (p *zmqPublisher) serveReplay() {
	for {
		msg, err := p.router.Recv()
		if err != nil {
			return
		}
		if len(msg.Frames) != 3 || len(msg.Frames[2]) != 8 {
			continue // vLLM ignores any other shape
		}
		id := msg.Frames[0]
		start := binary.BigEndian.Uint64(msg.Frames[2])
		p.mu.Lock()
		var out []bufEntry
		for _, e := range p.buf {
			if e.seq >= start {
				out = append(out, e)
			}
		}
		p.mu.Unlock()
		p.replays.Add(1)
		for _, e := range out {
			frames := [][]byte{id, {}}
			if p.replayWithTopic {
				frames = append(frames, p.topic)
			}
			frames = append(frames, seqBytes(e.seq), e.payload)
			if err := p.router.Send(zmq4.NewMsgFrom(frames...)); err != nil {
				p.log.Warn("kv events replay send failed", "err", err)
				break
			}
		}
		end := [][]byte{id, {}}
		if p.replayWithTopic {
			end = append(end, []byte{})
		}
		end = append(end, seqBytes(^uint64(0)), []byte{})
		if err := p.router.Send(zmq4.NewMsgFrom(end...)); err != nil {
			p.log.Warn("kv events replay end marker failed", "err", err)
		}
	}
}

// subscribers is the number of distinct topics subscribed; 0 means nobody
// listens yet (tests wait on it instead of sleeping).
func (p *zmqPublisher) subscribers() int {
	if t, ok := p.pub.(zmq4.Topics); ok {
		return len(t.Topics())
	}
	return 0
}

func (p *zmqPublisher) currentSeq() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.seq
}

func (p *zmqPublisher) close() {
	p.qmu.Lock()
	p.closed = true
	close(p.ch)
	p.qmu.Unlock()
	<-p.done
	p.cancel()
	p.pub.Close()
	if p.router != nil {
		p.router.Close()
	}
}
