package gateway

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/dispatch"
	"github.com/loxilb-llm/loxilb/pkg/engine"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/outlier"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/pkg/selector"
)

// DispatchFunc runs a prefill/decode request after the proxy has read the
// body: it writes the whole response and returns the outcome. It has the
// shape of the proxy's Plan.Dispatch hook.
type DispatchFunc func(ctx context.Context, w http.ResponseWriter, req *proxy.Request) proxy.Result

// pickPD answers Pick for a P/D rule: a plan whose Dispatch runs the
// engine's flow (the proxy hands the exchange over after reading the
// body), or one that forwards a non-inference call to a decode endpoint.
// Without a dispatcher (Config.PD nil) the rule cannot be served. A flow's
// prefill leg takes part in prefill coalescing as a single-pool request
// does (pdcoalesce.go): it may wait here for an earlier request computing
// the same prompt on its prefill endpoint, and leads the later ones.
func (g *Gateway) pickPD(ctx context.Context, st *service, req *proxy.Request) (proxy.Plan, error) {
	if g.cfg.PD == nil {
		return proxy.Plan{}, fmt.Errorf("%w: rule %d is a prefill/decode pool and the gateway has no P/D dispatcher (gateway.Config.PD)", proxy.ErrUnavailable, st.id)
	}
	plan, fn, leg, err := g.preparePD(ctx, st, req, g.cfg.PD)
	if err != nil || fn == nil {
		return plan, err
	}
	plan.Dispatch = fn
	if err := g.coalescePD(ctx, st, &plan, leg); err != nil {
		return proxy.Plan{}, err
	}
	return plan, nil
}

// Prepare is Pick for a P/D rule without the proxy: it returns the plan
// (receipt, decode endpoint as candidate) and the function that runs the
// flow. fn is nil when the request is not an inference call and the plan
// simply forwards it to a decode endpoint. Without the proxy nothing
// reports the flow's first byte, so its request neither leads nor waits
// for prefill coalescing.
func (g *Gateway) Prepare(req *proxy.Request) (proxy.Plan, DispatchFunc, error) {
	st := g.lookup(req.Service)
	if st == nil || !st.rule.Service.PDDisagg || g.cfg.PD == nil {
		return proxy.Plan{}, nil, fmt.Errorf("%w: service %d is not a prefill/decode rule this gateway dispatches", proxy.ErrUnavailable, req.Service)
	}
	plan, fn, _, err := g.preparePD(context.Background(), st, req, g.cfg.PD)
	return plan, fn, err
}

// forgetPD drops the dispatcher's state (sessions, prefix history,
// admission slots) of the P/D rules in old that next no longer has as
// P/D rules.
func (g *Gateway) forgetPD(old, next map[uint32]*service) {
	if g.cfg.PD == nil {
		return
	}
	for id, st := range old {
		if !st.rule.Service.PDDisagg {
			continue
		}
		if now, ok := next[id]; !ok || !now.rule.Service.PDDisagg {
			g.cfg.PD.Forget(id)
		}
	}
}

// pdPool renders a rule's endpoints for the dispatcher, with health.
func (g *Gateway) pdPool(st *service) *dispatch.Pool {
	r := st.rule
	pool := &dispatch.Pool{Service: st.id, Engine: r.Engine(), Scheme: "http", BootstrapPort: r.Service.PDBootstrap}
	if r.Service.Security == lbrule.SecurityE2ETLS {
		pool.Scheme = "https"
	}
	for i, ep := range r.Endpoints {
		e := dispatch.Endpoint{Idx: i, Host: ep.IP, Port: ep.Port, NixlPort: ep.NixlPort, Healthy: !st.isDraining(i)}
		if g.health != nil && e.Healthy {
			e.Healthy = g.health.Healthy(st.id, i)
		}
		switch ep.Role {
		case lbrule.RolePrefill:
			pool.Prefill = append(pool.Prefill, e)
		case lbrule.RoleDecode:
			pool.Decode = append(pool.Decode, e)
		}
	}
	return pool
}

// preparePD makes the P/D decision for one request: Tier 1.5 keys (mode 1),
// the prefill ladder and the decode choice. The OpenAI generation paths
// and, for SGLang pools, /generate run the P/D flow; other calls (model
// list, health) are forwarded to a healthy decode endpoint as is. leg is
// what the flow's prefill leg computes, for prefill coalescing (zero when
// the prompt was not hashed).
func (g *Gateway) preparePD(ctx context.Context, st *service, req *proxy.Request, d *dispatch.Dispatcher) (proxy.Plan, DispatchFunc, pdPrefill, error) {
	r := st.rule
	if err := g.checkModelName(st, req); err != nil {
		return proxy.Plan{}, nil, pdPrefill{}, err
	}
	pool := g.pdPool(st)
	ejected := append(g.ejectPD(st, outlier.RolePrefill, pool.Prefill), g.ejectPD(st, outlier.RoleDecode, pool.Decode)...)
	observe := g.pdObserver(st, pool)
	generate := !isInference(req.Method, req.Path)
	if !pdInference(st, req) {
		var cands []proxy.Endpoint
		for _, e := range pool.Decode {
			if e.Healthy {
				cands = append(cands, proxy.Endpoint{Idx: e.Idx, Addr: e.Addr()})
			}
		}
		if len(cands) == 0 {
			return proxy.Plan{}, nil, pdPrefill{}, fmt.Errorf("%w: rule %d has no healthy decode endpoint", proxy.ErrUnavailable, st.id)
		}
		plan := proxy.Plan{Candidates: cands, Receipt: "pd passthrough" + ejectedField(ejected)}
		if observe != nil {
			plan.Observe = func(ep proxy.Endpoint, o outlier.Outcome) {
				observe(dispatch.Endpoint{Idx: ep.Idx, Host: st.rule.Endpoints[ep.Idx].IP, Port: st.rule.Endpoints[ep.Idx].Port}, false, o)
			}
		}
		return plan, nil, pdPrefill{}, nil
	}
	dreq := &dispatch.Request{Pool: pool, Method: req.Method, Path: req.Path, Header: req.Header, Body: req.Body, Observe: observe}
	if h := r.Service.SessionHeaderName; h != "" {
		dreq.Session = req.Header.Get(h)
	}
	var keys []uint64
	tokens := 0 // the prompt's tokens, when it was hashed
	if st.hasher != nil && r.Service.KVExactMode == lbrule.KVExactPD {
		model := g.requestModel(st, req)
		if generate {
			ids, reason, err := g.generateTokens(ctx, st, model, req)
			if err != nil {
				return proxy.Plan{}, nil, pdPrefill{}, err
			}
			if reason == "" {
				keys, tokens = st.hasher.Keys(nil, ids), len(ids)
			}
		} else if model == "" {
			g.m.missed(st.label, ReasonNoModel)
		} else {
			ids, reason, err := g.promptTokens(ctx, st, model, req)
			if err != nil {
				return proxy.Plan{}, nil, pdPrefill{}, err
			}
			if reason == "" {
				// A fresh slice: the closure outlives Pick.
				keys, tokens = st.hasher.Keys(nil, ids), len(ids)
			}
		}
	}
	if len(keys) > 0 {
		dreq.PrefixKeys = keys
		view := router.ServiceView{ID: st.id, KVExactMode: r.Service.KVExactMode}
		bs := st.hasher.BlockSize()
		dreq.KV = func(cands []selector.Candidate) (int, string, bool) {
			if g.engine != nil {
				for i := range cands {
					if m, ok := g.engine.Metrics(st.id, cands[i].Idx); ok {
						cands[i].Metrics = m
					}
				}
			}
			v := view
			v.Untrusted = g.untrustedMask(st, cands)
			dec := g.router.Decide(v, keys, bs, cands, nil, selector.Request{})
			if dec.EP < 0 || dec.Tier == router.TierFallback {
				return -1, "", false
			}
			return dec.EP, dec.Receipt().String(), true
		}
	}
	var rankOf func(ep int) int
	var rankDone []func() // uncount the prefill legs on their ranks
	ri, rankAware := g.inv.(RankInventory)
	spec, _ := engine.Lookup(r.Engine())
	ranks := min(r.Service.KVDpRankCount, engine.MaxDPRanks)
	if len(keys) > 0 && rankAware && spec.Rank.PDPrefillField != "" && ranks > 1 {
		// Chosen once per endpoint, so the receipt names the rank the leg
		// is sent to even if events arrive in between; Pick and Dispatch
		// run on the request's goroutine, one after the other. The choice
		// reads and counts the ranks' load as a mode-4 request's does, so
		// prefill legs spread over the ranks and seed a cold one alike.
		type rankPick struct {
			rank, best int
			seeded     bool
		}
		chosen := map[int]rankPick{}
		pick := func(ep int) rankPick {
			p, ok := chosen[ep]
			if !ok {
				var lv rankSnapshot
				g.rankView(st, ep, ranks, time.Now(), &lv)
				ch := chooseRank(ri, st.id, ep, ranks, keys, &lv)
				p.rank, p.best = ch.rank, ch.best
				p.seeded = lv.seeded
				chosen[ep] = p
			}
			return p
		}
		rankOf = func(ep int) int { return pick(ep).rank }
		dreq.PrefillRank = func(ep int) (int, int, bool) {
			p := pick(ep)
			g.m.rankTargeted.WithLabelValues(st.label, strconv.Itoa(ep), strconv.Itoa(p.rank)).Inc()
			if p.seeded {
				g.m.rankSeeded.WithLabelValues(st.label, strconv.Itoa(ep), strconv.Itoa(p.rank)).Inc()
			}
			rankDone = append(rankDone, g.ranks.begin(st.id, ep, p.rank, keys, p.best, time.Now()))
			return p.rank, ranks, true
		}
	}
	choice, err := d.Choose(dreq)
	if err != nil {
		return proxy.Plan{}, nil, pdPrefill{}, fmt.Errorf("%w: %w", proxy.ErrUnavailable, err)
	}
	receipt := choice.Receipt()
	if rankOf != nil {
		receipt += " prefill_rank=" + strconv.Itoa(rankOf(choice.Prefill[0].Idx))
	}
	// What the prefill leg finds cached is read before its own
	// speculative entry makes the whole prompt look so.
	leg := g.prefillLeg(st, choice.Prefill[0].Idx, keys, tokens)
	if len(keys) > 0 && g.cfg.SpeculativeTTL > 0 {
		// The chosen prefill worker will hold this prefix before its
		// events say so; siblings should follow it there.
		g.inv.StoreSpeculative(st.id, choice.Prefill[0].Idx, keys, g.cfg.SpeculativeTTL)
	}
	plan := proxy.Plan{
		Candidates: []proxy.Endpoint{{Idx: choice.Decode.Idx, Addr: choice.Decode.Addr()}},
		Receipt:    receipt + ejectedField(ejected),
	}
	fn := func(ctx context.Context, w http.ResponseWriter, preq *proxy.Request) proxy.Result {
		run := *dreq
		run.Header, run.Body, run.Legs = preq.Header, preq.Body, preq.Legs
		defer func() {
			for _, done := range rankDone {
				done()
			}
		}()
		return d.Execute(ctx, w, &run, choice)
	}
	return plan, fn, leg, nil
}
