package diag

import (
	"context"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/control"
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
