package proxy

import (
	"syscall"

	"golang.org/x/sys/unix"
)

// reusePort sets SO_REUSEPORT on a listening socket before it binds.
func reusePort(_, _ string, c syscall.RawConn) error {
	var serr error
	if err := c.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
	}); err != nil {
		return err
	}
	return serr
}
