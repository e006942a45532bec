package control

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

// KernelReconciler installs the rules of modes 0-3 and 5 into the kernel
// data plane, and keeps endpoint health there in step with the prober.
// Mode-4 rules are served by the proxy and are not installed here.
type KernelReconciler struct {
	DP      dataplane.Dataplane
	Healthy func(service uint32, ep int) bool // nil: every endpoint healthy
	// ProxyPort, when non-zero, is the port of the proxy listener that the
	// data plane steers mode-4 VIP:port connections to (sk_lookup); mode-4
	// rules are then installed too, which also makes their VIPs local.
	ProxyPort uint16

	mu        sync.Mutex
	installed map[uint32]bool
	// applied is the fingerprint of what each installed service was last
	// given: Reconcile upserts only the services whose fingerprint changed,
	// so one rule change costs one data-plane update, not one per rule.
	applied map[uint32]string
	// draining holds, per installed L4 service, the endpoints in
	// maintenance: kept unhealthy in the kernel (no new flows; flows
	// already tracked keep flowing) whatever their probes say.
	draining map[uint32][]bool
}

// fingerprint identifies a service and its endpoints as given to the data plane.
func fingerprint(svc dataplane.Service, eps []dataplane.Endpoint) string {
	return fmt.Sprintf("%+v|%+v", svc, eps)
}

// Name implements Reconciler.
func (k *KernelReconciler) Name() string { return "dataplane" }

// KernelService maps an accepted rule onto the data plane's service. ok is
// false for rules the kernel does not handle: mode 4 without steering.
func KernelService(id uint32, r *lbrule.Rule, proxyPort uint16) (dataplane.Service, []dataplane.Endpoint, bool, error) {
	s := r.Service
	if s.Mode == lbrule.ModeFullProxy && proxyPort == 0 {
		return dataplane.Service{}, nil, false, nil
	}
	vip, err := netip.ParseAddr(s.ExternalIP)
	if err != nil {
		return dataplane.Service{}, nil, false, err
	}
	svc := dataplane.Service{ID: id, VIP: vip, Port: uint16(s.Port), Proto: s.Protocol, Mode: s.Mode,
		InactiveTimeout: time.Duration(s.InactiveTimeOut) * time.Second}
	if s.Mode == lbrule.ModeFullProxy {
		// The kernel only steers; the proxy applies the rule's selector.
		svc.Sel, svc.ProxyPort = dataplane.SelRoundRobin, proxyPort
	} else {
		sel, ok := KernelSelector(s.Sel)
		if !ok {
			return dataplane.Service{}, nil, false, fmt.Errorf("%w: sel %d (%s) has no kernel selector", dataplane.ErrUnsupported, s.Sel, lbrule.SelName(s.Sel))
		}
		svc.Sel = sel
	}
	eps := make([]dataplane.Endpoint, 0, len(r.Endpoints))
	for _, ep := range r.Endpoints {
		a, err := netip.ParseAddr(ep.IP)
		if err != nil {
			return dataplane.Service{}, nil, false, err
		}
		eps = append(eps, dataplane.Endpoint{Addr: a, Port: uint16(ep.Port), Weight: ep.Weight, Healthy: true})
	}
	return svc, eps, true, nil
}

// KernelSelector maps a rule's selector (loxilb's sel numbering) onto the
// kernel data path's selector for the L4 modes. chwbl (8) becomes Maglev
// consistent hashing (without chwbl's load bound, which needs per-request
// load the kernel does not see). ok is false for selectors the kernel has no
// equivalent of (n2, n3, gpu-aware, wrr-hash): they need mode 4.
func KernelSelector(sel int) (int, bool) {
	switch sel {
	case lbrule.SelRR:
		return dataplane.SelRoundRobin, true
	case lbrule.SelHash:
		return dataplane.SelHash, true
	case lbrule.SelPriority:
		return dataplane.SelPriority, true
	case lbrule.SelPersist:
		return dataplane.SelPersist, true
	case lbrule.SelLC:
		return dataplane.SelLeastConn, true
	case lbrule.SelCHWBL:
		return dataplane.SelConsistentHash, true
	}
	return 0, false
}

// Reconcile implements Reconciler.
func (k *KernelReconciler) Reconcile(ctx context.Context, services []Service) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	want := map[uint32]bool{}
	var errs []error
	for _, s := range services {
		svc, eps, ok, err := KernelService(s.ID, s.Rule, k.ProxyPort)
		if err != nil {
			errs = append(errs, &RuleError{ID: s.ID, Reason: ReasonNotInstalled, Err: fmt.Errorf("rule %d: %w", s.ID, err)})
			continue
		}
		if !ok {
			continue
		}
		if k.Healthy != nil {
			for i := range eps {
				eps[i].Healthy = k.Healthy(s.ID, i)
			}
		}
		var drained []bool
		if s.Rule.Service.Mode != lbrule.ModeFullProxy && len(s.Draining) > 0 {
			// Mode 4 is only steered here; the proxy drains its endpoints.
			drained = make([]bool, len(eps))
			for i := range eps {
				drained[i] = s.EndpointDraining(i)
				eps[i].Healthy = eps[i].Healthy && !drained[i]
			}
		}
		if k.draining == nil {
			k.draining = map[uint32][]bool{}
		}
		k.draining[s.ID] = drained
		fp := fingerprint(svc, eps)
		if k.installed[s.ID] && k.applied[s.ID] == fp {
			want[s.ID] = true
			continue
		}
		if err := k.DP.UpsertService(ctx, svc, eps); err != nil {
			// The others are installed all the same; this one is retried.
			errs = append(errs, &RuleError{ID: s.ID, Reason: ReasonNotInstalled, Err: fmt.Errorf("rule %d (%s): %w", s.ID, s.Rule.Key(), err)})
			delete(k.applied, s.ID)
			continue
		}
		if k.applied == nil {
			k.applied = map[uint32]string{}
		}
		k.applied[s.ID] = fp
		want[s.ID] = true
	}
	for id := range k.installed {
		if !want[id] {
			if err := k.DP.DeleteService(ctx, id); err != nil && !errors.Is(err, dataplane.ErrNotFound) {
				errs = append(errs, fmt.Errorf("remove rule %d from the data plane: %w", id, err))
			}
		}
	}
	for id := range k.applied {
		if !want[id] {
			delete(k.applied, id)
		}
	}
	for id := range k.draining {
		if !want[id] {
			delete(k.draining, id)
		}
	}
	k.installed = want
	return errors.Join(errs...)
}

// SetHealth forwards one endpoint's health change to the kernel when the
// service is installed there.
func (k *KernelReconciler) SetHealth(ctx context.Context, service uint32, ep int, healthy bool) error {
	k.mu.Lock()
	installed := k.installed[service]
	if d := k.draining[service]; ep >= 0 && ep < len(d) && d[ep] {
		healthy = false // in maintenance: a passing probe does not bring it back
	}
	k.mu.Unlock()
	if !installed {
		return nil
	}
	return k.DP.SetEndpointHealth(ctx, service, ep, healthy)
}

// Reason codes of rules refused by KernelUnavailable.
const (
	// ReasonNoDataplane: the kernel data plane is not running.
	ReasonNoDataplane = "EBPF_DATAPLANE_UNAVAILABLE"
	// ReasonNoInterfaces: the kernel data plane runs (steering mode 4) but
	// is attached to no interface, so no packet would reach the rule.
	ReasonNoInterfaces = "EBPF_NO_INTERFACES"
)

// KernelUnavailable refuses rules of modes 0-3 and 5 when the daemon runs
// without the eBPF data plane (disabled, not root, no BPF support): such a
// rule would be accepted and never served, so the create fails with a
// precondition error that says why.
type KernelUnavailable struct {
	Why  string
	Code string // reason code of the refusal; empty means ReasonNoDataplane
}

// Name implements Reconciler.
func (k KernelUnavailable) Name() string { return "dataplane" }

// Reconcile implements Reconciler.
func (k KernelUnavailable) Reconcile(_ context.Context, services []Service) error {
	code := k.Code
	if code == "" {
		code = ReasonNoDataplane
	}
	var errs []error
	for _, s := range services {
		if s.Rule.Service.Mode != lbrule.ModeFullProxy {
			errs = append(errs, &RuleError{ID: s.ID, Reason: code, Err: &lbrule.RuleError{Class: lbrule.ErrPrecondition, Field: "serviceArguments.mode", Reason: code,
				Msg: fmt.Sprintf("rule %d (%s) is mode %d (%s), which needs the eBPF data plane: %s", s.ID, s.Rule.Key(),
					s.Rule.Service.Mode, lbrule.ModeName(s.Rule.Service.Mode), k.Why)}})
		}
	}
	return errors.Join(errs...)
}
