package proxy

import "syscall"

// alive reports whether an idle pooled connection can carry another
// request: no stray buffered bytes, and a non-blocking MSG_PEEK on the
// socket finds neither end-of-file (the endpoint closed it, typically its
// keep-alive timeout) nor unsolicited data (a TLS close_notify, or a
// misbehaving server). It costs one recvfrom system call.
func (pc *pconn) alive() bool {
	if pc.br.Buffered() > 0 {
		return false
	}
	sc, ok := pc.raw.(syscall.Conn)
	if !ok {
		return true
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	alive := false
	var buf [1]byte
	err = rc.Read(func(fd uintptr) bool {
		// EAGAIN: nothing to read, still open. n == 0 without error is
		// end-of-file; n > 0 is data nobody asked for.
		_, _, rerr := syscall.Recvfrom(int(fd), buf[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		alive = rerr == syscall.EAGAIN
		return true // never wait: this is a probe
	})
	return err == nil && alive
}
