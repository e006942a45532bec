// Package daemontest builds and runs the real loxilb daemon (and loxicmd)
// as processes for end-to-end tests: no in-process shortcut, the same
// binaries a user runs.
package daemontest

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// Binaries holds the paths of freshly built binaries.
type Binaries struct {
	Dir     string
	Loxilb  string
	Loxicmd string
}

// Build compiles cmd/loxilb and loxicmd into a temporary directory. Call it
// from TestMain and remove Dir afterwards.
func Build() (*Binaries, error) {
	root, err := repoRoot()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "loxilb-bin")
	if err != nil {
		return nil, err
	}
	b := &Binaries{Dir: dir, Loxilb: filepath.Join(dir, "loxilb"), Loxicmd: filepath.Join(dir, "loxicmd")}
	for _, t := range [][2]string{{b.Loxilb, "./cmd/loxilb"}, {b.Loxicmd, "./loxicmd"}} {
		cmd := exec.Command("go", "build", "-o", t[0], t[1])
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("build %s: %v\n%s", t[1], err, out)
		}
	}
	return b, nil
}

// RepoRoot returns the repository root (the directory holding go.mod).
func RepoRoot() string {
	r, err := repoRoot()
	if err != nil {
		panic(err)
	}
	return r
}

func repoRoot() (string, error) {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", fmt.Errorf("cannot locate the repository")
	}
	return filepath.Abs(filepath.Join(filepath.Dir(file), "..", ".."))
}

// FreePort returns a TCP port free on 127.0.0.1 at the time of the call.
func FreePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// Daemon is a running loxilb process.
type Daemon struct {
	Port int
	cmd  *exec.Cmd
	mu   sync.Mutex
	logs bytes.Buffer
	done chan struct{}
}

type lockedWriter struct{ d *Daemon }

func (w lockedWriter) Write(p []byte) (int, error) {
	w.d.mu.Lock()
	defer w.d.mu.Unlock()
	return w.d.logs.Write(p)
}

// Logs returns what the daemon printed so far.
func (d *Daemon) Logs() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.logs.String()
}

// Start runs the daemon with a fresh API port on 127.0.0.1, the given state
// directory, extra environment (KEY=VALUE) and flags, and waits until the
// API answers. It is stopped when the test ends.
func Start(t testing.TB, b *Binaries, stateDir string, env []string, args ...string) *Daemon {
	t.Helper()
	port := FreePort(t)
	a := append([]string{"--api-addr", fmt.Sprintf("127.0.0.1:%d", port), "--state-dir", stateDir, "--no-dataplane"}, args...)
	if !hasFlag(args, "--tokenizer-dir") {
		a = append(a, "--tokenizer-dir", filepath.Join(stateDir, "tokenizers"))
	}
	d := &Daemon{Port: port, done: make(chan struct{})}
	d.cmd = exec.Command(b.Loxilb, a...)
	d.cmd.Env = append(os.Environ(), env...)
	d.cmd.Stdout, d.cmd.Stderr = lockedWriter{d}, lockedWriter{d}
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = d.cmd.Wait(); close(d.done) }()
	t.Cleanup(d.Stop)
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		resp, err := http.Get(d.URL("/version"))
		if err == nil {
			resp.Body.Close()
			return d
		}
		select {
		case <-d.done:
			t.Fatalf("daemon exited:\n%s", d.Logs())
		case <-time.After(50 * time.Millisecond):
		}
	}
	t.Fatalf("daemon did not come up:\n%s", d.Logs())
	return nil
}

func hasFlag(args []string, f string) bool {
	for _, a := range args {
		if a == f || strings.HasPrefix(a, f+"=") {
			return true
		}
	}
	return false
}

// URL returns the API URL of path (under /netlox/v1).
func (d *Daemon) URL(path string) string {
	return fmt.Sprintf("http://127.0.0.1:%d/netlox/v1%s", d.Port, path)
}

// PID returns the daemon's process id.
func (d *Daemon) PID() int { return d.cmd.Process.Pid }

// Exited reports whether the daemon process has ended.
func (d *Daemon) Exited() bool {
	select {
	case <-d.done:
		return true
	default:
		return false
	}
}

// Signal sends sig to the daemon process.
func (d *Daemon) Signal(sig os.Signal) error { return d.cmd.Process.Signal(sig) }

// Wait waits up to timeout for the daemon to exit and returns its exit
// status (-1 when a signal killed it); ok is false if it is still running.
func (d *Daemon) Wait(timeout time.Duration) (code int, ok bool) {
	select {
	case <-d.done:
		return d.cmd.ProcessState.ExitCode(), true
	case <-time.After(timeout):
		return 0, false
	}
}

// Stop interrupts the daemon and waits for it (killing it after 10s).
func (d *Daemon) Stop() { StopProcess(d.cmd.Process, d.done) }

// StopProcess interrupts p, unless done (closed when p has been waited
// for) says it has ended, and waits for it, killing it after 10s: how a
// test stops a daemon it started by other means than Start.
func StopProcess(p *os.Process, done <-chan struct{}) {
	select {
	case <-done:
		return
	default:
	}
	_ = p.Signal(os.Interrupt)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = p.Kill()
		<-done
	}
}

// CLI runs loxicmd against the daemon's port and returns stdout, stderr
// and the exit code.
func CLI(t testing.TB, b *Binaries, port int, args ...string) (string, string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, b.Loxicmd, append([]string{"-p", fmt.Sprint(port)}, args...)...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return out.String(), errb.String(), code
}

// Main builds the binaries, runs the tests and removes the binaries: the
// whole TestMain of a package of end-to-end tests.
//
//	func TestMain(m *testing.M) { os.Exit(daemontest.Main(m, &bins)) }
func Main(m *testing.M, bins **Binaries) int {
	b, err := Build()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	*bins = b
	defer os.RemoveAll(b.Dir)
	return m.Run()
}
