package hostile

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/daemontest"
)

var bins *daemontest.Binaries

func TestMain(m *testing.M) { os.Exit(daemontest.Main(m, &bins)) }

// tokenizerDir is the repository's staged tokenizers.
func tokenizerDir() string { return filepath.Join(daemontest.RepoRoot(), "testdata", "tokenizers") }

// startDaemon runs the daemon with metrics on, the repository's tokenizers
// (unless args name another dir) and a fresh state directory.
func startDaemon(t *testing.T, env []string, args ...string) *daemontest.Daemon {
	t.Helper()
	a := append([]string{"--metrics"}, args...)
	if !hasArg(args, "--tokenizer-dir") {
		a = append(a, "--tokenizer-dir", tokenizerDir())
	}
	if !hasArg(args, "--gc-heap-floor") {
		// The attacks' memory bounds measure what the daemon holds. The
		// heap floor lets up to 64 MiB of garbage wait for the next
		// collection by design (see README), which would hide a leak of
		// that size, so these daemons collect at Go's own pace.
		a = append(a, "--gc-heap-floor", "0")
	}
	return daemontest.Start(t, bins, t.TempDir(), env, a...)
}

func hasArg(args []string, f string) bool {
	for _, a := range args {
		if a == f || strings.HasPrefix(a, f+"=") {
			return true
		}
	}
	return false
}

// rssKiB reads the resident set size of a process from /proc.
func rssKiB(t *testing.T, pid int) int64 {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatalf("read daemon status: %v", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			if err != nil {
				t.Fatalf("parse VmRSS %q: %v", rest, err)
			}
			return n
		}
	}
	t.Fatal("no VmRSS in /proc status")
	return 0
}

// requireAlive fails the test if the daemon has exited, showing its logs.
func requireAlive(t *testing.T, d *daemontest.Daemon) {
	t.Helper()
	if d.Exited() {
		t.Fatalf("daemon died:\n%s", d.Logs())
	}
	resp, err := http.Get(d.URL("/version"))
	if err != nil {
		t.Fatalf("daemon API does not answer: %v\n%s", err, d.Logs())
	}
	resp.Body.Close()
}

// requireRSSBelow fails the test if the daemon's resident memory is above
// maxMiB.
func requireRSSBelow(t *testing.T, d *daemontest.Daemon, maxMiB int64) {
	t.Helper()
	if kib := rssKiB(t, d.PID()); kib > maxMiB<<10 {
		t.Fatalf("daemon RSS %d MiB, bound %d MiB", kib>>10, maxMiB)
	}
}

// apiDo sends a JSON body to the management API and returns status and body.
func apiDo(t *testing.T, d *daemontest.Daemon, method, path, body string) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, d.URL(path), strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// createRule posts a loxilb rule and fails unless it is accepted.
func createRule(t *testing.T, d *daemontest.Daemon, rule string) {
	t.Helper()
	if code, b := apiDo(t, d, http.MethodPost, "/config/loadbalancer", rule); code != http.StatusOK {
		t.Fatalf("create rule: %d %s", code, b)
	}
}

// metricSum scrapes the daemon's Prometheus export and returns the sum of
// every sample of the metric name whose labels contain all of the given
// name="value" pairs.
func metricSum(t *testing.T, d *daemontest.Daemon, name string, labels ...string) float64 {
	t.Helper()
	resp, err := http.Get(d.URL("/metrics"))
	if err != nil {
		t.Fatalf("scrape metrics: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var sum float64
	for _, line := range bytes.Split(b, []byte("\n")) {
		l := string(line)
		if !strings.HasPrefix(l, name) {
			continue
		}
		rest := l[len(name):]
		if rest == "" || (rest[0] != '{' && rest[0] != ' ') {
			continue
		}
		ok := true
		for _, lv := range labels {
			if !strings.Contains(rest, lv) {
				ok = false
				break
			}
		}
		if !ok {
			continue
		}
		f := strings.Fields(rest[strings.LastIndexByte(rest, '}')+1:])
		if len(f) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err == nil {
			sum += v
		}
	}
	return sum
}

// waitFor polls cond every 50 ms until it holds or the timeout passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if cond() {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("timed out after %v waiting for %s", timeout, what)
}
