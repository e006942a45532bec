//go:build !linux

package rawio

import (
	"net"
	"syscall"
)

// Conn is the Linux raw-system-call path for TCP sockets (rawio_linux.go);
// elsewhere there is none and connections use net.Conn's Read and Write.
type Conn struct {
	c  net.Conn
	rc syscall.RawConn
}

// New returns nil: there is no raw path here.
func New(net.Conn) *Conn { return nil }

// RawConn is the socket's syscall.RawConn.
func (r *Conn) RawConn() syscall.RawConn { return r.rc }

func (r *Conn) Read(p []byte) (int, error)  { return r.c.Read(p) }
func (r *Conn) Write(p []byte) (int, error) { return r.c.Write(p) }
