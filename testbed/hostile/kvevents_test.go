package hostile

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/loxilb-llm/loxilb/testbed/daemontest"
)

// Attacks on the KV event plane of the real daemon: whoever answers on an
// engine's ZMQ publisher or replay port, or its TensorRT-LLM drain, feeds
// the daemon directly.

// kvGreeting is a ZMTP 3.0 NULL greeting followed by a READY command
// announcing socket type typ.
func kvGreeting(typ string) []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10] = 0xff, 0x7f, 3
	copy(g[12:], "NULL")
	body := append([]byte{5}, "READY"...)
	body = append(body, byte(len("Socket-Type")))
	body = append(body, "Socket-Type"...)
	body = binary.BigEndian.AppendUint32(body, uint32(len(typ)))
	body = append(body, typ...)
	return append(append(g, 0x04, byte(len(body))), body...)
}

// kvHugeFrame is a long data frame header announcing size bytes.
func kvHugeFrame(size uint64) []byte {
	return binary.BigEndian.AppendUint64([]byte{0x02}, size)
}

// kvListenPair listens on host:P and host:P+offset (a publisher port and
// its replay port).
func kvListenPair(t *testing.T, host string, offset int) (net.Listener, net.Listener) {
	t.Helper()
	for i := 0; i < 50; i++ {
		a, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
		if err != nil {
			t.Fatal(err)
		}
		p := a.Addr().(*net.TCPAddr).Port
		if p+offset > 65535 {
			a.Close()
			continue
		}
		b, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(p+offset)))
		if err != nil {
			a.Close()
			continue
		}
		return a, b
	}
	t.Fatal("no free port pair")
	return nil, nil
}

// kvPeer serves script on every connection of ln and counts connections
// and the ones the daemon closed on its side.
type kvPeer struct {
	conns, dropped atomic.Int64
}

func kvServe(t *testing.T, ln net.Listener, script []byte) *kvPeer {
	p := &kvPeer{}
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
			p.conns.Add(1)
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(30 * time.Second))
				if _, err := c.Write(script); err != nil {
					p.dropped.Add(1)
					return
				}
				// The daemon's greeting, READY and subscription, then EOF
				// when it drops the connection.
				_, err := io.Copy(io.Discard, c)
				var ne net.Error
				if err == nil || !errors.As(err, &ne) || !ne.Timeout() {
					p.dropped.Add(1)
				}
			}()
		}
	}()
	return p
}

// kvSGLangRule is a mode-4 KV-exact SGLang rule with one endpoint.
func kvSGLangRule(vip string, vport int, ep string, zmqPort int) string {
	return fmt.Sprintf(`{"serviceArguments":{"externalIP":%q,"port":%d,"protocol":"tcp","mode":4,"sel":0,
		"kvExactMode":3,"kvEngineType":"sglang","kvZmqPort":%d,"kvBlockSize":16,"model_name":"Qwen/Qwen3-0.6B"},
		"endpoints":[{"endpointIP":%q,"targetPort":28000,"weight":1}]}`, vip, vport, zmqPort, ep)
}

// TestKVHugeZMTPFrame: a peer on the publisher port and one on the replay
// port each answer the daemon's SUB / DEALER with a frame header declaring
// 2^62 (live) and 2^40 (replay) bytes. zmq4 used to allocate that size
// (makeslice panic, or fatal out of memory) in its own goroutine, killing
// the daemon, and the stored rule made it crash-loop on every restart.
// Now each connection is refused at the header, counted, dropped and
// redialled with backoff; the daemon lives, restarts cleanly with the rule
// stored, and stays small.
func TestKVHugeZMTPFrame(t *testing.T) {
	live, replay := kvListenPair(t, "127.0.0.91", 1000)
	zmqPort := live.Addr().(*net.TCPAddr).Port
	lp := kvServe(t, live, append(kvGreeting("PUB"), kvHugeFrame(1<<62)...))
	rp := kvServe(t, replay, append(kvGreeting("ROUTER"), kvHugeFrame(1<<40)...))

	state := t.TempDir()
	args := []string{"--metrics", "--tokenizer-dir", tokenizerDir()}
	d := daemontest.Start(t, bins, state, nil, args...)
	createRule(t, d, kvSGLangRule("127.0.0.90", 28090, "127.0.0.91", zmqPort))

	refused := func(d *daemontest.Daemon) float64 {
		return metricSum(t, d, "loxilb_kv_rejected_total", `reason="message_too_large"`)
	}
	// Bounded: at most ~20 s of redials (backoff 0.5 s doubling to 5 s).
	waitFor(t, 20*time.Second, "live and replay refusals", func() bool {
		return refused(d) >= 4 && lp.conns.Load() >= 2 && rp.conns.Load() >= 2
	})
	requireAlive(t, d)
	requireRSSBelow(t, d, 200)
	if lp.dropped.Load() < 1 || rp.dropped.Load() < 1 {
		t.Fatalf("the daemon did not drop the hostile connections (live %d, replay %d)", lp.dropped.Load(), rp.dropped.Load())
	}
	code, body := apiDo(t, d, http.MethodGet, "/config/ai/kv/inventory?service_id=1&ep_idx=0", "")
	if code != http.StatusOK {
		t.Fatalf("inventory: %d %s", code, body)
	}
	t.Logf("RSS %d KiB after %v refusals (live conns %d, replay conns %d); inventory %s",
		rssKiB(t, d.PID()), refused(d), lp.conns.Load(), rp.conns.Load(), body)

	// The rule is stored: a restart subscribes to the same peers again.
	d.Stop()
	before := lp.conns.Load()
	d = daemontest.Start(t, bins, state, nil, args...)
	waitFor(t, 20*time.Second, "refusals after restart", func() bool {
		return refused(d) >= 2 && lp.conns.Load() > before
	})
	requireAlive(t, d)
	requireRSSBelow(t, d, 200)
}

// kvTinyEvents is an SGLang EventBatch [ts, [[""] x n]]: n two-byte events.
func kvTinyEvents(n int) []byte {
	b := binary.BigEndian.AppendUint32([]byte{0x92, 0x00, 0xdd}, uint32(n))
	for i := 0; i < n; i++ {
		b = append(b, 0x91, 0xa0)
	}
	return b
}

// TestKVAmplifyingBatch: a publisher sends a 9.5 MiB batch of 5M tiny
// events (the old decoder built about 5 GiB of events from it). The batch
// is refused at its events header and counted; the daemon stays small.
func TestKVAmplifyingBatch(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.94:0")
	if err != nil {
		t.Fatal(err)
	}
	zmqPort := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	pub := zmq4.NewPub(context.Background(), zmq4.WithLogger(nil))
	if err := pub.Listen("tcp://127.0.0.94:" + strconv.Itoa(zmqPort)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })

	d := startDaemon(t, []string{"LLB_KV_REPLAY_PORT_OFFSET=0"})
	createRule(t, d, kvSGLangRule("127.0.0.93", 28093, "127.0.0.94", zmqPort))
	waitFor(t, 15*time.Second, "subscriber connected", func() bool {
		return metricSum(t, d, "loxilb_kv_subscriber_connected") == 1
	})
	batch := kvTinyEvents(5_000_000)
	seq := make([]byte, 8)
	// The SUB only receives what is published after its subscription
	// reached the PUB: resend (bounded) until the refusal is counted.
	for i := 0; i < 10 && metricSum(t, d, "loxilb_kv_rejected_total", `reason="batch_limit"`) == 0; i++ {
		binary.BigEndian.PutUint64(seq, uint64(i))
		if err := pub.SendMulti(zmq4.NewMsgFrom([]byte("kv"), seq, batch)); err != nil {
			t.Fatal(err)
		}
		time.Sleep(500 * time.Millisecond)
	}
	if metricSum(t, d, "loxilb_kv_rejected_total", `reason="batch_limit"`) == 0 {
		t.Fatalf("batch not refused:\n%s", d.Logs())
	}
	requireAlive(t, d)
	requireRSSBelow(t, d, 250)
	t.Logf("RSS %d KiB after a %d-byte batch of 5M events", rssKiB(t, d.PID()), len(batch))
}

// TestKVTRTLLMHugeDrain: a TensorRT-LLM endpoint answers every drain with
// 60 MiB of [1,1,...] (the old decoder kept a RawMessage and an error per
// element: x1688). The body is cut at the size limit, counted, and the
// endpoint marked degraded; the daemon stays small.
func TestKVTRTLLMHugeDrain(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.96:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	body := make([]byte, 0, 60<<20)
	body = append(body, '[')
	for len(body) < 60<<20 {
		body = append(body, '1', ',')
	}
	body = append(body, '1', ']')
	var drains atomic.Int64
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/kv_cache_events" {
			w.WriteHeader(http.StatusNotFound)
			return
		}
		drains.Add(1)
		_, _ = w.Write(body)
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })

	d := startDaemon(t, nil)
	createRule(t, d, fmt.Sprintf(`{"serviceArguments":{"externalIP":"127.0.0.95","port":28095,"protocol":"tcp","mode":4,"sel":0,
		"kvExactMode":3,"kvEngineType":"trtllm","kvBlockSize":32,"model_name":"Qwen/Qwen3-0.6B"},
		"endpoints":[{"endpointIP":"127.0.0.96","targetPort":%d,"weight":1}]}`, port))
	waitFor(t, 20*time.Second, "drain refusals", func() bool {
		return metricSum(t, d, "loxilb_kv_rejected_total", `reason="body_too_large"`) >= 2
	})
	requireAlive(t, d)
	requireRSSBelow(t, d, 250)
	if metricSum(t, d, "loxilb_kv_subscriber_degraded") != 1 {
		t.Fatal("endpoint not marked degraded after a refused drain")
	}
	t.Logf("RSS %d KiB after %d drains of %d bytes", rssKiB(t, d.PID()), drains.Load(), len(body))
}
