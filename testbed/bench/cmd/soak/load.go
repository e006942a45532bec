package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"
)

// Request kinds of the mix.
var kinds = []string{"chat-stream", "chat", "completion-stream", "completion"}

// tally counts request outcomes by kind and by outcome: "ok", an HTTP
// status ("503"), or a client-side failure ("timeout", "conn-error",
// "stream-cut", "bad-body").
type tally struct {
	mu      sync.Mutex
	byKind  map[string]map[string]int
	total   int
	ok      int
	latency []time.Duration // of ok requests
}

func newTally() *tally { return &tally{byKind: map[string]map[string]int{}} }

func (t *tally) add(kind, outcome string, d time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	m := t.byKind[kind]
	if m == nil {
		m = map[string]int{}
		t.byKind[kind] = m
	}
	m[outcome]++
	t.total++
	if outcome == "ok" {
		t.ok++
		t.latency = append(t.latency, d)
	}
}

func (t *tally) snapshot() (total, ok int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.total, t.ok
}

// Requests is the load's summary in the report.
type Requests struct {
	Total     int                       `json:"total"`
	OK        int                       `json:"ok"`
	Errors    int                       `json:"errors"`
	ByOutcome map[string]int            `json:"by_outcome"`
	ByKind    map[string]map[string]int `json:"by_kind"`
	OKLatency Percentiles               `json:"ok_latency_ms"`
}

// Percentiles of a latency distribution in milliseconds.
type Percentiles struct {
	P50 float64 `json:"p50"`
	P90 float64 `json:"p90"`
	P99 float64 `json:"p99"`
	Max float64 `json:"max"`
}

func (t *tally) summary() Requests {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := Requests{Total: t.total, OK: t.ok, Errors: t.total - t.ok, ByOutcome: map[string]int{}, ByKind: map[string]map[string]int{}}
	for k, m := range t.byKind {
		r.ByKind[k] = map[string]int{}
		for o, n := range m {
			r.ByKind[k][o] = n
			r.ByOutcome[o] += n
		}
	}
	l := append([]time.Duration(nil), t.latency...)
	sort.Slice(l, func(i, j int) bool { return l[i] < l[j] })
	at := func(p float64) float64 {
		if len(l) == 0 {
			return 0
		}
		return float64(l[min(int(p*float64(len(l))), len(l)-1)].Microseconds()) / 1000
	}
	r.OKLatency = Percentiles{P50: at(.5), P90: at(.9), P99: at(.99), Max: at(1)}
	return r
}

// loadConfig shapes the request mix.
type loadConfig struct {
	VIP        string
	Model      string
	Workers    int
	Rate       float64 // requests per second over all workers
	ReqTimeout time.Duration
	Seed       uint64
}

// session is one user's growing chat: a system prompt shared with other
// users and the turns so far, so consecutive requests share a prefix.
type session struct {
	system string
	turns  []string // user, assistant, user, assistant, ...
}

const maxTurns = 8

// words is the vocabulary the prompts are drawn from.
var words = strings.Fields(`the a load balancer routes each request to an engine whose cache already holds
the prompt prefix so prefill is skipped and first tokens arrive sooner while
queues stay short across every endpoint of the fleet under steady traffic with
bursts of long shared system prompts and growing chat histories of many users
asking questions about kernels networks storage latency throughput memory and
how caches evict blocks when capacity runs out during a busy hour`)

func text(rng *rand.Rand, n int) string {
	var b strings.Builder
	for i := 0; i < n; i++ {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(words[rng.IntN(len(words))])
	}
	return b.String()
}

// runLoad drives workers until ctx ends and records every outcome.
func runLoad(ctx context.Context, cfg loadConfig, t *tally) {
	rng := rand.New(rand.NewPCG(cfg.Seed, 1))
	systems := make([]string, 6)
	for i := range systems {
		systems[i] = fmt.Sprintf("You are assistant %d. ", i) + text(rng, 300+rng.IntN(300))
	}
	client := &http.Client{Transport: &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		MaxIdleConnsPerHost: cfg.Workers, DisableCompression: true,
	}}
	defer client.CloseIdleConnections()
	// A shared ticker paces the whole mix at cfg.Rate.
	tick := time.NewTicker(time.Duration(float64(time.Second) / cfg.Rate))
	defer tick.Stop()
	var wg sync.WaitGroup
	for w := 0; w < cfg.Workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(cfg.Seed, uint64(100+w)))
			users := make([]*session, 3)
			for i := range users {
				users[i] = &session{system: systems[rng.IntN(len(systems))]}
			}
			for n := 0; ; n++ {
				select {
				case <-ctx.Done():
					return
				case <-tick.C:
				}
				s := users[n%len(users)]
				if len(s.turns) >= 2*maxTurns {
					*s = session{system: systems[rng.IntN(len(systems))]}
				}
				s.turns = append(s.turns, text(rng, 20+rng.IntN(60)))
				kind := kinds[rng.IntN(len(kinds))]
				outcome, d := doRequest(ctx, client, cfg, kind, s, 4+rng.IntN(20))
				if ctx.Err() != nil && outcome != "ok" {
					return // cut by the end of the run, not by the daemon
				}
				t.add(kind, outcome, d)
				s.turns = append(s.turns, text(rng, 10+rng.IntN(30)))
			}
		}()
	}
	wg.Wait()
}

// body renders the request for kind from the session.
func body(kind, model string, s *session, maxTokens int) (path string, b []byte) {
	stream := strings.HasSuffix(kind, "-stream")
	if strings.HasPrefix(kind, "chat") {
		msgs := []map[string]string{{"role": "system", "content": s.system}}
		for i, t := range s.turns {
			role := "user"
			if i%2 == 1 {
				role = "assistant"
			}
			msgs = append(msgs, map[string]string{"role": role, "content": t})
		}
		b, _ = json.Marshal(map[string]any{"model": model, "messages": msgs, "max_tokens": maxTokens, "stream": stream})
		return "/v1/chat/completions", b
	}
	prompt := s.system + "\n" + strings.Join(s.turns, "\n")
	b, _ = json.Marshal(map[string]any{"model": model, "prompt": prompt, "max_tokens": maxTokens, "stream": stream})
	return "/v1/completions", b
}

// doRequest sends one request with its own deadline and classifies it.
func doRequest(ctx context.Context, c *http.Client, cfg loadConfig, kind string, s *session, maxTokens int) (string, time.Duration) {
	path, b := body(kind, cfg.Model, s, maxTokens)
	rctx, cancel := context.WithTimeout(ctx, cfg.ReqTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(rctx, http.MethodPost, "http://"+cfg.VIP+path, bytes.NewReader(b))
	if err != nil {
		return "conn-error", 0
	}
	req.Header.Set("Content-Type", "application/json")
	t0 := time.Now()
	resp, err := c.Do(req)
	if err != nil {
		return clientError(rctx, err), 0
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		return fmt.Sprint(resp.StatusCode), 0
	}
	if strings.HasSuffix(kind, "-stream") {
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		chunks, done := 0, false
		for sc.Scan() {
			line := sc.Text()
			if line == "data: [DONE]" {
				done = true
			} else if strings.HasPrefix(line, "data: ") {
				chunks++
			}
		}
		if err := sc.Err(); err != nil {
			if rctx.Err() != nil {
				return "timeout", 0
			}
			return "stream-cut", 0
		}
		if !done || chunks == 0 {
			return "stream-cut", 0
		}
		return "ok", time.Since(t0)
	}
	var out struct {
		Choices []json.RawMessage `json:"choices"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 8<<20)).Decode(&out); err != nil {
		if rctx.Err() != nil {
			return "timeout", 0
		}
		return "bad-body", 0
	}
	if len(out.Choices) == 0 {
		return "bad-body", 0
	}
	return "ok", time.Since(t0)
}

func clientError(ctx context.Context, err error) string {
	if ctx.Err() != nil || errors.Is(err, context.DeadlineExceeded) {
		return "timeout"
	}
	return "conn-error"
}
