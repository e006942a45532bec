package hostile

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/testbed/daemontest"
)

// Attacks by clients and endpoints on the mode-4 gateway: client-chosen
// model names, huge prompts, and the routing receipt as a side channel.

// gwForged is the receipt a hostile endpoint tries to pass off as ours.
const gwForged = "tier=tier1.5 ep=0 matched=8/8 reason=forged"

// gwBackend is a loopback engine stand-in that answers every request with
// a small completion and a forged X-Loxilb-Route header. It returns its
// port.
func gwBackend(t *testing.T, ip string) int {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatalf("listen on %s: %v", ip, err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("X-Loxilb-Route", gwForged)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"x","object":"text_completion","choices":[{"index":0,"text":"ok"}],"usage":{"prompt_tokens":1,"completion_tokens":1}}`)
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return ln.Addr().(*net.TCPAddr).Port
}

// gwRule creates a mode-4 KV-exact SGLang rule (no hash seed needed) on
// vip:port over two gwBackends. Its KV event port has no publisher: the
// subscription just keeps retrying. modelName may be empty (clients
// choose the model).
func gwRule(t *testing.T, d *daemontest.Daemon, vip, modelName string) string {
	t.Helper()
	port := daemontest.FreePort(t)
	var eps []string
	for i := range 2 {
		ip := fmt.Sprintf("%s%d", strings.TrimSuffix(vip, "1"), 2+i)
		eps = append(eps, fmt.Sprintf(`{"endpointIP":%q,"targetPort":%d,"weight":1}`, ip, gwBackend(t, ip)))
	}
	model := ""
	if modelName != "" {
		model = fmt.Sprintf(`,"model_name":%q`, modelName)
	}
	createRule(t, d, fmt.Sprintf(`{"serviceArguments":{"externalIP":%q,"port":%d,"protocol":"tcp","mode":4,"sel":0,
		"kvExactMode":3,"kvEngineType":"sglang","kvZmqPort":%d,"kvBlockSize":16%s},"endpoints":[%s]}`,
		vip, port, daemontest.FreePort(t), model, strings.Join(eps, ",")))
	addr := net.JoinHostPort(vip, fmt.Sprint(port))
	waitFor(t, 10*time.Second, "the mode-4 listener", func() bool {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	return "http://" + addr
}

// gwPost sends one request to the VIP and returns status, headers and body.
func gwPost(t *testing.T, c *http.Client, url string, body []byte, hdr ...string) (int, http.Header, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, b
}

// gwErrorBody checks the OpenAI error shape and returns the message.
func gwErrorBody(t *testing.T, b []byte) string {
	t.Helper()
	var e struct {
		Error map[string]json.RawMessage `json:"error"`
	}
	if err := json.Unmarshal(b, &e); err != nil {
		t.Fatalf("error body is not JSON: %v: %.200s", err, b)
	}
	for _, k := range []string{"message", "type", "param", "code"} {
		if _, ok := e.Error[k]; !ok {
			t.Fatalf("error body lacks %q: %.300s", k, b)
		}
	}
	var msg string
	_ = json.Unmarshal(e.Error["message"], &msg)
	return msg
}

// TestGatewayClientModelNames: on a rule without model_name, 20,000
// distinct model names and a few 1 MiB ones. Before, each name became a
// registry entry, a capabilities row, a metric series and a WARN line,
// kept forever.
func TestGatewayClientModelNames(t *testing.T) {
	d := startDaemon(t, nil)
	url := gwRule(t, d, "127.0.13.1", "") + "/v1/completions"
	base := rssKiB(t, d.PID())

	const names = 20000
	deadline := time.Now().Add(3 * time.Minute)
	var next, bad atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := &http.Client{Timeout: 10 * time.Second}
			for time.Now().Before(deadline) {
				i := next.Add(1)
				if i > names {
					return
				}
				req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(fmt.Sprintf(`{"model":"attacker/model-%d","prompt":"hello"}`, i)))
				resp, err := c.Do(req)
				if err != nil {
					bad.Add(1)
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					bad.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	if sent := min(next.Load(), names); sent < names || bad.Load() > 0 {
		t.Fatalf("sent %d of %d names, %d failed", sent, names, bad.Load())
	}

	c := &http.Client{Timeout: 30 * time.Second}
	for i := range 3 {
		long := strings.Repeat(string(rune('a'+i)), 1<<20+i)
		start := time.Now()
		code, _, b := gwPost(t, c, url, []byte(`{"model":"`+long+`","prompt":"hello"}`))
		if code != http.StatusBadRequest {
			t.Fatalf("1 MiB model name: %d %.200s", code, b)
		}
		if msg := gwErrorBody(t, b); !strings.Contains(msg, "model name is") || len(msg) > 1024 {
			t.Fatalf("message %.300q", msg)
		}
		t.Logf("1 MiB model name refused in %v", time.Since(start))
	}

	requireAlive(t, d)
	code, caps := apiDo(t, d, http.MethodGet, "/status/capabilities", "")
	if code != http.StatusOK || len(caps) > 64<<10 {
		t.Fatalf("capabilities: %d, %d bytes", code, len(caps))
	}
	resp, err := http.Get(d.URL("/metrics"))
	if err != nil {
		t.Fatal(err)
	}
	mb, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if len(mb) > 1<<20 || bytes.Contains(mb, []byte("attacker/model")) {
		t.Fatalf("metrics export is %d bytes and names client models: %v", len(mb), bytes.Contains(mb, []byte("attacker/model")))
	}
	if v := metricSum(t, d, "loxilb_gateway_tokenizer_unavailable_total", `model="other"`, `reason="not_staged"`); v != names {
		t.Errorf("unknown models counted %v, want %d", v, names)
	}
	if v := metricSum(t, d, "loxilb_gateway_rejected_requests_total", `reason="model_name_too_long"`); v != 3 {
		t.Errorf("long names counted %v, want 3", v)
	}
	if n := strings.Count(d.Logs(), "no staged tokenizer"); n > 20 {
		t.Errorf("%d log lines about unknown models; want them rate-limited", n)
	}
	rss := rssKiB(t, d.PID())
	t.Logf("RSS %d MiB before, %d MiB after 20,000 names and three 1 MiB names; capabilities %d bytes; metrics %d bytes", base>>10, rss>>10, len(caps), len(mb))
	requireRSSBelow(t, d, 250)
}

// TestGatewayHugePrompt: a 16 MiB prompt of spaces (and the same as chat
// content) cost 13.5 s of CPU and ~1 GB before; it must be refused with
// 400 before tokenizing, quickly, with memory back under the bound.
func TestGatewayHugePrompt(t *testing.T) {
	d := startDaemon(t, nil)
	base := gwRule(t, d, "127.0.14.1", "Qwen/Qwen3-0.6B")
	c := &http.Client{Timeout: 60 * time.Second}
	// Load the tokenizer first, so what follows measures the attack.
	if code, _, b := gwPost(t, c, base+"/v1/completions", []byte(`{"model":"Qwen/Qwen3-0.6B","prompt":"hello"}`)); code != http.StatusOK {
		t.Fatalf("warm-up: %d %s", code, b)
	}
	warm := rssKiB(t, d.PID())
	spaces := strings.Repeat(" ", 16<<20)
	bodies := []struct{ path, body string }{
		{"/v1/completions", `{"model":"Qwen/Qwen3-0.6B","prompt":"` + spaces + `"}`},
		{"/v1/chat/completions", `{"model":"Qwen/Qwen3-0.6B","messages":[{"role":"user","content":"` + spaces + `"}]}`},
	}
	var worst time.Duration
	for round := range 3 {
		for _, b := range bodies {
			start := time.Now()
			code, _, rb := gwPost(t, c, base+b.path, []byte(b.body))
			el := time.Since(start)
			worst = max(worst, el)
			if code != http.StatusBadRequest {
				t.Fatalf("%s with 16 MiB of spaces: %d %.300s", b.path, code, rb)
			}
			if msg := gwErrorBody(t, rb); !strings.Contains(msg, "prompt too long") {
				t.Fatalf("message %q", msg)
			}
			t.Logf("round %d %s: 400 in %v, RSS %d MiB", round, b.path, el, rssKiB(t, d.PID())>>10)
		}
	}
	// Four at once: the tokenization slots and the byte bound keep it flat.
	var wg sync.WaitGroup
	var codes [4]int
	for i := range codes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, base+bodies[0].path, strings.NewReader(bodies[0].body))
			if resp, err := c.Do(req); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				codes[i] = resp.StatusCode
			}
		}()
	}
	wg.Wait()
	for i, code := range codes {
		if code != http.StatusBadRequest {
			t.Fatalf("concurrent attack %d: status %d", i, code)
		}
	}
	requireAlive(t, d)
	if v := metricSum(t, d, "loxilb_gateway_rejected_requests_total", `reason="prompt_too_long"`); v != 10 {
		t.Errorf("huge prompts counted %v, want 10", v)
	}
	if worst > 5*time.Second {
		t.Errorf("slowest refusal took %v", worst)
	}
	// A legitimate request is still served.
	if code, _, b := gwPost(t, c, base+"/v1/completions", []byte(`{"model":"Qwen/Qwen3-0.6B","prompt":"hello again"}`)); code != http.StatusOK {
		t.Fatalf("after the attack: %d %s", code, b)
	}
	t.Logf("RSS %d MiB warm, %d MiB after ten 16 MiB prompts; slowest refusal %v", warm>>10, rssKiB(t, d.PID())>>10, worst)
	requireRSSBelow(t, d, 600)
}

// TestGatewayReceipts: a receipt reveals whether another client's prompt
// is cached, so it is off unless the daemon is started with
// --proxy-receipts; and an endpoint can never forge one.
func TestGatewayReceipts(t *testing.T) {
	body := []byte(`{"model":"Qwen/Qwen3-0.6B","prompt":"` + strings.Repeat("The gateway hashes every full block of the prompt. ", 8) + `"}`)
	c := &http.Client{Timeout: 30 * time.Second}

	off := startDaemon(t, nil)
	url := gwRule(t, off, "127.0.15.1", "Qwen/Qwen3-0.6B") + "/v1/completions"
	for _, ask := range []bool{true, false} {
		var hdr []string
		if ask {
			hdr = []string{"X-Loxilb-Receipt", "1"}
		}
		code, h, b := gwPost(t, c, url, body, hdr...)
		if code != http.StatusOK {
			t.Fatalf("receipts off: %d %s", code, b)
		}
		if got := h.Values("X-Loxilb-Route"); len(got) != 0 {
			t.Fatalf("receipts off, asked=%v: X-Loxilb-Route %q", ask, got)
		}
	}
	requireAlive(t, off)
	off.Stop()

	on := startDaemon(t, nil, "--proxy-receipts", "on-request")
	url = gwRule(t, on, "127.0.16.1", "Qwen/Qwen3-0.6B") + "/v1/completions"
	code, h, b := gwPost(t, c, url, body, "X-Loxilb-Receipt", "1")
	if code != http.StatusOK {
		t.Fatalf("receipts on: %d %s", code, b)
	}
	got := h.Values("X-Loxilb-Route")
	if len(got) != 1 || strings.Contains(got[0], "forged") {
		t.Fatalf("receipts on: X-Loxilb-Route %q, want exactly ours", got)
	}
	if _, err := router.ParseReceipt(got[0]); err != nil {
		t.Fatalf("receipt %q: %v", got[0], err)
	}
	if code, h, _ := gwPost(t, c, url, body); code != http.StatusOK || len(h.Values("X-Loxilb-Route")) != 0 {
		t.Fatalf("receipts on, not asked: %d X-Loxilb-Route %q", code, h.Values("X-Loxilb-Route"))
	}
	requireAlive(t, on)
	requireRSSBelow(t, on, 500)
}

// TestGatewayBadLimitFlags: a bad value for a new limit stops the daemon
// at start, naming the flag.
func TestGatewayBadLimitFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--proxy-receipts", "yes"},
		{"--proxy-max-model-name", "0"},
		{"--tokenize-max-bytes", "10"},
		{"--tokenize-max-tokens", "-1"},
		{"--tokenize-concurrency", "5000"},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		out, err := exec.CommandContext(ctx, bins.Loxilb, append([]string{"--no-dataplane", "--state-dir", t.TempDir(),
			"--api-addr", fmt.Sprintf("127.0.0.1:%d", daemontest.FreePort(t))}, args...)...).CombinedOutput()
		cancel()
		if err == nil || !strings.Contains(string(out), args[0]) {
			t.Errorf("%v: err %v, output %q; want a refusal naming %s", args, err, out, args[0])
		}
	}
}
