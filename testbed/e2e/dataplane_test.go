package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/testbed/daemontest"
)

// requireRoot skips outside CI when not root; in CI (root) it never skips.
func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("CI runs as root: this privileged test must run")
	}
	t.Skip("needs root to load BPF programs (runs in CI)")
}

// TestDaemonWithKernelDataplane: the daemon loads the eBPF data plane,
// reports it ready, installs an L4 rule into it and keeps serving mode 4.
func TestDaemonWithKernelDataplane(t *testing.T) {
	requireRoot(t)
	pin := filepath.Join("/sys/fs/bpf", fmt.Sprintf("loxilb-e2e-%d", os.Getpid()))
	t.Cleanup(func() { _ = os.RemoveAll(pin) })
	d := daemontest.Start(t, bins, t.TempDir(), nil, "--no-dataplane=false", "--bpf-pin-path", pin)
	var caps struct {
		Capabilities []struct {
			Name   string
			Ready  bool
			Reason string
		}
	}
	getJSON(t, d.URL("/status/capabilities"), &caps)
	ready := false
	for _, c := range caps.Capabilities {
		if c.Name == "ebpf_dataplane" {
			ready = c.Ready
			if !ready {
				t.Fatalf("data plane not ready as root: %s\n%s", c.Reason, d.Logs())
			}
		}
	}
	if !ready {
		t.Fatalf("no ebpf_dataplane capability: %+v", caps)
	}
	rule := `{"serviceArguments":{"externalIP":"127.0.61.1","port":80,"protocol":"tcp","mode":2,"sel":0},
		"endpoints":[{"endpointIP":"127.0.61.2","targetPort":8080,"weight":1},{"endpointIP":"127.0.61.3","targetPort":8080,"weight":1}]}`
	resp, body := post(t, d.URL("/config/loadbalancer"), json.RawMessage(rule))
	if resp.StatusCode != 200 {
		t.Fatalf("L4 rule with the data plane: %d %s", resp.StatusCode, body)
	}
	if entries, err := os.ReadDir(pin); err != nil || len(entries) == 0 {
		t.Fatalf("maps not pinned under %s: %v", pin, err)
	}
	if !strings.Contains(d.Logs(), "eBPF data plane ready") {
		t.Errorf("daemon did not report the data plane:\n%s", d.Logs())
	}
}
