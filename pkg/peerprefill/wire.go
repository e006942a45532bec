package peerprefill

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"
)

// Wire format, big-endian:
//
//	magic "LXPF" | version 1 | kind | sender instance (8) | sequence (8)
//	kind begin:  service (4) | endpoint index (2) | endpoint address hash (8)
//	             | uncached tokens (4) | ttl ms (4) | key count (2) | keys (8 each)
//	kind done:   nothing more
//
// The sender instance is random per process and never 0, so a restarted
// node's sequence numbers never meet its predecessor's; receivers also
// rank two nodes' leaders of the same blocks by it (the lower goes first). The endpoint address
// hash lets a receiver refuse an announcement naming an endpoint index
// that, in its copy of the rule, is another address (a rule being changed
// while nodes resync).

// Limits of one datagram.
const (
	// MaxKeys bounds the block keys one announcement carries: 16k tokens
	// at 16 tokens per block. Longer prompts announce their first MaxKeys
	// uncached blocks, which is the part siblings share.
	MaxKeys = 1024
	// MaxTTL bounds the expiry an announcement may ask for.
	MaxTTL = 30 * time.Second

	headerLen   = 4 + 1 + 1 + 8 + 8
	beginFixed  = 4 + 2 + 8 + 4 + 4 + 2
	MaxDatagram = headerLen + beginFixed + 8*MaxKeys
)

const (
	magic   = "LXPF"
	version = 1

	kindBegin = 1
	kindDone  = 2
)

// ID names one announcement: the sending process and its sequence number.
type ID struct {
	Instance uint64
	Seq      uint64
}

// Prefill is one announcement: Keys of rule Service are being computed at
// endpoint EP (whose address hashes to EPHash) for a request with
// Uncached uncached prompt tokens, until done or TTL.
type Prefill struct {
	ID       ID
	Service  uint32
	EP       int
	EPHash   uint64
	Uncached int64
	TTL      time.Duration
	Keys     []uint64
}

// Reasons a datagram is dropped (the "reason" label).
const (
	DropUnknownPeer = "unknown_peer" // not from a member's peer address
	DropMalformed   = "malformed"    // wrong magic, version or kind, truncated, trailing bytes, over a limit
	DropRule        = "rule"         // names a rule or endpoint this node does not hold alike
	DropFull        = "full"         // the receiver holds as many announcements as it keeps
)

var errMalformed = errors.New("malformed prefill datagram")

// appendBegin encodes p.
func appendBegin(b []byte, p Prefill) []byte {
	keys := p.Keys[:min(len(p.Keys), MaxKeys)]
	b = appendHeader(b, kindBegin, p.ID)
	b = binary.BigEndian.AppendUint32(b, p.Service)
	b = binary.BigEndian.AppendUint16(b, uint16(p.EP))
	b = binary.BigEndian.AppendUint64(b, p.EPHash)
	b = binary.BigEndian.AppendUint32(b, uint32(min(max(p.Uncached, 0), 1<<32-1)))
	b = binary.BigEndian.AppendUint32(b, uint32(min(max(p.TTL, 0), MaxTTL)/time.Millisecond))
	b = binary.BigEndian.AppendUint16(b, uint16(len(keys)))
	for _, k := range keys {
		b = binary.BigEndian.AppendUint64(b, k)
	}
	return b
}

// appendDone encodes the end of announcement id.
func appendDone(b []byte, id ID) []byte { return appendHeader(b, kindDone, id) }

func appendHeader(b []byte, kind byte, id ID) []byte {
	b = append(b, magic...)
	b = append(b, version, kind)
	b = binary.BigEndian.AppendUint64(b, id.Instance)
	return binary.BigEndian.AppendUint64(b, id.Seq)
}

// decoded is one datagram: a begin (p set), a done (only p.ID) or a
// load snapshot (p.ID, and body for decodeLoads).
type decoded struct {
	kind byte
	p    Prefill
	body []byte
}

// decode reads one datagram; keys are appended to keyBuf (reused by the
// caller, so the handler must copy what it keeps).
func decode(b []byte, keyBuf []uint64) (decoded, error) {
	var d decoded
	if len(b) < headerLen || string(b[:4]) != magic || b[4] != version {
		return d, fmt.Errorf("%w: bad header", errMalformed)
	}
	d.kind = b[5]
	d.p.ID = ID{Instance: binary.BigEndian.Uint64(b[6:]), Seq: binary.BigEndian.Uint64(b[14:])}
	if d.p.ID.Instance == 0 {
		return d, fmt.Errorf("%w: instance 0", errMalformed)
	}
	b = b[headerLen:]
	switch d.kind {
	case kindDone:
		if len(b) != 0 {
			return d, fmt.Errorf("%w: %d bytes after a done", errMalformed, len(b))
		}
		return d, nil
	case kindLoad:
		d.body = b
		return d, nil
	case kindBegin:
	default:
		return d, fmt.Errorf("%w: kind %d", errMalformed, d.kind)
	}
	if len(b) < beginFixed {
		return d, fmt.Errorf("%w: truncated begin", errMalformed)
	}
	p := &d.p
	p.Service = binary.BigEndian.Uint32(b)
	p.EP = int(binary.BigEndian.Uint16(b[4:]))
	p.EPHash = binary.BigEndian.Uint64(b[6:])
	p.Uncached = int64(binary.BigEndian.Uint32(b[14:]))
	p.TTL = time.Duration(binary.BigEndian.Uint32(b[18:])) * time.Millisecond
	n := int(binary.BigEndian.Uint16(b[22:]))
	b = b[beginFixed:]
	switch {
	case n == 0 || n > MaxKeys:
		return d, fmt.Errorf("%w: %d keys, want 1..%d", errMalformed, n, MaxKeys)
	case len(b) != 8*n:
		return d, fmt.Errorf("%w: %d key bytes for %d keys", errMalformed, len(b), n)
	case p.TTL <= 0 || p.TTL > MaxTTL:
		return d, fmt.Errorf("%w: ttl %v, want within (0, %v]", errMalformed, p.TTL, MaxTTL)
	}
	keys := keyBuf[:0]
	for i := 0; i < n; i++ {
		keys = append(keys, binary.BigEndian.Uint64(b[8*i:]))
	}
	p.Keys = keys
	return d, nil
}

// EndpointHash is what an announcement carries to name its endpoint's
// address (FNV-1a 64): both sides hash the address their copy of the rule
// holds at the announced index.
func EndpointHash(addr string) uint64 {
	h := uint64(14695981039346656037)
	for i := 0; i < len(addr); i++ {
		h ^= uint64(addr[i])
		h *= 1099511628211
	}
	return h
}
