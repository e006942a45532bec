package rawio

import (
	"io"
	"net"
	"os"
	"sync"
	"syscall"
)

// Conn reads and writes a TCP connection's socket with raw system calls
// through its syscall.RawConn: the same poller, locks and deadlines as
// net.Conn's Read and Write, without telling the Go scheduler that a
// system call is under way.
//
// net.Conn's Read and Write enter and leave the scheduler around every
// read(2) and write(2), so that a thread blocked in the kernel gives its
// P to another. The proxy's sockets are non-blocking and a loopback or
// LAN read or write returns in microseconds, but on a busy machine the
// thread is often preempted inside one; the runtime's monitor then takes
// the P away (waking another thread for it) and, having found work,
// keeps polling every 20 µs. A proxy spends most of its time in exactly
// these calls, and profiles at 256 connections put that monitor and the
// thread hand-offs at about a tenth of the process's CPU. A call that
// cannot block needs none of it.
type Conn struct {
	rc     syscall.RawConn
	local  net.Addr
	remote net.Addr
	// A read and a write may run at once (the client watch reads while
	// an event stream is written): each direction has its own state,
	// and its own lock, as net.Conn allows concurrent calls.
	r, w rawOp
}

// rawOp is the state of one direction's call, with its step bound once
// (a closure per call would allocate).
type rawOp struct {
	mu    sync.Mutex
	p     []byte
	n     int
	errno syscall.Errno
	fn    func(uintptr) bool
}

// New returns the raw reader and writer of c, or nil if c is not a
// TCP connection (TLS sits above it and uses it as its net.Conn).
func New(c net.Conn) *Conn {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return nil
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return nil
	}
	r := &Conn{rc: rc, local: tc.LocalAddr(), remote: tc.RemoteAddr()}
	r.r.fn, r.w.fn = r.r.readStep, r.w.writeStep
	return r
}

// RawConn is the socket's syscall.RawConn, for a caller that waits on the
// poller with a step of its own (the proxy's flushAwait).
func (r *Conn) RawConn() syscall.RawConn { return r.rc }

// Read is net.Conn.Read: io.EOF at the end of the stream, errors wrapped
// as the net package wraps them.
func (r *Conn) Read(p []byte) (int, error) {
	n, err := r.call(&r.r, p, "read", r.rc.Read)
	if err == nil && n == 0 && len(p) > 0 {
		return 0, io.EOF
	}
	return n, err
}

// Write is net.Conn.Write: all of p, or an error with what was written.
func (r *Conn) Write(p []byte) (int, error) {
	return r.call(&r.w, p, "write", r.rc.Write)
}

// call runs op's step on p under the RawConn's Read or Write (wait),
// which waits on the poller whenever the step asks to.
func (r *Conn) call(op *rawOp, p []byte, name string, wait func(func(uintptr) bool) error) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	op.mu.Lock()
	defer op.mu.Unlock()
	op.p, op.n, op.errno = p, 0, 0
	err := wait(op.fn)
	n := op.n
	op.p = nil
	switch {
	case err != nil:
		return n, r.opError(name, err)
	case op.errno != 0:
		return n, r.opError(name, os.NewSyscallError(name, op.errno))
	}
	return n, nil
}

func (r *rawOp) readStep(fd uintptr) bool {
	for {
		n, e := sysRead(fd, r.p)
		switch e {
		case 0:
			r.n = n
			return true
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return false // wait until readable
		}
		r.errno = e
		return true
	}
}

func (r *rawOp) writeStep(fd uintptr) bool {
	for r.n < len(r.p) {
		rest := r.p[r.n:]
		n, e := sysWrite(fd, rest)
		switch e {
		case 0:
			r.n += n
		case syscall.EINTR:
		case syscall.EAGAIN:
			return false // wait until writable
		default:
			r.errno = e
			return true
		}
	}
	return true
}

// opError wraps err as net.Conn's Read and Write do; a RawConn's own
// error (a deadline, a closed connection) is unwrapped first, so the
// message names one operation, as net's does.
func (r *Conn) opError(op string, err error) error {
	if oe, ok := err.(*net.OpError); ok {
		err = oe.Err
	}
	return &net.OpError{Op: op, Net: "tcp", Source: r.local, Addr: r.remote, Err: err}
}
