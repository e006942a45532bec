package gateway

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"sync"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/health"
	"github.com/loxilb-llm/loxilb/pkg/kvevents"
)

// Subscriptions is the KV-event manager (*kvevents.Manager).
type Subscriptions interface {
	Sync(specs []kvevents.Spec) error
}

// Inventories is the part of kvindex a rule removal touches.
type Inventories interface {
	DropService(service uint32)
}

// KVReconciler keeps KV-event subscriptions and inventories in step with
// the KV-exact rules: prefill endpoints for kvExactMode 1, every endpoint
// for 3. An endpoint list change restarts that endpoint's subscription, and
// a removed rule's inventories are dropped.
type KVReconciler struct {
	Subs Subscriptions
	Inv  Inventories
	Seed string // LLB_KV_NONE_HASH_SEED

	mu   sync.Mutex
	prev map[uint32][]string // service -> endpoint identities, to drop stale inventories
}

// Name implements control.Reconciler.
func (k *KVReconciler) Name() string { return "kv-events" }

// Reconcile implements control.Reconciler.
func (k *KVReconciler) Reconcile(_ context.Context, services []control.Service) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	var specs []kvevents.Spec
	next := map[uint32][]string{}
	for _, s := range services {
		r := s.Rule
		var ids []string
		for _, ep := range r.Endpoints {
			ids = append(ids, ep.IP+":"+strconv.Itoa(ep.Port))
		}
		next[s.ID] = ids
		for _, i := range r.SubscribedEndpoints() {
			ep := r.Endpoints[i]
			name := r.Service.Name
			if name == "" {
				name = strconv.FormatUint(uint64(s.ID), 10)
			}
			specs = append(specs, kvevents.Spec{Service: s.ID, ServiceName: name, EPIdx: i, Engine: r.Engine(), Host: ep.IP,
				TargetPort: ep.Port, ZmqPort: r.Service.KVZmqPort, Ranks: r.Service.KVDpRankCount, HashAlgo: r.Service.KVHashAlgo,
				BlockSize: r.Service.KVBlockSize, Seed: k.Seed})
		}
	}
	if err := k.Subs.Sync(specs); err != nil {
		return fmt.Errorf("kv subscriptions: %w", err)
	}
	for id, ids := range k.prev {
		// A removed rule, or a rule whose endpoints changed (indexes now
		// mean other hosts): its inventories no longer describe anything.
		if now, ok := next[id]; !ok || fmt.Sprint(now) != fmt.Sprint(ids) {
			k.Inv.DropService(id)
		}
	}
	k.prev = next
	return nil
}

// Prober is the health prober (*health.Prober).
type Prober interface {
	Set(targets []health.Target) error
}

// ReasonHealthProbe: a rule's health probe could not be set up; the rule
// serves unprobed (degraded).
const ReasonHealthProbe = "HEALTH_PROBE_FAILED"

// HealthReconciler hands every rule's endpoints to the prober; a rule whose
// probe cannot be built is reported (degraded) and the others are probed.
type HealthReconciler struct {
	Prober Prober
}

// Name implements control.Reconciler.
func (h *HealthReconciler) Name() string { return "health" }

// Reconcile implements control.Reconciler.
func (h *HealthReconciler) Reconcile(_ context.Context, services []control.Service) error {
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

var _ control.Reconciler = (*KVReconciler)(nil)
var _ control.Reconciler = (*HealthReconciler)(nil)
