//go:build linux

package netns

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/testbed/daemontest"
)

// l4Rule is an L4 rule body on vip:port over the given lab backends
// (0-based) on port 8080.
func l4Rule(vip string, port int, proto string, mode, sel, block int, backends ...int) string {
	var eps []string
	for _, i := range backends {
		eps = append(eps, fmt.Sprintf(`{"endpointIP":%q,"targetPort":8080,"weight":1}`, BackendAddr(i)))
	}
	return fmt.Sprintf(`{"serviceArguments":{"externalIP":%q,"port":%d,"protocol":%q,"mode":%d,"sel":%d,"block":%d},"endpoints":[%s]}`,
		vip, port, proto, mode, sel, block, strings.Join(eps, ","))
}

// TestL4RulesThroughTheDaemon drives the real daemon in the lab: chwbl
// (sel 8) on an L4 mode is served by the kernel's Maglev table, and rules
// the data plane cannot take are refused up front with a 4xx and a reason
// code, consuming no rule id.
func TestL4RulesThroughTheDaemon(t *testing.T) {
	lab := withLab(t, 3)
	if lab == nil {
		return
	}
	bins, err := daemontest.Build()
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(bins.Dir)
	d := startDaemon(t, bins, t.TempDir(), daemonPin(t), "--interfaces", strings.Join(lab.LBIfaces, ","))

	vip := VIP(20)
	if code, body := postRule(t, d, l4Rule(vip.String(), 80, "tcp", 0, 8, 0, 0, 1, 2)); code != http.StatusOK {
		t.Fatalf("mode 0 with sel 8 (chwbl): %d %s", code, body)
	}
	seen := map[string]int{}
	for range 12 {
		seen[curl(t, lab, vip, 80).name]++
	}
	if len(seen) < 2 {
		t.Errorf("consistent hash over 12 connections from varying ports reached %v, want several backends", seen)
	}

	unroutable := `{"serviceArguments":{"externalIP":"172.30.100.21","port":80,"protocol":"tcp","mode":1,"sel":0},"endpoints":[{"endpointIP":"172.29.250.9","targetPort":8080,"weight":1}]}`
	for _, c := range []struct {
		name, body string
		code       int
		reason     string
	}{
		{"sctp with NAT", l4Rule("172.30.100.21", 80, "sctp", 2, 0, 0, 0), 400, "L4_SCTP_NAT_UNSUPPORTED"},
		{"IPv6 VIP", l4Rule("fd00::21", 80, "tcp", 0, 0, 0, 0), 400, "L4_IPV6_UNSUPPORTED"},
		{"icmp", `{"serviceArguments":{"externalIP":"172.30.100.21","port":0,"protocol":"icmp","mode":0,"sel":0},"endpoints":[{"endpointIP":"172.30.11.2","targetPort":0,"weight":1}]}`, 400, "L4_PROTOCOL_UNSUPPORTED"},
		{"n3 selector on an L4 rule", l4Rule("172.30.100.21", 2152, "udp", 0, 6, 0, 0), 400, "L4_SELECTOR_UNSUPPORTED"},
		{"multicast endpoint", `{"serviceArguments":{"externalIP":"172.30.100.21","port":80,"protocol":"tcp","mode":0,"sel":0},"endpoints":[{"endpointIP":"224.0.0.9","targetPort":8080,"weight":1}]}`, 400, "L4_ENDPOINT_UNSUPPORTED"},
		{"one-arm endpoint without a route", unroutable, 412, "L4_ENDPOINT_UNROUTABLE"},
		{"VIP of another rule (other block mark)", l4Rule(vip.String(), 80, "tcp", 0, 0, 7, 0), 409, "VIP_CONFLICT"},
	} {
		code, body := postRule(t, d, c.body)
		var eb struct {
			ReasonCode string `json:"reason_code"`
		}
		json.Unmarshal(body, &eb)
		if code != c.code || eb.ReasonCode != c.reason {
			t.Errorf("%s: %d %s, want %d %s", c.name, code, body, c.code, c.reason)
		}
	}
	if code, body := postRule(t, d, l4Rule(VIP(22).String(), 80, "tcp", 0, 0, 0, 0)); code != http.StatusOK {
		t.Fatalf("valid rule after the refusals: %d %s", code, body)
	}
	if ids := listRules(t, d); len(ids) != 2 || ids[0] != 1 || ids[1] != 2 {
		t.Fatalf("rule ids %v, want [1 2]: a refused create must not consume an id", ids)
	}
}
