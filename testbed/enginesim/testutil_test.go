package enginesim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
)

// startEngine runs an engine for the test with modelled delays off.
func startEngine(t *testing.T, cfg Config, deps Deps) *Engine {
	t.Helper()
	if !cfg.TimeScaleSet {
		cfg.TimeScale, cfg.TimeScaleSet = 0, true
	}
	e, err := New(cfg, deps)
	if err != nil {
		t.Fatalf("new engine: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("engine run: %v", err)
		}
	})
	return e
}

func fixedNow() time.Time { return time.Unix(1700000000, 500000000) }

type httpResult struct {
	status int
	body   []byte
	json   map[string]any
}

func do(t *testing.T, method, url string, body any) httpResult {
	t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		rd = strings.NewReader(b)
	default:
		raw, _ := json.Marshal(b)
		rd = bytes.NewReader(raw)
	}
	req, _ := http.NewRequest(method, url, rd)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	r := httpResult{status: resp.StatusCode, body: raw}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	_ = dec.Decode(&r.json)
	return r
}

func seqTokens(from, n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = from + i
	}
	return out
}

func cachedTokens(t *testing.T, r httpResult) int {
	t.Helper()
	if r.status != 200 {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	u, _ := r.json["usage"].(map[string]any)
	d, _ := u["prompt_tokens_details"].(map[string]any)
	n, err := d["cached_tokens"].(json.Number).Int64()
	if err != nil {
		t.Fatalf("cached_tokens missing: %s", r.body)
	}
	return int(n)
}

// subscriber is an independent ZMQ SUB consumer for tests.
type subscriber struct {
	sock zmq4.Socket
	msgs chan zmq4.Msg
}

func subscribe(t *testing.T, e *Engine, rank int, topic string) *subscriber {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s := &subscriber{sock: zmq4.NewSub(ctx), msgs: make(chan zmq4.Msg, 1024)}
	t.Cleanup(func() { cancel(); s.sock.Close() })
	if err := s.sock.Dial(fmt.Sprintf("tcp://127.0.0.1:%d", e.ZMQPorts()[rank])); err != nil {
		t.Fatalf("dial: %v", err)
	}
	if err := s.sock.SetOption(zmq4.OptionSubscribe, topic); err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			m, err := s.sock.Recv()
			if err != nil {
				close(s.msgs)
				return
			}
			s.msgs <- m
		}
	}()
	// Wait for the subscription to reach the publisher instead of sleeping
	// a guessed amount (ZMQ's slow-joiner problem).
	waitFor(t, "subscription", func() bool { return e.Stats().Ranks[rank].Subscribers > 0 })
	return s
}

func (s *subscriber) next(t *testing.T) zmq4.Msg {
	t.Helper()
	select {
	case m, ok := <-s.msgs:
		if !ok {
			t.Fatal("subscriber closed")
		}
		return m
	case <-time.After(10 * time.Second):
		t.Fatal("no event batch within 10s")
	}
	return zmq4.Msg{}
}

func (s *subscriber) none(t *testing.T, d time.Duration) {
	t.Helper()
	select {
	case m := <-s.msgs:
		t.Fatalf("unexpected batch seq %x", m.Frames[1])
	case <-time.After(d):
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// decodedBatch is a batch decoded generically by an independent msgpack
// library.
type decodedBatch struct {
	ts     float64
	events []any
	rank   int64
}

func decodeBatch(t *testing.T, payload []byte) decodedBatch {
	t.Helper()
	var outer []any
	if err := msgpack.Unmarshal(payload, &outer); err != nil {
		t.Fatalf("msgpack: %v", err)
	}
	if len(outer) != 3 {
		t.Fatalf("outer batch has %d elements, want 3", len(outer))
	}
	b := decodedBatch{events: outer[1].([]any)}
	b.ts, _ = outer[0].(float64)
	b.rank = toI64(outer[2])
	return b
}

func toI64(v any) int64 {
	switch n := v.(type) {
	case int8:
		return int64(n)
	case int16:
		return int64(n)
	case int32:
		return int64(n)
	case int64:
		return n
	case uint8:
		return int64(n)
	case uint16:
		return int64(n)
	case uint32:
		return int64(n)
	case uint64:
		return int64(n)
	}
	return -1 << 63
}

func toU64(v any) uint64 { return uint64(toI64(v)) }

// evField reads a field of a decoded event in either encoding.
func evField(ev any, name string, idx int) any {
	switch x := ev.(type) {
	case map[string]any:
		return x[name]
	case []any:
		if idx < len(x) {
			return x[idx]
		}
	}
	return nil
}

func evType(ev any) string {
	s, _ := evField(ev, "type", 0).(string)
	return s
}

func evKeys(ev any) []uint64 {
	var out []uint64
	for _, h := range evField(ev, "block_hashes", 1).([]any) {
		out = append(out, toU64(h))
	}
	return out
}

// sseEvents reads an SSE body into its data payloads.
func sseEvents(t *testing.T, body []byte) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "data: ") {
			out = append(out, strings.TrimPrefix(line, "data: "))
		}
	}
	return out
}
