//go:build !linux

package proxy

import (
	"net"
	"syscall"
)

// rawIO is the Linux raw-system-call path for TCP sockets (rawio_linux.go);
// elsewhere there is none and connections use net.Conn's Read and Write.
type rawIO struct {
	c  net.Conn
	rc syscall.RawConn
}

func newRawIO(net.Conn) *rawIO { return nil }

func (r *rawIO) Read(p []byte) (int, error)  { return r.c.Read(p) }
func (r *rawIO) Write(p []byte) (int, error) { return r.c.Write(p) }
