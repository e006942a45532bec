// Package enginemetrics reads what the engines say of their own load: it
// polls every mode-4 endpoint's Prometheus /metrics on its own timer
// (Scraper.Run; the targets follow the rules, Scraper.Reconcile) and keeps
// the last sample per endpoint for the gateway, which takes each signal
// through its own small interface (gateway.EngineSignals):
//
//   - Metrics: running and waiting requests and KV-cache usage, summed over
//     an engine's label sets (several models, data-parallel ranks), for
//     gpu-aware selection, the router's load blend and P/D's Tier 1.5;
//   - RankMetrics: running and waiting per data-parallel rank, for engines
//     that label their gauges with the rank (SGLang's dp_rank, ranks.go);
//   - Others: the engine's running+waiting less this node's own open
//     requests when the sample arrived (Config.SelfInFlight), the load
//     other gateway nodes put there;
//   - LearnedSlots: each endpoint's concurrent-sequence budget, read from
//     SGLang's server info or observed while the engine queues
//     (budget.go), for the gateway's prefill admission queue; while it is
//     unknown the endpoint is also sampled between scrapes when it may be
//     queueing (probe.go), as a burst's queue is short.
//
// It also counts the prompt tokens an LMCache tier served
// (loxilb_kv_lmcache_hit_tokens_total, lmcache.go).
//
// The scraper is a side input, not on a request's path: it is the one
// place besides pkg/proxy that sends HTTP requests to endpoints, and a
// request never waits for it. A sample older than Config.MaxAge is not
// served, so a dead metrics endpoint never pins a stale load.
//
// Engines are not trusted: a body is read up to Config.MaxBody, a gauge
// that is NaN, infinite, negative or above 2^20 refuses the whole sample
// (loxilb_kv_prefill_budget_rejected_total, bad_value) and a page without
// the engine's gauges is a counted scrape error
// (loxilb_gateway_engine_scrape_errors_total, by reason), never an idle
// engine. An https endpoint's certificate is not verified here: the values
// are load hints, and the proxy verifies the endpoint for traffic.
package enginemetrics
