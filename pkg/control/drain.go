package control

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/store"
)

// Endpoint maintenance (drain). A draining endpoint stays in its rule: its
// KV-event subscription, inventory, health probe and metrics carry on, so
// it returns warm when it is put back. Only new work avoids it: the proxy
// sends it no new mode-4 request (requests in flight, streams included,
// run to their end) and the kernel gives it no new L4 flow (established
// flows keep flowing). The state is stored with the rule, survives a
// restart and an update of the rule that keeps the endpoint, and goes with
// the endpoint when an update removes it.

// DrainState is one endpoint's maintenance state as SetDrain leaves it.
type DrainState struct {
	Service  Service
	EPIdx    int
	Endpoint string // host:port, as lbrule.Endpoint.Addr renders it
	Draining bool
	Changed  bool // false when the endpoint already was in that state
}

// SetDrain puts the endpoint addr ("ip:port") of the rule with key k in
// maintenance (on) or back in service. It is idempotent. The change is
// stored before any stage sees it, so a restart never loses it.
func (c *Controller) SetDrain(ctx context.Context, k lbrule.Key, addr string, on bool) (DrainState, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	svc, idx, addr, err := c.locateLocked(k, addr)
	if err != nil {
		return DrainState{}, err
	}
	if err := c.invalid[svc.ID]; err != nil {
		return DrainState{}, &lbrule.RuleError{Class: lbrule.ErrPrecondition, Reason: ReasonInvalid,
			Msg: fmt.Sprintf("rule %d (%s) is stored but does not validate (%v): delete it or create it again before draining its endpoints", svc.ID, k, err)}
	}
	st := DrainState{EPIdx: idx, Endpoint: addr, Draining: on}
	if svc.EndpointDraining(idx) == on {
		st.Service = svc
		return st, nil
	}
	next := slices.Clone(svc.Draining)
	if on {
		next = append(next, addr)
		slices.Sort(next)
	} else {
		next = slices.DeleteFunc(next, func(a string) bool { return a == addr })
		if len(next) == 0 {
			next = nil
		}
	}
	rb, err := lbrule.Encode(svc.Rule)
	if err != nil {
		return DrainState{}, err
	}
	rec := store.Record{ID: svc.ID, Rule: rb, CreateBody: svc.CreateBody, Draining: next,
		CreatedAt: svc.CreatedAt, UpdatedAt: svc.UpdatedAt}
	if err := c.store.Put(rec); err != nil {
		return DrainState{}, fmt.Errorf("persist rule %d: %w", svc.ID, err)
	}
	// Nodes sharing the store see the change in the fingerprint and apply it.
	c.stored[svc.ID] = recordFingerprint(rec)
	svc.Draining = next
	svc.Status = RuleStatus{}
	c.services[svc.ID] = svc
	if _, err := c.reconcileLocked(ctx); err != nil {
		// The state is stored and every stage has the table; a stage that
		// failed for its own reasons is retried by Run like any other.
		c.logger.Warn("reconcile after an endpoint drain change", "id", svc.ID, "err", err)
	}
	c.logger.Info("endpoint maintenance", "id", svc.ID, "key", k.String(), "endpoint", addr, "ep_idx", idx, "draining", on)
	svc.Status = c.status[svc.ID]
	st.Service, st.Changed = svc, true
	return st, nil
}

// Drain reports the maintenance state of the endpoint addr of the rule
// with key k, changing nothing.
func (c *Controller) Drain(k lbrule.Key, addr string) (DrainState, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	svc, idx, addr, err := c.locateLocked(k, addr)
	if err != nil {
		return DrainState{}, err
	}
	return DrainState{Service: svc, EPIdx: idx, Endpoint: addr, Draining: svc.EndpointDraining(idx)}, nil
}

// locateLocked finds the rule with key k and its endpoint addr, which it
// returns in canonical form (an IPv4-mapped address as plain IPv4).
func (c *Controller) locateLocked(k lbrule.Key, addr string) (Service, int, string, error) {
	ap, err := netip.ParseAddrPort(strings.TrimSpace(addr))
	if err != nil {
		return Service{}, -1, "", &lbrule.RuleError{Class: lbrule.ErrInvalid, Field: "endpoint",
			Msg: fmt.Sprintf("endpoint %q is not IP:PORT ([IPv6]:PORT for IPv6): %v", addr, err)}
	}
	addr = lbrule.Endpoint{IP: ap.Addr().Unmap().String(), Port: int(ap.Port())}.Addr()
	svc, ok := c.findLocked(k)
	if !ok {
		return Service{}, -1, "", &lbrule.RuleError{Class: lbrule.ErrNotFound, Msg: fmt.Sprintf("lbrule not-exists error: no rule %s", k)}
	}
	svc.Status = c.status[svc.ID]
	var have []string
	for i, ep := range svc.Rule.Endpoints {
		if ep.Addr() == addr {
			return svc, i, addr, nil
		}
		have = append(have, ep.Addr())
	}
	return Service{}, -1, "", &lbrule.RuleError{Class: lbrule.ErrNotFound, Field: "endpoint",
		Msg: fmt.Sprintf("rule %d (%s) has no endpoint %s; its endpoints are %s", svc.ID, k, addr, strings.Join(have, ", "))}
}

// keepDraining returns the entries of draining that name an endpoint of r,
// sorted and without repeats: what a stored or updated rule keeps of its
// maintenance state. Anything else (an endpoint an update removed, junk in
// a damaged store) is dropped.
func keepDraining(r *lbrule.Rule, draining []string) []string {
	if len(draining) == 0 || r == nil {
		return nil
	}
	var out []string
	for _, ep := range r.Endpoints {
		if a := ep.Addr(); slices.Contains(draining, a) && !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	slices.Sort(out)
	return out
}

// drainingLabels renders (service, ep_idx) for loxilb_endpoint_draining.
func drainingLabels(id uint32, ep int) (string, string) {
	return strconv.FormatUint(uint64(id), 10), strconv.Itoa(ep)
}
