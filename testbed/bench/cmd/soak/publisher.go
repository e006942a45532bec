package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

// publisherAttacks switches the hostile publisher's attacks that can crash
// or exhaust a daemon outright, so a run can measure the rest.
type publisherAttacks struct {
	// HugeFrame sends frame headers announcing a 2^40-byte body, and lets
	// the garbage attack's random bytes announce long frames of random
	// size (up to 2^64-1 bytes). Without it garbage never sets the long
	// flag, so no frame it announces exceeds 255 bytes.
	HugeFrame bool
	// BadHandshake answers the ZMTP handshake with a READY command whose
	// property list is truncated.
	BadHandshake bool
}

// badPublisher answers a rule endpoint's KV-event PUB port and its replay
// ROUTER port with a hostile ZMTP 3.0 peer: it completes the NULL
// handshake (or breaks it), then sends a random mix of garbage bytes,
// oversized and truncated frames, malformed msgpack, wrong frame counts,
// forged BlockStored batches, sequence jumps and restarts, and hangs up
// after a few seconds so that the daemon reconnects.
type badPublisher struct {
	attacks publisherAttacks
	seed    uint64

	pub, replay net.Listener
	wg          sync.WaitGroup

	mu     sync.Mutex
	counts map[string]int // attack name -> times sent
	conns  atomic.Int64
}

// startBadPublisher listens on host:port (PUB) and host:replayPort (ROUTER).
func startBadPublisher(ctx context.Context, host string, port, replayPort int, a publisherAttacks, seed uint64) (*badPublisher, error) {
	p := &badPublisher{attacks: a, seed: seed, counts: map[string]int{}}
	var err error
	if p.pub, err = net.Listen("tcp", net.JoinHostPort(host, fmt.Sprint(port))); err != nil {
		return nil, fmt.Errorf("bad publisher PUB: %w", err)
	}
	if p.replay, err = net.Listen("tcp", net.JoinHostPort(host, fmt.Sprint(replayPort))); err != nil {
		p.pub.Close()
		return nil, fmt.Errorf("bad publisher replay: %w", err)
	}
	p.wg.Add(2)
	go p.accept(ctx, p.pub, p.servePub)
	go p.accept(ctx, p.replay, p.serveReplay)
	return p, nil
}

// Close stops accepting and waits for every connection to end.
func (p *badPublisher) Close() {
	p.pub.Close()
	p.replay.Close()
	p.wg.Wait()
}

// Counts returns how many times each attack was sent.
func (p *badPublisher) Counts() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[string]int, len(p.counts)+1)
	for k, v := range p.counts {
		out[k] = v
	}
	out["connections"] = int(p.conns.Load())
	return out
}

func (p *badPublisher) count(name string) {
	p.mu.Lock()
	p.counts[name]++
	p.mu.Unlock()
}

func (p *badPublisher) accept(ctx context.Context, l net.Listener, serve func(context.Context, net.Conn, *rand.Rand)) {
	defer p.wg.Done()
	for n := uint64(0); ; n++ {
		c, err := l.Accept()
		if err != nil {
			return
		}
		p.conns.Add(1)
		rng := rand.New(rand.NewPCG(p.seed, n))
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			defer c.Close()
			// A connection lives at most a few seconds; the context ends
			// it early when the run stops.
			cctx, cancel := context.WithTimeout(ctx, time.Duration(1000+rng.IntN(4000))*time.Millisecond)
			defer cancel()
			stop := context.AfterFunc(cctx, func() { c.Close() })
			defer stop()
			serve(cctx, c, rng)
		}()
	}
}

// ZMTP 3.0 framing, written by hand so that it can also be broken.
const (
	flagMore    = 0x01
	flagLong    = 0x02
	flagCommand = 0x04
)

func zmtpGreeting() []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10], g[11] = 0xff, 0x7f, 3, 0
	copy(g[12:32], "NULL")
	return g
}

// zmtpFrame encodes one frame; flags may carry flagMore or flagCommand.
func zmtpFrame(flags byte, body []byte) []byte {
	if len(body) > 255 {
		b := make([]byte, 9, 9+len(body))
		b[0] = flags | flagLong
		binary.BigEndian.PutUint64(b[1:], uint64(len(body)))
		return append(b, body...)
	}
	return append([]byte{flags, byte(len(body))}, body...)
}

// zmtpMsg encodes a multi-frame message.
func zmtpMsg(frames ...[]byte) []byte {
	var b []byte
	for i, f := range frames {
		var fl byte
		if i < len(frames)-1 {
			fl = flagMore
		}
		b = append(b, zmtpFrame(fl, f)...)
	}
	return b
}

func readyCommand(socketType string) []byte {
	body := append([]byte{5}, "READY"...)
	body = append(body, byte(len("Socket-Type")))
	body = append(body, "Socket-Type"...)
	body = binary.BigEndian.AppendUint32(body, uint32(len(socketType)))
	body = append(body, socketType...)
	return zmtpFrame(flagCommand, body)
}

// truncatedReady is a READY command whose Socket-Type property announces a
// value length and then ends.
func truncatedReady() []byte {
	body := append([]byte{5}, "READY"...)
	body = append(body, byte(len("Socket-Type")))
	body = append(body, "Socket-Type"...)
	body = append(body, 0, 0)
	return zmtpFrame(flagCommand, body)
}

// readFrame reads one ZMTP frame and discards bodies beyond 1 MiB: the
// daemon is the peer under attack, not this side.
func readFrame(r io.Reader) (flags byte, body []byte, err error) {
	var h [9]byte
	if _, err = io.ReadFull(r, h[:2]); err != nil {
		return 0, nil, err
	}
	flags = h[0]
	size := uint64(h[1])
	if flags&flagLong != 0 {
		if _, err = io.ReadFull(r, h[2:9]); err != nil {
			return 0, nil, err
		}
		size = binary.BigEndian.Uint64(h[1:9])
	}
	if size > 1<<20 {
		return flags, nil, errors.New("peer frame too large")
	}
	body = make([]byte, size)
	_, err = io.ReadFull(r, body)
	return flags, body, err
}

// handshake completes (or, with the bad-handshake attack, breaks) the ZMTP
// NULL handshake as a socket of the given type. It returns false when the
// connection should end.
func (p *badPublisher) handshake(c net.Conn, socketType string, rng *rand.Rand) bool {
	if _, err := c.Write(zmtpGreeting()); err != nil {
		return false
	}
	var g [64]byte
	if _, err := io.ReadFull(c, g[:]); err != nil {
		return false
	}
	if p.attacks.BadHandshake && rng.IntN(8) == 0 {
		p.count("truncated-ready")
		_, _ = c.Write(truncatedReady())
		return false
	}
	if _, err := c.Write(readyCommand(socketType)); err != nil {
		return false
	}
	if _, _, err := readFrame(c); err != nil { // the daemon's READY
		return false
	}
	return true
}

// servePub plays a PUB socket that publishes hostile messages.
func (p *badPublisher) servePub(ctx context.Context, c net.Conn, rng *rand.Rand) {
	if !p.handshake(c, "PUB", rng) {
		return
	}
	// Subscriptions and anything else the daemon sends are drained.
	go func() { _, _ = io.Copy(io.Discard, c) }()
	seq := rng.Uint64N(1000)
	for ctx.Err() == nil {
		name, b, final := p.pubAttack(rng, &seq)
		p.count(name)
		if _, err := c.Write(b); err != nil || final {
			return
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(5+rng.IntN(45)) * time.Millisecond):
		}
	}
}

// pubAttack picks the next message. final reports that it leaves the
// stream unframed, so the connection must end after it.
func (p *badPublisher) pubAttack(rng *rand.Rand, seq *uint64) (name string, b []byte, final bool) {
	seq8 := func(s uint64) []byte { return binary.BigEndian.AppendUint64(nil, s) }
	next := func() []byte { *seq++; return seq8(*seq) }
	switch k := rng.IntN(100); {
	case k < 40:
		return "forged-blocks", zmtpMsg(nil, next(), forgedBatch(rng)), false
	case k < 48:
		*seq += 1 + rng.Uint64N(1<<20)
		return "seq-jump", zmtpMsg(nil, seq8(*seq), forgedBatch(rng)), false
	case k < 52:
		*seq = 0
		return "seq-restart", zmtpMsg(nil, seq8(0), forgedBatch(rng)), false
	case k < 70:
		return "bad-msgpack", zmtpMsg(nil, next(), badMsgpack(rng)), false
	case k < 78:
		switch rng.IntN(3) {
		case 0:
			return "bad-frame-count", zmtpMsg(forgedBatch(rng)), false
		case 1:
			return "bad-frame-count", zmtpMsg(nil, next(), nil, nil, []byte("x")), false
		default:
			return "bad-seq-frame", zmtpMsg(nil, []byte{1, 2, 3}, forgedBatch(rng)), false
		}
	case k < 86:
		return "garbage", p.garbage(rng, 64+rng.IntN(4096)), true
	case k < 92 && p.attacks.HugeFrame:
		h := []byte{flagLong, 0, 0, 0, 0, 0, 0, 0, 0}
		binary.BigEndian.PutUint64(h[1:], 1<<40)
		return "frame-2^40", h, true
	case k < 96:
		// A 16 MiB frame of which only 4 KiB ever arrives.
		h := []byte{flagLong, 0, 0, 0, 0, 0, 0, 0, 0}
		binary.BigEndian.PutUint64(h[1:], 16<<20)
		return "frame-truncated", append(h, make([]byte, 4096)...), true
	default:
		return "unknown-command", zmtpFrame(flagCommand, append([]byte{4}, "PING\xff\xff\xff"...)), false
	}
}

// garbage returns n random bytes; without the huge-frame attack no byte
// has the long-frame flag, whichever bytes the peer reads as frame flags.
func (p *badPublisher) garbage(rng *rand.Rand, n int) []byte {
	g := make([]byte, n)
	for i := range g {
		g[i] = byte(rng.Uint32())
		if !p.attacks.HugeFrame {
			g[i] &^= flagLong
		}
	}
	return g
}

// forgedBatch is a well-formed vLLM batch [ts, [events], rank] of
// BlockStored and BlockRemoved events for keys the publisher never
// computed; one in four also lies in its fields (token count not matching
// the block count, absurd block sizes, unknown media).
func forgedBatch(rng *rand.Rand) []byte { return forged(rng, rng.IntN(4) == 0) }

func forged(rng *rand.Rand, lie bool) []byte {
	n := 1 + rng.IntN(3)
	events := make([]any, 0, n)
	for range n {
		keys := make([]uint64, 1+rng.IntN(512))
		for i := range keys {
			keys[i] = rng.Uint64()
		}
		if rng.IntN(5) == 0 {
			events = append(events, map[string]any{"type": "BlockRemoved", "block_hashes": keys, "medium": "GPU"})
			continue
		}
		bs := 16
		toks := len(keys) * bs
		if lie {
			switch rng.IntN(4) {
			case 0:
				bs = 1 << 30
			case 1:
				toks = rng.IntN(toks + 1)
			case 2:
				bs = 0
			}
		}
		tokens := make([]uint32, toks)
		for i := range tokens {
			tokens[i] = rng.Uint32N(150000)
		}
		var parent any
		if rng.IntN(2) == 0 {
			parent = rng.Uint64()
		}
		medium := "GPU"
		if lie && rng.IntN(4) == 0 {
			medium = "LIES"
		}
		events = append(events, map[string]any{"type": "BlockStored", "block_hashes": keys, "parent_block_hash": parent,
			"token_ids": tokens, "block_size": bs, "lora_id": nil, "medium": medium})
	}
	if rng.IntN(20) == 0 {
		events = append(events, map[string]any{"type": "AllBlocksCleared"})
	}
	b, err := msgpack.Marshal([]any{float64(time.Now().UnixNano()) / 1e9, events, 0})
	if err != nil {
		panic(err) // only plain values above
	}
	return b
}

// badMsgpack returns a payload that is not a valid batch: random bytes,
// a truncated batch, containers announcing 2^32-1 elements, deep nesting,
// or a batch of the wrong shape.
func badMsgpack(rng *rand.Rand) []byte {
	switch rng.IntN(7) {
	case 0:
		b := make([]byte, 1+rng.IntN(2048))
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		return b
	case 1:
		b := forgedBatch(rng)
		return b[:rng.IntN(len(b))]
	case 2:
		// [ts, array32(0xffffffff) ...]
		return append([]byte{0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0}, 0xdd, 0xff, 0xff, 0xff, 0xff, 0x81)
	case 3:
		// A BlockStored whose block_hashes announce 2^32-1 entries.
		b := []byte{0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x82}
		b = append(b, 0xa4)
		b = append(b, "type"...)
		b = append(b, 0xab)
		b = append(b, "BlockStored"...)
		b = append(b, 0xac)
		b = append(b, "block_hashes"...)
		return append(b, 0xdd, 0xff, 0xff, 0xff, 0xff, 0xcf, 1, 2, 3, 4, 5, 6, 7, 8)
	case 4:
		// 100k nested one-element arrays.
		b := make([]byte, 100000)
		for i := range b {
			b[i] = 0x91
		}
		return b
	case 5:
		// A str32 announcing 4 GiB.
		return []byte{0x93, 0xdb, 0xff, 0xff, 0xff, 0xff, 'x'}
	default:
		b, _ := msgpack.Marshal(map[string]any{"ts": 1, "events": "none", "rank": -1})
		return b
	}
}

// serveReplay plays a ROUTER socket that answers replay requests with
// hostile replies: endless forged batches, garbage, a huge frame, or
// nothing at all.
func (p *badPublisher) serveReplay(ctx context.Context, c net.Conn, rng *rand.Rand) {
	if !p.handshake(c, "ROUTER", rng) {
		return
	}
	// The request: ["", seq8].
	for {
		fl, _, err := readFrame(c)
		if err != nil {
			return
		}
		if fl&flagMore == 0 && fl&flagCommand == 0 {
			break
		}
	}
	go func() { _, _ = io.Copy(io.Discard, c) }()
	switch k := rng.IntN(10); {
	case k < 4:
		p.count("replay-endless")
		for seq := uint64(0); ctx.Err() == nil; seq++ {
			if _, err := c.Write(zmtpMsg(nil, binary.BigEndian.AppendUint64(nil, seq), forgedBatch(rng))); err != nil {
				return
			}
			p.count("replay-forged-batch")
			time.Sleep(2 * time.Millisecond)
		}
	case k < 6:
		p.count("replay-bad-msgpack")
		for seq := uint64(0); seq < 50 && ctx.Err() == nil; seq++ {
			if _, err := c.Write(zmtpMsg(nil, binary.BigEndian.AppendUint64(nil, seq), badMsgpack(rng))); err != nil {
				return
			}
		}
	case k < 7 && p.attacks.HugeFrame:
		p.count("replay-frame-2^40")
		h := []byte{flagLong, 0, 0, 0, 0, 0, 0, 0, 0}
		binary.BigEndian.PutUint64(h[1:], 1<<40)
		_, _ = c.Write(h)
	case k < 8:
		p.count("replay-garbage")
		_, _ = c.Write(p.garbage(rng, 1024))
	default:
		p.count("replay-silent")
	}
	<-ctx.Done()
}
