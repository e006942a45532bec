//go:build linux

package ebpf

import (
	"net/netip"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

// TestFilterBits: the prefilter holds every frontend and every endpoint of
// a NAT service, not the endpoints of a DSR service (their replies bypass
// the LB) nor anything of a mode-4 service, and one address keeps to one
// 512-bit line whatever the port.
func TestFilterBits(t *testing.T) {
	a := func(s string) netip.Addr { return netip.MustParseAddr(s) }
	vip, vipDSR, vipProxy := a("172.31.9.1"), a("172.31.9.2"), a("172.31.9.3")
	eps := []dataplane.Endpoint{{Addr: a("172.31.1.1"), Port: 8080}, {Addr: a("172.31.1.2"), Port: 8081, Healthy: false}}
	key := func(v netip.Addr, port uint16) lbSvcKey { return lbSvcKey{Vip: nbo32(v), Port: nbo16(port), Proto: 6} }
	var f filterBitmap
	f.addService(dataplane.Service{VIP: vip, Port: 80, Proto: "tcp", Mode: dataplane.ModeDNAT}, eps, []lbSvcKey{key(vip, 80)})
	f.addService(dataplane.Service{VIP: vipDSR, Port: 80, Proto: "tcp", Mode: dataplane.ModeDSR},
		[]dataplane.Endpoint{{Addr: a("172.31.3.1"), Port: 80}}, []lbSvcKey{key(vipDSR, 80)})
	f.addService(dataplane.Service{VIP: vipProxy, Port: 80, Proto: "tcp", Mode: dataplane.ModeFullProxy}, eps, []lbSvcKey{key(vipProxy, 80)})

	for _, c := range []struct {
		addr netip.Addr
		port uint16
		want bool
	}{
		{vip, 80, true}, {a("172.31.1.1"), 8080, true}, {a("172.31.1.2"), 8081, true}, {vipDSR, 80, true},
		{a("172.31.3.1"), 80, false}, {vipProxy, 80, false},
	} {
		if got := f.has(nbo32(c.addr), nbo16(c.port), 6); got != c.want {
			t.Errorf("%v:%d in the prefilter: %v, want %v", c.addr, c.port, got, c.want)
		}
	}
	misses := 0
	for port := uint16(1); port < 2000; port++ {
		if !f.has(nbo32(vip), nbo16(port), 17) && !f.has(nbo32(a("172.31.7.7")), nbo16(port), 6) {
			misses++
		}
		if filterHash(nbo32(vip), nbo16(port), 6)>>9 != filterHash(nbo32(vip), nbo16(80), 6)>>9 {
			t.Fatalf("port %d moves %v to another line", port, vip)
		}
	}
	if misses < 1900 {
		t.Errorf("only %d of 1999 unrelated keys miss the prefilter", misses)
	}
}
