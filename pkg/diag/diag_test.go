package diag

import (
	"context"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/kvevents"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

// pdRule is a vLLM P/D rule without KV-exact routing, so only the NIXL
// check runs (it probes nothing: it reads what the dispatcher saw).
func pdRule(nixl int) []control.Service {
	r := &lbrule.Rule{Service: lbrule.ServiceArgs{KVEngine: "vllm", PDDisagg: true, KVZmqPort: 5557, KVBlockSize: 16},
		Endpoints: []lbrule.Endpoint{
			{IP: "127.0.0.61", Port: 8100, Role: lbrule.RolePrefill, NixlPort: nixl},
			{IP: "127.0.0.62", Port: 8200, Role: lbrule.RoleDecode}}}
	return []control.Service{{ID: 4, Rule: r}}
}

func nixlLine(t *testing.T, s Sources) Check {
	t.Helper()
	for _, c := range s.Run(context.Background(), 4, true) {
		if c.Check == CheckNIXL {
			return c
		}
	}
	t.Fatal("no nixl_side_channel line")
	return Check{}
}

// TestNIXLWarning: nixl_port 0 on a vLLM prefill endpoint whose reported
// remote_port differs from its HTTP port is a WARN naming the port to set;
// equal ports, or an explicit nixl_port, pass.
func TestNIXLWarning(t *testing.T) {
	reported := func(p int) func(uint32, int) (int, bool) {
		return func(svc uint32, ep int) (int, bool) { return p, svc == 4 && ep == 0 }
	}
	if cs := (Sources{Rules: func() []control.Service { return pdRule(0) }, SidePort: reported(5600)}).Run(context.Background(), 4, true); len(cs) != 1 {
		t.Errorf("a P/D rule without KV-exact routing: %d lines, want only the NIXL one", len(cs))
	}
	c := nixlLine(t, Sources{Rules: func() []control.Service { return pdRule(0) }, SidePort: reported(5600)})
	if c.Result != Warn || c.EPIdx != 0 || c.Endpoint != "127.0.0.61:8100" || !strings.Contains(c.Found, "5600") || !strings.Contains(c.Fix, "nixl_port 5600") {
		t.Errorf("differing side channel: %+v", c)
	}
	if c := nixlLine(t, Sources{Rules: func() []control.Service { return pdRule(0) }, SidePort: reported(8100)}); c.Result != Pass {
		t.Errorf("side channel on the HTTP port: %+v", c)
	}
	if c := nixlLine(t, Sources{Rules: func() []control.Service { return pdRule(5600) }, SidePort: reported(5600)}); c.Result != Pass {
		t.Errorf("explicit nixl_port: %+v", c)
	}
	none := func(uint32, int) (int, bool) { return 0, false }
	if c := nixlLine(t, Sources{Rules: func() []control.Service { return pdRule(0) }, SidePort: none}); c.Result != Warn {
		t.Errorf("nothing reported yet: %+v", c)
	}
}

// TestBlockSizeParsers reads the engines' own formats.
func TestBlockSizeParsers(t *testing.T) {
	m := "# HELP vllm:cache_config_info x\nvllm:cache_config_info{block_size=\"128\",engine=\"0\"} 1\n"
	if n, err := vllmBlockSize(strings.NewReader(m)); err != nil || n != 128 {
		t.Errorf("vllm: %d %v", n, err)
	}
	if _, err := vllmBlockSize(strings.NewReader("vllm:num_requests_running 0\n")); err == nil {
		t.Error("vllm without cache_config_info parsed")
	}
	if n, err := sglangPageSize(strings.NewReader(`{"page_size":64,"dp_size":1}`)); err != nil || n != 64 {
		t.Errorf("sglang: %d %v", n, err)
	}
	if _, err := sglangPageSize(strings.NewReader(`{"page_size":0}`)); err == nil {
		t.Error("page_size 0 parsed")
	}
}

// TestTRTDrainOwnership: the trt_drain line names the node that drains:
// this one alone or elected (then admission decides), another one (pass
// while its relay stream is up), or none yet.
func TestTRTDrainOwnership(t *testing.T) {
	line := func(res, check, where, found, fix string) Check {
		return Check{Result: res, Check: check, Endpoint: where, Found: found, Fix: fix}
	}
	adm := &kvevents.Admission{Verdict: kvevents.AdmissionAdmitted, Reason: "engine geometry matches the rule"}
	cases := []struct {
		name  string
		st    kvevents.EndpointStatus
		res   string
		found string
	}{
		{"single", kvevents.EndpointStatus{Admission: adm, Drain: &kvevents.DrainStatus{Role: kvevents.DrainSingle}}, Pass, "the gateway owns"},
		{"owner", kvevents.EndpointStatus{Admission: adm, Drain: &kvevents.DrainStatus{Role: kvevents.DrainOwner, Followers: 2}}, Pass, "2 nodes follow"},
		{"follower", kvevents.EndpointStatus{Connected: true, Drain: &kvevents.DrainStatus{Role: kvevents.DrainFollower, Owner: "http://10.1.1.1:11111/x"}}, Pass, "node http://10.1.1.1:11111/x drains"},
		{"follower down", kvevents.EndpointStatus{LastError: "kv relay stream: refused", Drain: &kvevents.DrainStatus{Role: kvevents.DrainFollower, Owner: "http://n2/x"}}, Warn, "relay stream from it is down: kv relay stream: refused"},
		{"electing", kvevents.EndpointStatus{Drain: &kvevents.DrainStatus{Role: kvevents.DrainElecting}}, Warn, "no node owns"},
		{"owner refused", kvevents.EndpointStatus{Admission: &kvevents.Admission{Verdict: kvevents.AdmissionRefused}, Drain: &kvevents.DrainStatus{Role: kvevents.DrainOwner}}, Fail, "admission refused"},
	}
	for _, c := range cases {
		got := trtDrain(line, "127.0.0.9:8000", c.st, true)
		if got.Result != c.res || !strings.Contains(got.Found, c.found) {
			t.Errorf("%s: %s %q, want %s containing %q", c.name, got.Result, got.Found, c.res, c.found)
		}
	}
}
