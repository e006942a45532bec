// Package outlier is passive health checking for mode-4 endpoints (outlier
// ejection, as Envoy's outlier detection and HAProxy's "observe layer7").
//
// In: the outcome of every attempt the proxy (or a P/D leg) made against an
// endpoint: success, gateway failure (connect refused or timed out, the
// connection reset before a response) or a 5xx answer. Out: whether an
// endpoint is ejected right now, which the gateway uses to leave it out of
// its candidates.
//
// An endpoint is ejected after Config.GatewayFailures consecutive gateway
// failures or Config.ServerErrors consecutive 5xx answers (in a
// prefill/decode pool after Config.PDOriginErrors consecutive origin errors
// of either kind: the P/D circuit breaker). The ejection lasts
// Config.BaseEjection, doubled for every ejection that follows within
// Config.MaxEjection of the previous one ending, capped at
// Config.MaxEjection. When it ends the endpoint is on probation: its next
// failure ejects it again at once, its next success ends the probation. At
// most Config.MaxEjectedPercent of a pool's endpoints are ejected at once,
// and never its last one; an ejection refused by that cap is counted.
//
// Neighbours: pkg/proxy and pkg/dispatch report attempts (Outcome);
// pkg/gateway asks Ejected while choosing candidates.
package outlier
