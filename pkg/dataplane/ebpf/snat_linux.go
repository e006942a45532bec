//go:build linux

// One-arm and full-NAT source ports: the range is reserved from the host's
// own stack so a SNATed flow never reuses a 4-tuple of a local socket.

package ebpf

import (
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

// Sysctls of the host stack's ephemeral ports (per network namespace).
const (
	sysctlPortRange     = "/proc/sys/net/ipv4/ip_local_port_range"
	sysctlReservedPorts = "/proc/sys/net/ipv4/ip_local_reserved_ports"
)

// reserveSNATPorts keeps the one-arm SNAT ports (snatLocalPortMin-Max) out
// of the host stack's ephemeral range: when ip_local_port_range overlaps
// them, they are added to ip_local_reserved_ports (logged), so a socket of
// the LB never gets a port a translated flow may use. A failure is logged,
// not fatal: one-arm then risks clashing with local sockets.
func (d *Dataplane) reserveSNATPorts() {
	raw, err := os.ReadFile(sysctlPortRange)
	if err != nil {
		d.log.Warn("read the ephemeral port range", "err", err)
		return
	}
	var lo, hi int
	if _, err := fmt.Sscanf(string(raw), "%d %d", &lo, &hi); err != nil {
		d.log.Warn("parse the ephemeral port range", "value", strings.TrimSpace(string(raw)), "err", err)
		return
	}
	if hi < snatLocalPortMin || lo > snatLocalPortMax {
		return
	}
	want := fmt.Sprintf("%d-%d", snatLocalPortMin, snatLocalPortMax)
	cur, err := os.ReadFile(sysctlReservedPorts)
	if err != nil {
		d.log.Warn("read the reserved ports", "err", err)
		return
	}
	list := strings.TrimSpace(string(cur))
	if slices.Contains(strings.Split(list, ","), want) {
		return
	}
	next := want
	if list != "" {
		next = list + "," + want
	}
	if err := os.WriteFile(sysctlReservedPorts, []byte(next), 0o644); err != nil {
		d.log.Warn("reserve the one-arm SNAT ports: local sockets may clash with one-arm flows", "ports", want, "err", err)
		return
	}
	d.log.Info("ip_local_port_range overlaps the one-arm SNAT ports: reserved them for the data plane",
		"ip_local_port_range", fmt.Sprintf("%d-%d", lo, hi), "ip_local_reserved_ports", next)
}

func snatAddr(svc dataplane.Service, ep dataplane.Endpoint) (uint32, error) {
	switch svc.Mode {
	case dataplane.ModeFullNAT:
		if svc.SNATAddr.IsValid() {
			return nbo32(svc.SNATAddr), nil
		}
		return nbo32(svc.VIP), nil
	case dataplane.ModeOneArm, dataplane.ModeHostOneArm:
		if svc.SNATAddr.IsValid() {
			return nbo32(svc.SNATAddr), nil
		}
		routes, err := netlink.RouteGet(ep.Addr.AsSlice())
		if err != nil || len(routes) == 0 || routes[0].Src == nil {
			return 0, fmt.Errorf("%w: derive the one-arm source address toward endpoint %v: no route with a source address (%v)",
				dataplane.ErrUnroutable, ep.Addr, err)
		}
		src, _ := netip.AddrFromSlice(routes[0].Src.To4())
		return nbo32(src), nil
	}
	return 0, nil
}
