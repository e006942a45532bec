package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
)

func chwblRule(kv int, mutate func(*lbrule.ServiceArgs)) *lbrule.Rule {
	r := &lbrule.Rule{Service: lbrule.ServiceArgs{ExternalIP: "127.0.0.77", Port: 9000, Protocol: "tcp", Mode: 4, Sel: lbrule.SelCHWBL, KVExactMode: kv, KVEngine: "vllm"}}
	for i := 0; i < 5; i++ {
		r.Endpoints = append(r.Endpoints, lbrule.Endpoint{IP: fmt.Sprintf("127.0.0.%d", 80+i), Port: 8000, Weight: 1})
	}
	if mutate != nil {
		mutate(&r.Service)
	}
	return r
}

// systemPrompt is longer than the 512 bytes the key used to read, as a
// service's shared system prompt is.
var systemPrompt = strings.Repeat("You are the support assistant of a bank. Answer briefly and cite the policy. ", 12)

func chatReq(conv int, turns int, extra string) *proxy.Request {
	msgs := []map[string]string{{"role": "system", "content": systemPrompt}}
	for t := 0; t < turns; t++ {
		msgs = append(msgs, map[string]string{"role": "user", "content": fmt.Sprintf("Conversation %d, question %d: what is the fee for transfer type %d?", conv, t, conv*7+t)})
		if t < turns-1 {
			msgs = append(msgs, map[string]string{"role": "assistant", "content": fmt.Sprintf("The fee is %d cents.", conv+t)})
		}
	}
	b, _ := json.Marshal(map[string]any{"model": "Qwen/Qwen3-0.6B", "messages": msgs})
	if extra != "" {
		b = append(b[:len(b)-1], ","+extra+"}"...)
	}
	r := req(string(b))
	r.Path = "/v1/chat/completions"
	return r
}

func pickEP(t *testing.T, f fixture, r *proxy.Request) int {
	t.Helper()
	p, err := f.g.Pick(context.Background(), r)
	if err != nil {
		t.Fatal(err)
	}
	rc, _ := router.ParseReceipt(p.Receipt)
	if p.Done != nil {
		p.Done(proxy.Result{})
	}
	return rc.EP
}

// A chat service shares one system prompt; its conversations differ from
// the first user message on. They must spread over every endpoint, and
// each conversation must stay on one endpoint as its history grows.
func TestChwblChatSpreadsConversationsAndKeepsEach(t *testing.T) {
	for _, kv := range []int{lbrule.KVExactOff, lbrule.KVExactSingle} {
		t.Run(fmt.Sprintf("kvExactMode=%d", kv), func(t *testing.T) {
			// No speculative entries: with an empty inventory every request
			// misses Tier 1.5 and the rule's chwbl places it.
			f := newFixtureConfig(t, Config{Seed: "1", SpeculativeTTL: -1}, chwblRule(kv, nil))
			const convs = 100
			count := map[int]int{}
			first := make([]int, convs)
			for c := 0; c < convs; c++ {
				first[c] = pickEP(t, f, chatReq(c, 1, ""))
				count[first[c]]++
			}
			if len(count) != 5 {
				t.Fatalf("%d conversations sharing a system prompt used %d of 5 endpoints: %v", convs, len(count), count)
			}
			for ep, n := range count {
				if n > 2*convs/5 {
					t.Errorf("endpoint %d took %d of %d conversations (more than twice its share): %v", ep, n, convs, count)
				}
			}
			for c := 0; c < convs; c++ {
				for turns := 2; turns <= 4; turns++ {
					if ep := pickEP(t, f, chatReq(c, turns, "")); ep != first[c] {
						t.Fatalf("conversation %d moved from endpoint %d to %d at turn %d", c, first[c], ep, turns)
					}
				}
			}
		})
	}
}

// Level 1 is loxilb's "system prompt + model": every conversation meets on
// one ring point, and the bounded load alone spreads them, never letting an
// endpoint exceed ceil(factor/100 * (L+1) / n).
func TestChwblLevelSystemBoundedLoad(t *testing.T) {
	f := newFixture(t, chwblRule(0, func(s *lbrule.ServiceArgs) {
		s.ChwblPrefixHashLevel, s.ChwblMeanLoadFactor, s.ChwblReplication = 1, 125, 100
	}))
	idle := map[int]bool{}
	for c := 0; c < 20; c++ {
		idle[pickEP(t, f, chatReq(c, 1, ""))] = true
	}
	if len(idle) != 1 {
		t.Fatalf("level 1 keys on the system prompt: idle picks should meet on one endpoint, got %v", idle)
	}
	// Every pick stays in flight (counted where the proxy would count it).
	inflight := map[int]int{}
	load := 0
	for c := 0; c < 100; c++ {
		ep := pickEP(t, f, chatReq(c, 1, ""))
		capacity := (125*(load+1) + 100*5 - 1) / (100 * 5)
		if n := f.g.inflight.Count(1, ep); n+1 > capacity {
			t.Fatalf("request %d: endpoint %d goes to %d in flight, above the bound %d (L=%d)", c, ep, n+1, capacity, load)
		}
		f.g.inflight.Counter(1, ep).Add(1)
		inflight[ep]++
		load++
	}
	// One hot key fills endpoints up to the bound in ring order: at
	// factor 125 that is at least 4 of 5.
	if used := len(inflight); used < 4 {
		t.Errorf("one hot key used %d endpoints under load: %v", used, inflight)
	}
}

func TestChwblCacheSalt(t *testing.T) {
	f := newFixture(t, chwblRule(0, func(s *lbrule.ServiceArgs) { s.ChwblEnableCacheSalt = true }))
	if _, err := f.g.Pick(context.Background(), chatReq(1, 1, "")); !errors.Is(err, proxy.ErrBadRequest) || !strings.Contains(err.Error(), "cache_salt") {
		t.Fatalf("request without cache_salt: %v", err)
	}
	if v := testutil.ToFloat64(f.g.m.rejectedC.WithLabelValues("1", rejectCacheSalt)); v != 1 {
		t.Errorf("refusal not counted: %v", v)
	}
	// The salt joins the key: one conversation under different salts may
	// land apart, under one salt it stays.
	seen := map[int]bool{}
	for s := 0; s < 40; s++ {
		seen[pickEP(t, f, chatReq(1, 1, fmt.Sprintf(`"cache_salt":"tenant-%d"`, s)))] = true
	}
	if len(seen) < 2 {
		t.Errorf("cache_salt is not part of the key: 40 salts all on %v", seen)
	}
	// Flags without bit 3 leave the salt out of the key.
	f = newFixture(t, chwblRule(0, func(s *lbrule.ServiceArgs) { s.ChwblPrefixHashFlags = lbrule.ChwblFlagTools }))
	seen = map[int]bool{}
	for s := 0; s < 40; s++ {
		seen[pickEP(t, f, chatReq(1, 1, fmt.Sprintf(`"cache_salt":"tenant-%d"`, s)))] = true
	}
	if len(seen) != 1 {
		t.Errorf("flags without the cache_salt bit still key on it: %v", seen)
	}
}

// With a tokenized rule the key is the block hash of the rendered
// conversation opening, so one conversation sent with string content and
// with a text-parts list (the same tokens) meets on one endpoint; keyed on
// the JSON (rule not tokenized) the two spellings are different keys.
func TestChwblTokenKeyIgnoresJSONSpelling(t *testing.T) {
	spell := func(conv int, parts bool) *proxy.Request {
		user := fmt.Sprintf("Conversation %d: what is the fee for transfer type %d?", conv, conv*7)
		var content any = user
		if parts {
			content = []map[string]string{{"type": "text", "text": user}}
		}
		b, _ := json.Marshal(map[string]any{"model": "Qwen/Qwen3-0.6B", "messages": []map[string]any{
			{"role": "system", "content": systemPrompt}, {"role": "user", "content": content}}})
		r := req(string(b))
		r.Path = "/v1/chat/completions"
		return r
	}
	differ := func(kv int) int {
		f := newFixtureConfig(t, Config{Seed: "1", SpeculativeTTL: -1}, chwblRule(kv, nil))
		n := 0
		for c := 0; c < 20; c++ {
			if pickEP(t, f, spell(c, false)) != pickEP(t, f, spell(c, true)) {
				n++
			}
		}
		return n
	}
	if n := differ(lbrule.KVExactSingle); n != 0 {
		t.Errorf("tokenized rule: %d of 20 conversations landed apart for a JSON spelling", n)
	}
	if n := differ(lbrule.KVExactOff); n == 0 {
		t.Errorf("untokenized rule keys on the JSON: spellings should differ (the check above could not fail)")
	}
}

// Tokenized completions are keyed on the block hash covering their first
// 1024 tokens (level 2): what follows does not move them, a difference
// inside does.
func TestChwblCompletionsTokenDepth(t *testing.T) {
	ks := keySpec{level: lbrule.ChwblLevelConversation}
	const bs = 16
	prompt := func(n int, change int) ([]uint32, []uint64) {
		ids := make([]uint32, n)
		for i := range ids {
			ids[i] = uint32(i)
		}
		if change >= 0 {
			ids[change] = 999999
		}
		// A chained key per full block, as blockhash gives.
		var keys []uint64
		h := uint64(1)
		for b := 0; (b+1)*bs <= n; b++ {
			for _, id := range ids[b*bs : (b+1)*bs] {
				h = h*1099511628211 ^ uint64(id)
			}
			keys = append(keys, h)
		}
		return ids, keys
	}
	key := func(n, change int) string {
		ids, keys := prompt(n, change)
		return string(ks.tokenBlocksKey("m", keyRequest{}, ids, keys, bs))
	}
	base := key(1500, -1)
	if key(3000, -1) != base || key(1500, 1200) != base {
		t.Error("tokens after the first 1024 changed the key")
	}
	if key(1500, 500) == base || key(1500, 1023) == base {
		t.Error("a token inside the first 1024 did not change the key")
	}
	if key(100, -1) == key(101, -1) {
		t.Error("a short prompt's trailing partial block is not in the key")
	}
}
