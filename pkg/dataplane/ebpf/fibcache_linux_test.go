//go:build linux

package ebpf

import (
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/dataplanetest"
)

// waitFIBGeneration waits until the data plane has seen a routing change
// after generation before.
func waitFIBGeneration(t *testing.T, d *Dataplane, before uint32) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for d.FIBGeneration() == before {
		if time.Now().After(deadline) {
			t.Fatalf("FIB generation still %d: the routing change was not noticed", before)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func ipCmd(t *testing.T, args string) {
	t.Helper()
	if err := dataplanetest.Run("ip", strings.Fields(args)...); err != nil {
		t.Fatal(err)
	}
}

func macOf(t *testing.T, ifname string) []byte {
	t.Helper()
	i, err := net.InterfaceByName(ifname)
	if err != nil {
		t.Fatal(err)
	}
	return i.HardwareAddr
}

// TestFIBCacheFollowsChanges: a conntrack hit reuses the FIB result cached
// in its entry (counter fib_cached), and a neighbour change, a route change,
// the cache's lifetime and a packet longer than any the FIB checked each
// make the next packet ask the FIB again, so the flow follows at once.
func TestFIBCacheFollowsChanges(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbfib") {
		return
	}
	fixtureNet(t)
	// The endpoint sits behind a next hop: first 172.31.1.12 on lbt0, then
	// 172.31.2.12 on lbt1.
	ipCmd(t, "neigh replace 172.31.2.12 lladdr 02:00:00:00:02:0c dev lbt1 nud permanent")
	ipCmd(t, "route add 172.31.5.5/32 via 172.31.1.12 dev lbt0")
	f := &fixture{t: t, d: newTestDP(t, Config{})}
	vip, be := vipN(7), netip.MustParseAddr("172.31.5.5")
	f.upsert(dataplane.Service{ID: 7, VIP: vip, Port: 80, Mode: dataplane.ModeDNAT}, ep(be, 8080))

	via := func(p pkt, dst []byte, src string) *pkt {
		p.ttl, p.dstMAC, p.srcMAC = 63, dst, macOf(t, src)
		return &p
	}
	hop1 := []byte{0x02, 0, 0, 0, 0x01, 0x0c}
	hop1b := []byte{0x02, 0, 0, 0, 0x01, 0x0d}
	hop2 := []byte{0x02, 0, 0, 0, 0x02, 0x0c}
	lookedUp := map[string]uint64{"ct_hit_orig": 1, "fwd_redirect": 1}
	cached := map[string]uint64{"ct_hit_orig": 1, "fwd_redirect": 1, "fib_cached": 1}
	ack := tcp(client, 41000, vip, 80, fACK)
	out := tcp(client, 41000, be, 8080, fACK)

	f.run(step{name: "SYN", in: tcp(client, 41000, vip, 80, fSYN), verdict: actRedirect,
		out: via(tcp(client, 41000, be, 8080, fSYN), hop1, "lbt0"), counters: map[string]uint64{"new_flow": 1, "fwd_redirect": 1}, ct: 2})
	f.run(step{name: "first hit asks the FIB", in: ack, verdict: actRedirect, out: via(out, hop1, "lbt0"), counters: lookedUp})
	f.run(step{name: "next hit uses the cached result", in: ack, verdict: actRedirect, out: via(out, hop1, "lbt0"), counters: cached})

	// The reply direction caches its own result, and its cached redirect
	// counts as a reply hit.
	ipCmd(t, "neigh replace 172.31.2.2 lladdr 02:00:00:00:02:02 dev lbt1 nud permanent")
	cliMAC := []byte{0x02, 0, 0, 0, 0x02, 0x02}
	reply, replyOut := tcp(be, 8080, client, 41000, fACK), tcp(vip, 80, client, 41000, fACK)
	f.run(step{name: "first reply asks the FIB", in: reply, verdict: actRedirect, out: via(replyOut, cliMAC, "lbt1"),
		counters: map[string]uint64{"ct_hit_reply": 1, "fwd_redirect": 1}})
	f.run(step{name: "next reply uses the cached result", in: reply, verdict: actRedirect, out: via(replyOut, cliMAC, "lbt1"),
		counters: map[string]uint64{"ct_hit_reply": 1, "fwd_redirect": 1, "fib_cached": 1}})

	gen := f.d.FIBGeneration()
	ipCmd(t, "neigh replace 172.31.1.12 lladdr 02:00:00:00:01:0d dev lbt0 nud permanent")
	waitFIBGeneration(t, f.d, gen)
	f.run(step{name: "after a neighbour change: new MAC", in: ack, verdict: actRedirect, out: via(out, hop1b, "lbt0"), counters: lookedUp})
	f.run(step{name: "new MAC cached", in: ack, verdict: actRedirect, out: via(out, hop1b, "lbt0"), counters: cached})

	gen = f.d.FIBGeneration()
	ipCmd(t, "route replace 172.31.5.5/32 via 172.31.2.12 dev lbt1")
	waitFIBGeneration(t, f.d, gen)
	f.run(step{name: "after a route change: other next hop and device", in: ack, verdict: actRedirect, out: via(out, hop2, "lbt1"), counters: lookedUp})
	f.run(step{name: "new route cached", in: ack, verdict: actRedirect, out: via(out, hop2, "lbt1"), counters: cached})

	long := ack
	long.payload = strings.Repeat("x", 400)
	longOut := out
	longOut.payload = long.payload
	f.run(step{name: "a longer packet than the FIB checked asks it", in: long, verdict: actRedirect, out: via(longOut, hop2, "lbt1"), counters: lookedUp})
	f.run(step{name: "then that length is cached", in: long, verdict: actRedirect, out: via(longOut, hop2, "lbt1"), counters: cached})
	f.run(step{name: "and shorter ones too", in: ack, verdict: actRedirect, out: via(out, hop2, "lbt1"), counters: cached})

	// Age the cached result past its lifetime (as if no notification came).
	age := func() {
		for k, v := range f.ct() {
			if v.FibGen != 0 {
				v.FibStamp -= 2 * fibTTLUnits
				if err := f.d.objs.LbConntrack.Put(k, v); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	age()
	f.run(step{name: "an expired result is looked up again", in: ack, verdict: actRedirect, out: via(out, hop2, "lbt1"), counters: lookedUp})
	f.run(step{name: "and cached again", in: ack, verdict: actRedirect, out: via(out, hop2, "lbt1"), counters: cached})
}

// TestPrefilterSkipsConntrack: a packet whose destination is no frontend and
// whose source is no endpoint leaves after the prefilter, even when a
// conntrack entry with its tuple exists (planted here); a reply from an
// endpoint still reaches conntrack.
func TestPrefilterSkipsConntrack(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbpre") {
		return
	}
	fixtureNet(t)
	f := &fixture{t: t, d: newTestDP(t, Config{})}
	vip := vipN(8)
	f.upsert(dataplane.Service{ID: 8, VIP: vip, Port: 80, Mode: dataplane.ModeDNAT}, ep(backend1, 8080))
	f.run(step{name: "SYN", in: tcp(client, 42000, vip, 80, fSYN), verdict: actRedirect,
		out: fwd(tcp(client, 42000, backend1, 8080, fSYN)), counters: map[string]uint64{"new_flow": 1, "fwd_redirect": 1}, ct: 2})
	// Copy the flow's client entry to a tuple the prefilter does not know.
	var val lbCtVal
	for k, v := range f.ct() {
		if k.Daddr == nbo32(vip) {
			val = v
		}
	}
	if val.Flags&ctXlateDst == 0 {
		t.Fatal("no client entry for the flow")
	}
	planted := lbCtKey{Saddr: nbo32(client), Daddr: nbo32(other), Sport: nbo16(42000), Dport: nbo16(81), Proto: 6}
	if err := f.d.objs.LbConntrack.Put(planted, val); err != nil {
		t.Fatal(err)
	}
	f.run(step{name: "not a frontend, not from an endpoint: passed untouched", in: tcp(client, 42000, other, 81, fACK),
		verdict: actOK, counters: map[string]uint64{"pass_no_service": 1}})
	f.run(step{name: "reply from the endpoint", in: tcp(backend1, 8080, client, 42000, fSYN|fACK),
		verdict: actRedirect, out: fwd(tcp(vip, 80, client, 42000, fSYN|fACK)), counters: map[string]uint64{"ct_hit_reply": 1, "fwd_redirect": 1}})
	// The filter tests the lower port's side first; a client port below
	// the service's must still find the frontend on the second test.
	f.run(step{name: "client port below the service port", in: tcp(client, 20, vip, 80, fSYN), verdict: actRedirect,
		out: fwd(tcp(client, 20, backend1, 8080, fSYN)), counters: map[string]uint64{"new_flow": 1, "fwd_redirect": 1}, ct: 2})
	f.d.DeleteService(t.Context(), 8)
	f.run(step{name: "after the delete the VIP is not ours", in: tcp(client, 42000, vip, 80, fACK),
		verdict: actOK, counters: map[string]uint64{"pass_no_service": 1}})
}
