//go:build linux

package netns

import (
	"encoding/binary"
	"fmt"
	"net/netip"

	cebpf "github.com/cilium/ebpf"
)

// loadRefDNAT loads the reference DNAT program (refdnat.c) for one service,
// vip:vport -> backend:bport over TCP. The caller attaches the program and
// calls the returned function to release it and its map.
func loadRefDNAT(vip netip.Addr, vport uint16, backend netip.Addr, bport uint16) (*cebpf.Program, func(), error) {
	spec, err := loadRefdnat()
	if err != nil {
		return nil, nil, err
	}
	// The program compares and writes them as the packet holds them.
	be32 := func(a netip.Addr) uint32 { b := a.As4(); return binary.NativeEndian.Uint32(b[:]) }
	be16 := func(p uint16) uint16 { return binary.NativeEndian.Uint16(binary.BigEndian.AppendUint16(nil, p)) }
	for name, v := range map[string]any{"ref_vip": be32(vip), "ref_backend": be32(backend), "ref_vport": be16(vport), "ref_bport": be16(bport)} {
		sv, ok := spec.Variables[name]
		if !ok {
			return nil, nil, fmt.Errorf("refdnat: no variable %s", name)
		}
		if err := sv.Set(v); err != nil {
			return nil, nil, fmt.Errorf("refdnat: set %s: %w", name, err)
		}
	}
	var objs refdnatObjects
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		return nil, nil, fmt.Errorf("refdnat: load: %w", err)
	}
	return objs.RefDnat, func() { objs.Close() }, nil
}
