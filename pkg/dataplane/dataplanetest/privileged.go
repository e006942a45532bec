package dataplanetest

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
)

// childEnv marks a test process re-executed inside a network namespace.
const childEnv = "LOXILB_TEST_NETNS_CHILD"

// RequirePrivileged skips the test unless the process is root with the
// tools the privileged tests use (ip, nsenter, unshare). Under CI=true it fails
// instead: CI runs as root and these tests must not silently vanish.
func RequirePrivileged(tb testing.TB) {
	tb.Helper()
	var why string
	if os.Geteuid() != 0 {
		why = "needs root (BPF, network namespaces)"
	} else {
		for _, tool := range []string{"ip", "nsenter", "unshare"} {
			if _, err := exec.LookPath(tool); err != nil {
				why = "needs " + tool + " on PATH"
				break
			}
		}
	}
	if why == "" {
		return
	}
	if os.Getenv("CI") == "true" {
		tb.Fatalf("privileged test cannot run in CI: %s", why)
	}
	tb.Skipf("skipping privileged test: %s (runs in CI as root)", why)
}

// UniqueName returns prefix plus random hex, short enough for interface
// and namespace names (15 bytes).
func UniqueName(prefix string) string {
	var b [3]byte
	rand.Read(b[:])
	n := prefix + hex.EncodeToString(b[:])
	if len(n) > 15 {
		n = n[:15]
	}
	return n
}

// Run executes a command and returns an error with its output on failure.
func Run(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// NewNetNS creates a named network namespace with loopback up and deletes
// it when the test ends.
func NewNetNS(tb testing.TB, prefix string) string {
	tb.Helper()
	ns := UniqueName(prefix)
	if err := Run("ip", "netns", "add", ns); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := Run("ip", "netns", "del", ns); err != nil {
			tb.Logf("cleanup: %v", err)
		}
	})
	if err := Run("ip", "-n", ns, "link", "set", "lo", "up"); err != nil {
		tb.Fatal(err)
	}
	return ns
}

// InNetNS reports whether this process is the re-executed child of
// RunInNetNS.
func InNetNS() bool { return os.Getenv(childEnv) != "" }

// RunInNetNS runs the current test again in a child process whose whole
// network namespace is ns (network namespaces are per thread, and Go moves
// goroutines between threads, so a process-wide switch is the safe way).
// It returns true in the child, which then runs the test body; the parent
// waits, relays the child's output and reports its failure.
//
//	if !dataplanetest.RunInNetNS(t, ns) { return }
//	// ... body runs inside ns ...
func RunInNetNS(t *testing.T, ns string, env ...string) bool {
	t.Helper()
	if InNetNS() {
		return true
	}
	runChild(t, ns, []string{"-test.run", anchored(t.Name())}, env)
	return false
}

// RunBenchInNetNS is RunInNetNS for benchmarks: the child runs only b's
// benchmark (top-level benchmarks only).
func RunBenchInNetNS(b *testing.B, ns string, env ...string) bool {
	b.Helper()
	if InNetNS() {
		return true
	}
	runChild(b, ns, []string{"-test.run", "^$", "-test.bench", anchored(b.Name()), "-test.benchtime", "1x"}, env)
	return false
}

func anchored(name string) string {
	parts := strings.Split(name, "/")
	for i, p := range parts {
		parts[i] = "^" + regexp.QuoteMeta(p) + "$"
	}
	return strings.Join(parts, "/")
}

func runChild(tb testing.TB, ns string, testArgs []string, env []string) {
	tb.Helper()
	// A private mount namespace too, so a test may mount bpffs without
	// touching the host's mount table.
	args := []string{"--mount", "--propagation", "private", "nsenter", "--net=/run/netns/" + ns, os.Args[0]}
	args = append(append(args, testArgs...), "-test.v", "-test.count=1")
	cmd := exec.Command("unshare", args...)
	cmd.Env = append(append(os.Environ(), childEnv+"="+ns), env...)
	var buf strings.Builder
	_, isBench := tb.(*testing.B)
	if testing.Verbose() || isBench {
		// Stream as well: a hanging child is otherwise silent until killed,
		// and benchmark logs are truncated.
		cmd.Stdout = io.MultiWriter(&buf, os.Stderr)
	} else {
		cmd.Stdout = &buf
	}
	cmd.Stderr = cmd.Stdout
	err := cmd.Run()
	out := buf.String()
	if !testing.Verbose() && !isBench {
		for _, line := range strings.Split(strings.TrimRight(out, "\n"), "\n") {
			tb.Log(line)
		}
	}
	if err != nil {
		tb.Fatalf("test in network namespace %s failed: %v", ns, err)
	}
	if !strings.Contains(out, "\nPASS") && !strings.HasPrefix(out, "PASS") {
		tb.Fatalf("test in network namespace %s did not report PASS", ns)
	}
}

// Isolated is the usual opening of a privileged test: it checks privileges,
// and in the parent process creates a throwaway namespace and re-runs the
// test there. It returns true only in the child, where the body should run.
//
//	if !dataplanetest.Isolated(t, "lbt") { return }
func Isolated(t *testing.T, prefix string) bool {
	t.Helper()
	RequirePrivileged(t)
	if InNetNS() {
		return true
	}
	RunInNetNS(t, NewNetNS(t, prefix))
	return false
}
