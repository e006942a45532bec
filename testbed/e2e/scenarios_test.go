package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// TestMismatchedSeedQuarantined: an engine launched with another
// PYTHONHASHSEED publishes blocks no request can match. Parity attestation
// sees keys that do not hash from their tokens, reports hash_mismatch and
// quarantines both endpoints: their blocks never enter the inventory (the
// zero-hit watchdog, which watches non-empty inventories, has nothing to
// watch), and the capabilities say why.
func TestMismatchedSeedQuarantined(t *testing.T) {
	p := newPool(t, poolOpts{n: 2, net: 51, env: []string{"LOXILB_KV_ZERO_HIT_N=5"},
		engine: func(_ int, c *enginesim.Config) { c.Seed = "999" }})
	complete(t, p.vip, longPrompt("storage", 0))
	complete(t, p.vip, longPrompt("archive", 0))
	waitFor(t, "both endpoints quarantined", 10*time.Second, func() bool {
		return metricValue(metrics(t, p.d), "loxilb_kv_quarantined") == 2
	})
	for i := 1; i <= 6; i++ {
		if r := complete(t, p.vip, longPrompt("storage", i)); r.tier == "tier1.5" && r.cached == 0 {
			t.Errorf("request %d credited with blocks the engine does not hold: %+v", i, r)
		}
	}
	m := metrics(t, p.d)
	if v := metricValue(m, "loxilb_kv_block_events_applied_total"); v != 0 {
		t.Errorf("%v mismatched blocks entered the inventory", v)
	}
	if !strings.Contains(p.d.Logs(), "quarantined") {
		t.Errorf("no quarantine warning in the log")
	}
	var caps struct {
		Capabilities []struct {
			Name       string
			ReasonCode string `json:"reason_code"`
		}
	}
	getJSON(t, p.d.URL("/status/capabilities"), &caps)
	mismatch, quarantined := 0, 0
	for _, c := range caps.Capabilities {
		if strings.HasPrefix(c.Name, "kv_parity:") && c.ReasonCode == "hash_mismatch" {
			mismatch++
		}
		if strings.HasPrefix(c.Name, "kv_quarantine:") && c.ReasonCode == "quarantined" {
			quarantined++
		}
	}
	if mismatch != 2 || quarantined != 2 {
		t.Errorf("capabilities: %d hash_mismatch, %d quarantined, want 2 and 2: %+v", mismatch, quarantined, caps.Capabilities)
	}
}

// TestHotPrefixSpills: one hot prefix under concurrency is spread by spill
// relief instead of piling onto the warm worker.
func TestHotPrefixSpills(t *testing.T) {
	p := newPool(t, poolOpts{n: 4, net: 52, engine: func(_ int, c *enginesim.Config) {
		c.TimeScale, c.DecodeUsPerToken = 1, 20000 // 4 output tokens ~ 80ms per request
	}})
	first := complete(t, p.vip, longPrompt("hot", 0))
	p.waitInventory(t, first.ep)
	var mu sync.Mutex
	perEP := map[int]int{}
	var wg sync.WaitGroup
	for i := 0; i < 32; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := complete(t, p.vip, longPrompt("hot", 100+i))
			mu.Lock()
			perEP[r.ep]++
			mu.Unlock()
		}()
	}
	wg.Wait()
	spills := metricValue(metrics(t, p.d), "loxilb_pd_kv_tier15_spills_total")
	if spills == 0 {
		t.Errorf("no spill under a hot prefix: %v", perEP)
	}
	mean := 32.0 / 4
	for ep, n := range perEP {
		if float64(n) > 2*mean+1 {
			t.Errorf("endpoint %d took %d of 32 requests (mean %.0f): %v", ep, n, mean, perEP)
		}
	}
	t.Logf("per-endpoint requests %v, spills %v", perEP, spills)
}

// TestColdEndpointIsSeeded: a restarted (empty) engine re-enters a warm
// fleet through cold-start seeding.
func TestColdEndpointIsSeeded(t *testing.T) {
	p := newPool(t, poolOpts{n: 3, net: 53, env: []string{"LOXILB_KV_COLDSTART_SEED_N=4", "LOXILB_KV_COLDSTART_MIN_BLOCKS=1"}})
	// Warm every endpoint with its own prefix.
	warm := map[int]string{}
	for i := 0; len(warm) < 3 && i < 40; i++ {
		topic := fmt.Sprintf("topic%d", i)
		r := complete(t, p.vip, longPrompt(topic, 0))
		if _, ok := warm[r.ep]; !ok {
			warm[r.ep] = topic
			p.waitInventory(t, r.ep)
		}
	}
	if len(warm) < 3 {
		t.Fatalf("could not warm every endpoint: %v", warm)
	}
	// Restart endpoint 2: its cache and the gateway's inventory empty out.
	p.engines[2].Restart()
	waitFor(t, "inventory of the restarted endpoint to clear", 10*time.Second, func() bool {
		var inv struct{ Total int }
		getJSON(t, p.d.URL("/config/ai/kv/inventory?service_id=1&ep_idx=2"), &inv)
		return inv.Total == 0
	})
	got := 0
	for i := 1; i <= 12; i++ {
		r := complete(t, p.vip, longPrompt(warm[0], i))
		if r.ep == 2 {
			got++
		}
	}
	if seeds := metricValue(metrics(t, p.d), "loxilb_pd_kv_tier15_cold_seeds_total"); seeds < 1 || got < 1 {
		t.Errorf("cold endpoint received %d seeded requests (metric %v)", got, seeds)
	}
}

// TestUnhealthyEndpointReceivesNothing: a failing health probe takes an
// endpoint out of scoring and selection; it returns when healthy.
func TestUnhealthyEndpointReceivesNothing(t *testing.T) {
	p := newPool(t, poolOpts{n: 3, net: 54, ruleArgs: `"monitor":true,"probetype":"http","probereq":"/health","probeTimeout":1,"probeRetries":1`})
	if err := p.engines[1].SetFaults(enginesim.Faults{HealthFail: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "endpoint 1 inactive", 10*time.Second, func() bool {
		var list struct {
			LBAttr []struct {
				Endpoints []struct{ State string } `json:"endpoints"`
			} `json:"lbAttr"`
		}
		getJSON(t, p.d.URL("/config/loadbalancer/all"), &list)
		return list.LBAttr[0].Endpoints[1].State == "inactive"
	})
	for i := 0; i < 12; i++ {
		if r := complete(t, p.vip, longPrompt(fmt.Sprintf("t%d", i), i)); r.ep == 1 {
			t.Fatalf("unhealthy endpoint received request %d", i)
		}
	}
	_ = p.engines[1].SetFaults(enginesim.Faults{})
	waitFor(t, "endpoint 1 active again", 10*time.Second, func() bool {
		var list struct {
			LBAttr []struct {
				Endpoints []struct{ State string } `json:"endpoints"`
			} `json:"lbAttr"`
		}
		getJSON(t, p.d.URL("/config/loadbalancer/all"), &list)
		return list.LBAttr[0].Endpoints[1].State == "active"
	})
}

// TestStreamingChunkByChunk: SSE arrives through the VIP as the engine
// produces it, not buffered until the end.
func TestStreamingChunkByChunk(t *testing.T) {
	p := newPool(t, poolOpts{n: 2, net: 55, engine: func(_ int, c *enginesim.Config) {
		c.TimeScale, c.DecodeUsPerToken = 1, 50000 // 50ms per token
	}})
	body, _ := json.Marshal(map[string]any{"model": model, "prompt": longPrompt("stream", 0), "max_tokens": 10, "stream": true})
	start := time.Now()
	resp, err := http.Post("http://"+p.vip+"/v1/completions", "application/json", strings.NewReader(string(body)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	var arrivals []time.Duration
	done := false
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "data: ") {
			arrivals = append(arrivals, time.Since(start))
			if line == "data: [DONE]" {
				done = true
			}
		}
	}
	if !done || len(arrivals) < 10 {
		t.Fatalf("stream incomplete: %d events, done=%v", len(arrivals), done)
	}
	// The first chunk arrived well before the last was produced (10 tokens at 50ms).
	if first, last := arrivals[0], arrivals[len(arrivals)-1]; last-first < 200*time.Millisecond {
		t.Errorf("chunks arrived together: first %v last %v", first, last)
	}
}

// TestSiblingBurstLandsTogether: 16 concurrent requests sharing a new
// 2k-token prefix are prefilled by at most 2 endpoints (speculative entries
// make the siblings follow the first before the engine's events arrive).
func TestSiblingBurstLandsTogether(t *testing.T) {
	p := newPool(t, poolOpts{n: 4, net: 56, engine: func(_ int, c *enginesim.Config) {
		c.TimeScale, c.PrefillUsPerToken = 1, 100 // a 2k-token prefill takes ~200ms
		c.Faults.EventDelayMs = 300               // events lag behind the burst
	}})
	var shared strings.Builder
	for shared.Len() < 9000 {
		fmt.Fprintf(&shared, "Clause %d of the shared contract binds both parties to fair terms. ", shared.Len())
	}
	var mu sync.Mutex
	eps := map[int]int{}
	var wg sync.WaitGroup
	for i := 0; i < 16; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := complete(t, p.vip, shared.String()+fmt.Sprintf(" Sibling question %d?", i))
			mu.Lock()
			eps[r.ep]++
			mu.Unlock()
		}()
		time.Sleep(5 * time.Millisecond)
	}
	wg.Wait()
	if len(eps) > 2 {
		t.Errorf("16 siblings were prefilled by %d endpoints: %v", len(eps), eps)
	}
	t.Logf("sibling burst distribution: %v", eps)
}

// TestPrefillQueueLetsCachedRequestsOvertake: with one prefill slot per
// endpoint, a request whose prompt is cached overtakes a cold prompt that
// was queued before it, instead of waiting behind it in the engine.
func TestPrefillQueueLetsCachedRequestsOvertake(t *testing.T) {
	p := newPool(t, poolOpts{n: 1, net: 57, env: []string{"LOXILB_KV_PREFILL_SLOTS=1", "LOXILB_KV_COALESCE_WAIT_MS=0"},
		engine: func(_ int, c *enginesim.Config) {
			c.TimeScale, c.PrefillUsPerToken, c.MaxRunning = 1, 2000, 1 // a cold ~600-token prompt holds the engine ~1.2s, so each state is seen by the polls
		}})
	complete(t, p.vip, longPrompt("warm", 0))
	p.waitInventory(t, 0)

	depth := func() float64 { return metricValue(metrics(t, p.d), "loxilb_kv_prefill_queue_depth") }
	type done struct {
		name string
		r    route
	}
	finished := make(chan done, 3)
	send := func(name, prompt string) {
		go func() { finished <- done{name, complete(t, p.vip, prompt)} }()
	}
	send("cold-a", longPrompt("first cold", 1))
	waitFor(t, "the first cold prompt to take the slot", 10*time.Second, func() bool {
		return metricValue(metrics(t, p.d), "loxilb_kv_prefill_slots_busy") == 1
	})
	send("cold-b", longPrompt("second cold", 2))
	waitFor(t, "the second cold prompt to queue", 10*time.Second, func() bool { return depth() == 1 })
	send("warm", longPrompt("warm", 3))
	waitFor(t, "the cached request to queue", 10*time.Second, func() bool { return depth() == 2 })

	var order []string
	var warm route
	for range 3 {
		d := <-finished
		order = append(order, d.name)
		if d.name == "warm" {
			warm = d.r
		}
	}
	if got := strings.Join(order, " "); got != "cold-a warm cold-b" {
		t.Fatalf("completion order %q, want the cached request before the cold one queued ahead of it", got)
	}
	if warm.matched == 0 || warm.cached == 0 {
		t.Fatalf("the overtaking request did not hit the cache: %+v", warm)
	}
	m := metrics(t, p.d)
	if v := metricValue(m, "loxilb_kv_prefill_admitted_total", `outcome="queued"`); v != 2 {
		t.Fatalf("admitted{queued} = %v, want 2", v)
	}
	t.Logf("completion order %v; warm request matched %d blocks, %d cached tokens", order, warm.matched, warm.cached)
}
