package hostile

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/testbed/daemontest"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
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
	pub := zmq4.NewPub(context.Background(), zmq4.WithLogger(log.New(io.Discard, "", 0)))
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

// kvStartEngine runs one engine emulator until the test ends.
func kvStartEngine(t *testing.T, cfg enginesim.Config) *enginesim.Engine {
	t.Helper()
	tok, err := enginesim.LoadTokenizer(filepath.Join(tokenizerDir(), "Qwen__Qwen3-0.6B"))
	if err != nil {
		t.Fatal(err)
	}
	cfg.Model = kvModel
	e, err := enginesim.New(cfg, enginesim.Deps{Tokenizer: tok})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = e.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return e
}

const kvModel = "Qwen/Qwen3-0.6B"

// kvPrompt is a prompt of several hundred tokens.
func kvPrompt() string {
	var b strings.Builder
	for i := 0; i < 40; i++ {
		fmt.Fprintf(&b, "Paragraph %d of the payroll export lists the accounts of the finance team. ", i)
	}
	return b.String()
}

// kvComplete posts a completion of prompt to base and returns the route
// receipt (zero when none).
func kvComplete(t *testing.T, base, prompt string) router.Receipt {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"model": kvModel, "prompt": prompt, "max_tokens": 4})
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/completions", bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Loxilb-Receipt", "1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("completion at %s: %d %s", base, resp.StatusCode, body)
	}
	rc, _ := router.ParseReceipt(resp.Header.Get("X-Loxilb-Route"))
	return rc
}

// kvChain returns an engine's resident block keys root first (one prompt's
// chain).
func kvChain(t *testing.T, e *enginesim.Engine) []uint64 {
	t.Helper()
	blocks := e.Cache().Ranks[0].Blocks
	child := map[uint64]uint64{}
	var root uint64
	roots := 0
	for _, b := range blocks {
		if b.Parent == nil {
			root, roots = b.Hash, roots+1
		} else {
			child[*b.Parent] = b.Hash
		}
	}
	if roots != 1 {
		t.Fatalf("engine holds %d chains, want 1", roots)
	}
	chain := []uint64{root}
	for k, ok := child[root]; ok; k, ok = child[k] {
		chain = append(chain, k)
	}
	return chain
}

// kvForgedStored is an SGLang EventBatch [ts, [BlockStored]] claiming keys
// (root-anchored) for 16 tokens each that are not the tokens they hash.
func kvForgedStored(keys []uint64) []byte {
	b := []byte{0x92, 0x00, 0x91, 0x95, 0xab}
	b = append(b, "BlockStored"...)
	b = append(b, 0xdc, byte(len(keys)>>8), byte(len(keys)))
	for _, k := range keys {
		b = binary.BigEndian.AppendUint64(append(b, 0xcf), k)
	}
	b = append(b, 0xc0) // parent: none
	n := 16 * len(keys)
	b = append(b, 0xdc, byte(n>>8), byte(n))
	for i := 0; i < n; i++ {
		b = append(b, 7)
	}
	return append(b, 16) // block_size
}

// TestKVForgedPublisherQuarantined: an attacker who can answer on an
// engine's ZMQ port learns the block keys of a chosen prompt (from an
// engine of its own) and publishes them for its endpoint, with token ids
// they do not hash from, to steer that prompt to itself. The gateway
// attests the blocks, quarantines the endpoint (inventory cleared, nothing
// stored), shows it in the capabilities and the inventory API, and the
// prompt gets no Tier-1.5 credit there.
func TestKVForgedPublisherQuarantined(t *testing.T) {
	const zmqPort = 25557
	sim := func(host, zmqHost string) enginesim.Config {
		return enginesim.Config{Engine: "sglang", Listen: host + ":28000", ZMQBind: zmqHost, ZMQPort: zmqPort,
			TimeScale: 0, TimeScaleSet: true}
	}
	kvStartEngine(t, sim("127.0.97.11", "127.0.97.11"))
	// The victim endpoint serves requests, but its publisher port is the
	// attacker's: the emulator publishes on another address.
	kvStartEngine(t, sim("127.0.97.12", "127.0.97.13"))
	forger := zmq4.NewPub(context.Background(), zmq4.WithLogger(log.New(io.Discard, "", 0)))
	if err := forger.Listen(fmt.Sprintf("tcp://127.0.97.12:%d", zmqPort)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { forger.Close() })

	// The attacker's own engine tells it the keys of the prompt.
	scout := kvStartEngine(t, sim("127.0.97.20", "127.0.97.20"))
	prompt := kvPrompt()
	kvComplete(t, "http://127.0.97.20:28000", prompt)
	keys := kvChain(t, scout)

	d := startDaemon(t, []string{"LLB_KV_MIN_MATCH_TOKENS=16"})
	createRule(t, d, `{"serviceArguments":{"externalIP":"127.0.97.1","port":28080,"protocol":"tcp","mode":4,"sel":0,
		"kvExactMode":3,"kvEngineType":"sglang","kvZmqPort":25557,"kvBlockSize":16,"model_name":"Qwen/Qwen3-0.6B"},
		"endpoints":[{"endpointIP":"127.0.97.11","targetPort":28000,"weight":1},{"endpointIP":"127.0.97.12","targetPort":28000,"weight":1}]}`)
	waitFor(t, 15*time.Second, "subscribers connected", func() bool {
		return metricSum(t, d, "loxilb_kv_subscriber_connected") == 2
	})

	// A SUB receives only what is published after its subscription
	// arrived: publish (bounded) until the daemon has seen the batch.
	forged := kvForgedStored(keys)
	seq := make([]byte, 8)
	for i := 0; i < 50 && metricSum(t, d, "loxilb_kv_quarantined", `ep_idx="1"`) == 0; i++ {
		binary.BigEndian.PutUint64(seq, uint64(i))
		if err := forger.SendMulti(zmq4.NewMsgFrom([]byte("kv"), seq, forged)); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if metricSum(t, d, "loxilb_kv_quarantined", `ep_idx="1"`) != 1 {
		t.Fatalf("forged endpoint not quarantined:\n%s", d.Logs())
	}
	if metricSum(t, d, "loxilb_kv_quarantines_total", `ep_idx="1"`) < 1 || metricSum(t, d, "loxilb_kv_events_skipped_total", `ep_idx="1"`, `reason="quarantined"`) < 1 {
		t.Fatal("quarantine or its skipped events not counted")
	}

	var inv struct {
		Total      int
		Subscriber struct {
			Parity struct {
				Verdict    string
				Quarantine struct {
					Quarantined bool
					Reason      string `json:"quarantine_reason"`
				}
			}
		}
	}
	code, body := apiDo(t, d, http.MethodGet, "/config/ai/kv/inventory?service_id=1&ep_idx=1", "")
	if code != http.StatusOK || json.Unmarshal(body, &inv) != nil {
		t.Fatalf("inventory: %d %s", code, body)
	}
	if inv.Total != 0 || !inv.Subscriber.Parity.Quarantine.Quarantined || inv.Subscriber.Parity.Verdict != "hash_mismatch" ||
		inv.Subscriber.Parity.Quarantine.Reason == "" {
		t.Fatalf("forged endpoint inventory: %s", body)
	}
	code, body = apiDo(t, d, http.MethodGet, "/status/capabilities", "")
	var caps struct {
		Capabilities []struct {
			Name       string
			Ready      bool
			ReasonCode string `json:"reason_code"`
			Reason     string
		}
	}
	if code != http.StatusOK || json.Unmarshal(body, &caps) != nil {
		t.Fatalf("capabilities: %d %s", code, body)
	}
	found := false
	for _, c := range caps.Capabilities {
		if c.Name == "kv_quarantine:1/1" && !c.Ready && c.ReasonCode == "quarantined" && strings.Contains(c.Reason, "do not hash") {
			found = true
		}
	}
	if !found {
		t.Fatalf("no kv_quarantine capability for the forged endpoint: %s", body)
	}

	// The chosen prompt is not steered by the forged blocks.
	if rc := kvComplete(t, "http://127.0.97.1:28080", prompt); rc.Tier == router.TierKV {
		t.Fatalf("forged blocks earned Tier-1.5 credit: %+v", rc)
	}
	requireAlive(t, d)
	requireRSSBelow(t, d, 200)
}
