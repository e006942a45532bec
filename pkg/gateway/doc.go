// Package gateway is the mode-4 (fullproxy) service table: for every mode-4
// rule it keeps the routing pipeline (tokenizer by model, block hasher, the
// rule's selector) and implements proxy.Picker on top of it:
//
//	request -> tokenizer (engine's rendering) -> blockhash (full blocks)
//	        -> kvindex (longest consecutive prefix per healthy endpoint)
//	        -> router (min-match guard, overlap/load blend, spill, cold seed, sel on a miss)
//	        -> ordered candidates + receipt
//	        -> (on engines with several data-parallel ranks: the chosen
//	           endpoint's rank holding the longest prefix, spread by
//	           per-rank load, a cold rank seeded when that is cheap, named
//	           to the engine in the body or a header as it reads it,
//	           rank.go, rankload.go, rankseed.go)
//	        -> (held while the chosen endpoint still computes the shared prefix
//	           for an earlier request: prefill coalescing, coalesce.go; with
//	           several nodes also a request another node announced, remote.go;
//	           a new leader deferring briefly to a crossing announcement of
//	           a better-ranked node, tiebreak.go)
//	        -> (queued while the endpoint's prefill slots are taken, shortest
//	           predicted prefill first: prefill admission, prefillq.go)
//
// Rules with pd_disagg_mode are served through pkg/dispatch when Config.PD
// is set (pd.go): Pick returns a plan whose Dispatch runs the engine's
// prefill/decode flow, or forwards a non-inference call to a decode
// endpoint, and Reconcile drops the dispatcher's state of rules that are
// gone. Without a dispatcher such rules get 503. A flow's prefill leg takes
// part in prefill coalescing on its prefill endpoint (pdcoalesce.go).
//
// Candidates' load is this node's in-flight requests (open: the
// proxy.InFlightTable the proxy counts into, given to New; held; queued)
// and the engines' own running/waiting, per endpoint and per data-parallel
// rank, with the prefill budgets learned from them: Config.Engine
// (EngineSignals), which pkg/enginemetrics's scraper serves from outside
// the request path. With several gateway nodes (Config.ClusterLoad) the
// in-flight count also carries what the others sent: their own counts as
// they shared them a few tens of milliseconds ago (Config.PeerLoad,
// pkg/peerprefill), else as of the last scrape, so every node ranks
// endpoints alike (peerload.go).
//
// The Gateway's own Reconcile only rebuilds its routing table. The other
// stages a rule touches (proxy listeners, KV-event subscriptions and
// inventories, health probes) are kept in step by pkg/reconcilers, so the
// proxy is configured by control, never through the Gateway.
//
// Requests are untrusted: a model name longer than MaxModelNameBytes and a
// prompt past MaxPromptBytes or the token bound get 400 before any routing
// work (loxilb_gateway_rejected_requests_total), at most
// TokenizeConcurrency requests tokenize at once, and a model name no rule
// serves and no staged tokenizer matches is counted as model="other",
// never kept.
//
// A request body seen before byte for byte (a retry, one prompt from many
// clients) takes its token ids, rendered prompt and block keys from the
// body cache (bodycache.go) instead of decoding, rendering, tokenizing and
// hashing again: exact (whole-body comparison, same rule, tokenizer and
// hasher), bounded by Config.BodyCacheBytes, a body admitted on its
// second sighting only, so new prompts copy nothing into it.
//
// Every miss has a counted reason (no tokenizer staged, unhashable request,
// short prompt, ...) so a misconfiguration is visible in metrics and in the
// routing receipt instead of silently falling through.
package gateway
