//go:build !unix

package store

import (
	"os"
	"time"
)

// lockFile is a no-op where flock does not exist; bbolt takes its own lock.
func lockFile(*os.File, time.Duration) (func(), error) { return func() {}, nil }
