//go:build linux

package ebpf

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

// TestPinLock: a pin path is held by one holder at a time; the refusal
// names the holder's pid and the flag to change, and is a configuration
// error (the daemon stops instead of running proxy-only). Closing the
// holder frees it.
func TestPinLock(t *testing.T) {
	dir := t.TempDir()
	first, err := lockPinPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	_, err = lockPinPath(dir)
	if !errors.Is(err, ErrPinPathBusy) || !errors.Is(err, dataplane.ErrConfig) {
		t.Fatalf("second lock: %v, want ErrPinPathBusy and ErrConfig", err)
	}
	if msg := err.Error(); !strings.Contains(msg, fmt.Sprintf("process %d", os.Getpid())) || !strings.Contains(msg, "--bpf-pin-path") {
		t.Fatalf("refusal %q does not name pid %d and --bpf-pin-path", msg, os.Getpid())
	}
	if pid := lockHolder(dir); pid != os.Getpid() {
		t.Fatalf("lockHolder = %d, want %d", pid, os.Getpid())
	}
	first.Close()
	again, err := lockPinPath(dir)
	if err != nil {
		t.Fatalf("lock after the holder closed: %v", err)
	}
	again.Close()
	if pid := lockHolder(dir); pid != 0 {
		t.Fatalf("lockHolder of a free path = %d", pid)
	}
}
