package main

import (
	"bytes"
	"os"
	"runtime"
	"strings"
	"testing"
)

// TestCleanupCommandLine: `loxilb cleanup` takes only --bpf-pin-path, and a
// directory that is not a pin path is refused untouched.
func TestCleanupCommandLine(t *testing.T) {
	var out, errb bytes.Buffer
	if err := cleanup([]string{"extra"}, &out, &errb); err == nil || !strings.Contains(err.Error(), `unexpected argument "extra"`) {
		t.Fatalf("cleanup extra: %v", err)
	}
	if err := cleanup([]string{"--interfaces", "eth0"}, &out, &errb); err == nil {
		t.Fatal("cleanup accepted a daemon flag")
	}
	if err := cleanup([]string{"-h"}, &out, &errb); err != nil || !strings.Contains(errb.String(), "usage: loxilb cleanup") {
		t.Fatalf("cleanup -h: %v\n%s", err, errb.String())
	}
	dir := t.TempDir()
	err := cleanup([]string{"--bpf-pin-path", dir}, &out, &errb)
	want := "not on a bpffs mount"
	switch {
	case runtime.GOOS != "linux":
		want = "needs Linux"
	case os.Geteuid() != 0:
		want = "needs root"
	}
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("cleanup of %s: %v, want an error containing %q", dir, err, want)
	}
}
