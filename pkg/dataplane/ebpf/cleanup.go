package ebpf

import "errors"

// ErrPinPathBusy means another process holds the pin path's lock: a
// daemon is running on it. Two daemons on one pin path would overwrite each
// other's maps and links, so the second refuses to start and cleanup refuses
// to remove what the running one serves with.
var ErrPinPathBusy = errors.New("pin path is in use")

// CleanupReport lists what Cleanup removed, one human-readable line per
// object, and what it left because it is not the data plane's.
type CleanupReport struct {
	Removed []string
	Left    []string
}
