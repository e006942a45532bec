package dispatch

import (
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/outlier"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

type legLog struct {
	mu  sync.Mutex
	got []string
}

func (l *legLog) observe(ep Endpoint, prefill bool, o outlier.Outcome) {
	role := "decode"
	if prefill {
		role = "prefill"
	}
	name := map[outlier.Outcome]string{outlier.Success: "ok", outlier.GatewayFailure: "gw", outlier.ServerError: "5xx"}[o]
	l.mu.Lock()
	defer l.mu.Unlock()
	l.got = append(l.got, fmt.Sprintf("%s %s@%d", name, role, ep.Idx))
}

func (l *legLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := append([]string(nil), l.got...)
	sort.Strings(s)
	return strings.Join(s, ", ")
}

// TestLegOutcomesObserved: every leg reports what it showed about its
// endpoint, in every engine's flow.
func TestLegOutcomesObserved(t *testing.T) {
	for _, engine := range []string{enginesim.EngineVLLM, enginesim.EngineSGLang, enginesim.EngineTRTLLM} {
		t.Run(engine, func(t *testing.T) {
			f := newFleet(t, fleetOpts{engine: engine, nPrefill: 1, nDec: 1})
			log := &legLog{}
			f.observe = log.observe
			dead := deadEndpoint(t, f.pool.Prefill[0].Host, 9)
			f.pool.Prefill = append([]Endpoint{dead}, f.pool.Prefill...)
			f.kv = pin(9)
			r := f.post(t, "/v1/completions", bodyFor(flowCases[1], prompt("observe", 4), 4))
			if r.status != 200 {
				t.Fatalf("status %d: %s", r.status, r.body)
			}
			if got, want := log.String(), "gw prefill@9, ok decode@1, ok prefill@0"; got != want {
				t.Fatalf("outcomes %q, want %q", got, want)
			}
		})
	}
	t.Run("prefill 503", func(t *testing.T) {
		f := newFleet(t, fleetOpts{engine: enginesim.EngineVLLM, nPrefill: 1, nDec: 1,
			prefillFaults: enginesim.Faults{FailRequests: -1, FailStatus: 503}})
		log := &legLog{}
		f.observe = log.observe
		r := f.post(t, "/v1/completions", bodyFor(flowCases[1], prompt("observe", 4), 4))
		if r.status != 502 {
			t.Fatalf("status %d: %s", r.status, r.body)
		}
		if got := log.String(); got != "5xx prefill@0" {
			t.Fatalf("outcomes %q", got)
		}
	})
}
