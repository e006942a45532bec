//go:build linux && race

package rawio

import "syscall"

// Under the race detector, Conn goes through syscall.Read and
// syscall.Write: they tell the detector that what one goroutine wrote to
// a socket happens before what another read from it, as every net.Conn
// does, so tests that learn of a result through a connection do not
// report races that are not there.
func sysRead(fd uintptr, p []byte) (int, syscall.Errno) {
	n, err := syscall.Read(int(fd), p)
	return max(n, 0), errnoOf(err)
}

func sysWrite(fd uintptr, p []byte) (int, syscall.Errno) {
	n, err := syscall.Write(int(fd), p)
	return max(n, 0), errnoOf(err)
}

func errnoOf(err error) syscall.Errno {
	if err == nil {
		return 0
	}
	if e, ok := err.(syscall.Errno); ok {
		return e
	}
	return syscall.EIO
}
