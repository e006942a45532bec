package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"
)

// daemon is the loxilb process under test.
type daemon struct {
	port int
	cmd  *exec.Cmd
	done chan struct{}
	api  *http.Client

	mu    sync.Mutex
	tail  []byte // the last logTail bytes the daemon printed
	pre   []byte // the lines it printed just before a panic or fatal error
	crash []byte // the start of the panic or fatal error
}

// logTail is how much of the daemon's output is kept.
const logTail = 64 << 10

// preKeep and crashKeep are how much output is kept from before and from
// a panic or fatal error on: the log lines that led to it, its message
// and the failing goroutine's stack, which the rest of a goroutine dump
// would push out of the tail.
const (
	preKeep   = 2 << 10
	crashKeep = 3 << 10
)

func (d *daemon) Write(p []byte) (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.crash == nil {
		if i := crashStart(p); i >= 0 {
			d.pre = lastLines(append(append([]byte{}, d.tail...), p[:i]...), preKeep)
			d.crash = append([]byte{}, p[i:min(len(p), i+crashKeep)]...)
		}
	} else if len(d.crash) < crashKeep {
		d.crash = append(d.crash, p[:min(len(p), crashKeep-len(d.crash))]...)
	}
	d.tail = append(d.tail, p...)
	if len(d.tail) > logTail {
		d.tail = append(d.tail[:0], d.tail[len(d.tail)-logTail:]...)
	}
	return len(p), nil
}

// crashStart returns where a Go panic or fatal error starts in p, or -1.
func crashStart(p []byte) int {
	for _, m := range []string{"panic: ", "fatal error: "} {
		for off := 0; ; {
			i := bytes.Index(p[off:], []byte(m))
			if i < 0 {
				break
			}
			if i += off; i == 0 || p[i-1] == '\n' {
				return i
			}
			off = i + 1
		}
	}
	return -1
}

// lastLines returns the last n bytes of b, starting at a line.
func lastLines(b []byte, n int) []byte {
	if len(b) > n {
		b = b[len(b)-n:]
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			b = b[i+1:]
		}
	}
	return b
}

// Logs returns the last n bytes of the daemon's output, cut at a line.
func (d *daemon) Logs(n int) string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return string(lastLines(d.tail, n))
}

// crashLog returns what explains the daemon's end: the lines before its
// panic or fatal error and the start of it when it printed one, else the
// last n bytes of its output.
func (d *daemon) crashLog(n int) string {
	d.mu.Lock()
	pre, crash := string(d.pre), string(d.crash)
	d.mu.Unlock()
	if crash == "" {
		return d.Logs(n)
	}
	return pre + crash + "\n..."
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// startDaemon runs loxilb proxy-only with its API and metrics on a free
// loopback port; args come after the soak's own flags, so a repeated flag
// in them wins.
func startDaemon(ctx context.Context, bin, stateDir, tokenizerDir string, env, args []string) (*daemon, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	d := &daemon{port: port, done: make(chan struct{}), api: &http.Client{Timeout: 5 * time.Second}}
	// Outlier ejection is off: it would take the bad backend out of
	// rotation after a few failures, and the soak exists to keep its
	// attacks flowing through the proxy for the whole run.
	a := append([]string{"--api-addr", fmt.Sprintf("127.0.0.1:%d", port), "--state-dir", stateDir,
		"--no-dataplane", "--tokenizer-dir", tokenizerDir, "--metrics", "--log-level", "warn",
		"--outlier-max-ejected-percent", "0"}, args...)
	d.cmd = exec.Command(bin, a...)
	d.cmd.Env = append(os.Environ(), env...)
	d.cmd.Stdout, d.cmd.Stderr = d, d
	if err := d.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	go func() { _ = d.cmd.Wait(); close(d.done) }()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		resp, err := d.api.Get(d.url("/version"))
		if err == nil {
			resp.Body.Close()
			return d, nil
		}
		select {
		case <-d.done:
			return nil, fmt.Errorf("daemon exited at start (%s):\n%s", d.cmd.ProcessState, d.Logs(4000))
		case <-ctx.Done():
			d.stop()
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	d.stop()
	return nil, fmt.Errorf("daemon API did not come up in 30s:\n%s", d.Logs(4000))
}

func (d *daemon) url(path string) string {
	return fmt.Sprintf("http://127.0.0.1:%d/netlox/v1%s", d.port, path)
}

func (d *daemon) exited() bool {
	select {
	case <-d.done:
		return true
	default:
		return false
	}
}

// exitState describes how the process ended ("" while it runs).
func (d *daemon) exitState() string {
	if !d.exited() {
		return ""
	}
	return d.cmd.ProcessState.String()
}

// stop interrupts the daemon and waits (killing it after 10s).
func (d *daemon) stop() {
	if d.exited() {
		return
	}
	_ = d.cmd.Process.Signal(os.Interrupt)
	select {
	case <-d.done:
	case <-time.After(10 * time.Second):
		_ = d.cmd.Process.Kill()
		<-d.done
	}
}

// kill ends the daemon at once (the memory guard).
func (d *daemon) kill() {
	if !d.exited() {
		_ = d.cmd.Process.Kill()
		<-d.done
	}
}

// rssKiB reads the daemon's resident set size.
func (d *daemon) rssKiB() (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", d.cmd.Process.Pid))
	if err != nil {
		return 0, err
	}
	return parseVmRSS(b)
}

// goroutines reads go_goroutines from the daemon's metrics export.
func (d *daemon) goroutines() (int, error) {
	resp, err := d.api.Get(d.url("/metrics"))
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("GET /metrics: %d", resp.StatusCode)
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return 0, err
	}
	v, ok := metricValue(b, "go_goroutines")
	if !ok {
		return 0, errors.New("no go_goroutines in the metrics export")
	}
	return int(v), nil
}

// metric sums every sample of a metric in the daemon's export.
func (d *daemon) metric(name string) (float64, bool) {
	resp, err := d.api.Get(d.url("/metrics"))
	if err != nil {
		return 0, false
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return 0, false
	}
	return metricValue(b, name)
}

// parseVmRSS returns the VmRSS line of a /proc/PID/status file in KiB.
func parseVmRSS(status []byte) (int64, error) {
	sc := bufio.NewScanner(bytes.NewReader(status))
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), "VmRSS:")
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) != 2 || f[1] != "kB" {
			return 0, fmt.Errorf("VmRSS line %q", sc.Text())
		}
		return strconv.ParseInt(f[0], 10, 64)
	}
	return 0, errors.New("no VmRSS line (process gone?)")
}

// metricValue sums the samples of the metric name in a Prometheus text
// export; ok is false when there is none.
func metricValue(export []byte, name string) (sum float64, ok bool) {
	for _, line := range strings.Split(string(export), "\n") {
		rest, found := strings.CutPrefix(line, name)
		if !found || rest == "" || (rest[0] != ' ' && rest[0] != '{') {
			continue
		}
		if i := strings.LastIndexByte(rest, '}'); i >= 0 {
			rest = rest[i+1:]
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			continue
		}
		sum += v
		ok = true
	}
	return sum, ok
}
