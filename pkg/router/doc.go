// Package router makes the Tier-1.5 decision of a mode-4 rule: which
// endpoint already holds the longest prefix of the request in its KV cache,
// tempered by load so one hot prefix cannot monopolise a worker, and with
// every decision explainable.
//
// In, all composed by package gateway, which tokenizes the request and
// calls Decide (or Fallback when it cannot): the request's block hashes
// (package blockhash), the rule's candidates with health (package health)
// and load (in-flight requests counted by the proxy plus those the gateway
// holds or queues for the endpoint, outstanding prefill tokens, the
// endpoint's sequence budget when the gateway knows it, engine metrics
// scraped from /metrics), the rule's fallback selector (package
// selector), and an Inventory (package kvindex, fed by the engines' KV
// events).
// Out: a Decision naming the endpoint, the tier (tier1.5, spill, cold_seed,
// fallback), matched/total blocks and a reason; Decision.Receipt formats it
// for the X-Loxilb-Route response header and for logs.
//
// The algorithm is documented on Router.Decide. Compared with loxilb's
// gateway it scores the longest consecutive prefix rather than an unordered
// overlap count, blends overlap and load in one formula (score = cached
// tokens − penalty·load, both in tokens of prefill: penalty is the
// uncached work of the service's typical request, learned per service, or
// LOXILB_KV_LOAD_PENALTY) instead of switching between modes, breaks
// every tie deterministically, never spills below a small absolute load
// floor, and labels every metric by service and endpoint so two rules never
// share a series.
//
// Spill relief and cold seeding price the cached tokens a move throws away
// against the queue it avoids (movecost.go), so a hot prefix still spreads
// and a restarted engine is still seeded, but a long session is not moved
// off its history next to a mildly loaded holder.
//
// With several gateway nodes (Config.ColdRendezvous), a cold prefix is
// placed by rendezvous hashing of its first blocks over the candidates
// within the bounded-load limits (rendezvous.go), so every node sends
// siblings of a new prefix to the same endpoint without coordination.
//
// The router is pure logic: no HTTP, no goroutines. Its only state is per
// service (cold-seed tick, zero-hit run, the running medians of a hit's
// uncached work, prompt length and cached prefix) and is dropped by Forget.
//
// Settings are Config's fields; the daemon reads them from its settings
// table (cmd/loxilb/settings_table.go, listed in the README's routing
// table), environment variables named as in loxilb (LLB_KV_MIN_MATCH_TOKENS,
// LOXILB_KV_SPILL_RELIEF, ...).
//
// Metrics: loxilb_pd_kv_tier15_hits_total{service,ep_idx},
// loxilb_pd_kv_tier15_spills_total{service,ep_idx},
// loxilb_pd_kv_tier15_cold_seeds_total{service,ep_idx},
// loxilb_pd_kv_tier15_miss_reason_total{service,reason},
// loxilb_pd_kv_zero_hit_watchdog_total{service,reason} (reason not_cached
// when every non-empty inventory attests hash parity, parity_suspect
// otherwise; see WithAttestation) and
// loxilb_pd_kv_tier15_decision_seconds{service}.
package router
