//go:build linux

package ebpf

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/dataplanetest"
)

// clsAttach attaches d's tc_lb with cls_bpf to ifname, as the TCX fallback
// does.
func clsAttach(t *testing.T, d *Dataplane, ifname string) {
	t.Helper()
	iface, err := net.InterfaceByName(ifname)
	if err != nil {
		t.Fatal(err)
	}
	q := &netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: iface.Index, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT}, QdiscType: "clsact"}
	if err := netlink.QdiscReplace(q); err != nil {
		t.Fatal(err)
	}
	if err := netlink.FilterReplace(clsFilter(iface.Index, d.objs.TcLb.FD())); err != nil {
		t.Fatal(err)
	}
}

func clsFilters(t *testing.T, ifname string) int {
	t.Helper()
	l, err := netlink.LinkByName(ifname)
	if err != nil {
		t.Fatal(err)
	}
	fs, err := netlink.FilterList(l, netlink.HANDLE_MIN_INGRESS)
	if err != nil {
		t.Fatal(err)
	}
	return len(fs)
}

func localRouted(t *testing.T, vip netip.Addr) bool {
	t.Helper()
	rs, err := netlink.RouteGet(vip.AsSlice())
	if err != nil { // unreachable: no route at all, so not local
		return false
	}
	return len(rs) > 0 && rs[0].Type == unix.RTN_LOCAL
}

// TestCleanup: what a data plane pinned and attached (a TCX link, a
// cls_bpf filter, the sk_lookup link, maps, a local VIP route) outlives its
// process; Cleanup refuses while it runs, then removes all of it and only
// it (another data plane's cls_bpf filter stays), and a second run finds
// nothing.
func TestCleanup(t *testing.T) {
	if !dataplanetest.Isolated(t, "lbcln") {
		return
	}
	fixtureNet(t)
	pin := testPin(t)
	d, err := New(Config{PinPath: pin, Interfaces: []string{"lbt0"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	clsAttach(t, d, "lbt1")
	vip := netip.MustParseAddr("172.31.100.9")
	d.mu.Lock()
	err = d.addLocalRoute(vip, 1)
	d.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	// Another data plane (no pins) with its own cls_bpf filter.
	other, err := New(Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	clsAttach(t, other, "lbt1p")
	defer func() {
		iface, _ := net.InterfaceByName("lbt1p")
		netlink.FilterDel(clsFilter(iface.Index, other.objs.TcLb.FD()))
	}()

	if rep, err := Cleanup(pin); !errors.Is(err, ErrPinPathBusy) || len(rep.Removed) != 0 {
		t.Fatalf("cleanup while the data plane runs: %+v %v, want ErrPinPathBusy and nothing removed", rep, err)
	}
	if !pinned(t, filepath.Join(pin, "lb_services")) || !localRouted(t, vip) {
		t.Fatal("a refused cleanup removed something")
	}

	// A map an older version pinned, which this build does not have.
	pinMap(t, filepath.Join(pin, "lb_old_version"))

	if err := d.Close(); err != nil { // as a killed daemon: everything stays
		t.Fatal(err)
	}
	if tcxPrograms(t, "lbt0") != 1 || clsFilters(t, "lbt1") != 1 || !localRouted(t, vip) {
		t.Fatal("the closed data plane's attachments are gone before cleanup")
	}
	rep, err := Cleanup(pin)
	if err != nil {
		t.Fatal(err)
	}
	out := strings.Join(rep.Removed, "\n")
	for _, want := range []string{"detached tc_lb from lbt0", "detached tc_lb (cls_bpf) from lbt1", "detached sk_lookup",
		"unpinned map " + filepath.Join(pin, "lb_conntrack"), "unpinned map " + filepath.Join(pin, "lb_old_version"),
		"removed pin directory " + pin} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
	// The other data plane still steers this namespace: the marked route
	// may be its, so it is left, and removed once that one is gone.
	if left := strings.Join(rep.Left, "\n"); !strings.Contains(left, "route local 172.31.100.9") || !localRouted(t, vip) {
		t.Errorf("marked route with another data plane attached: left %q, local %v; want it left", left, localRouted(t, vip))
	}
	other.Close()
	rep, err = Cleanup(pin)
	if err != nil || len(rep.Removed) != 1 || !strings.Contains(rep.Removed[0], "removed route local 172.31.100.9 dev lo") {
		t.Errorf("cleanup once the other data plane stopped: %+v %v, want the route removed", rep, err)
	}
	if n := tcxPrograms(t, "lbt0"); n != 0 {
		t.Errorf("%d TCX programs on lbt0 after cleanup", n)
	}
	if n := clsFilters(t, "lbt1"); n != 0 {
		t.Errorf("%d cls_bpf filters on lbt1 after cleanup", n)
	}
	if n := clsFilters(t, "lbt1p"); n != 1 {
		t.Errorf("the other data plane's cls_bpf filter: %d filters on lbt1p, want 1 left", n)
	}
	if localRouted(t, vip) {
		t.Error("VIP still local after cleanup")
	}
	if pinned(t, pin) {
		t.Error("pin directory still there")
	}
	if rep, err := Cleanup(pin); err != nil || len(rep.Removed)+len(rep.Left) != 0 {
		t.Fatalf("second cleanup: %+v %v, want nothing", rep, err)
	}

	// What is not the data plane's is left, and the directory with it.
	if err := os.Mkdir(pin, 0o700); err != nil {
		t.Fatal(err)
	}
	pinMap(t, filepath.Join(pin, "tool_map"))
	rep, err = Cleanup(pin)
	if err != nil || len(rep.Removed) != 0 || len(rep.Left) != 1 || !strings.Contains(rep.Left[0], "tool_map") || !pinned(t, filepath.Join(pin, "tool_map")) {
		t.Fatalf("cleanup of a directory holding another tool's map: %+v %v, want it left", rep, err)
	}
}

// pinMap pins a small array map at path.
func pinMap(t *testing.T, path string) {
	t.Helper()
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Pin(path); err != nil {
		t.Fatal(err)
	}
}

// TestCleanupRefusesNonBPFFS: a pin path that is not on bpffs (a typo such
// as a home directory) is refused and nothing in it removed.
func TestCleanupRefusesNonBPFFS(t *testing.T) {
	dataplanetest.RequirePrivileged(t)
	dir := t.TempDir()
	keep := filepath.Join(dir, "lb_services")
	if err := os.WriteFile(keep, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := Cleanup(dir)
	if !errors.Is(err, dataplane.ErrConfig) || !strings.Contains(err.Error(), "not on a bpffs mount") {
		t.Fatalf("cleanup of %s: %v, want ErrConfig naming bpffs", dir, err)
	}
	if _, err := os.Stat(keep); err != nil {
		t.Fatalf("file removed: %v", err)
	}
}
