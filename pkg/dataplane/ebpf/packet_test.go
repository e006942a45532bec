package ebpf

import (
	"encoding/binary"
	"net/netip"
)

// pkt describes an Ethernet/IPv4/L4 test packet; build renders it with valid
// checksums, so a program's output can be compared byte for byte with the
// packet it should have produced.
type pkt struct {
	src, dst     netip.Addr
	sport, dport uint16
	proto        uint8 // 6, 17 or 132
	flags        uint8 // TCP flags
	ttl          uint8
	payload      string
	noUDPCsum    bool
	fragOff      uint16
	dstMAC       []byte // default 02:00:00:00:00:01
	srcMAC       []byte // default 02:00:00:00:00:02
	rst          bool   // the RST tc_lb answers with: seq 2000, window 0, IP id 0 and DF
}

// rstTo is the RST tc_lb sends back for in, a TCP packet with ACK set (whose
// ack number, 2000, becomes the RST's sequence number).
func rstTo(in pkt) *pkt {
	return &pkt{src: in.dst, dst: in.src, sport: in.dport, dport: in.sport, proto: 6, flags: fRST, rst: true,
		dstMAC: []byte{0x02, 0, 0, 0, 0, 0x02}, srcMAC: []byte{0x02, 0, 0, 0, 0, 0x01}}
}

const (
	fFIN = 0x01
	fSYN = 0x02
	fRST = 0x04
	fACK = 0x10
)

func csumFold(sum uint32) uint16 {
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}

func csumAdd(sum uint32, b []byte) uint32 {
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	return sum
}

func (p pkt) build() []byte {
	ttl := p.ttl
	if ttl == 0 {
		ttl = 64
	}
	var l4 []byte
	switch p.proto {
	case 6:
		l4 = make([]byte, 20)
		binary.BigEndian.PutUint32(l4[4:], 1000)
		if p.flags&fACK != 0 {
			binary.BigEndian.PutUint32(l4[8:], 2000)
		}
		l4[12] = 5 << 4
		l4[13] = p.flags
		binary.BigEndian.PutUint16(l4[14:], 65535)
		if p.rst {
			binary.BigEndian.PutUint32(l4[4:], 2000)
			binary.BigEndian.PutUint16(l4[14:], 0)
		}
	case 17:
		l4 = make([]byte, 8)
	default:
		l4 = make([]byte, 12)
	}
	binary.BigEndian.PutUint16(l4[0:], p.sport)
	binary.BigEndian.PutUint16(l4[2:], p.dport)
	l4 = append(l4, p.payload...)
	if p.proto == 17 {
		binary.BigEndian.PutUint16(l4[4:], uint16(len(l4)))
	}
	s, d := p.src.As4(), p.dst.As4()
	if p.proto == 6 || (p.proto == 17 && !p.noUDPCsum) {
		sum := csumAdd(0, s[:])
		sum = csumAdd(sum, d[:])
		sum += uint32(p.proto) + uint32(len(l4))
		sum = csumAdd(sum, l4)
		c := csumFold(sum)
		if p.proto == 17 && c == 0 {
			c = 0xffff
		}
		off := 16
		if p.proto == 17 {
			off = 6
		}
		binary.BigEndian.PutUint16(l4[off:], c)
	}
	ip := make([]byte, 20)
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], uint16(20+len(l4)))
	binary.BigEndian.PutUint16(ip[4:], 0x1234)
	binary.BigEndian.PutUint16(ip[6:], p.fragOff)
	if p.rst {
		binary.BigEndian.PutUint16(ip[4:], 0)
		binary.BigEndian.PutUint16(ip[6:], 0x4000)
	}
	ip[8] = ttl
	ip[9] = p.proto
	copy(ip[12:], s[:])
	copy(ip[16:], d[:])
	binary.BigEndian.PutUint16(ip[10:], csumFold(csumAdd(0, ip)))
	eth := []byte{0x02, 0, 0, 0, 0, 0x01, 0x02, 0, 0, 0, 0, 0x02, 0x08, 0x00}
	if p.dstMAC != nil {
		copy(eth[0:6], p.dstMAC)
	}
	if p.srcMAC != nil {
		copy(eth[6:12], p.srcMAC)
	}
	return append(append(eth, ip...), l4...)
}

// decoded is the part of a packet the tests assert on.
type decoded struct {
	src, dst     netip.Addr
	sport, dport uint16
	ttl          uint8
	ipOK, l4OK   bool
	l4csum       uint16
}

// decode parses a built or program-produced packet and verifies both
// checksums from scratch.
func decode(b []byte) decoded {
	ip := b[14:]
	ihl := int(ip[0]&0xf) * 4
	l4 := ip[ihl:binary.BigEndian.Uint16(ip[2:])]
	var d decoded
	d.src = netip.AddrFrom4([4]byte(ip[12:16]))
	d.dst = netip.AddrFrom4([4]byte(ip[16:20]))
	d.ttl = ip[8]
	d.ipOK = csumFold(csumAdd(0, ip[:ihl])) == 0
	d.sport = binary.BigEndian.Uint16(l4[0:])
	d.dport = binary.BigEndian.Uint16(l4[2:])
	proto := ip[9]
	sum := csumAdd(0, ip[12:20])
	sum += uint32(proto) + uint32(len(l4))
	sum = csumAdd(sum, l4)
	switch proto {
	case 6:
		d.l4csum = binary.BigEndian.Uint16(l4[16:])
		d.l4OK = csumFold(sum) == 0
	case 17:
		d.l4csum = binary.BigEndian.Uint16(l4[6:])
		d.l4OK = d.l4csum == 0 || csumFold(sum) == 0
	default:
		d.l4OK = true
	}
	return d
}
