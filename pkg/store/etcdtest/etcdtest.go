// Package etcdtest runs a real etcd server (Debian's etcd-server package,
// /usr/bin/etcd) for tests: on 127.0.0.1, free ports, a temporary data
// directory, killed when the test ends. Outside CI a missing binary skips
// the test; in CI (CI=true) it fails it.
package etcdtest

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"
)

// Server is one running etcd member.
type Server struct {
	Endpoint string // host:port of the client URL
	// TLS is set by StartTLS: the PEM files a client needs.
	TLS  *TLSFiles
	t    testing.TB
	cmd  *exec.Cmd
	bin  string
	args []string
	done chan struct{}
	mu   sync.Mutex
	logs bytes.Buffer
}

type lockedWriter struct{ s *Server }

func (w lockedWriter) Write(p []byte) (int, error) {
	w.s.mu.Lock()
	defer w.s.mu.Unlock()
	return w.s.logs.Write(p)
}

// Binary returns the etcd executable: $LOXILB_ETCD_BIN, else etcd on PATH,
// else /usr/bin/etcd. It skips the test when there is none, and fails it
// in CI, where the package is installed.
func Binary(t testing.TB) string {
	t.Helper()
	if b := os.Getenv("LOXILB_ETCD_BIN"); b != "" {
		return b
	}
	if b, err := exec.LookPath("etcd"); err == nil {
		return b
	}
	if _, err := os.Stat("/usr/bin/etcd"); err == nil {
		return "/usr/bin/etcd"
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("etcd not installed: CI must install it (apt-get install etcd-server)")
	}
	t.Skip("skipping: etcd not installed (apt-get install etcd-server)")
	return ""
}

// Start runs etcd and waits until it serves clients.
func Start(t testing.TB) *Server { t.Helper(); return start(t, "127.0.0.1", nil) }

// StartOn is Start with etcd listening on host (an address of this
// network namespace) instead of 127.0.0.1, so that other namespaces reach it.
func StartOn(t testing.TB, host string) *Server { t.Helper(); return start(t, host, nil) }

// StartTLS runs etcd serving clients over TLS only, with a certificate of
// a fresh CA, and requiring a client certificate of that CA.
func StartTLS(t testing.TB) *Server {
	t.Helper()
	f, err := writeTLSFiles(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return start(t, "127.0.0.1", f)
}

func start(t testing.TB, host string, tf *TLSFiles) *Server {
	t.Helper()
	bin := Binary(t)
	client, peer := freePort(t, host), freePort(t, host)
	s := &Server{Endpoint: net.JoinHostPort(host, fmt.Sprint(client)), TLS: tf, t: t, done: make(chan struct{})}
	scheme := "http://"
	if tf != nil {
		scheme = "https://"
	}
	cu, pu := scheme+s.Endpoint, "http://"+net.JoinHostPort(host, fmt.Sprint(peer))
	args := []string{"--name", "test", "--data-dir", t.TempDir(),
		"--listen-client-urls", cu, "--advertise-client-urls", cu,
		"--listen-peer-urls", pu, "--initial-advertise-peer-urls", pu,
		"--initial-cluster", "test=" + pu, "--initial-cluster-state", "new"}
	if tf != nil {
		args = append(args, "--cert-file", tf.ServerCert, "--key-file", tf.ServerKey,
			"--trusted-ca-file", tf.CA, "--client-cert-auth")
	}
	s.bin, s.args = bin, args
	s.run()
	t.Cleanup(s.Stop)
	return s
}

// Restart starts the stopped etcd again on the same ports and data.
func (s *Server) Restart() {
	s.t.Helper()
	s.Stop()
	s.done = make(chan struct{})
	s.run()
}

func (s *Server) run() {
	t := s.t
	t.Helper()
	s.cmd = exec.Command(s.bin, s.args...)
	s.cmd.Stdout, s.cmd.Stderr = lockedWriter{s}, lockedWriter{s}
	if err := s.cmd.Start(); err != nil {
		t.Fatalf("start etcd: %v", err)
	}
	done := s.done
	go func() { _ = s.cmd.Wait(); close(done) }()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		c, err := net.DialTimeout("tcp", s.Endpoint, 100*time.Millisecond)
		if err == nil {
			c.Close()
			return
		}
		select {
		case <-s.done:
			t.Fatalf("etcd exited:\n%s", s.Logs())
		case <-time.After(50 * time.Millisecond):
		}
	}
	t.Fatalf("etcd did not come up:\n%s", s.Logs())
}

// Logs returns what etcd printed.
func (s *Server) Logs() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.logs.String()
}

// Stop kills etcd and waits for it to exit; calling it again is harmless.
func (s *Server) Stop() {
	select {
	case <-s.done:
		return
	default:
	}
	_ = s.cmd.Process.Kill()
	<-s.done
}

func freePort(t testing.TB, host string) int {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
