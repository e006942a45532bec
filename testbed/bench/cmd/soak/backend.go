package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// badBackend is a rule endpoint that accepts connections and then
// misbehaves at random, once per connection: it never answers the
// request, sends a header line that never ends, closes in the middle of
// a body, stalls a stream after its first event, or answers garbage. It
// answers everything the daemon sends it this way, its engine-metrics
// scrapes included.
type badBackend struct {
	endlessHeader bool
	// endlessCap bounds the bytes of one endless header line, so that the
	// attack ends by itself even against a daemon that buffers it all.
	endlessCap int64
	seed       uint64

	l     net.Listener
	wg    sync.WaitGroup
	mu    sync.Mutex
	modes map[string]int
	conns atomic.Int64
}

func startBadBackend(ctx context.Context, addr string, endlessHeader bool, endlessCap int64, seed uint64) (*badBackend, error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("bad backend: %w", err)
	}
	b := &badBackend{endlessHeader: endlessHeader, endlessCap: endlessCap, seed: seed, l: l, modes: map[string]int{}}
	b.wg.Add(1)
	go b.accept(ctx)
	return b, nil
}

// Close stops accepting and waits for every connection to end.
func (b *badBackend) Close() {
	b.l.Close()
	b.wg.Wait()
}

// Counts returns how many connections got each behaviour.
func (b *badBackend) Counts() map[string]int {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make(map[string]int, len(b.modes)+1)
	for k, v := range b.modes {
		out[k] = v
	}
	out["connections"] = int(b.conns.Load())
	return out
}

func (b *badBackend) accept(ctx context.Context) {
	defer b.wg.Done()
	for n := uint64(0); ; n++ {
		c, err := b.l.Accept()
		if err != nil {
			return
		}
		b.conns.Add(1)
		rng := rand.New(rand.NewPCG(b.seed, n))
		b.wg.Add(1)
		go func() {
			defer b.wg.Done()
			defer c.Close()
			// Nothing is held longer than 15 minutes, whatever the daemon
			// does; the context ends it early when the run stops.
			cctx, cancel := context.WithTimeout(ctx, 15*time.Minute)
			defer cancel()
			stop := context.AfterFunc(cctx, func() { c.Close() })
			defer stop()
			b.serve(cctx, c, rng)
		}()
	}
}

func (b *badBackend) count(mode string) {
	b.mu.Lock()
	b.modes[mode]++
	b.mu.Unlock()
}

// readRequest reads one request head and skips a Content-Length body.
func readRequest(br *bufio.Reader) (string, error) {
	line, err := br.ReadString('\n')
	if err != nil {
		return "", err
	}
	var n int64
	for {
		h, err := br.ReadString('\n')
		if err != nil {
			return "", err
		}
		h = strings.TrimRight(h, "\r\n")
		if h == "" {
			break
		}
		if k, v, ok := strings.Cut(h, ":"); ok && strings.EqualFold(strings.TrimSpace(k), "content-length") {
			_, _ = fmt.Sscan(strings.TrimSpace(v), &n)
		}
	}
	if n > 0 {
		if _, err := io.CopyN(io.Discard, br, n); err != nil {
			return "", err
		}
	}
	return strings.TrimSpace(line), nil
}

func (b *badBackend) serve(ctx context.Context, c net.Conn, rng *rand.Rand) {
	br := bufio.NewReader(c)
	if _, err := readRequest(br); err != nil {
		return
	}
	// hold keeps the connection open, reading whatever comes, until the
	// daemon closes it or the context ends.
	hold := func() { _, _ = io.Copy(io.Discard, br) }
	k := rng.IntN(100)
	switch {
	case k < 25:
		b.count("silent")
		hold()
	case k < 45 && b.endlessHeader:
		b.count("endless-header")
		if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Endless: "); err != nil {
			return
		}
		chunk := []byte(strings.Repeat("a", 32<<10))
		for sent := int64(0); sent < b.endlessCap && ctx.Err() == nil; sent += int64(len(chunk)) {
			if _, err := c.Write(chunk); err != nil {
				return
			}
		}
		hold()
	case k < 65:
		b.count("close-mid-body")
		if rng.IntN(2) == 0 {
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 10000\r\n\r\n"+
				`{"id":"cmpl-bad","object":"text_completion","choices":[{"index":0,"text":"tru`)
		} else {
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"+
				chunk(`data: {"id":"cmpl-bad","choices":[{"index":0,"text":"a"}]}`+"\n\n")+"40\r\ndata: {\"id\"")
		}
	case k < 85:
		b.count("stall-after-first-event")
		if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"+
			chunk(`data: {"id":"cmpl-bad","choices":[{"index":0,"text":"a","delta":{"content":"a"}}]}`+"\n\n")); err != nil {
			return
		}
		hold()
	default:
		b.count("garbage")
		g := make([]byte, 256+rng.IntN(4096))
		for i := range g {
			g[i] = byte(rng.Uint32())
		}
		_, _ = c.Write(g)
	}
}

// chunk encodes s as one HTTP/1.1 chunk.
func chunk(s string) string { return fmt.Sprintf("%x\r\n%s\r\n", len(s), s) }
