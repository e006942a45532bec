//go:build linux

package ebpf

import (
	"fmt"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

// Twins of FILTER_LINE_SHIFT and FILTER_BITS in bpf/consts.h.
const (
	filterLineShift = 5
	filterBits      = 512 << filterLineShift
)

// filterBitmap is the value of lb_filter: one bit per hashed {address,
// port, protocol}. tc_lb passes a packet whose destination and source both
// miss it without looking at conntrack or the services (see filter_match
// in bpf/lb.c); a collision only sends a packet down the full path.
type filterBitmap [filterBits / 64]uint64

// filterHash is the twin of filter_hash in bpf/lb.c: the address picks the
// 512-bit line, the whole key the bit. addr and port are network-order
// values as the program reads them from the packet.
func filterHash(addr uint32, port uint16, proto uint8) uint32 {
	line := (addr * 0x9E3779B1) >> (32 - filterLineShift)
	k := uint64(addr)<<32 | uint64(port)<<8 | uint64(proto)
	return line<<9 | uint32((k*0x9E3779B97F4A7C15)>>(64-9))
}

func (f *filterBitmap) set(addr uint32, port uint16, proto uint8) {
	h := filterHash(addr, port, proto)
	f[h>>6] |= 1 << (h & 63)
}

func (f *filterBitmap) has(addr uint32, port uint16, proto uint8) bool {
	h := filterHash(addr, port, proto)
	return f[h>>6]&(1<<(h&63)) != 0
}

// addService sets the bits of a kernel-path service: every frontend (the
// destination of client packets) and, unless DSR (replies bypass the LB),
// every endpoint, healthy or not, since a drained endpoint's flows go on
// (the source of reply packets). Mode 4 is steered by sk_lookup and has no
// bits.
func (f *filterBitmap) addService(svc dataplane.Service, eps []dataplane.Endpoint, keys []lbSvcKey) {
	if svc.Mode == dataplane.ModeFullProxy {
		return
	}
	proto, _ := dataplane.ProtoNumber(svc.Proto)
	for _, k := range keys {
		f.set(k.Vip, k.Port, k.Proto)
	}
	if svc.Mode == dataplane.ModeDSR {
		return
	}
	for _, ep := range eps {
		f.set(nbo32(ep.Addr), nbo16(ep.Port), proto)
	}
}

// union returns f | g.
func (f filterBitmap) union(g *filterBitmap) filterBitmap {
	for i := range f {
		f[i] |= g[i]
	}
	return f
}

// filterOf computes the prefilter of the installed services.
func (d *Dataplane) filterOf() filterBitmap {
	var f filterBitmap
	for _, st := range d.services {
		f.addService(st.svc, st.eps, st.keys)
	}
	return f
}

// writeFilter stores the prefilter of the installed services plus, when
// given, a service about to take effect (svc, eps, keys): written before
// its entry switches, so its frontends and endpoints already pass, and
// again without the extra once d.services holds it, which drops the bits of
// frontends and endpoints that went.
func (d *Dataplane) writeFilter(pending *filterBitmap) error {
	f := d.filterOf()
	if pending != nil {
		f = f.union(pending)
	}
	v := lbLbFilter{Bits: f}
	if err := d.objs.LbFilter.Put(uint32(0), &v); err != nil {
		return fmt.Errorf("write address prefilter: %w", err)
	}
	return nil
}

// syncFilter writes the exact prefilter after a change; a failure leaves a
// superset in place, which only costs lookups, so it is logged.
func (d *Dataplane) syncFilter() {
	if err := d.writeFilter(nil); err != nil {
		d.log.Warn("shrink the address prefilter", "err", err)
	}
}
