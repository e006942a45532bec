package main

import (
	"time"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/cluster"
	"github.com/loxilb-llm/loxilb/pkg/dispatch"
	"github.com/loxilb-llm/loxilb/pkg/gateway"
	"github.com/loxilb-llm/loxilb/pkg/gcfloor"
	"github.com/loxilb-llm/loxilb/pkg/kvevents"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/outlier"
	"github.com/loxilb-llm/loxilb/pkg/peerprefill"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

// The README tables the settings are listed in, in README order; a
// <!-- settings:ID --> ... <!-- /settings:ID --> block in README.md holds
// each (TestREADMESettings).
const (
	tabDaemon  = "daemon"
	tabRouting = "routing"
	tabPD      = "pd"
	tabProxy   = "proxy"
	tabKV      = "kv"
	tabAPI     = "api"
)

// Environment names. LLB_* are loxilb's own names, kept so a loxilb
// deployment's environment works unchanged; LOXILB_* are this daemon's
// additions. A flag with an environment variable reads the variable as its
// default.
const (
	envSeed               = lbrule.SeedEnv // LLB_KV_NONE_HASH_SEED
	envPDOriginErrors     = "LLB_PD_ORIGIN_ERR_THRESHOLD"
	envPDQueueDepthPerEP  = "LLB_PD_QUEUE_DEPTH_PER_EP"
	envCoalesceWaitMS     = "LOXILB_KV_COALESCE_WAIT_MS"
	envPrefillSlots       = "LOXILB_KV_PREFILL_SLOTS"
	envKVQuarantineVerify = "LOXILB_KV_QUARANTINE_VERIFY_BLOCKS"
)

// settings is the daemon's settings table: every flag and environment
// variable it reads, bound to the field of c that holds it. Building it
// sets every field to its default.
func (c *config) settings() []*setting {
	rd := router.DefaultConfig()
	c.router = rd
	return []*setting{
		// The daemon: API, store, files, data plane, resilience.
		{flag: "api-addr", env: "LOXILB_API_ADDR", table: tabDaemon, val: strVal(&c.apiAddr, "127.0.0.1:11111"),
			meaning: "management API listen address; a non-loopback address requires a token"},
		{flag: "api-token-file", env: "LOXILB_API_TOKEN_FILE", table: tabDaemon, val: strVal(&c.apiTokenFile, ""),
			meaning: "file holding the bearer token required on every API route (401 without, 403 wrong)"},
		{flag: "tls-cert", table: tabDaemon, val: strVal(&c.tlsCert, ""), meaning: "serve the API over HTTPS with this certificate (PEM)"},
		{flag: "tls-key", table: tabDaemon, val: strVal(&c.tlsKey, ""), meaning: "private key (PEM) for `--tls-cert`"},
		{flag: "state-dir", env: "LOXILB_STATE_DIR", table: tabDaemon, val: strVal(&c.stateDir, "/var/lib/loxilb"),
			meaning: "directory of the embedded rule store (bbolt); rules survive restarts"},
		{flag: "store", env: "LOXILB_STORE", table: tabDaemon, val: strVal(&c.store.url, "bolt"), rng: "`bolt`, `etcd://host:port[,host:port...]`",
			meaning: "rule store: `bolt` (the file rules.db in `--state-dir`, one node) or an etcd cluster shared by several nodes (see Running several nodes)"},
		{flag: "store-prefix", env: "LOXILB_STORE_PREFIX", table: tabDaemon, val: strVal(&c.store.prefix, "/loxilb/"), rng: "starts with `/`",
			meaning: "etcd key prefix of this gateway cluster's rules"},
		{flag: "store-tls-ca", env: "LOXILB_STORE_TLS_CA", table: tabDaemon, val: strVal(&c.store.tlsCA, ""),
			meaning: "CA (PEM) that etcd's server certificate is verified against; setting it (or `--store-tls-cert`) connects over TLS"},
		{flag: "store-tls-cert", env: "LOXILB_STORE_TLS_CERT", table: tabDaemon, val: strVal(&c.store.tlsCert, ""),
			meaning: "client certificate (PEM) presented to etcd (etcd's `--client-cert-auth`)"},
		{flag: "store-tls-key", env: "LOXILB_STORE_TLS_KEY", table: tabDaemon, val: strVal(&c.store.tlsKey, ""),
			meaning: "private key (PEM) for `--store-tls-cert`"},
		{flag: "store-user", env: "LOXILB_STORE_USER", table: tabDaemon, val: strVal(&c.store.user, ""),
			meaning: "etcd user name when etcd auth is on"},
		{flag: "store-password-file", env: "LOXILB_STORE_PASSWORD_FILE", table: tabDaemon, val: strVal(&c.store.passwordFile, ""),
			meaning: "file holding the etcd user's password"},
		{flag: "store-timeout", table: tabDaemon, val: durVal(&c.store.timeout, 2*time.Second, 100*time.Millisecond, time.Minute),
			meaning: "longest wait for one etcd request; a rule change that cannot be stored in time is refused with 503"},
		{flag: "node-name", env: "LOXILB_NODE_NAME", table: tabDaemon, val: strVal(&c.cluster.name, defaultNodeName()), def: "host name",
			rng: "letters, digits, `.`, `_`, `-`; at most 63", meaning: "this node's name among the nodes sharing a store; set it when two nodes share a host"},
		{flag: "advertise-addr", env: "LOXILB_ADVERTISE_ADDR", table: tabDaemon, val: strVal(&c.store.advertise, ""), def: "`--api-addr`",
			meaning: "with an etcd store: host:port at which the other nodes reach this node's management API: announced in its membership record (`loxicmd get cluster`) and used for the TensorRT-LLM drain relay (required when `--api-addr` is a wildcard address)"},
		{flag: "cluster-ttl", env: "LOXILB_CLUSTER_TTL", table: tabDaemon, val: durVal(&c.cluster.ttl, cluster.DefaultTTL, cluster.MinTTL, cluster.MaxTTL),
			meaning: "lease of this node's membership record: a node that dies leaves `loxicmd get cluster` within it (whole seconds)"},
		{flag: "cluster-peer-port", env: "LOXILB_CLUSTER_PEER_PORT", table: tabDaemon, val: intVal(&c.cluster.peerPort, 0, 0, 65535), def: "0 (any free port)",
			meaning: "with an etcd store and `LOXILB_KV_CLUSTER_ROUTING` on: UDP port on the `--advertise-addr` host where this node takes the other nodes' prefill announcements (cross-node prefill coalescing); announced in its membership record"},
		{flag: "trt-drain-lease-ttl", table: tabDaemon, val: durVal(&c.store.drainTTL, 10*time.Second, 2*time.Second, 5*time.Minute),
			meaning: "with an etcd store: lease of a node's ownership of a TensorRT-LLM endpoint's event drain; another node takes the drain over within this long after the owner dies (whole seconds)"},
		{flag: "tokenizer-dir", env: "LOXILB_TOKENIZER_DIR", table: tabDaemon, val: strVal(&c.tokenizerDir, "/etc/loxilb/tokenizers"),
			meaning: "staged tokenizers: `<dir>/<model-slug>/tokenizer.json`, slug = model name with `/` replaced by `__`"},
		{flag: "tokenizer-cache-bytes", env: "LOXILB_TOKENIZER_CACHE_BYTES", table: tabDaemon,
			val:     intVal(&c.tokenizerCache, tokenizer.DefaultCacheBytes, 0, 1<<30).in("bytes"),
			meaning: "per staged model: the token ids of recent prompt segments (each chat message, a long prompt) kept so that a repeated segment is not tokenized again and one sharing a long prefix with a kept one (a new question after the same document) tokenizes only from where they differ; past the bound the segments not hit recently are evicted (`loxilb_tokenizer_cache_evictions_total`; hits, resumes, misses: `loxilb_tokenizer_cache_lookups_total`); 0 turns it off"},
		{flag: "gc-heap-floor", env: "LOXILB_GC_HEAP_FLOOR", table: tabDaemon,
			val:     intVal(&c.gcHeapFloor, gcfloor.DefaultFloor, 0, 1<<40).in("bytes"),
			meaning: "the heap may grow by at least this much between garbage collections (GOGC is raised after each cycle until the next goal is the live heap plus this, never under Go's 100): a small heap is no longer collected every few thousand proxied requests; a heap larger than this is paced as Go's default paces it; GOMEMLIMIT still applies; 0, or GOGC set in the environment, leaves the runtime's pacing alone"},
		{flag: "interfaces", table: tabDaemon, val: strVal(&c.interfacesText, ""),
			meaning: "comma-separated interfaces the eBPF data plane attaches to; never \"all\""},
		{flag: "no-dataplane", table: tabDaemon, val: boolVal(&c.noDataplane, false), meaning: "run proxy-only: never load BPF programs"},
		{flag: "bpf-pin-path", table: tabDaemon, val: strVal(&c.bpfPinPath, defaultPinPath),
			meaning: "bpffs directory of the data plane's pinned maps and links; one daemon per directory, a second refuses to start (see Cleanup)"},
		{flag: "proxy-tls-cert", table: tabDaemon, val: strVal(&c.proxyCert, ""), meaning: "certificate (PEM) served by mode-4 rules with `security` 1 or 2"},
		{flag: "proxy-tls-key", table: tabDaemon, val: strVal(&c.proxyKey, ""), meaning: "private key (PEM) for `--proxy-tls-cert`"},
		{flag: "proxy-tls-ca", table: tabDaemon, val: strVal(&c.proxyCA, ""), def: "system roots",
			meaning: "CA (PEM) that endpoint certificates are verified against for `security` 2"},
		{flag: "proxy-tls-client-cert", env: "LOXILB_PROXY_TLS_CLIENT_CERT", table: tabDaemon, val: strVal(&c.proxyClient.cert, ""),
			meaning: "client certificate (PEM) presented to endpoints of `security` 2 rules (backend mTLS, P/D legs included); a rule's `mtls_backend` `client_cert_path`/`client_key_path` replace it"},
		{flag: "proxy-tls-client-key", env: "LOXILB_PROXY_TLS_CLIENT_KEY", table: tabDaemon, val: strVal(&c.proxyClient.key, ""),
			meaning: "private key (PEM) for `--proxy-tls-client-cert`"},
		{flag: "proxy-tls-client-ca", env: "LOXILB_PROXY_TLS_CLIENT_CA", table: tabDaemon, val: strVal(&c.proxyClient.ca, ""),
			meaning: "CA bundle (PEM) verifying client certificates at the VIP of rules whose `mtls_frontend` `client_cert_mode` is `optional` or `required` and that name no CA of their own"},
		{flag: "engine-metrics-interval", table: tabDaemon, val: durVal(&c.scrapeInterval, time.Second, 0, 24*time.Hour),
			meaning: "how often mode-4 endpoints' `/metrics` are read (gpu-aware selection, load blend, prefill budgets)"},
		{flag: "metrics", table: tabDaemon, val: boolVal(&c.metrics, false),
			meaning: "enable the Prometheus export at start (else `POST /netlox/v1/config/metrics`, which is kept in the rule store and restored at the next start, as is `DELETE`)"},
		{flag: "outlier-consecutive-gateway-failures", env: "LOXILB_OUTLIER_CONSECUTIVE_GATEWAY_FAILURES", table: tabDaemon,
			val:     intVal(&c.resilience.gatewayFailures, outlier.DefaultGatewayFailures, 1, 1000),
			meaning: "consecutive connect failures or resets before a response that eject a mode-4 endpoint (see Outlier ejection)"},
		{flag: "outlier-consecutive-5xx", env: "LOXILB_OUTLIER_CONSECUTIVE_5XX", table: tabDaemon,
			val: intVal(&c.resilience.serverErrors, outlier.DefaultServerErrors, 1, 1000), meaning: "consecutive 5xx answers that eject a mode-4 endpoint"},
		{flag: "outlier-base-ejection", env: "LOXILB_OUTLIER_BASE_EJECTION", table: tabDaemon,
			val:     durVal(&c.resilience.baseEjection, outlier.DefaultBaseEjection, 100*time.Millisecond, time.Hour),
			meaning: "first ejection's length, doubled for each repeated ejection"},
		{flag: "outlier-max-ejection", env: "LOXILB_OUTLIER_MAX_EJECTION", table: tabDaemon, rng: "`--outlier-base-ejection`..24h",
			val: durVal(&c.resilience.maxEjection, outlier.DefaultMaxEjection, 100*time.Millisecond, 24*time.Hour), meaning: "longest ejection"},
		{flag: "outlier-max-ejected-percent", env: "LOXILB_OUTLIER_MAX_EJECTED_PERCENT", table: tabDaemon,
			val:     intVal(&c.resilience.maxEjectedPct, outlier.DefaultMaxEjectedPercent, 0, 100),
			meaning: "largest share of a rule's endpoints (of a P/D role) ejected at once; never the last one (0 turns ejection off)"},
		{flag: "proxy-max-retries", table: tabDaemon, val: intVal(&c.resilience.maxRetries, proxy.DefaultMaxRetries, 0, 16),
			meaning: "further mode-4 endpoints a request is sent to when an attempt failed before the endpoint could start it (connect refused, reset while the request was written); never for a request an endpoint may have started"},
		{flag: "drain-timeout", env: "LOXILB_DRAIN_TIMEOUT", table: tabDaemon, val: durVal(&c.resilience.drainTimeout, 30*time.Second, 0, 24*time.Hour),
			meaning: "on SIGTERM, how long mode-4 requests in flight may run on after the listeners closed; a second SIGTERM exits at once (see Graceful drain)"},
		{env: envPDOriginErrors, table: tabDaemon, def: "unset", val: intVal(&c.resilience.pdOriginErrors, 0, 1, 1000),
			meaning: "P/D circuit breaker: consecutive origin errors (5xx or gateway failures) that eject a prefill or decode endpoint; unset: the two outlier thresholds above"},
		{flag: "kv-parity-strict", env: "LOXILB_KV_PARITY_STRICT", table: tabDaemon, val: boolVal(&c.kvParityStrict, false),
			meaning: "strict attestation for KV-exact rules that do not set `kvParityStrict`: an endpoint whose hash-parity verdict is `hash_mismatch`, `block_size_mismatch` or `hash_algo_mismatch` gets no Tier-1.5 traffic (see Strict attestation)"},
		{env: envSeed, table: tabDaemon, def: "unset", val: strVal(&c.seed, ""), rng: "at most 23 bytes of UTF-8",
			meaning: "vLLM none-hash seed (= the engines' `PYTHONHASHSEED`); vLLM KV-exact rules are refused without it"},
		{flag: "log-level", table: tabDaemon, val: strVal(&c.logLevelText, "info"), rng: "debug, info, warn, error", meaning: "least severe log lines written"},
		{flag: "log-format", table: tabDaemon, val: strVal(&c.logFormat, "text"), rng: "text, json", meaning: "log line format"},
		{flag: "version", table: tabDaemon, val: boolVal(&c.showVersion, false), meaning: "print the version and exit"},

		// Tier-1.5 routing, prefill coalescing and admission, inventories.
		{env: "LLB_KV_MIN_MATCH_TOKENS", table: tabRouting, val: intVal(&c.router.MinMatchTokens, rd.MinMatchTokens, 0, 4096),
			meaning: "skip Tier 1.5 when the best cached prefix is shorter (0 = off)"},
		{env: "LOXILB_KV_SPILL_RELIEF", table: tabRouting, val: toggleVal(&c.router.SpillRelief),
			meaning: "tri-state: unset = on for `kvExactMode` 3, off for 1; `on`/`off` force it"},
		{env: "LOXILB_KV_CLUSTER_ROUTING", table: tabRouting, val: toggleVal(&c.clusterRouting),
			meaning: "tri-state: unset = on with a shared rule store (`--store etcd://`), off alone; makes several gateway nodes agree without talking: a cold prefix (a miss, or a prompt every endpoint holds alike up to its new part) goes to the endpoint with the highest rendezvous-hash weight of its first blocks among those within the bounded-load limits and within its own prefill of the least outstanding prefill work, and each endpoint's load adds what other nodes sent (their own in-flight counts, shared every `LOXILB_KV_CLUSTER_LOAD_MS`; else engine running+waiting at the last scrape less this node's own requests then) to this node's in-flight count (see Several nodes in ARCHITECTURE.md)"},
		{env: "LOXILB_KV_MEAN_LOAD_FACTOR", table: tabRouting, val: intVal(&c.router.MeanLoadFactor, rd.MeanLoadFactor, 100, 1000).in("percent"),
			meaning: "spill cap in percent of the fleet mean load (no worker above twice the mean)"},
		{env: "LOXILB_KV_SPILL_MIN_LOAD", table: tabRouting, val: intVal(&c.router.SpillMinLoad, rd.SpillMinLoad, 0, 1000),
			meaning: "never spill below this load, in request-equivalents (continuous batching absorbs a few requests)"},
		{env: "LOXILB_KV_COLDSTART_SEED_N", table: tabRouting, val: intVal(&c.router.ColdSeedN, rd.ColdSeedN, 0, 1<<30),
			meaning: "every Nth Tier-1.5 hit goes to the lowest-index cold worker (inventory below `LOXILB_KV_COLDSTART_MIN_BLOCKS`), so a restarted engine re-enters a warm fleet (0 = off)"},
		{env: "LOXILB_KV_COLDSTART_MIN_BLOCKS", table: tabRouting, val: intVal(&c.router.ColdMinBlocks, rd.ColdMinBlocks, 0, 1<<30),
			meaning: "an inventory below this is cold (0 = empty only)"},
		{env: "LOXILB_KV_ZERO_HIT_N", table: tabRouting, val: intVal(&c.router.ZeroHitN, rd.ZeroHitN, 1, 1000000),
			meaning: "zero-hit lookups against non-empty inventories before the watchdog reports; each further one counts in `loxilb_pd_kv_zero_hit_watchdog_total{service,reason}`. `reason=\"not_cached\"` when every non-empty inventory's publisher attests hash parity (verdict `ok`, not quarantined): the prompts were simply not cached (unique prompts, or evicted), logged once per run at info. `reason=\"parity_suspect\"` when some verdict is not `ok` (`unverified`, a mismatch, or quarantined): a probable block-size, hash or tokenizer mismatch, one warning per run naming those endpoints"},
		{env: "LOXILB_KV_LOAD_PENALTY", table: tabRouting, def: "adaptive",
			val:     intVal(&c.router.LoadPenalty, rd.LoadPenalty, router.LoadPenaltyAdaptive, 100000).with("adaptive", router.LoadPenaltyAdaptive),
			meaning: "cached tokens one request of load is worth in the overlap/load blend; adaptive (unset, or -1): learned per rule as the median prefill work (uncached tokens) of its recent KV hits, so load and cache benefit share one unit; a number fixes it (0: load only breaks ties)"},
		{env: "LOXILB_KV_TIER_WEIGHT_CPU", table: tabRouting, val: floatVal(&c.router.TierWeightCPU, rd.TierWeightCPU, 0, 1),
			meaning: "what a cached block held only in host memory is worth against a GPU-resident one (weight 1.0) in Tier 1.5 (llm-d uses 0.8, Dynamo 0.75). KV events carry each copy's `medium`: `GPU` (or none, older engines) is the GPU tier; `CPU`, `CPU_PINNED`, `DISK`, `STORAGE`, `EXTERNAL` and LMCache backend names (`LMCache*`, `LocalCPUBackend`, `LocalDiskBackend`, any case) are offloaded copies on the CPU tier. A block on both tiers counts as GPU; a `BlockRemoved` for the GPU copy leaves the CPU copy (vLLM publishes each medium's evictions separately). An undocumented medium is not guessed onto a tier: its events are skipped and counted in `loxilb_kv_events_skipped_total{reason=\"medium\"}`. Receipts' `matched` counts both tiers"},
		{env: envCoalesceWaitMS, table: tabRouting, val: durVal(&c.coalesceWait, gateway.DefaultCoalesceWait, 0, 600*time.Second).counted(time.Millisecond, false),
			meaning: "prefill coalescing: a request routed to blocks its endpoint is still computing for an earlier request (a chat's next turn sent during the previous turn's prefill, siblings sharing a new prefix) is held until that request's first token, at most this long, instead of making the engine compute the same prefix twice (on a P/D rule with `kvExactMode` 1 the prefill leg leads and waits alike, on its prefill endpoint); counted in `loxilb_kv_coalesced_total{outcome}` and `loxilb_kv_coalesce_wait_seconds` (0 = off)"},
		{env: "LOXILB_KV_CLUSTER_TIEBREAK_MS", table: tabRouting, val: durVal(&c.clusterTieBreak, gateway.DefaultClusterTieBreak, 0, 100*time.Millisecond).counted(time.Millisecond, true),
			meaning: "with other gateway nodes hearing this node's prefill announcements (`LOXILB_KV_CLUSTER_ROUTING` on, an etcd store): a request that starts a new prefill and waits for nobody is announced, then held at most this long before it is forwarded (not on the node with the lowest instance once it has heard from every member: it never yields); if another node announces the same blocks at the same endpoint meanwhile and ranks first (the lower announcement instance), the request waits for that node's prefill as a coalesced follower instead of computing the prefix a second time. Two nodes' siblings that cross within the announcements' latency are otherwise both prefilled. Counted in `loxilb_cluster_prefill_tiebreak_total{outcome=yielded\\|kept\\|cancelled}`; duplicates left in `loxilb_cluster_prefill_duplicate_leaders_total` (fractional, 0 = off)"},
		{env: "LOXILB_KV_CLUSTER_LOAD_MS", table: tabRouting, val: durVal(&c.clusterLoadInterval, peerprefill.DefaultLoadInterval, 0, time.Second).counted(time.Millisecond, false),
			meaning: "with `LOXILB_KV_CLUSTER_ROUTING` on and an etcd store: every this often each gateway node sends the other nodes its requests in flight per endpoint (open, held for a prefill, queued for a prefill slot) over the prefill announcement port when they changed (every 250 ms when not), and each node adds the others' latest counts to its own in-flight count, instead of the engine's running+waiting at the last scrape less its own requests then; a snapshot older than 1 s is not used, and while any member's is missing or stale (a node that does not share, a rule being changed) the scraped estimate is. Behind ECMP each node otherwise sees its share of an endpoint's requests at once and the rest only a scrape later, so three nodes can send a hot prefix's holder three times the requests any of them believes it has. Counted in `loxilb_cluster_load_sent_total`, `loxilb_cluster_load_received_total`, `loxilb_cluster_load_rejected_total{reason=unknown_peer\\|malformed\\|stale}` (a snapshot of more than 256 endpoints or claiming more than 4096 requests on one is malformed), `loxilb_cluster_load_truncated_total`, and `loxilb_cluster_load_freshest_age_seconds` (-1: none held) (0 = not shared)"},
		{env: envPrefillSlots, table: tabRouting, val: intVal(&c.prefillSlots, gateway.PrefillAuto, 0, 4096).with("auto", gateway.PrefillAuto),
			meaning: "prefill admission queue, per endpoint: at most this many requests forwarded and still waiting for their first byte; more wait in the gateway and get free slots **shortest predicted prefill first** (uncached tokens from the KV inventory, a coalescing leader weighed by the requests waiting for it), so a cached chat turn overtakes a burst of cold prompts instead of queueing behind them in the engine; a waiting request yields at most its own predicted tokens, or as many requests as the budget, to shorter ones (each holds a sequence for its decode steps too), then goes next, so long prompts are not starved into the TTFT tail. `auto` (or unset) sizes it per endpoint with the engine's concurrent-sequence budget, learned by the `/metrics` scraper: SGLang publishes it (`/get_server_info`, falling back to `/server_info`: the sum of `internal_states[].effective_max_running_requests_per_dp`, else `max_running_requests`; source `server_info`); vLLM, TensorRT-LLM and llama.cpp do not (vLLM's `vllm:cache_config_info` has no `max_num_seqs`), so it is observed from `running`/`waiting`: once the engine was seen queueing at its peak (waiting > 0 while as many requests run as were ever seen running) in two consecutive samples (one sample may be a request not yet scheduled), the most requests seen running at once (source `observed`; a lower bound that grows towards the budget, since the engine also runs requests past their first byte and the queue's bounded wait forwards over a low value); while an endpoint's budget is unknown the scraper samples it again, at most every 50 ms, whenever this node has more requests open there than the engine was seen running, or right after a sample that saw it queueing, since an engine queues in bursts that scrapes a second apart rarely see twice. Until an endpoint's budget is known its requests are not queued. An engine value that is NaN, negative or above 2^20 is refused (`loxilb_kv_prefill_budget_rejected_total{reason=bad_value}`; `reason=malformed` for server info that is not the expected JSON), and a budget is forgotten when the endpoint's address or engine changes. `N` fixes the budget for every endpoint (like a server `maxconn`); `0` turns the queue off. It counts requests, not tokens, so for an engine that batches prefill by tokens per step (vLLM's `max_num_batched_tokens`) it bounds the prefills outstanding. The applied budget is `loxilb_kv_prefill_slots{service,ep_idx,source}` (source `server_info`, `observed`, `configured`, `none`, `off`) and `prefill_slots` in the inventory API. Counted in `loxilb_kv_prefill_admitted_total{outcome=immediate\\|queued\\|timeout\\|inherited\\|cancelled}` and `loxilb_kv_prefill_queue_wait_seconds`; queued requests count as their endpoint's load. Applies to KV-exact single-pool rules (`kvExactMode` 3); requests that are not tokenized and P/D rules are not queued"},
		{env: "LOXILB_KV_PREFILL_QUEUE_MS", table: tabRouting,
			val:     durVal(&c.prefillWait, gateway.DefaultPrefillQueueWait, time.Millisecond, 600*time.Second).counted(time.Millisecond, false),
			meaning: "longest wait for a prefill slot; then the request is forwarded anyway and the engine's own queue takes it, so a long prompt is overtaken for at most this long"},
		{env: "LOXILB_KV_MAX_BLOCKS", table: tabRouting, val: intVal(&c.maxBlocks, 1_000_000, 1000, 100_000_000),
			meaning: "inventory cap per endpoint (oldest blocks evicted, counted)"},
		{env: "LLB_KV_REPLAY_PORT_OFFSET", table: tabRouting, val: intVal(&c.kv.ReplayPortOffset, kvevents.DefaultReplayPortOffset, 0, 65535),
			meaning: "vLLM replay ROUTER at kvZmqPort + offset (0 = no replay)"},
		{env: "LOXILB_KV_TRTLLM_POLL_MIN_MS", table: tabRouting,
			val:     durVal(&c.kv.TRTPollMin, 5*time.Millisecond, time.Millisecond, 10*time.Second).counted(time.Millisecond, false),
			meaning: "shortest adaptive TensorRT-LLM drain interval"},
		{env: "LOXILB_KV_TRTLLM_POLL_MAX_MS", table: tabRouting,
			val:     durVal(&c.kv.TRTPollMax, 20*time.Millisecond, time.Millisecond, 10*time.Second).counted(time.Millisecond, false),
			meaning: "longest adaptive TensorRT-LLM drain interval (raised to the shortest when below it)"},

		// Prefill/decode disaggregation.
		{env: "LLB_PD_PREFILL_TIMEOUT_SEC", table: tabPD, val: pdSeconds(&c.pd.PrefillTimeout, 30*time.Second),
			meaning: "a whole prefill (or context) leg: connect, compute and the complete response"},
		{env: "LLB_PD_DECODE_TIMEOUT_SEC", table: tabPD, val: pdSeconds(&c.pd.DecodeFirstByteTimeout, 60*time.Second),
			meaning: "from sending a decode leg to its first response body byte"},
		{env: "LLB_PD_DECODE_IDLE_SEC", table: tabPD, val: pdSeconds(&c.pd.DecodeIdleTimeout, 60*time.Second),
			meaning: "silence between two reads of a decode response once it started"},
		{env: "LLB_PD_MAX_INFLIGHT_PER_EP", table: tabPD, val: intVal(&c.pd.MaxInflightPerEP, 0, 0, 1<<20),
			meaning: "legs in flight per endpoint (0 = no cap); more wait for a slot"},
		{env: envPDQueueDepthPerEP, table: tabPD, val: intVal(&c.pd.QueueDepthPerEP, 16, 0, dispatch.MaxQueueDepthPerEP),
			meaning: "requests waiting for a slot of one endpoint at its cap; beyond them 429 with `Retry-After` (0 = no waiting)"},
		{env: "LLB_PD_MAX_PARK_SEC", table: tabPD, val: pdSeconds(&c.pd.MaxPark, 5*time.Second),
			meaning: "longest wait for a slot; then 503 with `Retry-After`"},
		{env: "LLB_PD_MAX_TOTAL_INFLIGHT", table: tabPD, val: intVal(&c.pd.MaxTotalInflight, 0, 0, 1<<24),
			meaning: "P/D requests of the process in flight (0 = no cap); beyond it 429"},
		{env: "LLB_PD_SESSION_TTL_SEC", table: tabPD, val: pdSeconds(&c.pd.SessionTTL, 300*time.Second),
			meaning: "how long a session keeps its prefill and decode endpoints after its last request"},

		// Clients of the mode-4 proxy.
		{flag: "proxy-max-body", table: tabProxy, val: intVal(&c.maxBodyBytes, 32<<20, 1, 1<<40).in("bytes"),
			meaning: "one request body", beyond: "413"},
		{flag: "proxy-max-inflight-body", table: tabProxy, rng: "`--proxy-max-body`..1 TiB",
			val:     intVal(&c.proxyLimits.maxInflightBody, proxy.DefaultMaxInflightBodyBytes, 1, 1<<40).in("bytes"),
			meaning: "bytes all mode-4 request bodies hold together; bodies grow as bytes arrive, never by the declared length",
			beyond:  "503 `proxy_overloaded` with `Retry-After: 1`, connection closed; `loxilb_proxy_conn_rejected_total{reason=\"body_memory\"}`, gauge `loxilb_proxy_body_bytes_inflight`"},
		{flag: "proxy-max-conns", table: tabProxy, val: intVal(&c.proxyLimits.maxConns, proxy.DefaultMaxConnsPerListener, 1, 1<<20),
			meaning: "client connections per mode-4 listener (an idle keep-alive connection costs about 21 KiB of RSS, measured with 2000)",
			beyond:  "closed at accept; `loxilb_proxy_conn_rejected_total{reason=\"conn_limit\"}`"},
		{flag: "proxy-max-response-header", table: tabProxy,
			val:     intVal(&c.proxyLimits.maxResponseHeader, proxy.DefaultMaxResponseHeaderBytes, 4<<10, 64<<20).in("bytes"),
			meaning: "response headers from an endpoint, P/D legs included",
			beyond:  "502 `upstream_protocol_error`; `loxilb_proxy_upstream_limit_total{limit=\"response_header_bytes\"}`"},
		{flag: "proxy-response-header-timeout", table: tabProxy,
			val:     durVal(&c.proxyLimits.responseHeaderTimeout, proxy.DefaultResponseHeaderTimeout, time.Second, 24*time.Hour),
			meaning: "wait for an endpoint's headers and then its first body byte (a long prompt behind a busy engine's queue needs minutes; past that a client cannot tell it from a hung engine)",
			beyond:  "504 (a cut if event-stream headers were already sent); `{limit=\"response_header_timeout\"}`"},
		{flag: "proxy-stream-idle-timeout", table: tabProxy,
			val:     durVal(&c.proxyLimits.streamIdleTimeout, proxy.DefaultStreamIdleTimeout, time.Second, 24*time.Hour),
			meaning: "silence between body bytes once the body started", beyond: "connection cut (truncated body); `{limit=\"stream_idle\"}`"},
		{flag: "proxy-abort-on-client-close", table: tabProxy, val: boolVal(&c.proxyLimits.abortOnClientClose, false),
			meaning: "by default a client that half-closes after its request still gets the answer; only a closed or reset connection cancels the request. On: a client's FIN cancels it (the endpoint is freed at once)"},
		{flag: "proxy-max-model-name", table: tabProxy, val: intVal(&c.maxModelName, gateway.DefaultMaxModelNameBytes, 1, 65536).in("bytes"),
			meaning: "bytes of a request's model name (body `model` or `X-Model`)",
			beyond:  "400 `invalid_request_error`, `loxilb_gateway_rejected_requests_total{reason=\"model_name_too_long\"}`"},
		{flag: "tokenize-max-bytes", table: tabProxy, val: intVal(&c.tokMaxBytes, gateway.DefaultMaxPromptBytes, 1024, 256<<20).in("bytes"),
			meaning: "prompt text tokenized per request (completions prompt or rendered chat), checked before BPE",
			beyond:  "400, `loxilb_gateway_rejected_requests_total{reason=\"prompt_too_long\"}`"},
		{flag: "tokenize-max-tokens", table: tabProxy, def: "0 = the model's context length (staged `config.json` `max_position_embeddings`, else `tokenizer_config.json` `model_max_length`), else 262144",
			val: intVal(&c.tokMaxTokens, 0, 1, 1<<24).with("0", 0), meaning: "prompt tokens per request, token-id prompts included; encoding stops at the bound",
			beyond: "400, same counter"},
		{flag: "tokenize-body-cache-bytes", table: tabProxy, val: intVal(&c.bodyCacheBytes, gateway.DefaultBodyCacheBytes, 0, 1<<30).in("bytes"),
			meaning: "request bodies seen more than once, kept with their token ids, rendered prompt and block keys, so the same bytes again (a retry, one prompt from many clients) skip decoding, rendering, tokenizing and hashing; exact (whole-body comparison, same rule, tokenizer and hasher), least recently used evicted past the bound (`loxilb_gateway_body_cache_lookups_total`, `loxilb_gateway_body_cache_evictions_total`, `loxilb_gateway_body_cache_bytes`); 0 turns it off"},
		{flag: "tokenize-concurrency", table: tabProxy, def: "0 = one per CPU", val: intVal(&c.tokConcurrency, 0, 1, 1024).with("0", 0),
			meaning: "requests tokenizing at once; the others wait as long as their client does", beyond: "gauge `loxilb_gateway_tokenize_waiting`"},
		{flag: "proxy-receipts", env: "LOXILB_PROXY_RECEIPTS", table: tabProxy, val: strVal(&c.receiptsText, "off"), rng: "`off`, `on-request`, `always`",
			meaning: "when mode-4 responses carry the `X-Loxilb-Route` routing receipt (`on-request`: when the request sends `X-Loxilb-Receipt: 1`); a receipt shows any client what other clients' prompts left cached; an endpoint's own is always dropped",
			beyond:  "no header"},

		// Engines and KV-event publishers.
		{env: "LOXILB_KV_MAX_MESSAGE_BYTES", table: tabKV, val: intVal(&c.kv.MaxMessageBytes, kvevents.DefaultMaxMessageBytes, 4096, 1<<30).in("bytes"),
			meaning: "one ZMQ message (checked at every ZMTP frame header, before the frame is read) and one TensorRT-LLM drain body",
			beyond:  "connection closed and redialled with backoff (0.5 s doubling to 5 s); `loxilb_kv_rejected_total{reason=\"message_too_large\"}` (ZMQ) or `{reason=\"body_too_large\"}` (drain discarded, endpoint degraded)"},
		{env: "LOXILB_KV_MAX_MESSAGE_FRAMES", table: tabKV, val: intVal(&c.kv.MaxMessageFrames, kvevents.DefaultMaxMessageFrames, 4, 1024),
			meaning: "frames per ZMQ message (the engines send 3, replay replies 4 or 5)", beyond: "`message_too_large`"},
		{env: "LOXILB_KV_MAX_BATCH_EVENTS", table: tabKV, val: intVal(&c.kv.MaxBatchEvents, kvevents.DefaultMaxBatchEvents, 1, 1<<24),
			meaning: "events per batch (msgpack or drain), checked against the container's declared length before decoding",
			beyond:  "batch dropped whole (the inventory is unchanged), `{reason=\"batch_limit\"}`"},
		{env: "LOXILB_KV_MAX_BATCH_HASHES", table: tabKV, val: intVal(&c.kv.MaxBatchHashes, kvevents.DefaultMaxBatchHashes, 1, 1<<28),
			meaning: "block hashes per batch, all events together", beyond: "same"},
		{env: "LOXILB_KV_MAX_BATCH_TOKENS", table: tabKV, val: intVal(&c.kv.MaxBatchTokens, kvevents.DefaultMaxBatchTokens, 1, 1<<28),
			meaning: "token ids per batch, all events together", beyond: "same"},
		{env: "LOXILB_KV_TRTLLM_MAX_HEADER_BYTES", table: tabKV, val: intVal(&c.kv.TRTMaxHeaderBytes, kvevents.DefaultTRTMaxHeaderB, 1024, 1<<20).in("bytes"),
			meaning: "response headers of one TensorRT-LLM `/kv_cache_events` or `/server_info` exchange", beyond: "exchange fails, retried with backoff"},
		{env: "LOXILB_KV_REPLAY_MAX_BATCHES", table: tabKV, val: intVal(&c.kv.ReplayMaxBatches, kvevents.DefaultReplayMaxBatches, 1, 1<<24),
			meaning: "batches in one vLLM replay exchange", beyond: "exchange closed, `{reason=\"replay_too_long\"}`"},
		{env: envKVQuarantineVerify, table: tabKV, val: intVal(&c.kv.QuarantineVerifyBlocks, kvevents.DefaultQuarantineVerifyBlocks, 1, 1<<20),
			meaning: "consecutive verified blocks that lift a quarantine (below)"},

		// The management API.
		{flag: "api-read-header-timeout", table: tabAPI, val: durVal(&c.api.readHeaderTimeout, api.DefaultReadHeaderTimeout, 100*time.Millisecond, 5*time.Minute),
			meaning: "time to send a request's headers and TLS handshake", beyond: "connection closed, `loxilb_api_rejected_total{reason=\"no_request\"}`"},
		{flag: "api-read-timeout", table: tabAPI, val: durVal(&c.api.readTimeout, api.DefaultReadTimeout, 100*time.Millisecond, time.Hour),
			meaning: "time to send a whole request, body included", beyond: "408 `API_BODY_TIMEOUT`, `{reason=\"body_timeout\"}`"},
		{flag: "api-write-timeout", table: tabAPI, val: durVal(&c.api.writeTimeout, api.DefaultWriteTimeout, time.Second, time.Hour),
			meaning: "time to write a response", beyond: "connection closed"},
		{flag: "api-idle-timeout", table: tabAPI, val: durVal(&c.api.idleTimeout, api.DefaultIdleTimeout, time.Second, time.Hour),
			meaning: "idle keep-alive connection", beyond: "connection closed"},
		{flag: "api-max-body", table: tabAPI, val: intVal(&c.api.maxBody, api.DefaultMaxBodyBytes, 1024, lbrule.MaxBodyBytes).in("bytes"),
			meaning: "request body (no rule body is larger than the maximum)", beyond: "413 `API_BODY_TOO_LARGE`, unread when declared, `{reason=\"body_too_large\"}`"},
		{flag: "api-max-conns", table: tabAPI, val: intVal(&c.api.maxConns, api.DefaultMaxConns, 1, 65536),
			meaning: "API connections open at once", beyond: "closed at accept, `{reason=\"conn_limit\"}`"},
		{flag: "api-allow-cleartext", table: tabAPI, val: boolVal(&c.api.allowCleartext, false),
			meaning: "accept a bearer token over plain HTTP on a non-loopback `--api-addr`", beyond: "without it the daemon refuses to start: use `--tls-cert`"},
	}
}

// pdSeconds is a P/D timeout: seconds, fractions allowed, above 0 and at
// most a day, as loxilb reads them.
func pdSeconds(p *time.Duration, def time.Duration) *duration {
	d := durVal(p, def, time.Nanosecond, 24*time.Hour).counted(time.Second, true)
	d.spanText = "above 0, at most 86400 s"
	return d
}
