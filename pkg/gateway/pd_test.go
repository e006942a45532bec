package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/dispatch"
	"github.com/loxilb-llm/loxilb/pkg/kvindex"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/reconcilers"
	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

const pdModel = "Qwen/Qwen3-0.6B"

var pdTokDir = filepath.Join("..", "..", "testdata", "tokenizers")

// pdTok loads the emulators' tokenizer once for all tests (it is safe for
// concurrent use and slow to load).
var pdTok = sync.OnceValues(func() (enginesim.Tokenizer, error) {
	return enginesim.LoadTokenizer(filepath.Join(pdTokDir, tokenizer.Slug(pdModel)))
})

func pdEngine(t *testing.T, c enginesim.Config) *enginesim.Engine {
	t.Helper()
	tok, err := pdTok()
	if err != nil {
		t.Fatal(err)
	}
	c.Model, c.ZMQPort = pdModel, -1
	if !c.TimeScaleSet {
		// Instant, unless the test models the engine's time.
		c.TimeScale, c.TimeScaleSet = 0, true
	}
	e, err := enginesim.New(c, enginesim.Deps{Tokenizer: tok})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = e.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return e
}

// pdBench is a gateway with real tokenizer, hasher, index and router in
// front of emulators in P/D roles, served by a test handler that does what
// the proxy's dispatch hook does.
type pdBench struct {
	prefill, decode []*enginesim.Engine
	index           *kvindex.Index
	g               *Gateway
	srv             *httptest.Server
}

func newPDBench(t *testing.T, engine string, kvMode, third int) *pdBench {
	t.Helper()
	return newPDBenchRanks(t, engine, kvMode, third, 1)
}

// newPDBenchRanks is newPDBench with ranks data-parallel ranks per prefill
// engine (the rule's kvDpRankCount).
func newPDBenchRanks(t *testing.T, engine string, kvMode, third, ranks int) *pdBench {
	t.Helper()
	return newPDBenchWith(t, engine, kvMode, third, ranks, nil)
}

// newPDBenchWith is newPDBenchRanks with tweak applied to each prefill
// engine's config.
func newPDBenchWith(t *testing.T, engine string, kvMode, third, ranks int, tweak func(*enginesim.Config)) *pdBench {
	t.Helper()
	b := &pdBench{}
	reg := prometheus.NewRegistry()
	rule := &lbrule.Rule{Service: lbrule.ServiceArgs{ExternalIP: "127.0.0.1", Port: 1, Protocol: "tcp", Mode: lbrule.ModeFullProxy,
		PDDisagg: true, KVExactMode: kvMode, KVEngine: engine, KVBlockSize: 16, ModelName: pdModel, SessionHeaderName: "X-Session",
		KVDpRankCount: ranks}}
	switch engine {
	case "vllm":
		rule.Service.KVHashAlgo = "sha256_cbor"
	case "sglang":
		rule.Service.KVHashAlgo = "sha256_sglang"
	case "trtllm":
		rule.Service.KVHashAlgo = "blockhash_trtllm"
		rule.Service.KVBlockSize = 32
	}
	boot := 0
	for i := 0; i < 2; i++ {
		c := enginesim.Config{Engine: engine, Role: enginesim.RolePrefill, Listen: fmt.Sprintf("127.0.%d.%d:0", third, 11+i), BootstrapPort: boot, DPRanks: ranks}
		if tweak != nil {
			tweak(&c)
		}
		e := pdEngine(t, c)
		if engine == "sglang" {
			boot = e.BootstrapPort()
		}
		b.prefill = append(b.prefill, e)
		rule.Endpoints = append(rule.Endpoints, epOf(t, e, lbrule.RolePrefill))
	}
	rule.Service.PDBootstrap = boot
	for i := 0; i < 2; i++ {
		e := pdEngine(t, enginesim.Config{Engine: engine, Role: enginesim.RoleDecode, Listen: fmt.Sprintf("127.0.%d.%d:0", third, 101+i)})
		b.decode = append(b.decode, e)
		rule.Endpoints = append(rule.Endpoints, epOf(t, e, lbrule.RoleDecode))
	}
	toks, err := tokenizer.NewRegistry(pdTokDir, nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	b.index, err = kvindex.New(kvindex.Config{}, reg)
	if err != nil {
		t.Fatal(err)
	}
	rt, err := router.New(router.DefaultConfig(), b.index, nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	b.g, err = New(Config{}, toks, b.index, rt, nil, new(proxy.InFlightTable), nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.g.Reconcile(context.Background(), []control.Service{{ID: 1, Rule: rule}}); err != nil {
		t.Fatal(err)
	}
	b.newPD(t, dispatch.Config{})
	legs, err := proxy.NewTransport(proxy.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(legs.CloseIdleConnections)
	b.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		req := &proxy.Request{Service: 1, Method: r.Method, Path: r.URL.Path, Model: proxy.ModelOf(r.Header, body),
			Header: r.Header, Body: body, ClientAddr: netip.MustParseAddrPort(r.RemoteAddr)}
		plan, fn, err := b.g.Prepare(req)
		if err != nil || fn == nil {
			http.Error(w, fmt.Sprint(err), proxy.StatusFor(err))
			return
		}
		w.Header().Set(proxy.HeaderRoute, plan.Receipt)
		req.Legs = legs // what the proxy does before Plan.Dispatch
		if res := fn(r.Context(), w, req); dispatch.MustAbort(res) {
			panic(http.ErrAbortHandler)
		}
	}))
	t.Cleanup(b.srv.Close)
	return b
}

// serveProxy serves the bench's rule through the real proxy, with the
// Gateway as its Picker, on a free port of host, and returns its URL once
// a model list is answered there.
func (b *pdBench) serveProxy(t *testing.T, host string) string {
	t.Helper()
	ln, err := net.Listen("tcp", host+":0")
	if err != nil {
		t.Fatal(err)
	}
	vip := ln.Addr().(*net.TCPAddr).AddrPort()
	ln.Close()
	rule := b.g.lookup(1).rule.Clone()
	rule.Service.ExternalIP, rule.Service.Port = vip.Addr().String(), int(vip.Port())
	px, err := proxy.New(proxy.Config{}, b.g, b.g.inflight, nil, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	lr := &reconcilers.Listeners{Proxy: px, Config: reconcilers.ListenerConfig{Receipts: proxy.ReceiptsOnRequest}}
	if err := reconcileAll(lr, b.g, []control.Service{{ID: 1, Rule: rule}}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = px.Serve(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	url := "http://" + vip.String()
	var resp *http.Response
	for i := 0; i < 100; i++ { // the listener comes up asynchronously
		if resp, err = http.Get(url + "/v1/models"); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("model list through the proxy: %v %v", resp, err)
	}
	resp.Body.Close()
	return url
}

// newPD starts over with an empty dispatcher (no routing history).
func (b *pdBench) newPD(t *testing.T, cfg dispatch.Config) {
	t.Helper()
	d, err := dispatch.New(cfg, nil, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	b.g.cfg.PD = d
}

func epOf(t *testing.T, e *enginesim.Engine, role int) lbrule.Endpoint {
	t.Helper()
	host, port, _ := net.SplitHostPort(e.Addr())
	p, _ := strconv.Atoi(port)
	return lbrule.Endpoint{IP: host, Port: p, Weight: 1, Role: role}
}

func (b *pdBench) chat(t *testing.T, content string, stream bool) (receipt string, body []byte) {
	t.Helper()
	req := map[string]any{"model": pdModel, "max_tokens": 6, "stream": stream,
		"messages": []map[string]string{{"role": "system", "content": "You are a careful assistant."}, {"role": "user", "content": content}}}
	raw, _ := json.Marshal(req)
	resp, err := http.Post(b.srv.URL+"/v1/chat/completions", "application/json", bytes.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || err != nil {
		t.Fatalf("status %d err %v: %s", resp.StatusCode, err, out)
	}
	return resp.Header.Get(proxy.HeaderRoute), out
}

func transfers(es []*enginesim.Engine) []uint64 {
	out := make([]uint64, len(es))
	for i, e := range es {
		out[i] = e.Stats().PDTransfers
	}
	return out
}

func longDoc(n int) string {
	var sb strings.Builder
	for i := 0; i < n; i++ {
		fmt.Fprintf(&sb, "Clause %d of the contract says the supplier ships parts within %d days. ", i, 3+i%7)
	}
	return sb.String()
}

// TestPDTier15FollowsInventory (kvExactMode 1): the prefill worker whose
// inventory holds a long prefix (as its KV events report it: the keys come
// from the engine's own cache) gets the next request with that prefix, by
// Tier 1.5 and not by routing history; decode legs spread.
func TestPDTier15FollowsInventory(t *testing.T) {
	for _, engine := range []string{"vllm", "sglang"} {
		t.Run(engine, func(t *testing.T) {
			b := newPDBench(t, engine, lbrule.KVExactPD, map[string]int{"vllm": 71, "sglang": 72}[engine])
			doc := longDoc(30)
			before := transfers(b.prefill)
			b.chat(t, doc+" Question one?", false)
			after := transfers(b.prefill)
			holder := 0
			if after[1] != before[1] {
				holder = 1
			}
			// Deliver the holder's cache to the index as its event feed would.
			snap := b.prefill[holder].Cache()
			var keys []uint64
			for _, r := range snap.Ranks {
				for _, bl := range r.Blocks {
					keys = append(keys, bl.Hash)
				}
			}
			if len(keys) < 10 {
				t.Fatalf("prefill cache holds %d blocks", len(keys))
			}
			b.index.Store(1, holder, 0, keys)
			// No routing history may decide: the prefix tier needs a full
			// match, and every question differs.
			b.newPD(t, dispatch.Config{TrieMinPercent: 100})
			for round := 0; round < 4; round++ {
				q := fmt.Sprintf(" Question %d: %s", round+2, strings.Repeat(fmt.Sprintf("detail-%d ", round), 30))
				rc, _ := b.chat(t, doc+q, round%2 == 1)
				if !strings.Contains(rc, "tier=tier1.5") || !strings.Contains(rc, fmt.Sprintf("prefill=%d", holder)) {
					t.Fatalf("round %d receipt %q: want Tier 1.5 to prefill %d", round, rc, holder)
				}
			}
			got := transfers(b.prefill)
			if got[holder]-after[holder] != 4 {
				t.Fatalf("holder ran %d of 4 prefills", got[holder]-after[holder])
			}
			d0, d1 := b.decode[0].Stats().Completed, b.decode[1].Stats().Completed
			if d0 == 0 || d1 == 0 {
				t.Fatalf("decode legs did not spread: %d / %d", d0, d1)
			}
		})
	}
}

// TestPDBase (kvExactMode 0) runs each engine's flow through the gateway:
// roles, bootstrap port and receipts come from the rule.
func TestPDBase(t *testing.T) {
	for i, engine := range []string{"vllm", "sglang", "trtllm"} {
		t.Run(engine, func(t *testing.T) {
			b := newPDBench(t, engine, lbrule.KVExactOff, 74+i)
			for _, stream := range []bool{false, true} {
				rc, body := b.chat(t, longDoc(3), stream)
				if !strings.HasPrefix(rc, "pd tier=") {
					t.Fatalf("receipt %q", rc)
				}
				if stream != bytes.Contains(body, []byte("data: [DONE]")) {
					t.Fatalf("stream=%v body %s", stream, body)
				}
			}
		})
	}
}

// TestPDPassthrough: a model list on a P/D rule goes to a decode endpoint.
func TestPDPassthrough(t *testing.T) {
	b := newPDBench(t, "vllm", lbrule.KVExactOff, 78)
	plan, fn, err := b.g.Prepare(&proxy.Request{Service: 1, Method: "GET", Path: "/v1/models", Header: http.Header{}})
	if err != nil || fn != nil || len(plan.Candidates) != 2 || plan.Candidates[0].Idx < 2 {
		t.Fatalf("plan %+v fn %v err %v", plan, fn != nil, err)
	}
	// Without a dispatcher the Gateway refuses P/D rules with a clear 503.
	b.g.cfg.PD = nil
	_, err = b.g.Pick(context.Background(), &proxy.Request{Service: 1, Method: "POST", Path: "/v1/completions", Header: http.Header{}})
	if proxy.StatusFor(err) != 503 || !strings.Contains(err.Error(), "no P/D dispatcher") {
		t.Fatalf("gateway.Pick on a P/D rule without a dispatcher: %v", err)
	}
}

// TestPDThroughProxy: the real proxy, with the Gateway as its Picker, hands P/D
// requests to the dispatcher through Plan.Dispatch and still forwards
// non-inference calls itself.
func TestPDThroughProxy(t *testing.T) {
	b := newPDBench(t, "vllm", lbrule.KVExactOff, 79)
	url := b.serveProxy(t, "127.0.79.1")
	for _, stream := range []bool{false, true} {
		raw, _ := json.Marshal(map[string]any{"model": pdModel, "prompt": longDoc(2), "max_tokens": 5, "stream": stream})
		req, _ := http.NewRequest("POST", url+"/v1/completions", bytes.NewReader(raw))
		req.Header.Set(proxy.HeaderReceiptRequest, "1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || err != nil || !strings.HasPrefix(resp.Header.Get(proxy.HeaderRoute), "pd tier=") {
			t.Fatalf("status %d err %v route %q: %s", resp.StatusCode, err, resp.Header.Get(proxy.HeaderRoute), body)
		}
		if stream != bytes.Contains(body, []byte("[DONE]")) {
			t.Fatalf("stream=%v: %s", stream, body)
		}
	}
	if tr := transfers(b.prefill); tr[0]+tr[1] != 2 {
		t.Fatalf("prefill transfers %v, want 2", tr)
	}
}

// TestPDPrefillRankFollowsInventory: on SGLang prefill engines with two
// data-parallel ranks, the prefill leg goes to the rank whose inventory
// holds the prompt's prefix, named to the engine, and the receipt says so.
func TestPDPrefillRankFollowsInventory(t *testing.T) {
	b := newPDBenchRanks(t, "sglang", lbrule.KVExactPD, 77, 2)
	doc := longDoc(30)
	rc, _ := b.chat(t, doc+" Question one?", false)
	var holder, rank int
	if _, err := fmt.Sscanf(rc[strings.Index(rc, "prefill="):], "prefill=%d", &holder); err != nil {
		t.Fatalf("receipt %q: %v", rc, err)
	}
	if _, err := fmt.Sscanf(rc[strings.Index(rc, "prefill_rank="):], "prefill_rank=%d", &rank); err != nil {
		t.Fatalf("receipt %q names no prefill rank: %v", rc, err)
	}
	// Deliver the holder's cache, rank by rank, as its event feeds would.
	stored := 0
	for _, r := range b.prefill[holder].Cache().Ranks {
		var keys []uint64
		for _, bl := range r.Blocks {
			keys = append(keys, bl.Hash)
		}
		if len(keys) > 0 && r.Rank != rank {
			t.Fatalf("rank %d holds the prefix, the receipt named rank %d", r.Rank, rank)
		}
		stored += len(keys)
		b.index.Store(1, holder, r.Rank, keys)
	}
	if stored < 10 {
		t.Fatalf("prefill cache holds %d blocks", stored)
	}
	b.newPD(t, dispatch.Config{TrieMinPercent: 100})
	before := b.prefill[holder].Stats().Ranks[rank].Targeted
	for round := 0; round < 4; round++ {
		q := fmt.Sprintf(" Question %d: %s", round+2, strings.Repeat(fmt.Sprintf("detail-%d ", round), 30))
		rc, _ := b.chat(t, doc+q, round%2 == 1)
		want := fmt.Sprintf("prefill=%d", holder)
		if !strings.Contains(rc, "tier=tier1.5") || !strings.Contains(rc, want) || !strings.HasSuffix(rc, fmt.Sprintf("prefill_rank=%d", rank)) {
			t.Fatalf("round %d receipt %q: want Tier 1.5 to prefill %d rank %d", round, rc, holder, rank)
		}
	}
	if got := b.prefill[holder].Stats().Ranks[rank].Targeted - before; got != 4 {
		t.Fatalf("rank %d of prefill %d was named for %d of 4 legs", rank, holder, got)
	}
}

// TestPDReconcileForgets: the Gateway's Reconcile drops the dispatcher's
// state of a P/D rule once the rule is gone, and keeps it while the rule
// stays.
func TestPDReconcileForgets(t *testing.T) {
	b := newPDBench(t, "vllm", lbrule.KVExactPD, 89)
	reg := prometheus.NewRegistry()
	d, err := dispatch.New(dispatch.Config{}, nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	b.g.cfg.PD = d
	trieNodes := func() float64 {
		t.Helper()
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == "loxilb_pd_trie_nodes" {
				return mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		return 0
	}
	b.chat(t, longDoc(10)+" Question?", false)
	if trieNodes() == 0 {
		t.Fatal("a P/D request left no prefix history")
	}
	keep := []control.Service{{ID: 1, Rule: b.g.lookup(1).rule}}
	if err := b.g.Reconcile(context.Background(), keep); err != nil || trieNodes() == 0 {
		t.Fatalf("the rule stayed, yet its history went (err %v)", err)
	}
	if err := b.g.Reconcile(context.Background(), nil); err != nil || trieNodes() != 0 {
		t.Fatalf("the rule went, %v prefix history nodes stay (err %v)", trieNodes(), err)
	}
}
