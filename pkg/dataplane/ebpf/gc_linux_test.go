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
		if got := ctTimeout(c.state, time.Duration(c.timeout)*time.Second); got != c.want {
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

// TestCtIdle: entry times are a 32-bit clock of ~1 ms units; the idle time
// survives its wrap, and a stamp written after the GC read the clock is not
// idle at all.
func TestCtIdle(t *testing.T) {
	unit := time.Duration(1) << ctTimeShift
	for _, c := range []struct {
		name      string
		now, last uint32
		want      time.Duration
	}{
		{"same tick", 500, 500, 0},
		{"a second", 2000, 1000, 1000 * unit},
		{"across the wrap", 5, 0xffff_fffb, 10 * unit},
		{"stamped after the read", 1000, 1001, 0},
		{"stamped after the read, across the wrap", 0xffff_ffff, 2, 0},
	} {
		if got := ctIdle(c.now, c.last); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
	if ctTick(uint64(3)<<ctTimeShift+5) != 3 || ctTick(uint64(1)<<(32+ctTimeShift)) != 0 {
		t.Fatal("tick of a time")
	}
}
