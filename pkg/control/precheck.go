package control

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

// Prechecker is implemented by stages that can refuse a rule before the
// controller allocates its id or changes anything, so a refused create
// consumes nothing. id is the rule's id when it replaces one, else 0.
type Prechecker interface {
	Precheck(ctx context.Context, id uint32, r *lbrule.Rule) error
}

// Reason codes of L4 rules the kernel data plane refuses up front.
const (
	ReasonL4Protocol   = "L4_PROTOCOL_UNSUPPORTED" // 400: icmp has no L4 data path
	ReasonL4IPv6       = "L4_IPV6_UNSUPPORTED"     // 400: IPv6 VIP or endpoint
	ReasonL4SCTPNAT    = "L4_SCTP_NAT_UNSUPPORTED" // 400: SCTP needs mode 3 (dsr) or 4
	ReasonL4Selector   = "L4_SELECTOR_UNSUPPORTED" // 400: a selector only the proxy has
	ReasonL4Endpoint   = "L4_ENDPOINT_UNSUPPORTED" // 400: too many or unusable endpoints
	ReasonVIPConflict  = "VIP_CONFLICT"            // 409: another rule has the VIP, port and protocol
	ReasonL4TableFull  = "L4_TABLE_FULL"           // 412: the kernel service table is full
	ReasonL4Unroutable = "L4_ENDPOINT_UNROUTABLE"  // 412: one-arm endpoint without a route
)

// precheckLocked asks every stage that can whether it would take r.
func (c *Controller) precheckLocked(ctx context.Context, id uint32, r *lbrule.Rule) error {
	for _, rec := range c.recs {
		if p, ok := rec.(Prechecker); ok {
			if err := p.Precheck(ctx, id, r); err != nil {
				return err
			}
		}
	}
	return nil
}

func refuse(class error, reason, field, format string, args ...any) *lbrule.RuleError {
	return &lbrule.RuleError{Class: class, Reason: reason, Field: field, Msg: fmt.Sprintf(format, args...)}
}

// Precheck implements Prechecker: the rule's shape against what the kernel
// path can do, then the data plane's own check (dataplane.Checker) against
// its installed state.
func (k *KernelReconciler) Precheck(ctx context.Context, id uint32, r *lbrule.Rule) error {
	s := r.Service
	if s.Mode == lbrule.ModeFullProxy && k.ProxyPort == 0 {
		return nil
	}
	if err := l4Shape(r); err != nil {
		return err
	}
	svc, eps, ok, err := KernelService(id, r, k.ProxyPort)
	if err != nil {
		return refuse(lbrule.ErrInvalid, ReasonL4Endpoint, "", "%v", err)
	}
	if !ok {
		return nil
	}
	ch, ok := k.DP.(dataplane.Checker)
	if !ok {
		return nil
	}
	err = ch.CheckService(ctx, svc, eps)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, dataplane.ErrConflict):
		return refuse(lbrule.ErrConflict, ReasonVIPConflict, "serviceArguments.externalIP",
			"%s:%d/%s is taken in the kernel data plane: %v", s.ExternalIP, s.Port, s.Protocol, err)
	case errors.Is(err, dataplane.ErrCapacity):
		return refuse(lbrule.ErrPrecondition, ReasonL4TableFull, "",
			"the kernel service table is full (%d services): delete a rule first: %v", dataplane.MaxServices, err)
	case errors.Is(err, dataplane.ErrUnroutable):
		return refuse(lbrule.ErrPrecondition, ReasonL4Unroutable, "endpoints",
			"mode %d (%s) sends from the LB's address toward each endpoint: add a route to it or set a SNAT address: %v", s.Mode, lbrule.ModeName(s.Mode), err)
	case errors.Is(err, dataplane.ErrInvalid), errors.Is(err, dataplane.ErrUnsupported):
		return refuse(lbrule.ErrInvalid, ReasonL4Endpoint, "", "the kernel data plane refuses the rule: %v", err)
	}
	return err // closed or broken: a server error, still before any id
}

// l4Shape refuses what no kernel data path serves, from the rule alone.
func l4Shape(r *lbrule.Rule) error {
	s := r.Service
	mode := fmt.Sprintf("mode %d (%s)", s.Mode, lbrule.ModeName(s.Mode))
	if s.Protocol == "icmp" {
		return refuse(lbrule.ErrInvalid, ReasonL4Protocol, "serviceArguments.protocol",
			"%s balances tcp, udp or sctp; icmp has no L4 data path", mode)
	}
	if vip, err := netip.ParseAddr(s.ExternalIP); err == nil && !vip.Unmap().Is4() {
		return refuse(lbrule.ErrInvalid, ReasonL4IPv6, "serviceArguments.externalIP",
			"%s is IPv4 only: VIP %s is IPv6 (use mode 4, fullproxy, for IPv6)", mode, s.ExternalIP)
	}
	if s.Protocol == "sctp" && s.Mode != lbrule.ModeDSR && s.Mode != lbrule.ModeFullProxy {
		return refuse(lbrule.ErrInvalid, ReasonL4SCTPNAT, "serviceArguments.mode",
			"sctp with address rewrite (%s) is not supported: its CRC32c cannot be patched in the kernel; use mode 3 (dsr)", mode)
	}
	if s.Mode != lbrule.ModeFullProxy {
		if _, ok := KernelSelector(s.Sel); !ok {
			return refuse(lbrule.ErrInvalid, ReasonL4Selector, "serviceArguments.sel",
				"sel %d (%s) needs mode 4 (fullproxy); %s has rr, hash, priority, persist, lc and chwbl (consistent hash)", s.Sel, lbrule.SelName(s.Sel), mode)
		}
	}
	if len(r.Endpoints) > dataplane.MaxEndpoints {
		return refuse(lbrule.ErrInvalid, ReasonL4Endpoint, "endpoints",
			"%d endpoints; the kernel data path takes at most %d per rule", len(r.Endpoints), dataplane.MaxEndpoints)
	}
	for i, ep := range r.Endpoints {
		a, err := netip.ParseAddr(ep.IP)
		if err != nil {
			continue // the validator names it
		}
		field := fmt.Sprintf("endpoints[%d].endpointIP", i)
		if !a.Unmap().Is4() {
			return refuse(lbrule.ErrInvalid, ReasonL4IPv6, field, "%s is IPv4 only: endpoint %s is IPv6", mode, ep.IP)
		}
		if a.IsUnspecified() || a.IsMulticast() {
			return refuse(lbrule.ErrInvalid, ReasonL4Endpoint, field, "endpoint %s is not a unicast address", ep.IP)
		}
	}
	return nil
}

// Precheck implements Prechecker: without the data plane, L4 rules are
// refused before they get an id.
func (k KernelUnavailable) Precheck(_ context.Context, _ uint32, r *lbrule.Rule) error {
	if r.Service.Mode == lbrule.ModeFullProxy {
		return nil
	}
	code := k.Code
	if code == "" {
		code = ReasonNoDataplane
	}
	return &lbrule.RuleError{Class: lbrule.ErrPrecondition, Field: "serviceArguments.mode", Reason: code,
		Msg: fmt.Sprintf("rule %s is mode %d (%s), which needs the eBPF data plane: %s", r.Key(), r.Service.Mode, lbrule.ModeName(r.Service.Mode), k.Why)}
}
