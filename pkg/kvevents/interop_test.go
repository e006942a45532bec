package kvevents

import (
	"bufio"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"
)

const python = "/usr/bin/python3"

// requirePythonZMQ skips outside CI when Debian's python3-zmq/python3-msgpack
// are missing; in CI (CI=true) their absence is a failure.
func requirePythonZMQ(t *testing.T) {
	t.Helper()
	out, err := exec.Command(python, "-c", "import zmq, msgpack").CombinedOutput()
	if err == nil {
		return
	}
	msg := fmt.Sprintf("interop needs %s with python3-zmq and python3-msgpack (apt-get install python3-zmq python3-msgpack): %v: %s", python, err, out)
	if os.Getenv("CI") == "true" {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

// freeConsecutivePorts finds n consecutive loopback ports that are free now.
func freeConsecutivePorts(t *testing.T, n int) int {
	t.Helper()
	for attempt := 0; attempt < 100; attempt++ {
		base := 20000 + rand.IntN(30000)
		var ls []net.Listener
		for i := 0; i < n; i++ {
			l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(base+i)))
			if err != nil {
				break
			}
			ls = append(ls, l)
		}
		for _, l := range ls {
			l.Close()
		}
		if len(ls) == n {
			return base
		}
	}
	t.Fatal("no free consecutive ports")
	return 0
}

type pyPub struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string
}

func startPyPub(t *testing.T, args ...string) *pyPub {
	t.Helper()
	vec, err := filepath.Abs(vectorsDir)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(python, append([]string{"testdata/pypub.py", "--vectors", vec}, args...)...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &pyPub{cmd: cmd, stdin: stdin, lines: make(chan string, 4)}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
		close(p.lines)
	}()
	t.Cleanup(func() {
		stdin.Close()
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	return p
}

func (p *pyPub) expect(t *testing.T, want string) {
	t.Helper()
	select {
	case l, ok := <-p.lines:
		if !ok || l != want {
			t.Fatalf("publisher said %q (open=%v), want %q", l, ok, want)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("publisher never said %q", want)
	}
}

// TestInteropPythonVLLM: libzmq PUB and ROUTER, python-msgpack payloads,
// including a batch only the replay buffer holds.
func TestInteropPythonVLLM(t *testing.T) {
	requirePythonZMQ(t)
	base := freeConsecutivePorts(t, 1)
	replay := freeConsecutivePorts(t, 1)
	spec := vllmSpec(base)
	spec.ReplayEndpoint = fmt.Sprintf("tcp://127.0.0.1:%d", replay)
	pub := startPyPub(t, "--engine", "vllm", "--base-port", strconv.Itoa(base), "--replay-port", strconv.Itoa(replay))
	pub.expect(t, "ready")
	h := startManager(t, fastConfig(), spec)
	waitFor(t, "seq 0 from python", func() bool { return h.status(7, 2).Ranks[0].HasSeq })
	io.WriteString(pub.stdin, "go\n")
	pub.expect(t, "sent")
	want := sorted(16300212363532267629, 8671309795006503672, 42)
	waitFor(t, "python inventory", func() bool { return slices.Equal(h.sink.keys(7, 2, 0), want) })
	st := h.status(7, 2)
	if st.Gaps != 1 || st.Degraded || st.DecodeErrors != 0 || st.ReplayFailures != 0 || st.Replays < 2 || st.Parity.Verdict != VerdictOK || st.Ranks[0].LastSeq != 4 {
		t.Fatalf("status = %+v", st)
	}
}

// TestInteropPythonSGLang: two libzmq rank publishers on consecutive ports.
func TestInteropPythonSGLang(t *testing.T) {
	requirePythonZMQ(t)
	base := freeConsecutivePorts(t, 2)
	spec := Spec{Service: 5, EPIdx: 3, Engine: EngineSGLang, Host: "127.0.0.1", ZmqPort: base, Ranks: 2, BlockSize: 16}
	pub := startPyPub(t, "--engine", "sglang", "--base-port", strconv.Itoa(base), "--ranks", "2")
	pub.expect(t, "ready")
	h := startManager(t, fastConfig(), spec)
	waitFor(t, "seq 0 from both ranks", func() bool {
		st := h.status(5, 3)
		return st.Ranks[0].HasSeq && st.Ranks[1].HasSeq
	})
	io.WriteString(pub.stdin, "go\n")
	pub.expect(t, "sent")
	neg := int64(-2360060374177730597)
	waitFor(t, "python inventory", func() bool {
		return slices.Equal(h.sink.keys(5, 3, 0), []uint64{uint64(neg)}) &&
			slices.Equal(h.sink.keys(5, 3, 1), []uint64{8635429971592222890})
	})
	st := h.status(5, 3)
	if st.DecodeErrors != 0 || st.Gaps != 0 || st.Parity.Verdict != VerdictOK {
		t.Fatalf("status = %+v", st)
	}
}
