package gateway

import (
	"strconv"
	"strings"

	"github.com/loxilb-llm/loxilb/pkg/dispatch"
	"github.com/loxilb-llm/loxilb/pkg/outlier"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/selector"
)

// Outliers is passive health checking (*outlier.Detector): the proxy's and
// the P/D legs' attempt outcomes go in, ejected endpoints are left out of
// the candidates.
type Outliers interface {
	// Observe records one attempt against the endpoint (index ep, dial
	// address addr) of pool p and reports whether it ejected it.
	Observe(p outlier.Pool, ep int, addr string, o outlier.Outcome) bool
	// Ejected reports whether the endpoint is ejected now.
	Ejected(service uint32, role outlier.Role, addr string) bool
	// Forget drops a removed rule's records.
	Forget(service uint32)
}

// ejectCandidates marks the ejected endpoints among the healthy candidates
// unhealthy, so neither the router nor failover picks them, and returns
// their indices for the receipt. When that would leave no healthy
// candidate, ejection is ignored: a degraded endpoint beats a 503.
func (g *Gateway) ejectCandidates(st *service, cands []selector.Candidate) []int {
	if g.cfg.Outliers == nil {
		return nil
	}
	var ejected []int
	healthy := 0
	for i := range cands {
		c := &cands[i]
		if !c.Healthy {
			continue
		}
		if g.cfg.Outliers.Ejected(st.id, outlier.RoleNone, st.addrs[c.Idx]) {
			ejected = append(ejected, c.Idx)
			c.Healthy = false
			continue
		}
		healthy++
	}
	if len(ejected) == 0 {
		return nil
	}
	if healthy == 0 {
		for i := range cands {
			for _, e := range ejected {
				if cands[i].Idx == e {
					cands[i].Healthy = true
				}
			}
		}
		return nil
	}
	for _, e := range ejected {
		g.m.ejectedSkipped.WithLabelValues(st.label, strconv.Itoa(e)).Inc()
	}
	return ejected
}

// ejectPD does the same for one role's endpoints of a P/D pool.
func (g *Gateway) ejectPD(st *service, role outlier.Role, eps []dispatch.Endpoint) []int {
	if g.cfg.Outliers == nil {
		return nil
	}
	var ejected []int
	healthy := 0
	for i := range eps {
		e := &eps[i]
		if !e.Healthy {
			continue
		}
		if g.cfg.Outliers.Ejected(st.id, role, e.Addr()) {
			ejected = append(ejected, e.Idx)
			e.Healthy = false
			continue
		}
		healthy++
	}
	if len(ejected) == 0 {
		return nil
	}
	if healthy == 0 {
		for i := range eps {
			for _, x := range ejected {
				if eps[i].Idx == x {
					eps[i].Healthy = true
				}
			}
		}
		return nil
	}
	for _, e := range ejected {
		g.m.ejectedSkipped.WithLabelValues(st.label, strconv.Itoa(e)).Inc()
	}
	return ejected
}

// observer returns the proxy's per-attempt hook for a single-pool rule of
// n endpoints, nil without passive health checking.
func (g *Gateway) observer(st *service, n int) func(proxy.Endpoint, outlier.Outcome) {
	o := g.cfg.Outliers
	if o == nil {
		return nil
	}
	pool := outlier.Pool{Service: st.id, Size: n}
	return func(ep proxy.Endpoint, out outlier.Outcome) { o.Observe(pool, ep.Idx, ep.Addr, out) }
}

// ejectedField renders the receipt's ejected= field: the endpoints left out
// because they are ejected, "" when none were.
func ejectedField(ejected []int) string {
	if len(ejected) == 0 {
		return ""
	}
	var b strings.Builder
	b.WriteString(" ejected=")
	for i, e := range ejected {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(e))
	}
	return b.String()
}

// pdObserver returns the dispatcher's per-leg hook for a P/D pool: each
// role is its own pool for the ejection cap (the P/D circuit breaker).
func (g *Gateway) pdObserver(st *service, pool *dispatch.Pool) func(dispatch.Endpoint, bool, outlier.Outcome) {
	o := g.cfg.Outliers
	if o == nil {
		return nil
	}
	pre := outlier.Pool{Service: st.id, Role: outlier.RolePrefill, Size: len(pool.Prefill)}
	dec := outlier.Pool{Service: st.id, Role: outlier.RoleDecode, Size: len(pool.Decode)}
	return func(ep dispatch.Endpoint, prefill bool, out outlier.Outcome) {
		p := dec
		if prefill {
			p = pre
		}
		o.Observe(p, ep.Idx, ep.Addr(), out)
	}
}
