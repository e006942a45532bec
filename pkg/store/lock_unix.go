//go:build unix

package store

import (
	"os"
	"syscall"
	"time"
)

// lockFile takes the exclusive flock bbolt itself takes, polling until
// timeout, and returns its release.
func lockFile(f *os.File, timeout time.Duration) (func(), error) {
	deadline := time.Now().Add(timeout)
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { _ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN) }, nil
		}
		if err != syscall.EWOULDBLOCK || time.Now().After(deadline) {
			return nil, err
		}
		time.Sleep(50 * time.Millisecond)
	}
}
