//go:build linux

package ebpf

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/dataplanetest"
)

// testPin is a pin directory of this test's own under /sys/fs/bpf (the
// host's bpffs is shared with the child's private mount namespace), purged
// when the test ends.
func testPin(t *testing.T) string {
	t.Helper()
	pin := filepath.Join("/sys/fs/bpf", dataplanetest.UniqueName("lbrst"))
	t.Cleanup(func() {
		if err := os.RemoveAll(pin); err != nil {
			t.Errorf("remove pin path: %v", err)
		}
	})
	return pin
}

// tcxPrograms is how many programs are attached to ifname's TCX ingress.
func tcxPrograms(t *testing.T, ifname string) int {
	t.Helper()
	iface, err := net.InterfaceByName(ifname)
	if err != nil {
		t.Fatal(err)
	}
	res, err := link.QueryPrograms(link.QueryOptions{Target: iface.Index, Attach: ebpf.AttachTCXIngress})
	if err != nil {
		t.Fatalf("query TCX programs of %s: %v", ifname, err)
	}
	return len(res.Programs)
}

func pinned(t *testing.T, path string) bool {
	t.Helper()
	_, err := os.Stat(path)
	return err == nil
}

// TestBadInterfaceLeavesPinnedState: a start naming an interface that does
// not exist fails with ErrConfig naming it, before touching the pinned
// links the previous run left serving.
func TestBadInterfaceLeavesPinnedState(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbbad") {
		return
	}
	fixtureNet(t)
	pin := testPin(t)
	d1, err := New(Config{PinPath: pin, Interfaces: []string{"lbt0"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	f := &fixture{t: t, d: d1}
	f.upsert(dataplane.Service{ID: 1, VIP: vipN(40), Port: 80}, ep(backend1, 8080))
	if err := d1.Close(); err != nil {
		t.Fatal(err)
	}

	_, err = New(Config{PinPath: pin, Interfaces: []string{"lbt0", "typo0"}}, nil)
	if !errors.Is(err, dataplane.ErrConfig) || !strings.Contains(err.Error(), `"typo0"`) {
		t.Fatalf("start with a mistyped interface: %v, want ErrConfig naming typo0", err)
	}
	if n := tcxPrograms(t, "lbt0"); n != 1 || !pinned(t, filepath.Join(pin, "tcx_lbt0")) {
		t.Fatalf("after the failed start: %d programs on lbt0, pinned %v", n, pinned(t, filepath.Join(pin, "tcx_lbt0")))
	}

	// A failure after the links are taken over (abandon) keeps the re-used
	// link attached and pinned and detaches only what that run attached.
	d2, err := New(Config{PinPath: pin, Interfaces: []string{"lbt0", "lbt1"}, GCInterval: time.Hour}, nil)
	if err != nil {
		t.Fatal(err)
	}
	close(d2.gcStop)
	<-d2.gcDone
	d2.abandon()
	if n := tcxPrograms(t, "lbt0"); n != 1 || !pinned(t, filepath.Join(pin, "tcx_lbt0")) {
		t.Fatalf("after an abandoned start: %d programs on lbt0, pinned %v", n, pinned(t, filepath.Join(pin, "tcx_lbt0")))
	}
	if n := tcxPrograms(t, "lbt1"); n != 0 || pinned(t, filepath.Join(pin, "tcx_lbt1")) {
		t.Fatalf("after an abandoned start: %d programs on lbt1 (attached by that run), pinned %v", n, pinned(t, filepath.Join(pin, "tcx_lbt1")))
	}

	d3, err := New(Config{PinPath: pin, Interfaces: []string{"lbt0"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d3.Purge()
	if st, err := d3.Stats(context.Background()); err != nil || len(st.Services) != 1 {
		t.Fatalf("services after the failed starts: %+v %v", st.Services, err)
	}
}

// TestDroppedInterfaceDetached: an interface left out of the configuration
// on restart loses tc_lb.
func TestDroppedInterfaceDetached(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbdrop") {
		return
	}
	fixtureNet(t)
	pin := testPin(t)
	d1, err := New(Config{PinPath: pin, Interfaces: []string{"lbt0", "lbt1"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := d1.Close(); err != nil {
		t.Fatal(err)
	}
	if tcxPrograms(t, "lbt0") != 1 || tcxPrograms(t, "lbt1") != 1 {
		t.Fatal("pinned links not attached after close")
	}
	d2, err := New(Config{PinPath: pin, Interfaces: []string{"lbt0"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Purge()
	if n := tcxPrograms(t, "lbt1"); n != 0 || pinned(t, filepath.Join(pin, "tcx_lbt1")) {
		t.Fatalf("dropped interface lbt1: %d programs, pinned %v", n, pinned(t, filepath.Join(pin, "tcx_lbt1")))
	}
	if n := tcxPrograms(t, "lbt0"); n != 1 {
		t.Fatalf("kept interface lbt0: %d programs", n)
	}
}

// TestRecoveredServicesReconciled: after a restart, services the control
// plane does not claim are removed and counted; an ID reused for another
// frontend, or a frontend taken by another ID, never inherits the old
// service's slot state.
func TestRecoveredServicesReconciled(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbghost") {
		return
	}
	fixtureNet(t)
	pin := testPin(t)
	cfg := Config{PinPath: pin, Interfaces: []string{"lbt0"}, GCInterval: time.Hour}
	d1, err := New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	f := &fixture{t: t, d: d1}
	for i, id := range []uint32{1, 2, 3, 5} {
		f.upsert(dataplane.Service{ID: id, VIP: vipN(byte(50 + i)), Port: 80}, ep(backend1, 8080))
	}
	f.run(step{name: "SYN to service 3", in: tcp(client, 52000, vipN(52), 80, fSYN), verdict: actRedirect,
		out: fwd(tcp(client, 52000, backend1, 8080, fSYN)), counters: map[string]uint64{"new_flow": 1, "fwd_redirect": 1}, ct: 2})
	if err := d1.Close(); err != nil {
		t.Fatal(err)
	}

	d2, err := New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Purge()
	f.d = d2
	f.upsert(dataplane.Service{ID: 2, VIP: vipN(51), Port: 80}, ep(backend1, 8080)) // the same service: kept
	f.upsert(dataplane.Service{ID: 3, VIP: vipN(60), Port: 80}, ep(backend1, 8080)) // ID 3 now names another VIP
	f.upsert(dataplane.Service{ID: 4, VIP: vipN(50), Port: 80}, ep(backend1, 8080)) // VIP of leftover 1
	if got := d2.StaleServicesRemoved(); got != 2 {
		t.Fatalf("stale services removed by upserts: %d, want 2", got)
	}
	d2.GC() // the predecessors' flows are stale
	st, err := d2.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if st.Services[3].Flows != 0 || len(f.ct()) != 0 {
		t.Fatalf("service 3 inherited its predecessor's state: %+v, %d conntrack entries", st.Services[3], len(f.ct()))
	}
	ids, err := d2.PruneRecovered(context.Background())
	if err != nil || len(ids) != 1 || ids[0] != 5 {
		t.Fatalf("pruned %v %v, want [5]", ids, err)
	}
	if got := d2.StaleServicesRemoved(); got != 3 {
		t.Fatalf("stale services removed: %d, want 3", got)
	}
	st, _ = d2.Stats(context.Background())
	if _, ok := st.Services[1]; ok || len(st.Services) != 3 {
		t.Fatalf("services after pruning: %+v", st.Services)
	}
	f.run(step{name: "SYN to the pruned service's VIP", in: tcp(client, 52001, vipN(53), 80, fSYN), verdict: actOK,
		counters: map[string]uint64{"pass_no_service": 1}})
}

// TestRecoveredVIPRouteRemoved: deleting a mode-4 service after a restart
// removes the local route the previous run added for its VIP.
func TestRecoveredVIPRouteRemoved(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbroute") {
		return
	}
	pin := testPin(t)
	vip := netip.MustParseAddr("172.31.100.7")
	local := func() bool {
		rs, err := netlink.RouteGet(vip.AsSlice())
		return err == nil && len(rs) > 0 && rs[0].Type == unix.RTN_LOCAL
	}
	d1, err := New(Config{PinPath: pin}, nil)
	if err != nil {
		t.Fatal(err)
	}
	lc := net.ListenConfig{}
	lc.SetMultipathTCP(false)
	ln, err := lc.Listen(context.Background(), "tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := uint16(ln.Addr().(*net.TCPAddr).Port)
	if err := d1.RegisterProxyListener(port, ln.(*net.TCPListener)); err != nil {
		t.Fatal(err)
	}
	for _, id := range []uint32{7, 8} {
		if err := d1.UpsertService(context.Background(), dataplane.Service{ID: id, VIP: vip, Port: uint16(80 + id), Proto: "tcp",
			Mode: dataplane.ModeFullProxy, ProxyPort: port}, nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := d1.Close(); err != nil {
		t.Fatal(err)
	}
	if !local() {
		t.Fatal("VIP not local after close")
	}

	d2, err := New(Config{PinPath: pin}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Purge()
	if err := d2.DeleteService(context.Background(), 7); err != nil {
		t.Fatal(err)
	}
	if !local() {
		t.Fatal("VIP no longer local while service 8 still uses it")
	}
	if err := d2.DeleteService(context.Background(), 8); err != nil {
		t.Fatal(err)
	}
	if local() {
		t.Fatal("VIP still local after its last recovered service was deleted")
	}
}

// TestIncompatiblePinnedMapRecreated: a pin directory left by a version
// with another map layout (here: a conntrack value of the old size and a
// shorter counter array) does not stop the start; those maps are created
// afresh, the compatible ones are kept.
func TestIncompatiblePinnedMapRecreated(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbcompat") {
		return
	}
	pin := testPin(t)
	// The test's mount namespace has no bpffs until a data plane mounts it.
	if err := ensureBPFFS(pin); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(pin, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, m := range []*ebpf.MapSpec{
		// The 88-byte value before the conntrack entry was packed into one cache line.
		{Name: "lb_conntrack", Type: ebpf.LRUHash, KeySize: 16, ValueSize: 88, MaxEntries: 1024},
		{Name: "lb_counters", Type: ebpf.PerCPUArray, KeySize: 4, ValueSize: 8, MaxEntries: 21},
		{Name: "lb_rr_cursor", Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: dataplane.MaxServices},
	} {
		old, err := ebpf.NewMap(m)
		if err != nil {
			t.Fatal(err)
		}
		if err := old.Pin(filepath.Join(pin, m.Name)); err != nil {
			t.Fatal(err)
		}
		if m.Name == "lb_rr_cursor" {
			old.Put(uint32(7), uint32(42))
		}
		old.Close()
	}
	d, err := New(Config{PinPath: pin, GCInterval: time.Hour}, nil)
	if err != nil {
		t.Fatalf("start on a pin directory of another layout: %v", err)
	}
	defer d.Purge()
	if vs := d.objs.LbConntrack.ValueSize(); vs != uint32(binary.Size(lbCtVal{})) {
		t.Fatalf("conntrack value size %d: the old map was kept", vs)
	}
	var cur uint32
	if err := d.objs.LbRrCursor.Lookup(uint32(7), &cur); err != nil || cur != 42 {
		t.Fatalf("a compatible pinned map was not kept: cursor %d, %v", cur, err)
	}
	if _, err := d.Stats(context.Background()); err != nil {
		t.Fatal(err)
	}
}
