//go:build linux

package netns

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/dataplane/dataplanetest"
	"github.com/loxilb-llm/loxilb/testbed/daemontest"
)

// TestDaemonRestarts runs the real daemon in the lab's LB namespace and
// restarts it the ways operators get wrong: a mistyped interface, a wiped
// rule store, no interface at all. Each case has its own pin path under
// /sys/fs/bpf, removed at the end.
func TestDaemonRestarts(t *testing.T) {
	lab := withLab(t, 3)
	if lab == nil {
		return
	}
	bins, err := daemontest.Build()
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(bins.Dir)
	ifaces := strings.Join(lab.LBIfaces, ",")

	t.Run("MistypedInterfaceLeavesTrafficFlowing", func(t *testing.T) {
		pin, state := daemonPin(t), t.TempDir()
		d := startDaemon(t, bins, state, pin, "--interfaces", ifaces)
		vip := VIP(1)
		if code, body := postRule(t, d, mode0Rule(vip, 0, 1, 2)); code != http.StatusOK {
			t.Fatalf("create: %d %s", code, body)
		}
		curl(t, lab, vip, 80)
		d.Stop()
		curl(t, lab, vip, 80) // the pinned program serves while no daemon runs

		// Traffic keeps flowing while the daemon is started with a typo.
		stop := make(chan struct{})
		failures := make(chan []string, 1)
		go func() {
			var bad []string
			for i := 0; i < 1000; i++ {
				select {
				case <-stop:
					if i >= 3 { // a few requests even when the start fails at once
						failures <- bad
						return
					}
				default:
				}
				out, err := Exec(lab.Client, "curl", "-sS", "--max-time", "2", fmt.Sprintf("http://%s:80/", vip))
				if err != nil || !strings.Contains(out, "name=be") {
					bad = append(bad, fmt.Sprintf("%q %v", out, err))
				}
				time.Sleep(50 * time.Millisecond)
			}
			failures <- bad
		}()
		bad := strings.Join(lab.LBIfaces[:len(lab.LBIfaces)-1], ",") + ",typo0"
		code, out := runDaemon(t, bins, state, pin, "--interfaces", bad)
		close(stop)
		if code == 0 || !strings.Contains(out, `"typo0"`) {
			t.Errorf("daemon with --interfaces %s: exit %d, want non-zero naming typo0:\n%s", bad, code, out)
		}
		if f := <-failures; len(f) > 0 {
			t.Fatalf("%d requests through the VIP failed around the failed start: %v", len(f), f)
		}
		curl(t, lab, vip, 80)
		if t.Failed() {
			return
		}

		// Started right, it takes the pinned state over and serves the rule.
		d = startDaemon(t, bins, state, pin, "--interfaces", ifaces)
		if rules := listRules(t, d); len(rules) != 1 {
			t.Fatalf("rules after restart: %v", rules)
		}
		for i := range 3 {
			if r := curl(t, lab, vip, 80); r.name == "" {
				t.Fatalf("request %d after restart: %+v", i, r)
			}
		}
	})

	t.Run("WipedStateRemovesLeftovers", func(t *testing.T) {
		pin := daemonPin(t)
		d := startDaemon(t, bins, t.TempDir(), pin, "--interfaces", ifaces)
		for _, r := range []string{mode0Rule(VIP(2), 0, 1, 2), mode0Rule(VIP(3), 0, 1, 2)} {
			if code, body := postRule(t, d, r); code != http.StatusOK {
				t.Fatalf("create: %d %s", code, body)
			}
		}
		curl(t, lab, VIP(2), 80)
		curl(t, lab, VIP(3), 80)
		d.Stop()

		// Another (empty) state directory over the same pinned maps.
		d = startDaemon(t, bins, t.TempDir(), pin, "--interfaces", ifaces)
		if rules := listRules(t, d); len(rules) != 0 {
			t.Fatalf("rules in a fresh store: %v", rules)
		}
		m := scrape(t, d)
		if v := metricValue(m, "loxilb_dataplane_stale_services_removed_total"); v != 2 {
			t.Fatalf("stale services removed: %v, want 2\n%s", v, d.Logs())
		}
		if out, err := Exec(lab.Client, "curl", "-sS", "--max-time", "2", fmt.Sprintf("http://%s:80/", VIP(3))); err == nil {
			t.Fatalf("a service the store does not hold still answers: %q", out)
		}
		// The same VIP again, with another endpoint set: a fresh service.
		if code, body := postRule(t, d, mode0Rule(VIP(2), 1)); code != http.StatusOK {
			t.Fatalf("create on a leftover's VIP: %d %s", code, body)
		}
		for range 3 {
			if r := curl(t, lab, VIP(2), 80); r.name != "be2" {
				t.Fatalf("answer from %s, want be2 (the new rule's only endpoint)", r.name)
			}
		}
		rules := listRules(t, d)
		if len(rules) != 1 {
			t.Fatalf("rules: %v", rules)
		}
		flows := metricValue(scrape(t, d), "loxilb_dataplane_service_flows_total", fmt.Sprintf(`service="%d"`, rules[0]))
		if flows != 3 {
			t.Fatalf("flows of the new service: %v, want 3 (nothing inherited)", flows)
		}
	})

	t.Run("DroppedInterfaceDetached", func(t *testing.T) {
		pin, state := daemonPin(t), t.TempDir()
		d := startDaemon(t, bins, state, pin, "--interfaces", ifaces)
		vip := VIP(6)
		if code, body := postRule(t, d, mode0Rule(vip, 0, 1, 2)); code != http.StatusOK {
			t.Fatalf("create: %d %s", code, body)
		}
		curl(t, lab, vip, 80)
		d.Stop()
		// Without the client-side interface the VIP is no longer balanced.
		rest := strings.Join(lab.LBIfaces[1:], ",")
		d = startDaemon(t, bins, state, pin, "--interfaces", rest)
		if out, err := Exec(lab.Client, "curl", "-sS", "--max-time", "2", fmt.Sprintf("http://%s:80/", vip)); err == nil {
			t.Fatalf("VIP still balanced on %s, dropped from --interfaces: %q", lab.LBIfaces[0], out)
		}
		var caps struct {
			Capabilities []struct {
				Name   string `json:"name"`
				Ready  bool   `json:"ready"`
				Reason string `json:"reason"`
			} `json:"capabilities"`
		}
		getDaemonJSON(t, d, "/status/capabilities", &caps)
		for _, c := range caps.Capabilities {
			if c.Name == "ebpf_dataplane" && (!c.Ready || strings.Contains(c.Reason, lab.LBIfaces[0]+",") || !strings.Contains(c.Reason, lab.LBIfaces[1])) {
				t.Fatalf("capability after dropping %s: %+v", lab.LBIfaces[0], c)
			}
		}
		d.Stop()
		d = startDaemon(t, bins, state, pin, "--interfaces", ifaces)
		curl(t, lab, vip, 80)
	})

	t.Run("Mode4RouteRemovedAfterRestart", func(t *testing.T) {
		pin, state := daemonPin(t), t.TempDir()
		d := startDaemon(t, bins, state, pin, "--interfaces", ifaces)
		vip := VIP(7)
		rule := fmt.Sprintf(`{"serviceArguments":{"externalIP":%q,"port":80,"protocol":"tcp","mode":4,"sel":0},`+
			`"endpoints":[{"endpointIP":%q,"targetPort":8080,"weight":1}]}`, vip, BackendAddr(0))
		if code, body := postRule(t, d, rule); code != http.StatusOK {
			t.Fatalf("create mode 4: %d %s", code, body)
		}
		if !vipLocal(t, vip) {
			t.Fatalf("mode-4 VIP %v not made local", vip)
		}
		d.Stop()
		d = startDaemon(t, bins, state, pin, "--interfaces", ifaces)
		req, _ := http.NewRequest(http.MethodDelete, d.URL(fmt.Sprintf("/config/loadbalancer/externalipaddress/%s/port/80/protocol/tcp", vip)), nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("delete: %d", resp.StatusCode)
		}
		if vipLocal(t, vip) {
			t.Fatalf("VIP %v still local after its rule was deleted", vip)
		}
	})

	t.Run("NoInterfacesRefusesL4", func(t *testing.T) {
		d := startDaemon(t, bins, t.TempDir(), daemonPin(t))
		code, body := postRule(t, d, mode0Rule(VIP(4), 0))
		var eb struct {
			ReasonCode string `json:"reason_code"`
		}
		_ = json.Unmarshal(body, &eb)
		if code != http.StatusPreconditionFailed || eb.ReasonCode != "EBPF_NO_INTERFACES" {
			t.Fatalf("mode-0 rule with no interface: %d %s, want 412 EBPF_NO_INTERFACES", code, body)
		}
		var caps struct {
			Capabilities []struct {
				Name       string `json:"name"`
				Ready      bool   `json:"ready"`
				ReasonCode string `json:"reason_code"`
				Reason     string `json:"reason"`
			} `json:"capabilities"`
		}
		getDaemonJSON(t, d, "/status/capabilities", &caps)
		for _, c := range caps.Capabilities {
			if c.Name == "ebpf_dataplane" && (c.Ready || c.ReasonCode != "no_interfaces") {
				t.Fatalf("capability: %+v", c)
			}
		}
		if rules := listRules(t, d); len(rules) != 0 {
			t.Fatalf("refused rule listed: %v", rules)
		}
	})
}

// vipLocal reports whether vip has a route in the local table (this
// process runs in the LB namespace).
func vipLocal(t *testing.T, vip netip.Addr) bool {
	t.Helper()
	out, err := exec.Command("ip", "-4", "route", "show", "table", "local", vip.String()).CombinedOutput()
	if err != nil {
		t.Fatalf("ip route: %v: %s", err, out)
	}
	return strings.Contains(string(out), "local "+vip.String())
}

func daemonPin(t *testing.T) string {
	t.Helper()
	pin := filepath.Join("/sys/fs/bpf", dataplanetest.UniqueName("lbdmn"))
	t.Cleanup(func() {
		if err := os.RemoveAll(pin); err != nil {
			t.Errorf("remove pin path %s: %v", pin, err)
		}
	})
	return pin
}

func startDaemon(t *testing.T, b *daemontest.Binaries, state, pin string, args ...string) *daemontest.Daemon {
	t.Helper()
	return daemontest.Start(t, b, state, nil, append([]string{"--no-dataplane=false", "--bpf-pin-path", pin, "--metrics"}, args...)...)
}

// runDaemon runs the daemon expecting it to stop by itself, and returns its
// exit code and output. It is killed after 20 s.
func runDaemon(t *testing.T, b *daemontest.Binaries, state, pin string, args ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	port := daemontest.FreePort(t)
	a := append([]string{"--api-addr", fmt.Sprintf("127.0.0.1:%d", port), "--state-dir", state, "--bpf-pin-path", pin,
		"--tokenizer-dir", filepath.Join(state, "tokenizers")}, args...)
	out, err := exec.CommandContext(ctx, b.Loxilb, a...).CombinedOutput()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0, string(out)
	case errors.As(err, &ee):
		return ee.ExitCode(), string(out)
	}
	t.Fatalf("run daemon: %v\n%s", err, out)
	return 0, ""
}

// mode0Rule is a mode-0 round-robin rule on vip:80 over the given lab
// backends (0-based) on port 8080.
func mode0Rule(vip netip.Addr, backends ...int) string {
	var eps []string
	for _, i := range backends {
		eps = append(eps, fmt.Sprintf(`{"endpointIP":%q,"targetPort":8080,"weight":1}`, BackendAddr(i)))
	}
	return fmt.Sprintf(`{"serviceArguments":{"externalIP":%q,"port":80,"protocol":"tcp","mode":0,"sel":0},"endpoints":[%s]}`,
		vip, strings.Join(eps, ","))
}

func postRule(t *testing.T, d *daemontest.Daemon, rule string) (int, []byte) {
	t.Helper()
	resp, err := http.Post(d.URL("/config/loadbalancer"), "application/json", bytes.NewReader([]byte(rule)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, body
}

func getDaemonJSON(t *testing.T, d *daemontest.Daemon, path string, out any) {
	t.Helper()
	resp, err := http.Get(d.URL(path))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("GET %s: %d %s", path, resp.StatusCode, b)
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		t.Fatal(err)
	}
}

// listRules returns the service IDs of the daemon's rules.
func listRules(t *testing.T, d *daemontest.Daemon) []uint32 {
	t.Helper()
	var list struct {
		LBAttr []struct {
			ServiceID uint32 `json:"serviceID"`
		} `json:"lbAttr"`
	}
	getDaemonJSON(t, d, "/config/loadbalancer/all", &list)
	ids := []uint32{}
	for _, r := range list.LBAttr {
		ids = append(ids, r.ServiceID)
	}
	return ids
}

func scrape(t *testing.T, d *daemontest.Daemon) string {
	t.Helper()
	resp, err := http.Get(d.URL("/metrics"))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// metricValue sums the samples of metric name whose labels contain every
// one of labels; -1 when there is none.
func metricValue(text, name string, labels ...string) float64 {
	var sum float64
	found := false
	for _, line := range strings.Split(text, "\n") {
		metric, value, ok := strings.Cut(line, " ")
		if !ok || strings.HasPrefix(line, "#") || (metric != name && !strings.HasPrefix(metric, name+"{")) {
			continue
		}
		match := true
		for _, l := range labels {
			match = match && strings.Contains(metric, l)
		}
		var v float64
		if _, err := fmt.Sscan(value, &v); match && err == nil {
			sum += v
			found = true
		}
	}
	if !found {
		return -1
	}
	return sum
}
