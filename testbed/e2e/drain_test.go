package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/daemontest"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// drainFixture is a daemon with one mode-4 rule over an engine that
// streams one token every 100 ms.
func drainFixture(t *testing.T, net int, args ...string) (*daemontest.Daemon, string) {
	t.Helper()
	host := fmt.Sprintf("127.79.%d.11", net)
	startEngine(t, enginesim.Config{Engine: "vllm", Listen: host + ":28000", ZMQPort: -1,
		TimeScale: 1, TimeScaleSet: true, DecodeUsPerToken: 100_000, PrefillUsPerToken: 1})
	a := append([]string{"--tokenizer-dir", tokenizerDir(), "--metrics"}, args...)
	d := daemontest.Start(t, bins, t.TempDir(), nil, a...)
	rule := fmt.Sprintf(`{"serviceArguments":{"externalIP":"127.79.%d.1","port":28080,"protocol":"tcp","mode":4,"sel":0,
		"probetype":"none"},"endpoints":[{"endpointIP":%q,"targetPort":28000,"weight":1}]}`, net, host)
	resp, body := post(t, d.URL("/config/loadbalancer"), json.RawMessage(rule))
	if resp.StatusCode != 200 {
		t.Fatalf("create rule: %d %s", resp.StatusCode, body)
	}
	return d, fmt.Sprintf("127.79.%d.1:28080", net)
}

// openStream starts a streamed completion of n tokens and returns once its
// first event arrived.
func openStream(t *testing.T, vip string, n int) (*http.Response, *bufio.Reader) {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"model": model, "prompt": "tell me a long story", "max_tokens": n, "stream": true, "ignore_eos": true})
	resp, err := http.Post("http://"+vip+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	if resp.StatusCode != 200 {
		body, _ := io.ReadAll(resp.Body)
		t.Fatalf("stream: %d %s", resp.StatusCode, body)
	}
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("first event: %q %v", line, err)
	}
	return resp, br
}

// readRest reads the stream to its end: the events and whether [DONE]
// arrived, and the read error if the stream was cut.
func readRest(br *bufio.Reader) (events int, done bool, err error) {
	for {
		line, rerr := br.ReadString('\n')
		if strings.HasPrefix(line, "data: ") {
			if strings.TrimSpace(line) == "data: [DONE]" {
				done = true
			} else {
				events++
			}
		}
		if rerr == io.EOF {
			return events, done, nil
		}
		if rerr != nil {
			return events, done, rerr
		}
	}
}

func waitRefused(t *testing.T, vip string) {
	t.Helper()
	waitFor(t, "the mode-4 listener to close", 3*time.Second, func() bool {
		c, err := net.DialTimeout("tcp", vip, 200*time.Millisecond)
		if err != nil {
			return true
		}
		c.Close()
		return false
	})
}

// TestDrainCompletesStream: a 3 s stream in flight at SIGTERM finishes
// whole; new connections are refused at once; the daemon then exits 0.
func TestDrainCompletesStream(t *testing.T) {
	d, vip := drainFixture(t, 1)
	_, br := openStream(t, vip, 30)
	sent := time.Now()
	if err := d.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	waitRefused(t, vip)
	// The API (and its metrics) stays up while the proxy drains.
	if v := metricValue(metrics(t, d), "loxilb_proxy_drain_requests_total"); v != 0 {
		t.Errorf("drain outcomes before the stream ended: %v", v)
	}
	events, done, err := readRest(br)
	if err != nil || !done || events < 28 {
		t.Fatalf("stream after SIGTERM: %d more events, [DONE]=%v, err %v; want it complete", events, done, err)
	}
	code, ok := d.Wait(10 * time.Second)
	if !ok || code != 0 {
		t.Fatalf("daemon exit: code %d, exited %v:\n%s", code, ok, d.Logs())
	}
	t.Logf("stream completed %v after SIGTERM (%d more events); daemon exited 0", time.Since(sent).Round(time.Millisecond), events)
	if !strings.Contains(d.Logs(), "proxy: drained") || !strings.Contains(d.Logs(), "completed=1") {
		t.Errorf("no drain summary with completed=1 in the logs:\n%s", d.Logs())
	}
}

// TestDrainTimeoutCutsStream: with --drain-timeout 1s a 10 s stream is cut
// about a second after SIGTERM, and the daemon still exits 0.
func TestDrainTimeoutCutsStream(t *testing.T) {
	d, vip := drainFixture(t, 2, "--drain-timeout", "1s")
	_, br := openStream(t, vip, 100)
	sent := time.Now()
	if err := d.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	_, done, err := readRest(br)
	cutAfter := time.Since(sent)
	if done {
		t.Fatal("the stream completed; want it cut by the drain timeout")
	}
	if cutAfter < 900*time.Millisecond || cutAfter > 5*time.Second {
		t.Errorf("stream cut %v after SIGTERM, want about the 1 s drain timeout", cutAfter)
	}
	code, ok := d.Wait(10 * time.Second)
	if !ok || code != 0 {
		t.Fatalf("daemon exit: code %d, exited %v:\n%s", code, ok, d.Logs())
	}
	t.Logf("stream cut %v after SIGTERM (read error: %v); daemon exited 0", cutAfter.Round(time.Millisecond), err)
	if !strings.Contains(d.Logs(), "cut=1") {
		t.Errorf("no drain summary with cut=1 in the logs:\n%s", d.Logs())
	}
}

// TestDrainSecondSignalExitsNow: a second SIGTERM during the drain ends
// the daemon at once with a non-zero status.
func TestDrainSecondSignalExitsNow(t *testing.T) {
	d, vip := drainFixture(t, 3)
	_, br := openStream(t, vip, 100)
	if err := d.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	waitRefused(t, vip)
	sent := time.Now()
	if err := d.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	code, ok := d.Wait(3 * time.Second)
	if !ok || code == 0 {
		t.Fatalf("after a second SIGTERM: exit code %d, exited %v; want a prompt non-zero exit:\n%s", code, ok, d.Logs())
	}
	_, done, _ := readRest(br)
	if done {
		t.Error("the stream completed although the daemon exited")
	}
	t.Logf("second SIGTERM: exited with %d after %v", code, time.Since(sent).Round(time.Millisecond))
}
