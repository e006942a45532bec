//go:build linux

package ebpf

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

// lockPinPath takes the per-host lock of a pin path: an exclusive flock on
// the pin directory itself (bpffs holds no regular files, so the directory
// is the lock file). The lock lives as long as the returned file, and the
// kernel drops it when its holder dies, so a killed daemon never leaves a
// stale lock behind. A held lock is ErrPinPathBusy naming the holder.
func lockPinPath(path string) (*os.File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open pin directory: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, busyError(path)
		}
		return nil, fmt.Errorf("lock pin directory %s: %w", path, err)
	}
	return f, nil
}

// busyError names the process holding path's lock, as /proc/locks shows it.
func busyError(path string) error {
	holder := "another process"
	if pid := lockHolder(path); pid > 0 {
		holder = fmt.Sprintf("process %d", pid)
		if comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); err == nil {
			holder += " (" + strings.TrimSpace(string(comm)) + ")"
		}
	}
	return fmt.Errorf("%w: %w: %s is held by %s, a data plane running on it; "+
		"start this daemon with a different --bpf-pin-path, or stop that one first", dataplane.ErrConfig, ErrPinPathBusy, path, holder)
}

// lockHolder returns the pid holding a flock on path, 0 when none is found.
// /proc/locks names a lock's file as major:minor (hex) and inode number.
func lockHolder(path string) int {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0
	}
	id := fmt.Sprintf("%02x:%02x:%d", unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino)
	f, err := os.Open("/proc/locks")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// "1: FLOCK  ADVISORY  WRITE 6686 00:27:11245 0 EOF"; waiters
		// have "->" after the index and are skipped.
		fs := strings.Fields(sc.Text())
		if len(fs) < 6 || fs[1] != "FLOCK" || fs[5] != id {
			continue
		}
		if pid, err := strconv.Atoi(fs[4]); err == nil {
			return pid
		}
	}
	return 0
}
