//go:build !linux

package proxy

import (
	"errors"
	"syscall"
)

// reusePort is Linux-only: elsewhere a shared VIP:port cannot be bound.
func reusePort(_, _ string, _ syscall.RawConn) error {
	return errors.New("SO_REUSEPORT listeners are supported on Linux only")
}
