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

// TestDaemonWithKernelDataplane: the daemon loads the eBPF data plane and
// steers mode 4 with it. Started without --interfaces (this test runs in the
// host's namespace, whose interfaces it must not touch), it says the kernel
// path is not ready and why, and refuses L4 rules instead of accepting rules
// no packet would reach.
func TestDaemonWithKernelDataplane(t *testing.T) {
	requireRoot(t)
	pin := filepath.Join("/sys/fs/bpf", fmt.Sprintf("loxilb-e2e-%d", os.Getpid()))
	t.Cleanup(func() { _ = os.RemoveAll(pin) })
	d := daemontest.Start(t, bins, t.TempDir(), []string{"LLB_KV_NONE_HASH_SEED=" + seed}, "--no-dataplane=false", "--bpf-pin-path", pin,
		"--tokenizer-dir", tokenizerDir(), "--metrics", "--proxy-receipts", "on-request")
	var caps struct {
		Capabilities []struct {
			Name       string
			Ready      bool
			ReasonCode string `json:"reason_code"`
			Reason     string
		}
	}
	getJSON(t, d.URL("/status/capabilities"), &caps)
	found := false
	for _, c := range caps.Capabilities {
		if c.Name == "ebpf_dataplane" {
			found = true
			if c.Ready || c.ReasonCode != "no_interfaces" || !strings.Contains(c.Reason, "no interface") {
				t.Fatalf("data plane without interfaces: %+v\n%s", c, d.Logs())
			}
		}
	}
	if !found {
		t.Fatalf("no ebpf_dataplane capability: %+v", caps)
	}
	rule := `{"serviceArguments":{"externalIP":"127.0.61.1","port":80,"protocol":"tcp","mode":2,"sel":0},
		"endpoints":[{"endpointIP":"127.0.61.2","targetPort":8080,"weight":1},{"endpointIP":"127.0.61.3","targetPort":8080,"weight":1}]}`
	resp, body := post(t, d.URL("/config/loadbalancer"), json.RawMessage(rule))
	if resp.StatusCode != 412 || !strings.Contains(string(body), "EBPF_NO_INTERFACES") {
		t.Fatalf("L4 rule with no interface attached: %d %s", resp.StatusCode, body)
	}
	if entries, err := os.ReadDir(pin); err != nil || len(entries) == 0 {
		t.Fatalf("maps not pinned under %s: %v", pin, err)
	}
	if !strings.Contains(d.Logs(), "mode4_steering=true") {
		t.Errorf("daemon did not report mode-4 steering:\n%s", d.Logs())
	}

	// Mode 4 with the data plane: sk_lookup hands VIP:port connections to
	// the proxy's steering listener, which still finds the rule by VIP.
	e := startEngine(t, enginesimVLLM("127.0.61.12"))
	_ = e
	rule4 := fmt.Sprintf(`{"serviceArguments":{"externalIP":"127.0.61.10","port":28080,"protocol":"tcp","mode":4,"sel":0,"kvExactMode":3,
		"kvEngineType":"vllm","kvZmqPort":25557,"model_name":%q},"endpoints":[{"endpointIP":"127.0.61.12","targetPort":28000,"weight":1}]}`, model)
	if resp, body := post(t, d.URL("/config/loadbalancer"), json.RawMessage(rule4)); resp.StatusCode != 200 {
		t.Fatalf("mode-4 rule with the data plane: %d %s", resp.StatusCode, body)
	}
	r := complete(t, "127.0.61.10:28080", longPrompt("steering", 0))
	if r.ep != 0 {
		t.Fatalf("request through the steered VIP: %+v", r)
	}
	if v := metricValue(metrics(t, d), "loxilb_dataplane_packets_total", `reason="proxy_steered"`); v < 1 {
		m := metrics(t, d)
		var lines []string
		for _, l := range strings.Split(m, "\n") {
			if strings.HasPrefix(l, "loxilb_dataplane") {
				lines = append(lines, l)
			}
		}
		t.Errorf("no connection was steered by sk_lookup (proxy_steered=%v):\n%s\n%s", v, strings.Join(lines, "\n"), d.Logs())
	}
}
