package peerprefill

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"slices"
)

// Load datagram, after the common header (kind load):
//
//	entry count (2) | entries: service (4) | endpoint index (2)
//	                  | endpoint address hash (8) | in flight (2)
//
// One datagram is the sender's whole snapshot: an endpoint it does not
// name has none of its requests in flight. The header's sequence number
// orders a sender's snapshots, so a late datagram does not undo a newer
// one.

// Limits of one load datagram.
const (
	// MaxLoads bounds the entries of one snapshot: endpoints with
	// requests in flight at once on one node. A node with more sends the
	// MaxLoads most loaded (counted in loxilb_cluster_load_truncated_total).
	MaxLoads = 256
	// MaxLoadInFlight bounds the requests one entry may claim, far above
	// what an engine batches; a larger claim makes the datagram malformed
	// rather than being believed, so a peer cannot push an endpoint's load
	// beyond this.
	MaxLoadInFlight = 4096

	loadEntryLen = 4 + 2 + 8 + 2
)

const kindLoad = 3

// Load is one endpoint's requests in flight on one node: sent to the
// endpoint and not yet ended, held for a prefill there, or queued for one
// of its prefill slots.
type Load struct {
	Service  uint32
	EP       int
	EPHash   uint64
	InFlight int
}

// loadOrder sorts a snapshot by endpoint, so two snapshots compare entry
// by entry.
func loadOrder(a, b Load) int {
	if c := cmp.Compare(a.Service, b.Service); c != 0 {
		return c
	}
	return cmp.Compare(a.EP, b.EP)
}

// normalizeLoads drops empty and out-of-range entries, keeps the MaxLoads
// most loaded and sorts what is left by endpoint; it reports how many
// loaded entries were cut.
func normalizeLoads(ls []Load) ([]Load, int) {
	ls = slices.DeleteFunc(ls, func(l Load) bool { return l.InFlight <= 0 || l.EP < 0 || l.EP > 0xffff })
	cut := 0
	if len(ls) > MaxLoads {
		slices.SortFunc(ls, func(a, b Load) int {
			if a.InFlight != b.InFlight {
				return b.InFlight - a.InFlight
			}
			return loadOrder(a, b)
		})
		cut = len(ls) - MaxLoads
		ls = ls[:MaxLoads]
	}
	slices.SortFunc(ls, loadOrder)
	return ls, cut
}

// appendLoad encodes snapshot ls (normalized) as announcement id.
func appendLoad(b []byte, id ID, ls []Load) []byte {
	b = appendHeader(b, kindLoad, id)
	b = binary.BigEndian.AppendUint16(b, uint16(len(ls)))
	for _, l := range ls {
		b = binary.BigEndian.AppendUint32(b, l.Service)
		b = binary.BigEndian.AppendUint16(b, uint16(l.EP))
		b = binary.BigEndian.AppendUint64(b, l.EPHash)
		b = binary.BigEndian.AppendUint16(b, uint16(min(l.InFlight, MaxLoadInFlight)))
	}
	return b
}

// decodeLoads reads the body of a load datagram (after the header) into
// buf; every entry is checked against the limits.
func decodeLoads(b []byte, buf []Load) ([]Load, error) {
	if len(b) < 2 {
		return nil, fmt.Errorf("%w: truncated load", errMalformed)
	}
	n := int(binary.BigEndian.Uint16(b))
	b = b[2:]
	switch {
	case n > MaxLoads:
		return nil, fmt.Errorf("%w: %d load entries, want at most %d", errMalformed, n, MaxLoads)
	case len(b) != loadEntryLen*n:
		return nil, fmt.Errorf("%w: %d entry bytes for %d load entries", errMalformed, len(b), n)
	}
	ls := buf[:0]
	for i := 0; i < n; i++ {
		e := b[loadEntryLen*i:]
		l := Load{Service: binary.BigEndian.Uint32(e), EP: int(binary.BigEndian.Uint16(e[4:])),
			EPHash: binary.BigEndian.Uint64(e[6:]), InFlight: int(binary.BigEndian.Uint16(e[14:]))}
		if l.InFlight == 0 || l.InFlight > MaxLoadInFlight {
			return nil, fmt.Errorf("%w: %d in flight, want 1..%d", errMalformed, l.InFlight, MaxLoadInFlight)
		}
		// Ascending, so each endpoint is named once and a receiver finds
		// it by binary search.
		if i > 0 && loadOrder(ls[i-1], l) >= 0 {
			return nil, fmt.Errorf("%w: load entries out of order", errMalformed)
		}
		ls = append(ls, l)
	}
	return ls, nil
}
