// Package dispatch runs prefill/decode (P/D) disaggregated requests for
// mode-4 rules with pd_disagg_mode: it chooses a prefill and a decode
// endpoint, drives the engine's own P/D protocol over two HTTP legs, and
// streams the decode answer back to the client.
//
// In: a Request (the rule as a Pool of prefill and decode Endpoints with
// health, the client's method, path, headers and JSON body, the session
// header value, optional block keys and an optional Tier 1.5 scorer) from
// the gateway, which tokenizes and hashes the prompt for kvExactMode 1.
// Out: the legs, sent through the proxy's upstream for the rule
// (Request.Legs, which the proxy hands the flow in proxy.Request.Legs:
// pooled connections, TLS settings, in-flight counts, error classes); the
// complete client response written to an http.ResponseWriter; a
// proxy.Result for the proxy's metrics. Neighbours: pkg/gateway (builds
// the Request and Tier 1.5 scorer over pkg/router and pkg/kvindex),
// pkg/proxy (reads the body, calls the dispatch hook with the rule's
// upstream, maps every error to a status, records the Result). The
// dispatcher owns no connection and no HTTP client.
//
// # Flows
//
// vLLM (NixlConnector, sequential), as vLLM's toy proxy does: the prefill
// leg is the client body with kv_transfer_params {"do_remote_decode": true,
// "do_remote_prefill": false, remote_* null}, "stream": false,
// "max_tokens": 1 (and "max_completion_tokens": 1 when present), without
// stream_options, min_tokens and min_completion_tokens. Its response must
// carry a top-level kv_transfer_params object (missing: 502
// pd_params_missing; not an object, wrong field types, or over
// MaxParamsBytes: 502 pd_params_malformed). The object is forwarded
// opaquely except that remote_host becomes the prefill endpoint's IP and
// remote_port its nixl_port (0: its target port), as the loxilb
// documentation specifies. The decode leg is the original body plus those
// parameters. Both legs carry the same X-Request-Id.
//
// SGLang (concurrent): one fresh bootstrap_room, uniform in [0, 2^63-1],
// per request (one per prompt for batched prompts), bootstrap_host = the
// prefill endpoint IP and bootstrap_port = the rule's pdBootstrapPort (0:
// 8998), added to the same body sent to both legs at once. Besides the
// OpenAI paths this serves SGLang's native /generate (PathGenerate), whose
// batch ("text" or "input_ids" as a list of prompts) gets the three fields
// as lists, one entry and a distinct room per prompt, as sgl-router sends
// them; a /generate body naming neither or both prompt fields, an empty
// list or a list mixing kinds is a 400 before any leg (checkGenerate), and
// /generate on another engine's pool is a 400 too. The client gets
// the decode leg; the prefill response is read and discarded. A failed
// prefill cancels the decode leg (and the client gets the prefill's error,
// the root cause); a failed decode cancels the prefill leg.
//
// TensorRT-LLM (sequential): the context leg carries disaggregated_params
// {"request_type": "context_only"}, "stream": false, "max_tokens": 1; its
// choice's disaggregated_params, with request_type set to
// "generation_only", go into the original body for the generation leg.
// When the context leg already finished the request (finish_reason not
// "length" or "not_finished") its response is the answer (as one SSE chunk
// for a streaming client) and no generation leg is sent.
//
// # Choosing endpoints
//
// Prefill ladder: session affinity (the rule's session_header_name value;
// bounded LRU with SessionTTL) -> prefix history (which prefill endpoint
// each chained block key was last routed to; block keys from the gateway,
// else a chained hash of the prompt text in PromptChunkBytes chunks;
// needs TrieMinPercent of the blocks) -> Tier 1.5 over the prefill
// inventories (kvExactMode 1 only) -> least in-flight. Decode: session
// affinity -> least in-flight. Affinity tiers yield when their endpoint is
// unhealthy or more than BalanceAbs legs busier than the least loaded one.
// Choice.Prefill lists the other healthy prefill endpoints after the
// chosen one: a prefill connect failure (nothing sent) moves on to the
// next (SGLang: with a fresh room, after cancelling the decode leg). A
// decode connect failure likewise moves the decode leg to the next healthy
// decode endpoint: the transfer parameters (or the SGLang room) name the
// prefill side, so any decode worker can pull the KV cache.
//
// # Failure and admission
//
// Every leg has a bound: PrefillTimeout for the whole prefill leg,
// DecodeFirstByteTimeout to the first decode body byte, DecodeIdleTimeout
// between reads (these replace the proxy's response timeouts for the
// legs; Config.DialTimeout replaces its dial timeout). The client's status
// line is written only once the decode leg produced its first byte, so a
// failure before that is a JSON error (502 connect/TLS/protocol/params,
// 504 timeout, 503 no healthy endpoint). Failures wrap pkg/proxy's
// sentinels and a failed leg is a proxy.LegError; the proxy's single
// mapping function (proxy.WriteError) answers them, as for any other
// mode-4 rule. A
// prefill 4xx is relayed as is; a decode error status is relayed as is.
// After bytes reached the client a failure cuts the stream: Serve returns
// a Result for which MustAbort is true and the caller must close the
// connection. Admission: each endpoint admits MaxInflightPerEP legs
// (LLB_PD_MAX_INFLIGHT_PER_EP, 0 = unlimited); at most QueueDepthPerEP
// (LLB_PD_QUEUE_DEPTH_PER_EP, <= 64) wait, at most MaxPark
// (LLB_PD_MAX_PARK_SEC); beyond the queue 429, after the wait 503, both
// with Retry-After. LLB_PD_MAX_TOTAL_INFLIGHT caps the process (429).
//
// # Settings
//
// Config's fields; the daemon reads them once from the LLB_PD_* variables
// of its settings table (cmd/loxilb/settings_table.go, the README's P/D
// table lists defaults and ranges).
//
// # Metrics (on the injected registerer; service = rule number, endpoint =
// index in the rule)
//
//	loxilb_ai_pd_requests_total{service,engine,outcome}
//	loxilb_ai_pd_prefill_duration_seconds{service,endpoint}
//	loxilb_ai_pd_decode_ttft_seconds{service,endpoint}
//	loxilb_ai_pd_kv_params_found_total, _missing_total, _malformed_total{service,endpoint}
//	loxilb_ai_pd_leg_errors_total{service,endpoint,leg,class}
//	loxilb_pd_leg_timeouts_total{service,endpoint,leg}
//	loxilb_pd_admission_queued_total{service,endpoint}
//	loxilb_pd_admission_shed_total{service,endpoint,reason}
//	loxilb_pd_connect_failover_total{service,endpoint}
//	loxilb_pd_decode_stream_aborted_total{service,endpoint}
//	loxilb_pd_trt_ctx_early_exit_total{service}
//	loxilb_pd_prefill_tier_total{service,tier}
//	loxilb_ai_pd_session_hits_total{service}
//	loxilb_pd_sessions_active, loxilb_pd_trie_nodes, loxilb_pd_inflight{service,endpoint}
//
// A Dispatcher is safe for concurrent use.
package dispatch
