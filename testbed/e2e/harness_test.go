package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/daemontest"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

var bins *daemontest.Binaries

func TestMain(m *testing.M) { os.Exit(daemontest.Main(m, &bins)) }

const (
	model = "Qwen/Qwen3-0.6B"
	seed  = "4242"
)

func tokenizerDir() string { return filepath.Join(daemontest.RepoRoot(), "testdata", "tokenizers") }

// startEngine runs one emulator on its own loopback address so every
// endpoint of a rule shares the rule's kvZmqPort, as real hosts do.
func startEngine(t *testing.T, cfg enginesim.Config) *enginesim.Engine {
	t.Helper()
	tok, err := enginesim.LoadTokenizer(filepath.Join(tokenizerDir(), "Qwen__Qwen3-0.6B"))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Model == "" {
		cfg.Model = model
	}
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

func post(t *testing.T, url string, body any, hdr ...string) (*http.Response, []byte) {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	return resp, data
}

func getJSON(t *testing.T, url string, out any) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("GET %s: %d %s", url, resp.StatusCode, b)
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		t.Fatal(err)
	}
}

func waitFor(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if cond() {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("timed out waiting for %s", what)
}

func metricValue(text, name string, labels ...string) float64 {
	var sum float64
	for _, line := range strings.Split(text, "\n") {
		if !strings.HasPrefix(line, name) || strings.HasPrefix(line, "#") {
			continue
		}
		ok := true
		for _, l := range labels {
			if !strings.Contains(line, l) {
				ok = false
			}
		}
		if !ok {
			continue
		}
		var v float64
		if _, err := fmt.Sscanf(line[strings.LastIndex(line, " ")+1:], "%g", &v); err == nil {
			sum += v
		}
	}
	return sum
}

func metrics(t *testing.T, d *daemontest.Daemon) string {
	t.Helper()
	resp, err := http.Get(d.URL("/metrics"))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// checkMetricLabels asserts the export's label contract: an endpoint is
// always `ep_idx` and a rule is always `service`, whose value names a rule of
// loxilb_service_info, so every per-service series joins with every other.
func checkMetricLabels(t *testing.T, text string) {
	t.Helper()
	label := regexp.MustCompile(`([a-z_]+)="([^"]*)"`)
	known := map[string]bool{}
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(line, "loxilb_service_info{") {
			for _, m := range label.FindAllStringSubmatch(line, -1) {
				if m[1] == "service" {
					known[m[2]] = true
				}
			}
		}
	}
	if len(known) == 0 {
		t.Fatal("no loxilb_service_info series in the export")
	}
	for _, line := range strings.Split(text, "\n") {
		if !strings.HasPrefix(line, "loxilb_") {
			continue
		}
		for _, m := range label.FindAllStringSubmatch(line, -1) {
			switch {
			case m[1] == "ep" || m[1] == "endpoint":
				t.Errorf("series labels an endpoint %q, want ep_idx: %s", m[1], line)
			case m[1] == "service" && !known[m[2]]:
				t.Errorf("series labels service %q, which no loxilb_service_info names: %s", m[2], line)
			}
		}
	}
}
