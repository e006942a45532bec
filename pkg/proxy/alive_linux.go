package proxy

import "syscall"

// alive reports whether an idle pooled connection can carry another
// request: no stray buffered bytes, and a non-blocking MSG_PEEK on the
// socket finds neither end-of-file (the endpoint closed it, typically its
// keep-alive timeout) nor unsolicited data (a TLS close_notify, or a
// misbehaving server). It costs one recvfrom system call.
func (pc *pconn) alive() bool {
	pc.u.probes.Add(1)
	if pc.br.Buffered() > 0 {
		return false
	}
	if pc.probe == nil {
		sc, ok := pc.raw.(syscall.Conn)
		if !ok {
			return true
		}
		rc, err := sc.SyscallConn()
		if err != nil {
			return false
		}
		// Built once per connection: the probe runs before every reuse.
		pc.probe = &peekProbe{rc: rc}
		pc.probe.fn = pc.probe.peek
	}
	return pc.probe.run()
}

// peekProbe holds the per-connection state of the liveness probe so that
// probing allocates nothing.
type peekProbe struct {
	rc    syscall.RawConn
	fn    func(fd uintptr) bool
	alive bool
	buf   [1]byte
}

func (p *peekProbe) peek(fd uintptr) bool {
	// EAGAIN: nothing to read, still open. n == 0 without error is
	// end-of-file; n > 0 is data nobody asked for.
	_, _, err := syscall.Recvfrom(int(fd), p.buf[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
	p.alive = err == syscall.EAGAIN
	return true // never wait: this is a probe
}

func (p *peekProbe) run() bool {
	p.alive = false
	return p.rc.Read(p.fn) == nil && p.alive
}
