//go:build !linux

package ebpf

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

// Config configures the eBPF data plane; see the Linux build for details.
type Config struct {
	Interfaces      []string
	PinPath         string
	GCInterval      time.Duration
	StackForwarding bool
	HashSeed        uint32
}

// Open reports that the eBPF data plane needs Linux.
func Open(cfg Config, logger *slog.Logger, reg prometheus.Registerer) (dataplane.Dataplane, dataplane.Capability, error) {
	err := fmt.Errorf("%w: the eBPF data plane needs Linux", dataplane.ErrUnsupported)
	return nil, dataplane.Capability{Name: CapabilityName, Reason: err.Error()}, err
}

// Cleanup reports that the eBPF data plane needs Linux.
func Cleanup(pinPath string) (CleanupReport, error) {
	return CleanupReport{}, fmt.Errorf("%w: the eBPF data plane needs Linux", dataplane.ErrUnsupported)
}
