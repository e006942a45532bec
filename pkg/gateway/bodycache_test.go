package gateway

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/blockhash"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

// uncachedKeys is what the pipeline computes for body without any cache:
// the reference every cached answer must equal.
func uncachedKeys(t testing.TB, f fixture, path string, body []byte) ([]uint32, []uint64, string) {
	t.Helper()
	tok, err := f.g.tok.Get("Qwen/Qwen3-0.6B")
	if err != nil {
		t.Fatal(err)
	}
	rt, err := tok.EncodeRequest(tokenizer.EngineVLLM, path, body)
	if err != nil {
		t.Fatal(err)
	}
	return rt.IDs, f.g.lookup(1).hasher.Keys(nil, rt.IDs), rt.Rendered
}

func bodyCacheFixture(t testing.TB, max int64) fixture {
	t.Helper()
	return newFixtureConfig(t, Config{Seed: "1", BodyCacheBytes: max}, rule(3, "Qwen/Qwen3-0.6B"))
}

func chatBodyReq(body []byte) *proxy.Request {
	r := &proxy.Request{Service: 1, Method: http.MethodPost, Path: "/v1/chat/completions", Header: http.Header{}, Body: body}
	r.Model = proxy.ModelOf(r.Header, r.Body)
	return r
}

// promptKeysOf runs the decision's pipeline once and copies what it
// returned (a cache hit's slices are the cache's).
func promptKeysOf(t testing.TB, f fixture, rq *proxy.Request) ([]uint32, []uint64, string, bool) {
	t.Helper()
	ids, rendered, keys, shared, reason, err := f.g.promptKeys(context.Background(), f.g.lookup(1), "Qwen/Qwen3-0.6B", rq,
		&parsedBody{raw: rq.Body}, nil, nil)
	if err != nil || reason != "" {
		t.Fatalf("promptKeys: %v %q", err, reason)
	}
	return slices.Clone(ids), slices.Clone(keys), rendered, shared
}

// A body is stored on its second sighting and served from the cache from
// the third on, with the very ids, keys and rendered prompt the uncached
// pipeline computes, for chat and completions bodies alike.
func TestBodyCacheExact(t *testing.T) {
	f := bodyCacheFixture(t, DefaultBodyCacheBytes)
	bodies := []*proxy.Request{chatBodyReq(chatBody(2000)), chatBodyReq(chatBodyVariant(300, " Request 9.", "")), req(prompt)}
	for _, rq := range bodies {
		wantIDs, wantKeys, wantRendered := uncachedKeys(t, f, rq.Path, rq.Body)
		for i := 0; i < 4; i++ {
			ids, keys, rendered, shared := promptKeysOf(t, f, rq)
			if shared != (i >= 2) {
				t.Fatalf("%s sighting %d: served from the cache %v", rq.Path, i+1, shared)
			}
			if !slices.Equal(ids, wantIDs) || !slices.Equal(keys, wantKeys) || rendered != wantRendered {
				t.Fatalf("%s sighting %d: %d ids, %d keys differ from the uncached %d, %d", rq.Path, i+1, len(ids), len(keys), len(wantIDs), len(wantKeys))
			}
		}
	}
	c := f.g.bodies
	if h, m, a := testutil.ToFloat64(c.hits), testutil.ToFloat64(c.misses), testutil.ToFloat64(c.admitted); h != 6 || m != 6 || a != 3 {
		t.Fatalf("hits %v misses %v admitted %v, want 6 6 3", h, m, a)
	}
}

// A hit needs the same bytes, path, service, tokenizer and hasher: an
// entry under the same hash for anything else is a miss.
func TestBodyCacheNoFalseHit(t *testing.T) {
	f := bodyCacheFixture(t, DefaultBodyCacheBytes)
	tok, _ := f.g.tok.Get("Qwen/Qwen3-0.6B")
	h := f.g.lookup(1).hasher
	other, err := blockhash.New(blockhash.Config{Algo: blockhash.SHA256CBOR, BlockSize: h.BlockSize(), Seed: "1"})
	if err != nil {
		t.Fatal(err)
	}
	c := f.g.bodies
	body := []byte(`{"prompt":"a"}`)
	const sum = 7 // any hash: the check must not trust it
	for range 2 {
		c.offer(sum, 1, "/v1/completions", tok, h, body, []uint32{1, 2}, []uint64{3}, "")
	}
	if _, ok := c.get(sum, 1, "/v1/completions", tok, h, body); !ok {
		t.Fatal("the stored body is not served")
	}
	for name, miss := range map[string]func() bool{
		"bytes":   func() bool { _, ok := c.get(sum, 1, "/v1/completions", tok, h, []byte(`{"prompt":"b"}`)); return ok },
		"length":  func() bool { _, ok := c.get(sum, 1, "/v1/completions", tok, h, body[:len(body)-1]); return ok },
		"path":    func() bool { _, ok := c.get(sum, 1, "/v1/chat/completions", tok, h, body); return ok },
		"service": func() bool { _, ok := c.get(sum, 2, "/v1/completions", tok, h, body); return ok },
		"hasher":  func() bool { _, ok := c.get(sum, 1, "/v1/completions", tok, other, body); return ok },
		"tokenizer": func() bool {
			_, ok := c.get(sum, 1, "/v1/completions", &tokenizer.Tokenizer{}, h, body)
			return ok
		},
	} {
		if miss() {
			t.Errorf("a different %s is served from the cache", name)
		}
	}
}

// The cache stays within its bytes, evicting the least recently used
// entry first and counting it.
func TestBodyCacheBound(t *testing.T) {
	f := bodyCacheFixture(t, 4096)
	tok, _ := f.g.tok.Get("Qwen/Qwen3-0.6B")
	h := f.g.lookup(1).hasher
	c := f.g.bodies
	ids := make([]uint32, 300) // ~1.4 KB an entry: two fit in the bound
	put := func(i int) {
		b := []byte(fmt.Sprintf("body %d", i))
		c.offer(bodySum(b), 1, "/p", tok, h, b, ids, nil, "")
		c.offer(bodySum(b), 1, "/p", tok, h, b, ids, nil, "")
	}
	has := func(i int) bool {
		b := []byte(fmt.Sprintf("body %d", i))
		_, ok := c.get(bodySum(b), 1, "/p", tok, h, b)
		return ok
	}
	for i := range 5 {
		put(i)
		if !has(0) { // 0 is used after every insert: never the oldest
			t.Fatalf("entry 0 evicted after inserting %d", i)
		}
	}
	if c.used > c.max || c.used <= 0 {
		t.Fatalf("%d bytes held, bound %d", c.used, c.max)
	}
	if has(1) || !has(4) {
		t.Fatal("the least recently used entry was not the one evicted")
	}
	if testutil.ToFloat64(c.evicted) == 0 {
		t.Fatal("evictions not counted")
	}
	// An entry larger than the whole bound is never stored.
	big := make([]byte, 8192)
	c.offer(bodySum(big), 1, "/p", tok, h, big, nil, nil, "")
	c.offer(bodySum(big), 1, "/p", tok, h, big, nil, nil, "")
	if _, ok := c.get(bodySum(big), 1, "/p", tok, h, big); ok || c.used > c.max {
		t.Fatal("an entry over the bound was stored")
	}
}

// Concurrent decisions on repeated and new bodies all get the uncached
// pipeline's answer: a hit's ids are never handed to Pick's pool, where
// another request would overwrite them (run with -race too).
func TestBodyCacheConcurrentPick(t *testing.T) {
	f := bodyCacheFixture(t, DefaultBodyCacheBytes)
	type want struct {
		ids  []uint32
		keys []uint64
	}
	var rqs []*proxy.Request
	var wants []want
	for i := range 4 {
		rq := chatBodyReq(chatBodyVariant(200+100*i, fmt.Sprintf(" Request %d.", i), ""))
		ids, keys, _ := uncachedKeys(t, f, rq.Path, rq.Body)
		rqs, wants = append(rqs, rq), append(wants, want{ids, keys})
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 40 {
				k := (w + i) % len(rqs)
				p, err := f.g.Pick(context.Background(), rqs[k])
				if err != nil {
					errs <- err
					return
				}
				// The first byte came: later requests for the prefix need
				// not wait for this one.
				p.FirstByte()
				p.Done(proxy.Result{})
				ids, _, keys, shared, _, err := f.g.promptKeys(context.Background(), f.g.lookup(1), "Qwen/Qwen3-0.6B", rqs[k],
					&parsedBody{raw: rqs[k].Body}, nil, nil)
				if err != nil || !slices.Equal(ids, wants[k].ids) || !slices.Equal(keys, wants[k].keys) {
					errs <- fmt.Errorf("body %d (cached %v): %v, %d ids %d keys differ", k, shared, err, len(ids), len(keys))
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if testutil.ToFloat64(f.g.bodies.hits) == 0 {
		t.Fatal("no decision was served from the cache")
	}
}
