package rawio

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/wait"
)

// tcpPair returns both ends of a loopback TCP connection.
func tcpPair(t *testing.T) (client, server *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	done := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		done <- c
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s := <-done
	if s == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { c.Close(); s.Close() })
	return c.(*net.TCPConn), s.(*net.TCPConn)
}

// TestRawIOBehavesAsNetConn: the raw path reads and writes what
// net.Conn would, waits on the poller when the socket is empty or full,
// and reports end of stream, deadlines, resets and closes with the errors
// net.Conn gives.
func TestRawIOBehavesAsNetConn(t *testing.T) {
	c, s := tcpPair(t)
	rc, rs := New(c), New(s)
	if rc == nil || rs == nil {
		t.Fatal("no raw path for a TCP connection")
	}
	if New(&net.UnixConn{}) != nil {
		t.Error("raw path for a connection that is not TCP")
	}
	// More than the socket buffers hold: the writer waits for room.
	big := bytes.Repeat([]byte("0123456789abcdef"), 1<<18) // 4 MiB
	errc := make(chan error, 1)
	go func() {
		n, err := rc.Write(big)
		if err == nil && n != len(big) {
			err = io.ErrShortWrite
		}
		errc <- err
	}()
	got := make([]byte, 0, len(big))
	buf := make([]byte, 64<<10)
	for len(got) < len(big) {
		n, err := rs.Read(buf) // waits while the socket is empty
		if err != nil {
			t.Fatalf("read after %d bytes: %v", len(got), err)
		}
		got = append(got, buf[:n]...)
	}
	if err := <-errc; err != nil {
		t.Fatalf("write: %v", err)
	}
	if !bytes.Equal(got, big) {
		t.Fatal("bytes differ")
	}

	_ = s.SetReadDeadline(time.Now().Add(-time.Second))
	_, err := rs.Read(buf)
	var ne net.Error
	// The error itself answers Timeout(), as net.Conn's does: the proxy
	// classifies it with a type assertion, without errors.As.
	to, direct := err.(interface{ Timeout() bool })
	if !errors.As(err, &ne) || !ne.Timeout() || !errors.Is(err, os.ErrDeadlineExceeded) || !direct || !to.Timeout() {
		t.Errorf("read past the deadline: %v, want a net timeout", err)
	}
	_ = s.SetReadDeadline(time.Time{})

	_ = c.CloseWrite()
	if n, err := rs.Read(buf); n != 0 || err != io.EOF {
		t.Errorf("read after the peer's half-close: %d, %v; want io.EOF", n, err)
	}

	_ = c.SetLinger(0)
	_ = c.Close() // a reset
	var werr error
	wait.Eventually(t, "a write failing on the reset connection", func() bool {
		_, werr = rs.Write([]byte("x"))
		return werr != nil
	})
	if !errors.Is(werr, syscall.ECONNRESET) && !errors.Is(werr, syscall.EPIPE) {
		t.Errorf("write to a reset connection: %v", werr)
	}

	_ = s.Close()
	if _, err := rs.Read(buf); !errors.Is(err, net.ErrClosed) {
		t.Errorf("read of a closed connection: %v, want net.ErrClosed", err)
	}
}

// TestRawIOReadAndWriteAtOnce: a read waiting on the socket (the client
// watch) and writes on the same connection (an event stream) run at once
// without touching each other's state.
func TestRawIOReadAndWriteAtOnce(t *testing.T) {
	c, s := tcpPair(t)
	rs := New(s)
	readErr := make(chan error, 1)
	go func() {
		var b [1]byte
		n, err := rs.Read(b[:]) // waits: the client sends nothing yet
		if err == nil && (n != 1 || b[0] != 'q') {
			err = io.ErrUnexpectedEOF
		}
		readErr <- err
	}()
	msg := bytes.Repeat([]byte("data: x\n\n"), 1000)
	go func() {
		for range 50 {
			if _, err := rs.Write(msg); err != nil {
				return
			}
		}
	}()
	got := make([]byte, 50*len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatalf("client read: %v", err)
	}
	if !bytes.Equal(got, bytes.Repeat(msg, 50)) {
		t.Error("written bytes differ")
	}
	_, _ = c.Write([]byte("q"))
	if err := <-readErr; err != nil {
		t.Errorf("concurrent read: %v", err)
	}
}
