//go:build linux

package ebpf

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/dataplanetest"
)

func TestConformance(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbconf") {
		return
	}
	dataplanetest.RunConformance(t, func(t *testing.T) dataplane.Dataplane {
		d, err := New(Config{}, nil)
		if err != nil {
			t.Fatal(err)
		}
		return d
	})
}

func TestOpenReportsCapability(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbcap") {
		return
	}
	reg := prometheus.NewRegistry()
	dp, capab, err := Open(Config{Interfaces: []string{"lo"}}, nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	defer dp.Close()
	if !capab.Ready || capab.Name != "ebpf_dataplane" {
		t.Fatalf("capability %+v", capab)
	}
	if err := dp.UpsertService(context.Background(), dataplane.Service{ID: 1, VIP: vipN(1), Port: 80, Proto: "tcp"},
		[]dataplane.Endpoint{ep(backend1, 80)}); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, mf := range mfs {
		names[mf.GetName()] = true
	}
	for _, want := range []string{"loxilb_dataplane_packets_total", "loxilb_dataplane_service_flows_total", "loxilb_dataplane_conntrack_entries"} {
		if !names[want] {
			t.Errorf("metric %s missing (have %v)", want, names)
		}
	}

	_, capab, err = Open(Config{Interfaces: []string{"nosuchif0"}}, nil, nil)
	if err == nil || capab.Ready || capab.Reason == "" {
		t.Fatalf("bad interface: err %v capability %+v", err, capab)
	}
	_, capab, err = Open(Config{PinPath: t.TempDir()}, nil, nil)
	if !errors.Is(err, dataplane.ErrInvalid) || capab.Ready {
		t.Fatalf("pin path off bpffs: err %v capability %+v", err, capab)
	}
}

// TestRestartKeepsState opens a pinned data plane, installs a service and a
// flow, closes it (as a daemon exit would) and opens again: the service, its
// index and the flow's conntrack entries must survive.
func TestRestartKeepsState(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbpin") {
		return
	}
	fixtureNet(t)
	pin := filepath.Join("/sys/fs/bpf", dataplanetest.UniqueName("lbtest"))
	cfg := Config{PinPath: pin, Interfaces: []string{"lbt0"}}
	d1, err := New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	vip := vipN(20)
	f := &fixture{t: t, d: d1}
	f.upsert(dataplane.Service{ID: 42, VIP: vip, Port: 80, Mode: dataplane.ModeDNAT, Sel: dataplane.SelRoundRobin}, ep(backend1, 8080))
	f.run(step{name: "SYN", in: tcp(client, 50000, vip, 80, fSYN), verdict: actRedirect,
		out: fwd(tcp(client, 50000, backend1, 8080, fSYN)), counters: map[string]uint64{"new_flow": 1, "fwd_redirect": 1}, ct: 2})
	if err := d1.Close(); err != nil {
		t.Fatal(err)
	}

	d2, err := New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := d2.Purge(); err != nil {
			t.Errorf("purge: %v", err)
		}
		if _, err := os.Stat(pin); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("pin path still there after purge: %v", err)
		}
	}()
	st, err := d2.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if s, ok := st.Services[42]; !ok || s.Flows != 1 {
		t.Fatalf("after restart: services %+v", st.Services)
	}
	f.d = d2
	f.run(step{name: "established flow continues", in: tcp(client, 50000, vip, 80, fACK), verdict: actRedirect,
		out: fwd(tcp(client, 50000, backend1, 8080, fACK)), counters: map[string]uint64{"ct_hit_orig": 1, "fwd_redirect": 1}})
	// The control plane re-upserts its desired state after a restart.
	f.upsert(dataplane.Service{ID: 42, VIP: vip, Port: 80, Mode: dataplane.ModeDNAT, Sel: dataplane.SelRoundRobin}, ep(backend1, 8080))
	f.run(step{name: "flow survives the re-upsert", in: tcp(client, 50000, vip, 80, fACK), verdict: actRedirect,
		out: fwd(tcp(client, 50000, backend1, 8080, fACK)), counters: map[string]uint64{"ct_hit_orig": 1, "fwd_redirect": 1}})
}

func TestConntrackGC(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbgc") {
		return
	}
	fixtureNet(t)
	d := newTestDP(t, Config{GCInterval: time.Hour})
	f := &fixture{t: t, d: d}
	vip := vipN(30)
	f.upsert(dataplane.Service{ID: 1, VIP: vip, Port: 80, InactiveTimeout: time.Second}, ep(backend1, 80))
	f.run(step{name: "SYN", in: tcp(client, 51000, vip, 80, fSYN), verdict: actRedirect,
		out: fwd(tcp(client, 51000, backend1, 80, fSYN)), counters: map[string]uint64{"new_flow": 1, "fwd_redirect": 1}, ct: 2})
	if n := d.GC(); n != 0 {
		t.Fatalf("fresh entries collected: %d", n)
	}
	time.Sleep(1100 * time.Millisecond) // the timeout under test; no faster clock exists for bpf_ktime_get_coarse_ns
	if n := d.GC(); n != 2 {
		t.Fatalf("expired entries collected: %d, want 2", n)
	}
	if st, _ := d.Stats(context.Background()); st.ConntrackEntries != 0 {
		t.Fatalf("conntrack entries %d after GC", st.ConntrackEntries)
	}
	late := tcp(client, 51000, vip, 80, fACK)
	f.run(step{name: "late packet of the expired flow: RST back to the client", in: late, verdict: actRedirect, out: rstTo(late),
		counters: map[string]uint64{"drop_not_syn": 1, "rst_sent": 1}})
	// Deleting a service makes its flows stale: the GC drops them at once.
	f.run(step{name: "SYN", in: tcp(client, 51001, vip, 80, fSYN), verdict: actRedirect,
		out: fwd(tcp(client, 51001, backend1, 80, fSYN)), counters: map[string]uint64{"new_flow": 1, "fwd_redirect": 1}, ct: 2})
	if err := d.DeleteService(context.Background(), 1); err != nil {
		t.Fatal(err)
	}
	if n := d.GC(); n != 2 {
		t.Fatalf("GC removed %d entries of the deleted service, want 2", n)
	}
	if n := len(f.ct()); n != 0 {
		t.Fatalf("%d conntrack entries after delete", n)
	}
}

// TestSkLookupSteering checks mode 4: a connection to VIP:port lands on the
// registered proxy listener, which sees the VIP as its local address.
func TestSkLookupSteering(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbsk") {
		return
	}
	d := newTestDP(t, Config{})
	lc := net.ListenConfig{}
	lc.SetMultipathTCP(false)
	ln, err := lc.Listen(context.Background(), "tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := uint16(ln.Addr().(*net.TCPAddr).Port)
	if err := d.RegisterProxyListener(port, ln.(*net.TCPListener)); err != nil {
		t.Fatal(err)
	}
	vip := netip.MustParseAddr("172.31.100.1")
	if err := d.UpsertService(context.Background(), dataplane.Service{ID: 4, VIP: vip, Port: 80, Proto: "tcp",
		Mode: dataplane.ModeFullProxy, ProxyPort: port}, nil); err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			io.WriteString(c, c.LocalAddr().String())
			c.Close()
		}
	}()
	for i := range 20 { // short connections, the proxy closes first (TIME_WAIT on its side)
		c, err := net.DialTimeout("tcp4", "172.31.100.1:80", 5*time.Second)
		if err != nil {
			t.Fatalf("dial %d: %v", i, err)
		}
		b, _ := io.ReadAll(c)
		c.Close()
		if string(b) != "172.31.100.1:80" {
			t.Fatalf("proxy saw local address %q, want the VIP", b)
		}
	}
	st, _ := d.Stats(context.Background())
	if st.Counters["proxy_steered"] < 20 {
		t.Fatalf("proxy_steered = %d", st.Counters["proxy_steered"])
	}
	fp := dataplane.Service{ID: 4, VIP: vip, Port: 80, Proto: "tcp", Mode: dataplane.ModeFullProxy, ProxyPort: port}
	if err := d.UpsertService(context.Background(), fp, nil); err != nil { // idempotent re-upsert
		t.Fatal(err)
	}
	// Switching the same frontend to the kernel path and back moves it
	// between the two maps.
	l4 := fp
	l4.Mode = dataplane.ModeDNAT
	if err := d.UpsertService(context.Background(), l4, []dataplane.Endpoint{ep(backend1, 80)}); err != nil {
		t.Fatal(err)
	}
	k := lbSvcKey{Vip: nbo32(vip), Port: nbo16(80), Proto: 6}
	var pv lbProxyVal
	var sv lbSvcVal
	if err := d.objs.LbProxyVips.Lookup(k, &pv); err == nil {
		t.Fatal("proxy entry left after switching to mode 0")
	}
	if err := d.objs.LbServices.Lookup(k, &sv); err != nil {
		t.Fatalf("mode 0 entry missing: %v", err)
	}
	if err := d.UpsertService(context.Background(), fp, nil); err != nil {
		t.Fatal(err)
	}
	if err := d.objs.LbServices.Lookup(k, &sv); err == nil {
		t.Fatal("kernel entry left after switching back to mode 4")
	}
	if c, err := net.DialTimeout("tcp4", "172.31.100.1:80", 5*time.Second); err != nil {
		t.Fatalf("after switching back: %v", err)
	} else {
		c.Close()
	}
	if err := d.DeleteService(context.Background(), 4); err != nil {
		t.Fatal(err)
	}
	if _, err := net.DialTimeout("tcp4", "172.31.100.1:80", time.Second); err == nil {
		t.Fatal("VIP still answers after delete")
	}
	if rs, err := netlink.RouteGet(vip.AsSlice()); err == nil && len(rs) > 0 && rs[0].Type == unix.RTN_LOCAL {
		t.Fatal("VIP still local after delete")
	}

	mp, err := net.Listen("tcp4", "127.0.0.1:0") // MPTCP by default
	if err != nil {
		t.Fatal(err)
	}
	defer mp.Close()
	if err := d.RegisterProxyListener(1, mp.(*net.TCPListener)); err != nil && !errors.Is(err, dataplane.ErrUnsupported) {
		t.Fatalf("MPTCP listener: %v, want nil or ErrUnsupported", err)
	}
}
