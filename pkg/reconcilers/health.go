package reconcilers

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/health"
)

// Prober is the health prober (*health.Prober).
type Prober interface {
	Set(targets []health.Target) error
}

// ReasonHealthProbe: a rule's health probe could not be set up; the rule
// serves unprobed (degraded).
const ReasonHealthProbe = "HEALTH_PROBE_FAILED"

// Health hands every rule's endpoints to the prober; a rule whose
// probe cannot be built is reported (degraded) and the others are probed.
type Health struct {
	Prober Prober
}

// Name implements control.Reconciler.
func (h *Health) Name() string { return "health" }

// Reconcile implements control.Reconciler.
func (h *Health) Reconcile(_ context.Context, services []control.Service) error {
	var targets []health.Target
	var errs []error
	for _, s := range services {
		r := s.Rule
		monitor := health.MonitorEnabled(r.Service.Monitor, r.Service.ProbeType)
		if pt := r.Service.ProbeType; pt == "udp" || pt == "sctp" {
			// Accepted for loxilb rule files and reported inert
			// (lbrule.Inert): the endpoints are not probed.
			monitor = false
		}
		var probe health.Probe
		if monitor {
			p, err := health.ProbeFromRule(r.Service.ProbeType, r.Service.ProbePort, r.Service.ProbeReq, r.Service.ProbeResp,
				r.Service.ProbeTimeout, r.Service.ProbeRetries)
			if err != nil {
				// The rule serves unprobed; the others keep their probes.
				errs = append(errs, &control.RuleError{ID: s.ID, Reason: ReasonHealthProbe, Degraded: true, Err: fmt.Errorf("rule %d (%s): %w", s.ID, r.Key(), err)})
				continue
			}
			probe = p
		}
		var ts []health.Target
		var bad error
		for i, ep := range r.Endpoints {
			addr, err := netip.ParseAddr(ep.IP)
			if err != nil {
				bad = fmt.Errorf("rule %d endpoint %d: %w", s.ID, i, err)
				break
			}
			// Octavia's per-endpoint monitor address and HTTP path,
			// when set, take the rule's place for this endpoint's probe.
			if ep.MonitorAddress != "" {
				if ma, err := netip.ParseAddr(ep.MonitorAddress); err == nil {
					addr = ma.Unmap()
				}
			}
			p := probe
			if ep.URLPath != "" && (p.Type == health.ProbeHTTP || p.Type == health.ProbeHTTPS) {
				p.Request = ep.URLPath
			}
			ts = append(ts, health.Target{Service: s.ID, EP: i, Addr: addr, Port: uint16(ep.Port), Monitor: monitor, Probe: p})
		}
		if bad != nil {
			errs = append(errs, &control.RuleError{ID: s.ID, Reason: ReasonHealthProbe, Degraded: true, Err: bad})
			continue
		}
		targets = append(targets, ts...)
	}
	if err := h.Prober.Set(targets); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

var _ control.Reconciler = (*Health)(nil)
