package health

import (
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

type fixedHealth map[int]bool

func (f fixedHealth) Healthy(_ uint32, ep int) bool { return f[ep] }

// A monitored endpoint reads "active" or "inactive" as its probe says; an
// endpoint nothing probes, and a rule that is gone, read "".
func TestEndpointState(t *testing.T) {
	rules := map[uint32]*lbrule.Rule{
		1: {Service: lbrule.ServiceArgs{Monitor: true}},
		2: {Service: lbrule.ServiceArgs{ProbeType: "http"}},
		3: {Service: lbrule.ServiceArgs{ProbeType: "none"}},
	}
	state := EndpointState(fixedHealth{0: true}, func(id uint32) (control.Service, bool) {
		r, ok := rules[id]
		return control.Service{ID: id, Rule: r}, ok
	})
	for _, c := range []struct {
		service uint32
		ep      int
		want    string
	}{{1, 0, "active"}, {1, 1, "inactive"}, {2, 0, "active"}, {2, 1, "inactive"}, {3, 0, ""}, {3, 1, ""}, {4, 0, ""}} {
		if got := state(c.service, c.ep); got != c.want {
			t.Errorf("service %d endpoint %d: %q, want %q", c.service, c.ep, got, c.want)
		}
	}
}
