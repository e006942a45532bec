package gateway

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/pkg/selector"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

// Miss reasons the gateway adds to the router's.
const (
	ReasonNotInference = "not_inference" // a path or method that carries no prompt
	ReasonNoModel      = "no_model"      // neither the rule nor the request names a model
)

// routingKeyTokens is how many leading tokens key the consistent-hash
// selectors: enough to separate system prompts, short enough that a growing
// conversation keeps its key.
const routingKeyTokens = 64

// maxPooledIDs bounds the token-id buffers Pick keeps for reuse (256 KB):
// a rare very long prompt's array is left to the GC instead of pinned.
const maxPooledIDs = 64 << 10

// routingKeyBytes bounds the raw-body prefix used as the key when the
// prompt is not tokenized (KV-exact off).
const routingKeyBytes = 512

func isInference(method, path string) bool {
	return method == http.MethodPost && (path == "/v1/completions" || path == "/v1/chat/completions")
}

// Pick implements proxy.Picker. It may hold the request until an earlier
// request finishes computing the prompt prefix both share on the chosen
// endpoint (prefill coalescing, see coalesce.go).
func (g *Gateway) Pick(ctx context.Context, req *proxy.Request) (proxy.Plan, error) {
	st := g.lookup(req.Service)
	if st == nil {
		return proxy.Plan{}, fmt.Errorf("%w: no mode-4 rule with service id %d", proxy.ErrUnavailable, req.Service)
	}
	r := st.rule
	if r.Service.PDDisagg {
		return g.pickPD(ctx, st, req)
	}
	if err := g.checkModelName(st, req); err != nil {
		return proxy.Plan{}, err
	}
	cands := g.candidates(st)
	ejected := g.ejectCandidates(st, cands)
	view := router.ServiceView{ID: st.id, KVExactMode: r.Service.KVExactMode, ShortestFirst: g.prefill.queues(st.id, len(st.addrs))}
	freq := selector.Request{ClientIP: req.ClientAddr.Addr()}
	// Only a hashing selector reads the key: round robin and the like
	// skip building one (a copy of up to routingKeyBytes of the body).
	keyed := selector.UsesKey(st.sel)
	if h := r.Service.SessionHeaderName; h != "" && keyed && st.key.has(lbrule.ChwblFlagSession) {
		if v := req.Header.Get(h); v != "" {
			freq.Key = []byte(v)
		}
	}
	body := &parsedBody{raw: req.Body}
	kr, err := g.keyRequest(st, req, body)
	if err != nil {
		return proxy.Plan{}, err
	}

	model := g.requestModel(st, req)
	var d router.Decision
	var keys []uint64
	promptTokens := 0 // 0 when the prompt was not tokenized
	kp := g.keyPool.Get().(*[]uint64)
	defer func() { *kp = keys[:0]; g.keyPool.Put(kp) }()
	keys = (*kp)[:0]
	// Nothing keeps the prompt's ids past Pick (the keys, the routing key
	// and the plan are computed from them), so their array goes back to
	// the pool, unless a long prompt made it larger than is worth keeping.
	var ids []uint32
	shared := false // ids are the body cache's, read-only: never pooled
	ip := g.idPool.Get().(*[]uint32)
	defer func() {
		if !shared && cap(ids) <= maxPooledIDs {
			*ip = ids[:0]
		}
		g.idPool.Put(ip)
	}()

	switch {
	case st.hasher == nil:
		if keyed {
			g.fillKey(st, &freq, model, req, kr)
		}
		d = g.router.Fallback(view, router.ReasonModeOff, cands, st.sel, freq)
	case !isInference(req.Method, req.Path):
		d = g.router.Fallback(view, ReasonNotInference, cands, st.sel, freq)
	case model == "":
		g.m.missed(st.label, ReasonNoModel)
		d = g.router.Fallback(view, ReasonNoModel, cands, st.sel, freq)
	default:
		var rendered, reason string
		ids, rendered, keys, shared, reason, err = g.promptKeys(ctx, st, model, req, body, *ip, keys)
		if err != nil {
			return proxy.Plan{}, err
		}
		if reason != "" {
			if keyed {
				g.fillKey(st, &freq, model, req, kr)
			}
			d = g.router.Fallback(view, reason, cands, st.sel, freq)
			break
		}
		promptTokens = len(ids)
		if freq.Key == nil && usesKey(r.Service.Sel) {
			switch {
			case kr == nil:
				freq.Key = tokenKey(model, ids)
			case req.Path == "/v1/completions":
				freq.Key = st.key.tokenBlocksKey(model, *kr, ids, keys, st.hasher.BlockSize())
			default:
				tok, _ := g.tok.Get(model)
				var ok bool
				if freq.Key, ok = st.key.chatTokenKey(model, *kr, tok, rendered, ids, keys, st.hasher.BlockSize()); !ok {
					freq.Key = st.key.requestKey(model, req.Path, *kr)
				}
			}
		}
		view.Untrusted = g.untrustedMask(st, cands)
		d = g.router.Decide(view, keys, st.hasher.BlockSize(), cands, st.sel, freq)
	}
	if d.EP < 0 {
		if st.draining != nil {
			return proxy.Plan{}, fmt.Errorf("%w: rule %d has no healthy endpoint that is not draining", proxy.ErrUnavailable, st.id)
		}
		return proxy.Plan{}, fmt.Errorf("%w: rule %d has no healthy endpoint", proxy.ErrUnavailable, st.id)
	}
	if len(keys) > 0 && g.cfg.SpeculativeTTL > 0 {
		// Siblings sharing this new prefix follow it before the engine's
		// events arrive (the index copies the keys).
		g.inv.StoreSpeculative(st.id, d.EP, keys, g.cfg.SpeculativeTTL)
	}
	plan := proxy.Plan{Candidates: g.order(st, d.EP, cands), Observe: st.observe}
	rc := d.Receipt()
	rankDone := func() {} // uncounts the request on its rank
	// The blocks the engine serves from cache: the endpoint's prefix, or,
	// on a named rank, what that rank holds of it (a rank chosen for its
	// load or seeded holds less than the endpoint's deepest rank).
	cachedBlocks := d.MatchedBlocks
	if ri, ok := g.inv.(RankInventory); ok && st.rank != nil && len(keys) > 0 {
		now := time.Now()
		var lv rankSnapshot
		g.rankView(st, d.EP, st.rank.ranks, now, &lv)
		ch := chooseRank(ri, st.id, d.EP, st.rank.ranks, keys, &lv)
		if ep, ok := st.rank.targetEndpoint(plan.Candidates[0], ch.rank, req.Body); ok {
			plan.Candidates[0] = ep
			rc.Rank, rc.RankSet = ch.rank, true
			g.m.rankTargeted.WithLabelValues(st.label, strconv.Itoa(d.EP), strconv.Itoa(ch.rank)).Inc()
			if lv.seeded {
				g.m.rankSeeded.WithLabelValues(st.label, strconv.Itoa(d.EP), strconv.Itoa(ch.rank)).Inc()
			}
			rankDone = g.ranks.begin(st.id, d.EP, ch.rank, keys, ch.best, now)
			cachedBlocks = min(cachedBlocks, ch.held)
		}
	}
	plan.Receipt = rc.String() + ejectedField(ejected) + untrustedField(view.Untrusted)
	if promptTokens == 0 {
		// Not tokenized: nothing to coalesce, queue or learn from, so
		// the plan needs no FirstByte or Done (saving their closures).
		return plan, nil
	}
	predicted := int64(cachedBlocks * d.BlockSize)
	// The engine recomputes at least the prompt's last token.
	uncached := max(int64(promptTokens)-predicted, 1)
	lead := func() {} // ends this request's coalescing leadership
	slot := func() {} // frees its prefill slot
	work := func() {} // uncounts its outstanding prefill work
	if promptTokens > 0 {
		work = g.work.add(st.id, d.EP, uncached)
	}
	var follow, self *leader
	if promptTokens > 0 && g.cfg.CoalesceWait > 0 {
		follow = g.leaderFor(st, d, keys)
		computed := keys[min(d.MatchedBlocks, len(keys)):]
		lead, self = g.lead(st, d.EP, computed, uncached, follow == nil && g.contesting())
	}
	release := func() { lead(); slot(); work() }
	plan.FirstByte = release
	plan.Done = func(proxy.Result) { release(); rankDone() }
	if st.hasher != nil && len(keys) > 0 {
		label := st.label
		plan.Done = func(res proxy.Result) {
			release()
			rankDone()
			g.m.closedLoop(label, res, predicted)
		}
	}
	if self != nil && self.contest != nil {
		var gone bool
		if follow, gone = g.tieBreak(ctx, st, self); gone {
			lead()
			work()
			rankDone()
			return proxy.Plan{}, fmt.Errorf("%w: client went away while its prefill deferred to other nodes", proxy.ErrClientCanceled)
		}
	}
	inherit := false
	if follow != nil {
		out := g.follow(ctx, st, d.EP, follow)
		if out == waitCancelled {
			lead()
			work()
			rankDone()
			return proxy.Plan{}, fmt.Errorf("%w: client went away while waiting for a shared prefill", proxy.ErrClientCanceled)
		}
		inherit = out == waitReleased
	}
	if promptTokens > 0 && g.prefill.on() {
		start := time.Now()
		var out admitOutcome
		slot, out = g.prefill.admit(ctx, st.id, d.EP, uncached, self, g.cfg.PrefillQueueWait, inherit)
		g.m.admitted.WithLabelValues(st.label, strconv.Itoa(d.EP), string(out)).Inc()
		if out != admitImmediate && out != admitInherited {
			g.m.admitWait.WithLabelValues(st.label).Observe(time.Since(start).Seconds())
		}
		if out == admitCancelled {
			lead()
			work()
			rankDone()
			return proxy.Plan{}, fmt.Errorf("%w: client went away while queued for a prefill slot", proxy.ErrClientCanceled)
		}
	}
	return plan, nil
}

// leaderFor returns the earlier request d's endpoint is still computing the
// shared prefix for, when waiting for it saves at least as much work as it
// may cost: the blocks only in flight (routed, not yet confirmed by the
// engine's events) are at least half the leader's own prefill.
func (g *Gateway) leaderFor(st *service, d router.Decision, keys []uint64) *leader {
	n := min(d.MatchedBlocks, len(keys))
	if g.cfg.CoalesceWait <= 0 || n == 0 || d.BlockSize <= 0 {
		return nil
	}
	ci, ok := g.inv.(router.ConfirmedInventory)
	if !ok {
		return nil
	}
	eps, conf := [1]int{d.EP}, [1]int{}
	ci.PrefixMatchConfirmed(st.id, keys[:n], eps[:], conf[:])
	inflight := n - min(max(conf[0], 0), n)
	if inflight == 0 {
		return nil
	}
	l := g.leaders.find(st.id, d.EP, keys[n-1])
	if l == nil || 2*int64(inflight*d.BlockSize) < l.uncached {
		return nil
	}
	return l
}

// requestModel names the model a request is tokenized for: the rule's
// model_name, else the request's model (body "model" or X-Model), else,
// for a request that names none, the model of the only staged tokenizer:
// vLLM and SGLang serve such a request with the one model they run, so a
// single-model deployment stages exactly that tokenizer. "" when none
// applies (several tokenizers staged: the model cannot be inferred); the
// request then skips Tier 1.5 (no_model).
func (g *Gateway) requestModel(st *service, req *proxy.Request) string {
	if m := st.rule.Service.ModelName; m != "" {
		return m
	}
	if req.Model != "" {
		return req.Model
	}
	if st.hasher == nil {
		return ""
	}
	m, ok := g.tok.SoleModel()
	if !ok {
		return ""
	}
	g.m.modelImplied.WithLabelValues(st.label).Inc()
	return m
}

// Rejection reasons counted by loxilb_gateway_rejected_requests_total.
const (
	rejectModelName = "model_name_too_long"
	rejectPrompt    = "prompt_too_long"
)

// modelOther labels requests whose model no rule names and no staged
// tokenizer serves: clients choose those names, so each must not become
// a metric series.
const modelOther = "other"

// checkModelName refuses a model name longer than MaxModelNameBytes.
func (g *Gateway) checkModelName(st *service, req *proxy.Request) error {
	n := len(req.Model)
	if n <= g.cfg.MaxModelNameBytes {
		return nil
	}
	g.m.rejected(st.label, rejectModelName)
	err := fmt.Errorf("%w: the model name is %d bytes, longer than the %d bytes this gateway accepts", proxy.ErrBadRequest, n, g.cfg.MaxModelNameBytes)
	g.logReject(st, rejectModelName, err)
	return err
}

func (g *Gateway) logReject(st *service, reason string, err error) {
	if ok, held := g.rejectLog.allow(time.Now()); ok {
		g.logger.Warn("request refused", "service", st.id, "reason", reason, "err", err, "similar_refusals_not_logged", held)
	}
}

// promptTokens renders and tokenizes the request as the rule's engine does.
// A non-empty reason means Tier 1.5 must decline (and why); an error means
// the request itself is malformed, too long, or its client went away
// while it waited for a tokenization slot.
func (g *Gateway) promptTokens(ctx context.Context, st *service, model string, req *proxy.Request) ([]uint32, string, error) {
	ids, _, reason, err := g.promptTokensRendered(ctx, st, model, req, &parsedBody{raw: req.Body}, nil)
	return ids, reason, err
}

// promptTokensRendered is promptTokens that also returns the rendered chat
// prompt (empty for completions); body is req.Body, read at most once.
func (g *Gateway) promptTokensRendered(ctx context.Context, st *service, model string, req *proxy.Request, body *parsedBody, buf []uint32) ([]uint32, string, string, error) {
	tok, err := g.tok.Get(model)
	if err != nil {
		label := model
		if st.rule.Service.ModelName == "" && (errors.Is(err, tokenizer.ErrNotStaged) || errors.Is(err, tokenizer.ErrInvalidModelName)) {
			label = modelOther
			if ok, held := g.unknownLog.allow(time.Now()); ok {
				g.logger.Warn("request names a model with no staged tokenizer; routed without KV awareness",
					"service", st.id, "model", model, "err", err, "similar_requests_not_logged", held)
			}
		}
		g.m.tokenizerMissing(st.label, label, err)
		return nil, "", router.ReasonNoTokenizer, nil
	}
	opts := tokenizer.RequestOptions{MaxPromptBytes: g.cfg.MaxPromptBytes, MaxPromptTokens: g.cfg.MaxPromptTokens,
		CompletionsBOS: st.rule.Profile().CompletionsBOS, IDs: buf}
	if opts.MaxPromptTokens <= 0 {
		opts.MaxPromptTokens = tok.MaxLength()
		if opts.MaxPromptTokens <= 0 {
			opts.MaxPromptTokens = DefaultMaxPromptTokens
		}
	}
	// Tokenizing is CPU-bound: more at once than there are cores only
	// makes every request slower, so the rest wait for a slot.
	g.m.tokWaiting.Inc()
	select {
	case g.tokSlots <- struct{}{}:
		g.m.tokWaiting.Dec()
	case <-ctx.Done():
		g.m.tokWaiting.Dec()
		return nil, "", "", fmt.Errorf("%w: client went away while waiting to be tokenized", proxy.ErrClientCanceled)
	}
	var rt tokenizer.RequestTokens
	parsed, err := body.get()
	if err == nil {
		rt, err = tok.EncodeParsed(st.rule.Engine(), req.Path, parsed, opts)
	}
	<-g.tokSlots
	if err != nil {
		switch {
		case errors.Is(err, tokenizer.ErrPromptTooLong):
			g.m.rejected(st.label, rejectPrompt)
			err = fmt.Errorf("%w: %v (model %q)", proxy.ErrBadRequest, err, model)
			g.logReject(st, rejectPrompt, err)
			return nil, "", "", err
		case errors.Is(err, tokenizer.ErrBadRequest):
			return nil, "", "", fmt.Errorf("%w: %v", proxy.ErrBadRequest, err)
		}
		g.m.missed(st.label, router.ReasonUnhashable)
		return nil, "", router.ReasonUnhashable, nil
	}
	if rt.Unhashable != "" {
		g.m.unhashable(st.label, rt.Unhashable)
		return nil, "", router.ReasonUnhashable, nil
	}
	return rt.IDs, rt.Rendered, "", nil
}

func (g *Gateway) candidates(st *service) []selector.Candidate {
	r := st.rule
	out := make([]selector.Candidate, 0, len(r.Endpoints))
	for i, ep := range r.Endpoints {
		if r.Service.PDDisagg && ep.Role != lbrule.RoleNone {
			continue
		}
		c := selector.Candidate{Idx: i, Weight: ep.Weight, Healthy: !st.isDraining(i)}
		if g.health != nil && c.Healthy {
			c.Healthy = g.health.Healthy(st.id, i)
		}
		// Requests held for a shared prefill on this endpoint or queued
		// for one of its prefill slots will be sent to it: they are its
		// load already.
		c.InFlight = g.localInFlight(st, i)
		c.PrefillTokens = g.work.outstanding(st.id, i)
		c.Slots, _ = g.prefill.budget(st.id, i)
		if g.others != nil {
			// What other nodes sent (Config.ClusterLoad, peerload.go).
			c.InFlight += g.otherNodes(st, i)
		}
		if g.engine != nil {
			if m, ok := g.engine.Metrics(st.id, i); ok {
				c.Metrics = m
			}
		}
		out = append(out, c)
	}
	return out
}

// order puts the chosen endpoint first and the other healthy endpoints
// after it, least loaded first, as failover targets for connect errors.
func (g *Gateway) order(st *service, chosen int, cands []selector.Candidate) []proxy.Endpoint {
	out := make([]proxy.Endpoint, 1, max(len(cands), 1))
	out[0] = proxy.Endpoint{Idx: chosen, Addr: st.addrs[chosen]}
	var arr [16]selector.Candidate // most rules: no allocation
	rest := arr[:0]
	for _, c := range cands {
		if c.Healthy && c.Idx != chosen {
			rest = append(rest, c)
		}
	}
	slices.SortStableFunc(rest, func(a, b selector.Candidate) int { return cmp.Compare(a.InFlight, b.InFlight) })
	for _, c := range rest {
		out = append(out, proxy.Endpoint{Idx: c.Idx, Addr: st.addrs[c.Idx]})
	}
	return out
}

// tokenKey keys the consistent-hash selectors on model + the first tokens.
func tokenKey(model string, ids []uint32) []byte {
	n := min(len(ids), routingKeyTokens)
	b := make([]byte, 0, len(model)+1+4*n)
	b = append(b, model...)
	b = append(b, 0)
	for _, id := range ids[:n] {
		b = binary.LittleEndian.AppendUint32(b, id)
	}
	return b
}

// rejectCacheSalt counts requests refused for lacking the cache_salt
// their rule requires (chwbl_enable_cache_salt).
const rejectCacheSalt = "cache_salt_missing"

// keyRequest parses what the routing key reads from an inference request,
// when the rule's selector hashes a key or the rule requires cache_salt;
// nil otherwise, or when the body is not a JSON object.
func (g *Gateway) keyRequest(st *service, req *proxy.Request, body *parsedBody) (*keyRequest, error) {
	if !isInference(req.Method, req.Path) || !usesKey(st.rule.Service.Sel) && !st.key.requireSalt {
		return nil, nil
	}
	kr, ok := keyRequestOf(body)
	if err := st.key.checkCacheSalt(kr); err != nil {
		g.m.rejected(st.label, rejectCacheSalt)
		g.logReject(st, rejectCacheSalt, err)
		return nil, err
	}
	if !ok {
		return nil, nil
	}
	return &kr, nil
}

// parsedBody reads an inference request's body once, the first time a
// stage needs it (the routing key, the tokenizer), and hands every later
// stage the same fields.
type parsedBody struct {
	raw  []byte
	done bool
	req  *tokenizer.Request
	err  error
}

func (b *parsedBody) get() (*tokenizer.Request, error) {
	if !b.done {
		b.req, b.err = tokenizer.ParseRequest(b.raw)
		b.done = true
	}
	return b.req, b.err
}

// fillKey keys the hashing selectors when the prompt is not tokenized: on
// the prompt prefix at the rule's depth (routekey.go), or on model + the
// first bytes of a body that is not a JSON object.
func (g *Gateway) fillKey(st *service, freq *selector.Request, model string, req *proxy.Request, kr *keyRequest) {
	if freq.Key != nil || !usesKey(st.rule.Service.Sel) {
		return
	}
	if kr != nil {
		freq.Key = st.key.requestKey(model, req.Path, *kr)
		return
	}
	g.fillKeyFromBody(freq, model, req.Body)
}

// fillKeyFromBody keys the selectors on model + a body prefix. A client
// sends the same prompt prefix in the same byte order, so repeated
// prefixes still meet on one endpoint.
func (g *Gateway) fillKeyFromBody(freq *selector.Request, model string, body []byte) {
	if freq.Key != nil || len(body) == 0 {
		return
	}
	n := min(len(body), routingKeyBytes)
	k := make([]byte, 0, len(model)+1+n)
	k = append(k, model...)
	k = append(k, 0)
	freq.Key = append(k, body[:n]...)
}
