//go:build linux

// Byte-order and key codecs shared by the map writers.

package ebpf

import (
	"encoding/binary"
	"fmt"
	"net/netip"
)

// Byte-order helpers: map fields hold network-order bytes in host-order
// integers, because the program compares raw packet bytes.
func nbo32(a netip.Addr) uint32 {
	b := a.As4()
	return binary.NativeEndian.Uint32(b[:])
}

func addrFrom(v uint32) netip.Addr {
	var b [4]byte
	binary.NativeEndian.PutUint32(b[:], v)
	return netip.AddrFrom4(b)
}

func nbo16(p uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], p)
	return binary.NativeEndian.Uint16(b[:])
}

func hostPort(v uint16) uint16 {
	var b [2]byte
	binary.NativeEndian.PutUint16(b[:], v)
	return binary.BigEndian.Uint16(b[:])
}

func beKey(idx uint16, gen uint8, ep int) uint32 {
	return (uint32(idx)*2+uint32(gen&1))*maxEPs + uint32(ep)
}

func protoName(p uint8) string {
	switch p {
	case 6:
		return "tcp"
	case 17:
		return "udp"
	case 132:
		return "sctp"
	}
	return fmt.Sprintf("proto-%d", p)
}
