package dataplane

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"syscall"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

// Modes of a service, numbered as loxilb's serviceArguments.mode.
const (
	ModeDNAT       = 0 // destination NAT; backends route replies back through the LB
	ModeOneArm     = 1 // DNAT + SNAT to the LB's address on the route to the endpoint
	ModeFullNAT    = 2 // DNAT + SNAT to the VIP or a configured address
	ModeDSR        = 3 // no rewrite; endpoints own the VIP; hash selection only
	ModeFullProxy  = 4 // terminated by the user-space proxy; kernel only steers
	ModeHostOneArm = 5 // VIP 0.0.0.0: every local address, one-arm SNAT
)

// Selectors of a service, numbered as loxilb's sel (8 is the inference
// gateway's chwbl, which the kernel path serves with a Maglev table).
const (
	SelRoundRobin     = lbrule.SelRR
	SelHash           = lbrule.SelHash
	SelPriority       = lbrule.SelPriority // weighted round robin; Endpoint.Weight is the weight
	SelPersist        = lbrule.SelPersist  // client address affinity
	SelLeastConn      = lbrule.SelLC
	SelConsistentHash = lbrule.SelCHWBL
)

// Limits of the kernel tables; the fake enforces the same ones so the
// conformance suite holds for both.
const (
	MaxServices          = 256
	MaxEndpoints         = 64
	DefaultPersistTime   = 3 * time.Hour // loxilb's pto default (10800 s)
	DefaultTCPInactivity = 240 * time.Second
	DefaultUDPInactivity = 20 * time.Second
	MaxInactivity        = 24 * time.Hour
)

// Service is one load-balancing rule as the data plane sees it.
type Service struct {
	ID              uint32     // control-plane identity; stable across updates
	VIP             netip.Addr // IPv4; 0.0.0.0 only for ModeHostOneArm
	Port            uint16
	Proto           string // "tcp", "udp" or "sctp"
	Mode            int    // Mode* constant
	Sel             int    // Sel* constant
	InactiveTimeout time.Duration
	// SNATAddr is the source address for ModeOneArm/ModeFullNAT. Zero means
	// derive it: the LB's address on the route to each endpoint (one-arm) or
	// the VIP (full NAT).
	SNATAddr netip.Addr
	// ProxyPort is, for ModeFullProxy, the port of the proxy listener that
	// VIP:Port connections are steered to (see ProxySteerer).
	ProxyPort uint16
	// PersistTimeout is the affinity lifetime for SelPersist; zero means
	// DefaultPersistTime.
	PersistTimeout time.Duration
}

// Endpoint is one backend of a service.
type Endpoint struct {
	Addr    netip.Addr
	Port    uint16
	Weight  int // SelPriority only; <= 0 counts as 1
	Healthy bool
}

// ServiceStats are the per-service counters.
type ServiceStats struct {
	Packets uint64 // both directions
	Bytes   uint64
	Flows   uint64 // connections created
	// Evicted counts connection-tracking entries the data plane lost to
	// eviction (a full table), whose packets and bytes are missing from
	// Packets and Bytes; 0 where nothing is evicted.
	Evicted uint64
}

// Stats is a snapshot of the data plane's counters.
type Stats struct {
	// Counters holds one entry per verdict and drop reason, keyed by a
	// stable snake_case name (e.g. "new_flow", "drop_not_syn").
	Counters map[string]uint64
	// Services holds an entry for every installed service, keyed by ID.
	Services map[uint32]ServiceStats
	// ConntrackEntries is the number of conntrack entries (two per NATed flow).
	ConntrackEntries int
}

// Capability reports whether the kernel data plane is usable, for the
// daemon's capability list.
type Capability struct {
	Name   string // "ebpf_dataplane"
	Ready  bool
	Reason string // why not ready, or a short description when ready
}

// Dataplane is the kernel side of the load balancer. Implementations are safe
// for concurrent use.
type Dataplane interface {
	// UpsertService installs or replaces a service and its endpoints. A
	// replaced service switches to the new endpoint set atomically: a new
	// connection sees either the old or the new set, never a mix.
	// Established connections to endpoints that remain keep flowing.
	UpsertService(ctx context.Context, svc Service, eps []Endpoint) error
	// DeleteService removes a service and its connections. Deleting an
	// unknown ID is not an error.
	DeleteService(ctx context.Context, id uint32) error
	// SetEndpointHealth marks endpoint epIdx (its position in the slice
	// given to UpsertService) healthy or not. Unhealthy endpoints get no new
	// connections.
	SetEndpointHealth(ctx context.Context, id uint32, epIdx int, healthy bool) error
	// Stats returns the counters.
	Stats(ctx context.Context) (Stats, error)
	// Close releases user-space resources. Whether the kernel data path
	// keeps running is up to the implementation's configuration.
	Close() error
}

// ProxySteerer is implemented by data planes that steer mode-4 connections
// into the proxy's listener (the eBPF one, with sk_lookup).
type ProxySteerer interface {
	// RegisterProxyListener makes l the target of every ModeFullProxy
	// service whose ProxyPort equals port. l must be a TCP listener (for
	// example *net.TCPListener) created without MPTCP.
	RegisterProxyListener(port uint16, l syscall.Conn) error
}

// Checker is implemented by data planes that can tell, without changing
// anything, whether UpsertService would accept a service now: the checks
// of Validate plus those that depend on the installed state (a frontend
// another service has, a full table, a one-arm endpoint with no route).
// The control plane runs it before it allocates a rule id, so a refused
// rule consumes nothing. ID 0 stands for a service not installed yet.
type Checker interface {
	CheckService(ctx context.Context, svc Service, eps []Endpoint) error
}

// Recoverer is implemented by data planes whose services outlive the
// process (the eBPF one, with pinned maps): at start they hold what the
// previous run installed, which may not be what the control plane holds now
// (another or a wiped rule store).
type Recoverer interface {
	// PruneRecovered removes every service recovered at start that has not
	// been upserted since, and returns their IDs. Call it once, after the
	// control plane has installed its desired state. A recovered service
	// whose ID an upsert reuses for another VIP, port or protocol, or whose
	// frontend a service with another ID takes, is removed by that upsert
	// (never reused); such removals are counted with the pruned ones.
	PruneRecovered(ctx context.Context) ([]uint32, error)
}

// Errors callers branch on. Returned errors wrap them.
var (
	ErrInvalid     = errors.New("invalid service")
	ErrUnsupported = errors.New("unsupported by the data plane")
	ErrNotFound    = errors.New("service not found")
	ErrConflict    = errors.New("VIP, port and protocol already used by another service")
	ErrCapacity    = errors.New("data plane table full")
	ErrClosed      = errors.New("data plane closed")
	// ErrUnroutable marks an endpoint the data plane cannot reach the way
	// the mode needs (one-arm: no route with a source address toward it).
	ErrUnroutable = errors.New("endpoint not routable")
	// ErrConfig marks an operator mistake in the data plane's own
	// configuration (an interface that does not exist, a pin path off
	// bpffs): the daemon stops instead of running without it.
	ErrConfig = errors.New("invalid data plane configuration")
)

// ProtoNumber returns the IP protocol number of "tcp", "udp" or "sctp".
func ProtoNumber(proto string) (uint8, error) {
	switch proto {
	case "tcp":
		return 6, nil
	case "udp":
		return 17, nil
	case "sctp":
		return 132, nil
	}
	return 0, fmt.Errorf("%w: protocol %q (want tcp, udp or sctp)", ErrInvalid, proto)
}

// Validate checks a service and its endpoints against what the data plane
// can do. Both implementations call it, so they reject the same input.
func Validate(svc Service, eps []Endpoint) error {
	if _, err := ProtoNumber(svc.Proto); err != nil {
		return fmt.Errorf("service %d: %w", svc.ID, err)
	}
	if !svc.VIP.IsValid() || !svc.VIP.Is4() {
		return fmt.Errorf("%w: service %d: VIP %v is not an IPv4 address", ErrInvalid, svc.ID, svc.VIP)
	}
	if svc.Port == 0 {
		return fmt.Errorf("%w: service %d: port 0", ErrInvalid, svc.ID)
	}
	if svc.Mode < ModeDNAT || svc.Mode > ModeHostOneArm {
		return fmt.Errorf("%w: service %d: mode %d (want 0-5)", ErrInvalid, svc.ID, svc.Mode)
	}
	if svc.VIP.IsUnspecified() != (svc.Mode == ModeHostOneArm) {
		return fmt.Errorf("%w: service %d: VIP 0.0.0.0 is required by, and only allowed for, mode %d (hostonearm)",
			ErrInvalid, svc.ID, ModeHostOneArm)
	}
	switch svc.Sel {
	case SelRoundRobin, SelHash, SelPriority, SelPersist, SelLeastConn, SelConsistentHash:
	default:
		return fmt.Errorf("%w: service %d: selector %d in the kernel data path", ErrUnsupported, svc.ID, svc.Sel)
	}
	if svc.InactiveTimeout < 0 || svc.InactiveTimeout > MaxInactivity {
		return fmt.Errorf("%w: service %d: inactive timeout %v (want 0-%v)", ErrInvalid, svc.ID, svc.InactiveTimeout, MaxInactivity)
	}
	if svc.PersistTimeout < 0 {
		return fmt.Errorf("%w: service %d: negative persist timeout", ErrInvalid, svc.ID)
	}
	if svc.SNATAddr.IsValid() && !svc.SNATAddr.Is4() {
		return fmt.Errorf("%w: service %d: SNAT address %v is not IPv4", ErrInvalid, svc.ID, svc.SNATAddr)
	}
	switch svc.Mode {
	case ModeFullProxy:
		if svc.Proto != "tcp" {
			return fmt.Errorf("%w: service %d: fullproxy steering is TCP only", ErrUnsupported, svc.ID)
		}
		if svc.ProxyPort == 0 {
			return fmt.Errorf("%w: service %d: fullproxy needs a proxy port", ErrInvalid, svc.ID)
		}
	case ModeDSR:
		if svc.Sel != SelHash && svc.Sel != SelConsistentHash {
			return fmt.Errorf("%w: service %d: dsr needs a hash selector (1 or 8)", ErrInvalid, svc.ID)
		}
	default:
		if svc.Proto == "sctp" {
			return fmt.Errorf("%w: service %d: SCTP with address rewrite (its CRC32c cannot be patched in the kernel path); use dsr or fullproxy",
				ErrUnsupported, svc.ID)
		}
	}
	if len(eps) > MaxEndpoints {
		return fmt.Errorf("%w: service %d: %d endpoints (max %d)", ErrCapacity, svc.ID, len(eps), MaxEndpoints)
	}
	for i, ep := range eps {
		if !ep.Addr.IsValid() || !ep.Addr.Is4() || ep.Addr.IsUnspecified() {
			return fmt.Errorf("%w: service %d: endpoint %d: address %v is not a usable IPv4 address", ErrInvalid, svc.ID, i, ep.Addr)
		}
		if ep.Port == 0 {
			return fmt.Errorf("%w: service %d: endpoint %d: port 0", ErrInvalid, svc.ID, i)
		}
		if svc.Mode == ModeDSR && ep.Port != svc.Port {
			return fmt.Errorf("%w: service %d: endpoint %d: dsr cannot translate port %d to %d", ErrInvalid, svc.ID, i, svc.Port, ep.Port)
		}
	}
	return nil
}

// InactivityFor returns the effective inactivity timeout of a service.
func InactivityFor(svc Service) time.Duration {
	if svc.InactiveTimeout > 0 {
		return svc.InactiveTimeout
	}
	if svc.Proto == "udp" {
		return DefaultUDPInactivity
	}
	return DefaultTCPInactivity
}
