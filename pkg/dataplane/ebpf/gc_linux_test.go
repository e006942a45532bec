//go:build linux

package ebpf

import (
	"net/netip"
	"testing"
	"time"
)

// The entries tc_lb creates for one flow of each mode; peerKey must map each
// onto the other (GC relies on it to keep a flow's two entries together).
func TestPeerKeyPairsEntries(t *testing.T) {
	a := func(s string) uint32 { return nbo32(netip.MustParseAddr(s)) }
	p := nbo16
	cl, vip, be, snat := a("172.31.2.2"), a("172.31.9.1"), a("172.31.1.10"), a("172.31.1.1")
	fwdKey := lbCtKey{Saddr: cl, Daddr: vip, Sport: p(40000), Dport: p(80), Proto: 6}
	cases := []struct {
		name   string
		fv, rv lbCtVal
		rk     lbCtKey
	}{
		{"dnat",
			lbCtVal{Flags: ctXlateDst, NewDaddr: be, NewDport: p(8080)},
			lbCtVal{Flags: ctReply | ctXlateSrc, NewSaddr: vip, NewSport: p(80)},
			lbCtKey{Saddr: be, Daddr: cl, Sport: p(8080), Dport: p(40000), Proto: 6}},
		{"fullnat with a new port",
			lbCtVal{Flags: ctXlateDst | ctXlateSrc, NewDaddr: be, NewDport: p(8080), NewSaddr: snat, NewSport: p(33000)},
			lbCtVal{Flags: ctReply | ctXlateSrc | ctXlateDst, NewSaddr: vip, NewSport: p(80), NewDaddr: cl, NewDport: p(40000)},
			lbCtKey{Saddr: be, Daddr: snat, Sport: p(8080), Dport: p(33000), Proto: 6}},
	}
	for _, c := range cases {
		if got := peerKey(&fwdKey, &c.fv); got != c.rk {
			t.Errorf("%s: peer of the client entry %+v, want %+v", c.name, got, c.rk)
		}
		if got := peerKey(&c.rk, &c.rv); got != fwdKey {
			t.Errorf("%s: peer of the reply entry %+v, want %+v", c.name, got, fwdKey)
		}
	}
}

func TestCtTimeout(t *testing.T) {
	for _, c := range []struct {
		state   uint8
		timeout uint32
		want    time.Duration
	}{
		{ctEst, 240, 240 * time.Second},
		{ctNew, 240, 60 * time.Second},
		{ctNew, 5, 5 * time.Second},
		{ctFin, 240, 10 * time.Second},
		{ctClosed, 1, time.Second},
	} {
		v := lbCtVal{State: c.state, TimeoutS: c.timeout}
		if got := ctTimeout(&v); got != c.want {
			t.Errorf("state %d timeout %d: %v, want %v", c.state, c.timeout, got, c.want)
		}
	}
}

func TestByteOrderHelpers(t *testing.T) {
	a := netip.MustParseAddr("172.31.2.3")
	if addrFrom(nbo32(a)) != a {
		t.Fatal("address round trip")
	}
	if hostPort(nbo16(8080)) != 8080 {
		t.Fatal("port round trip")
	}
	if beKey(3, 1, 5) != (3*2+1)*maxEPs+5 {
		t.Fatal("backend key layout")
	}
}
