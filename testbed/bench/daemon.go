package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Binaries are the product binaries under test.
type Binaries struct {
	Loxilb  string
	Loxicmd string
}

// BuildBinaries compiles cmd/loxilb and loxicmd from the module at root into
// dir.
func BuildBinaries(ctx context.Context, root, dir string) (Binaries, error) {
	b := Binaries{Loxilb: filepath.Join(dir, "loxilb"), Loxicmd: filepath.Join(dir, "loxicmd")}
	for _, t := range [][2]string{{b.Loxilb, "./cmd/loxilb"}, {b.Loxicmd, "./loxicmd"}} {
		cmd := exec.CommandContext(ctx, "go", "build", "-o", t[0], t[1])
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			return b, fmt.Errorf("build %s: %w\n%s", t[1], err, out)
		}
	}
	return b, nil
}

// FindRepoRoot walks up from dir to the directory holding go.mod.
func FindRepoRoot(dir string) (string, error) {
	d, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
			return d, nil
		}
		p := filepath.Dir(d)
		if p == d {
			return "", fmt.Errorf("no go.mod above %s", dir)
		}
		d = p
	}
}

// daemon is one running loxilb process.
type daemon struct {
	port int
	cmd  *exec.Cmd
	mu   sync.Mutex
	logs bytes.Buffer
	done chan struct{}
}

func (d *daemon) Write(p []byte) (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.logs.Len() < 4<<20 {
		d.logs.Write(p)
	}
	return len(p), nil
}

// Logs returns the tail of what the daemon printed.
func (d *daemon) Logs() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	s := d.logs.String()
	if len(s) > 4000 {
		s = s[len(s)-4000:]
	}
	return s
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// startDaemon runs loxilb proxy-only (no BPF, no root) with its API on a
// free loopback port and waits until the API answers.
func startDaemon(ctx context.Context, bin, stateDir, tokenizerDir string, env []string, args ...string) (*daemon, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	d := &daemon{port: port, done: make(chan struct{})}
	d.cmd = exec.Command(bin, append([]string{"--api-addr", fmt.Sprintf("127.0.0.1:%d", port), "--state-dir", stateDir,
		"--no-dataplane", "--tokenizer-dir", tokenizerDir, "--metrics", "--log-level", "warn",
		"--proxy-receipts", "on-request"}, args...)...) // the report reads every request's receipt
	d.cmd.Env = append(os.Environ(), env...)
	d.cmd.Stdout, d.cmd.Stderr = d, d
	if err := d.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	go func() { _ = d.cmd.Wait(); close(d.done) }()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		resp, err := http.Get(d.url("/version"))
		if err == nil {
			resp.Body.Close()
			return d, nil
		}
		select {
		case <-d.done:
			return nil, fmt.Errorf("daemon exited at start:\n%s", d.Logs())
		case <-ctx.Done():
			d.stop()
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	d.stop()
	return nil, fmt.Errorf("daemon API did not come up in 30s:\n%s", d.Logs())
}

func (d *daemon) url(path string) string {
	return fmt.Sprintf("http://127.0.0.1:%d/netlox/v1%s", d.port, path)
}

// stop interrupts the daemon and waits (killing it after 10s).
func (d *daemon) stop() {
	select {
	case <-d.done:
		return
	default:
	}
	_ = d.cmd.Process.Signal(os.Interrupt)
	select {
	case <-d.done:
	case <-time.After(10 * time.Second):
		_ = d.cmd.Process.Kill()
		<-d.done
	}
}

// prefillBudgets reads the prefill admission budget the daemon applies to
// each endpoint ("2 observed", by ep_idx) and how many requests waited in
// its queue, from its metrics.
func (d *daemon) prefillBudgets(endpoints int) ([]string, int, error) {
	resp, err := http.Get(d.url("/metrics"))
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, 0, err
	}
	label := func(line, name string) string {
		_, v, ok := strings.Cut(line, name+`="`)
		if !ok {
			return ""
		}
		v, _, _ = strings.Cut(v, `"`)
		return v
	}
	budgets := make([]string, endpoints)
	queued := 0
	for _, line := range strings.Split(string(b), "\n") {
		value := line[strings.LastIndex(line, " ")+1:]
		switch {
		case strings.HasPrefix(line, "loxilb_kv_prefill_slots{"):
			if ep, err := strconv.Atoi(label(line, "ep_idx")); err == nil && ep >= 0 && ep < endpoints {
				budgets[ep] = value + " " + label(line, "source")
			}
		case strings.HasPrefix(line, "loxilb_kv_prefill_admitted_total{") && label(line, "outcome") == "queued":
			n, _ := strconv.ParseFloat(value, 64)
			queued += int(n)
		}
	}
	return budgets, queued, nil
}

// metric sums the samples of a Prometheus metric in the daemon's export.
func (d *daemon) metric(name string) (float64, error) { return d.metricWith(name, "") }

// metricWith sums the samples of a Prometheus metric whose labels contain
// match (`outcome="yielded"`; "" for all).
func (d *daemon) metricWith(name, match string) (float64, error) {
	resp, err := http.Get(d.url("/metrics"))
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, err
	}
	if resp.StatusCode != 200 {
		return 0, fmt.Errorf("GET /metrics: %d", resp.StatusCode)
	}
	var sum float64
	found := false
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.HasPrefix(line, name) || (len(line) > len(name) && line[len(name)] != ' ' && line[len(name)] != '{') ||
			!strings.Contains(line, match) {
			continue
		}
		var v float64
		if _, err := fmt.Sscanf(line[strings.LastIndex(line, " ")+1:], "%g", &v); err == nil {
			sum += v
			found = true
		}
	}
	if !found {
		return 0, errMetricAbsent
	}
	return sum, nil
}

var errMetricAbsent = errors.New("metric absent")

// EtcdBinary is the etcd server several gateway nodes share (Debian's
// etcd-server): $LOXILB_ETCD_BIN, else /usr/bin/etcd.
func EtcdBinary() string {
	if b := os.Getenv("LOXILB_ETCD_BIN"); b != "" {
		return b
	}
	return "/usr/bin/etcd"
}

// startEtcd runs a one-member etcd on free loopback ports with its data in
// dir and waits until it takes client connections. The returned daemon's
// port is etcd's client port (its url method does not apply).
func startEtcd(ctx context.Context, dir string) (*daemon, error) {
	client, err := freePort()
	if err != nil {
		return nil, err
	}
	peer, err := freePort()
	if err != nil {
		return nil, err
	}
	cu, pu := fmt.Sprintf("http://127.0.0.1:%d", client), fmt.Sprintf("http://127.0.0.1:%d", peer)
	d := &daemon{port: client, done: make(chan struct{})}
	d.cmd = exec.Command(EtcdBinary(), "--name", "bench", "--data-dir", dir,
		"--listen-client-urls", cu, "--advertise-client-urls", cu,
		"--listen-peer-urls", pu, "--initial-advertise-peer-urls", pu,
		"--initial-cluster", "bench="+pu, "--initial-cluster-state", "new")
	d.cmd.Stdout, d.cmd.Stderr = d, d
	if err := d.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start etcd (%s; Debian package etcd-server): %w", EtcdBinary(), err)
	}
	go func() { _ = d.cmd.Wait(); close(d.done) }()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", client), 100*time.Millisecond); err == nil {
			c.Close()
			return d, nil
		}
		select {
		case <-d.done:
			return nil, fmt.Errorf("etcd exited at start:\n%s", d.Logs())
		case <-ctx.Done():
			d.stop()
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	d.stop()
	return nil, fmt.Errorf("etcd did not come up in 20s:\n%s", d.Logs())
}
