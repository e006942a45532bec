package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/daemontest"
)

// Restarts of the real daemon process where one stored rule cannot be
// applied: the others serve, the bad one is listed with its status and
// reason, and a held VIP:port comes back by itself once it frees.

// backend answers every request with its name, as a plain endpoint.
func backend(t *testing.T, addr, name string) {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, name) })}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close() })
}

// viaVIP asks vip for /health with a fresh connection and returns the
// answer's body, or an error when the VIP does not serve.
func viaVIP(vip string) (string, error) {
	c := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Get("http://" + vip + "/health")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		return "", fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	return string(b), err
}

func plainRule(vip string, port int, name, ep string) json.RawMessage {
	host, p, _ := net.SplitHostPort(ep)
	return json.RawMessage(fmt.Sprintf(`{"serviceArguments":{"externalIP":%q,"port":%d,"protocol":"tcp","mode":4,"sel":0,"name":%q},
		"endpoints":[{"endpointIP":%q,"targetPort":%s,"weight":1}]}`, vip, port, name, host, p))
}

type listedRule struct {
	ServiceID uint32 `json:"serviceID"`
	Service   struct {
		ExternalIP string `json:"externalIP"`
		Port       int    `json:"port"`
	} `json:"serviceArguments"`
	Status *struct {
		State      string `json:"state"`
		ReasonCode string `json:"reason_code"`
		Reason     string `json:"reason"`
		Attempts   int    `json:"attempts"`
		NextRetry  string `json:"next_retry"`
	} `json:"ruleStatus"`
}

func listRules(t *testing.T, d *daemontest.Daemon) map[string]listedRule {
	t.Helper()
	var list struct {
		LBAttr []listedRule `json:"lbAttr"`
	}
	getJSON(t, d.URL("/config/loadbalancer/all"), &list)
	out := map[string]listedRule{}
	for _, r := range list.LBAttr {
		out[net.JoinHostPort(r.Service.ExternalIP, fmt.Sprint(r.Service.Port))] = r
	}
	return out
}

func rulesCapability(t *testing.T, d *daemontest.Daemon) map[string]int {
	t.Helper()
	var caps struct {
		Capabilities []struct {
			Name   string         `json:"name"`
			Counts map[string]int `json:"counts"`
		} `json:"capabilities"`
	}
	getJSON(t, d.URL("/status/capabilities"), &caps)
	for _, c := range caps.Capabilities {
		if c.Name == "rules" {
			return c.Counts
		}
	}
	t.Fatal("no rules capability")
	return nil
}

func createRule(t *testing.T, d *daemontest.Daemon, rule json.RawMessage) {
	t.Helper()
	resp, body := post(t, d.URL("/config/loadbalancer"), rule)
	if resp.StatusCode != 200 {
		t.Fatalf("create rule: %d %s", resp.StatusCode, body)
	}
}

// TestRestartWithHeldPort: another process holds one rule's VIP:port when
// the daemon restarts. The other rules serve, the held one is listed
// failed VIP_PORT_IN_USE (capabilities and metrics count it), and once
// the holder lets go it serves within the retry backoff, with no API call.
func TestRestartWithHeldPort(t *testing.T) {
	const port = 28301
	ep := "127.0.201.10:28310"
	backend(t, ep, "backend")
	vips := []string{"127.0.201.1", "127.0.201.2", "127.0.201.3"}
	state := t.TempDir()
	d := daemontest.Start(t, bins, state, nil, "--metrics")
	for i, v := range vips {
		createRule(t, d, plainRule(v, port, fmt.Sprintf("r%d", i), ep))
	}
	for _, v := range vips {
		if got, err := viaVIP(net.JoinHostPort(v, fmt.Sprint(port))); err != nil || got != "backend" {
			t.Fatalf("%s before the restart: %q %v", v, got, err)
		}
	}
	d.Stop()

	heldAddr := net.JoinHostPort(vips[1], fmt.Sprint(port))
	holder, err := net.Listen("tcp", heldAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	d = daemontest.Start(t, bins, state, nil, "--metrics")
	for _, v := range []string{vips[0], vips[2]} {
		addr := net.JoinHostPort(v, fmt.Sprint(port))
		waitFor(t, addr+" serving after the restart", 10*time.Second, func() bool {
			got, err := viaVIP(addr)
			return err == nil && got == "backend"
		})
	}
	rules := listRules(t, d)
	if len(rules) != 3 {
		t.Fatalf("listed %d rules, want 3: %v", len(rules), rules)
	}
	held := rules[heldAddr]
	if held.Status == nil || held.Status.State != "failed" || held.Status.ReasonCode != "VIP_PORT_IN_USE" ||
		held.Status.NextRetry == "" || !strings.Contains(held.Status.Reason, heldAddr) {
		t.Fatalf("held rule status: %+v", held.Status)
	}
	for _, v := range []string{vips[0], vips[2]} {
		if s := rules[net.JoinHostPort(v, fmt.Sprint(port))].Status; s == nil || s.State != "applied" {
			t.Fatalf("%s status: %+v", v, s)
		}
	}
	if c := rulesCapability(t, d); c["applied"] != 2 || c["failed"] != 1 {
		t.Fatalf("rules capability counts: %v", c)
	}
	m := metrics(t, d)
	if metricValue(m, "loxilb_rules", `status="failed"`) != 1 || metricValue(m, "loxilb_rules", `status="applied"`) != 2 ||
		metricValue(m, "loxilb_rule_apply_failures_total", `reason="VIP_PORT_IN_USE"`) < 1 {
		t.Fatalf("rule metrics:\n%s", grepLines(m, "loxilb_rule"))
	}
	out, errs, code := daemontest.CLI(t, bins, d.Port, "get", "lb", "-o", "wide")
	if code != 0 || !strings.Contains(out, "RULE STATUS") || !strings.Contains(out, "failed:VIP_PORT_IN_USE") {
		t.Fatalf("loxicmd get lb -o wide: %d %s %s", code, out, errs)
	}

	// The holder lets go: the VIP serves again by itself.
	holder.Close()
	released := time.Now()
	waitFor(t, heldAddr+" serving after the port freed", 40*time.Second, func() bool {
		got, err := viaVIP(heldAddr)
		return err == nil && got == "backend"
	})
	t.Logf("held VIP served %v after the port freed (retry backoff 1 s doubling to 30 s)", time.Since(released).Round(10*time.Millisecond))
	if s := listRules(t, d)[heldAddr].Status; s == nil || s.State != "applied" {
		t.Fatalf("after the port freed: %+v", s)
	}
}

// TestRestartWithoutSeedKeepsVLLMRule: a vLLM KV-exact rule is stored and
// the daemon restarts without LLB_KV_NONE_HASH_SEED. The other rule
// serves; the vLLM rule is listed failed KV_EXACT_SEED_UNSET, its VIP:port
// cannot be stored a second time (409), and it can be deleted.
func TestRestartWithoutSeedKeepsVLLMRule(t *testing.T) {
	ep := "127.0.202.10:28320"
	backend(t, ep, "backend")
	state := t.TempDir()
	d := daemontest.Start(t, bins, state, []string{"LLB_KV_NONE_HASH_SEED=" + seed})
	vllm := json.RawMessage(`{"serviceArguments":{"externalIP":"127.0.202.1","port":28302,"protocol":"tcp","mode":4,"sel":0,
		"kvExactMode":3,"kvEngineType":"vllm","kvZmqPort":28357,"kvDpRankCount":1,"kvBlockSize":16,"name":"vllm"},
		"endpoints":[{"endpointIP":"127.0.202.10","targetPort":28320,"weight":1}]}`)
	createRule(t, d, vllm)
	createRule(t, d, plainRule("127.0.202.2", 28302, "plain", ep))
	d.Stop()

	d = daemontest.Start(t, bins, state, []string{"LLB_KV_NONE_HASH_SEED="})
	waitFor(t, "the plain rule serving", 10*time.Second, func() bool {
		got, err := viaVIP("127.0.202.2:28302")
		return err == nil && got == "backend"
	})
	rules := listRules(t, d)
	v, ok := rules["127.0.202.1:28302"]
	if !ok || v.Status == nil || v.Status.State != "failed" || v.Status.ReasonCode != "KV_EXACT_SEED_UNSET" || v.Status.NextRetry != "" {
		t.Fatalf("vLLM rule after a restart without the seed: %+v", v)
	}
	if s := rules["127.0.202.2:28302"].Status; s == nil || s.State != "applied" {
		t.Fatalf("plain rule: %+v", s)
	}
	if _, err := viaVIP("127.0.202.1:28302"); err == nil {
		t.Fatal("the invalid rule's VIP serves")
	}
	// Same VIP:port, another engine: refused, not stored twice.
	sglang := json.RawMessage(strings.Replace(string(vllm), `"vllm"`, `"sglang"`, 1))
	resp, body := post(t, d.URL("/config/loadbalancer"), sglang)
	if resp.StatusCode != 409 {
		t.Fatalf("re-create on the failed rule's VIP:port: %d %s", resp.StatusCode, body)
	}
	out, _, code := daemontest.CLI(t, bins, d.Port, "get", "lb", "-o", "wide")
	if code != 0 || !strings.Contains(out, "failed:KV_EXACT_SEED_UNSET") {
		t.Fatalf("loxicmd get lb -o wide: %d %s", code, out)
	}
	if out, errs, code := daemontest.CLI(t, bins, d.Port, "delete", "lb", "127.0.202.1", "--tcp=28302"); code != 0 {
		t.Fatalf("delete the failed rule: %d %s %s", code, out, errs)
	}
	if rules := listRules(t, d); len(rules) != 1 {
		t.Fatalf("after delete: %v", rules)
	}
	if c := rulesCapability(t, d); c["applied"] != 1 || c["failed"] != 0 {
		t.Fatalf("rules capability counts: %v", c)
	}

	// With the seed back, the same VIP:port can be created once.
	d.Stop()
	d = daemontest.Start(t, bins, state, []string{"LLB_KV_NONE_HASH_SEED=" + seed})
	createRule(t, d, vllm)
	if rules := listRules(t, d); len(rules) != 2 || rules["127.0.202.1:28302"].Status.State != "applied" {
		t.Fatalf("after re-creating with the seed: %+v", rules)
	}
}

// TestMetricsSwitchSurvivesRestart: POST /config/metrics is remembered.
func TestMetricsSwitchSurvivesRestart(t *testing.T) {
	state := t.TempDir()
	d := daemontest.Start(t, bins, state, nil)
	get := func() int {
		resp, err := http.Get(d.URL("/metrics"))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := get(); code != 503 {
		t.Fatalf("metrics before enabling: %d", code)
	}
	if resp, body := post(t, d.URL("/config/metrics"), nil); resp.StatusCode != 200 {
		t.Fatalf("enable metrics: %d %s", resp.StatusCode, body)
	}
	d.Stop()
	d = daemontest.Start(t, bins, state, nil)
	if code := get(); code != 200 {
		t.Fatalf("metrics after the restart: %d, want 200", code)
	}
}

func grepLines(text, prefix string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.HasPrefix(l, prefix) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
