//go:build linux

package netns

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/loxilb-llm/loxilb/testbed/daemontest"
)

// TestCleanup kills the real daemon (SIGKILL, so it removes nothing) after
// it attached to the lab's interfaces, pinned its maps, made a mode-4 VIP
// local and balanced a mode-0 VIP, then runs `loxilb cleanup` and checks
// the kernel holds nothing of it. A second daemon, and cleanup, on the pin
// path of a running daemon are refused naming its pid.
func TestCleanup(t *testing.T) {
	lab := withLab(t, 2)
	if lab == nil {
		return
	}
	bins, err := daemontest.Build()
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(bins.Dir)
	ifaces := strings.Join(lab.LBIfaces, ",")
	pin := daemonPin(t)
	d := startDaemon(t, bins, t.TempDir(), pin, "--interfaces", ifaces)
	l4, proxied := VIP(8), VIP(9)
	if code, body := postRule(t, d, mode0Rule(l4, 0, 1)); code != http.StatusOK {
		t.Fatalf("create mode 0: %d %s", code, body)
	}
	rule := fmt.Sprintf(`{"serviceArguments":{"externalIP":%q,"port":80,"protocol":"tcp","mode":4,"sel":0},`+
		`"endpoints":[{"endpointIP":%q,"targetPort":8080,"weight":1}]}`, proxied, BackendAddr(0))
	if code, body := postRule(t, d, rule); code != http.StatusOK {
		t.Fatalf("create mode 4: %d %s", code, body)
	}
	curl(t, lab, l4, 80)
	pid := fmt.Sprint(d.PID())

	// A second daemon on the same pin path refuses to start, naming the first.
	code, out := runDaemon(t, bins, t.TempDir(), pin, "--interfaces", ifaces)
	if code == 0 || !strings.Contains(out, "process "+pid) || !strings.Contains(out, "different --bpf-pin-path") {
		t.Fatalf("second daemon on %s: exit %d, want non-zero naming pid %s and --bpf-pin-path:\n%s", pin, code, pid, out)
	}
	// So does cleanup, and the running daemon keeps serving.
	code, out = runCleanup(t, bins, pin)
	if code == 0 || !strings.Contains(out, "process "+pid) {
		t.Fatalf("cleanup while pid %s runs: exit %d, want non-zero naming it:\n%s", pid, code, out)
	}
	curl(t, lab, l4, 80)

	if err := syscall.Kill(d.PID(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); !d.Exited(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("daemon still running 10 s after SIGKILL")
		}
	}
	// What a killed daemon leaves: the pinned program still balances, the
	// VIP is still local.
	curl(t, lab, l4, 80)
	if !vipLocal(t, proxied) || kernelPrograms(t, lab) == 0 {
		t.Fatalf("after SIGKILL: VIP local %v, programs %d; want the leftovers the test removes", vipLocal(t, proxied), kernelPrograms(t, lab))
	}

	code, out = runCleanup(t, bins, pin)
	if code != 0 {
		t.Fatalf("cleanup: exit %d:\n%s", code, out)
	}
	t.Logf("cleanup:\n%s", out)
	for _, want := range []string{
		"detached tc_lb from " + lab.LBIfaces[0], "detached tc_lb from " + lab.LBIfaces[1],
		"detached sk_lookup from the network namespace", "unpinned map " + pin + "/lb_services",
		"removed route local " + proxied.String() + " dev lo", "removed pin directory " + pin,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("cleanup output lacks %q:\n%s", want, out)
		}
	}
	if _, err := os.Stat(pin); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pin path %s after cleanup: %v", pin, err)
	}
	if n := kernelPrograms(t, lab); n != 0 {
		t.Errorf("%d programs still attached (TCX on %s, sk_lookup on the namespace)", n, ifaces)
	}
	if vipLocal(t, proxied) {
		t.Errorf("mode-4 VIP %v still local after cleanup", proxied)
	}
	if out, err := Exec(lab.Client, "curl", "-sS", "--max-time", "2", fmt.Sprintf("http://%s:80/", l4)); err == nil {
		t.Errorf("mode-0 VIP still balanced after cleanup: %q", out)
	}

	code, out = runCleanup(t, bins, pin)
	if code != 0 || !strings.Contains(out, "nothing to remove") {
		t.Fatalf("second cleanup: exit %d, want 0 and \"nothing to remove\":\n%s", code, out)
	}
}

// kernelPrograms counts the TCX ingress programs on the LB's interfaces and
// the sk_lookup programs of its network namespace (this process's).
func kernelPrograms(t *testing.T, lab *Lab) int {
	t.Helper()
	n := 0
	for _, name := range lab.LBIfaces {
		iface, err := net.InterfaceByName(name)
		if err != nil {
			t.Fatal(err)
		}
		res, err := link.QueryPrograms(link.QueryOptions{Target: iface.Index, Attach: ebpf.AttachTCXIngress})
		if err != nil {
			t.Fatalf("query TCX programs of %s: %v", name, err)
		}
		n += len(res.Programs)
	}
	ns, err := os.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	res, err := link.QueryPrograms(link.QueryOptions{Target: int(ns.Fd()), Attach: ebpf.AttachSkLookup})
	if err != nil {
		t.Fatalf("query sk_lookup programs: %v", err)
	}
	return n + len(res.Programs)
}

// runCleanup runs `loxilb cleanup --bpf-pin-path pin` and returns its exit
// code and output.
func runCleanup(t *testing.T, b *daemontest.Binaries, pin string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, b.Loxilb, "cleanup", "--bpf-pin-path", pin).CombinedOutput()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0, string(out)
	case errors.As(err, &ee):
		return ee.ExitCode(), string(out)
	}
	t.Fatalf("run cleanup: %v\n%s", err, out)
	return 0, ""
}
