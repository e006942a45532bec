package gateway

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// Identical P/D requests that arrive while the first one's prefill leg
// still computes the prompt wait for it (its first byte) and then prefill
// on the same engine, which holds the prompt by then: the prompt is
// computed once, not once per request. The prefill engines model their
// prefill time (the decode ones answer at once), and the requests go
// through the real proxy, which fires the plan's first-byte hook.
func TestPDConcurrentIdenticalRequestsPrefillOnce(t *testing.T) {
	slow := func(c *enginesim.Config) {
		// ~3 s for the prompt below on an idle machine: the followers
		// arrive well within the leader's prefill.
		c.TimeScale, c.TimeScaleSet, c.PrefillUsPerToken = 1, true, 6000
	}
	b := newPDBenchWith(t, "vllm", lbrule.KVExactPD, 93, 1, slow)
	b.g.cfg.CoalesceWait = time.Minute // outlasts any pause of a loaded machine
	url := b.serveProxy(t, "127.0.93.1")
	raw, _ := json.Marshal(map[string]any{"model": pdModel, "prompt": longDoc(30), "max_tokens": 4})
	type answer struct {
		status  int
		receipt string
		err     error
	}
	send := func(out chan<- answer) {
		req, _ := http.NewRequest("POST", url+"/v1/completions", bytes.NewReader(raw))
		req.Header.Set(proxy.HeaderReceiptRequest, "1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			out <- answer{err: err}
			return
		}
		_, err = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		out <- answer{status: resp.StatusCode, receipt: resp.Header.Get(proxy.HeaderRoute), err: err}
	}
	running := func() int64 {
		var n int64
		for _, e := range b.prefill {
			n += e.Stats().Running
		}
		return n
	}
	const followers = 3
	answers := make(chan answer, followers+1)
	go send(answers)
	waitUntil(t, "the first request's prefill to run", func() bool { return running() == 1 })
	for range followers {
		go send(answers)
	}
	var receipts []string
	for range followers + 1 {
		a := <-answers
		if a.err != nil || a.status != 200 {
			t.Fatalf("status %d err %v", a.status, a.err)
		}
		receipts = append(receipts, a.receipt)
	}
	var prompt, computed uint64
	for _, e := range b.prefill {
		s := e.Stats()
		prompt += s.PromptTokens
		computed += s.PromptTokens - s.HitTokens
	}
	once := prompt / (followers + 1)
	if computed >= 2*once {
		t.Fatalf("the prefill engines computed %d prompt tokens for %d identical prompts of %d tokens: the followers did not wait for the first one (receipts %q)",
			computed, followers+1, once, receipts)
	}
	// Every follower was held and released by the leader's first byte.
	var released float64
	for ep := range 2 {
		released += testutil.ToFloat64(b.g.m.coalesced.WithLabelValues("1", strconv.Itoa(ep), string(waitReleased)))
	}
	if released != followers {
		t.Fatalf("%v followers released by the leader, want %d (receipts %q)", released, followers, receipts)
	}
	for _, rc := range receipts {
		if !strings.Contains(rc, "prefill=") {
			t.Fatalf("receipt %q", rc)
		}
	}
}
