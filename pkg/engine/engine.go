// Package engine is the capability matrix of the inference engines the gateway
// speaks to, kept as data so that rule validation, the capability API, the
// KV-event ingesters and the P/D dispatcher all read one table instead of
// repeating engine switches.
package engine

import "sort"

// Name identifies an engine contract, as spelled in the rule field kvEngineType.
type Name string

// The engines the gateway knows. The empty string on the wire means VLLM.
const (
	VLLM     Name = "vllm"
	SGLang   Name = "sglang"
	TRTLLM   Name = "trtllm"
	LlamaCpp Name = "llamacpp"
)

// Default is the engine a rule gets when kvEngineType is omitted.
const Default = VLLM

// Hash algorithm names as spelled in the rule field kvHashAlgo.
const (
	AlgoSHA256CBOR      = "sha256_cbor"
	AlgoXXHashCBOR      = "xxhash_cbor"
	AlgoSHA256SGLang    = "sha256_sglang"
	AlgoBlockHashTRTLLM = "blockhash_trtllm"
)

// AllAlgos lists every hash algorithm a rule may name, in documentation order.
var AllAlgos = []string{AlgoSHA256CBOR, AlgoXXHashCBOR, AlgoSHA256SGLang, AlgoBlockHashTRTLLM}

// Transport says how an engine publishes its KV-cache events.
type Transport string

// Event transports.
const (
	TransportZMQ        Transport = "zmq"          // one PUB socket at kvZmqPort
	TransportZMQPerRank Transport = "zmq_per_rank" // one PUB socket per DP rank at kvZmqPort+rank
	TransportHTTPDrain  Transport = "http_drain"   // destructive POST /kv_cache_events on the serving port
	TransportNone       Transport = "none"
)

// PDFlow says how an engine's prefill/decode disaggregation is driven.
type PDFlow string

// P/D request flows.
const (
	PDSequential     PDFlow = "sequential"         // vLLM: prefill, then decode with kv_transfer_params
	PDConcurrentRoom PDFlow = "concurrent_room"    // SGLang: both legs at once sharing a bootstrap room
	PDContextThenGen PDFlow = "context_generation" // TRT-LLM: context_only, then generation_only
	PDNone           PDFlow = "none"
)

// Engine-independent limits and defaults of the rule fields.
const (
	DefaultZMQPort          = 5557
	DefaultBootstrapPort    = 8998
	MaxDPRanks              = 8
	DefaultBlockSize        = 16
	MaxVLLMSeedLen          = 23 // a one-byte CBOR text header: the gateway's limit, not vLLM's
	DefaultReplayPortOffset = 1000
)

// Request paths the P/D flows serve.
const (
	PathCompletions     = "/v1/completions"
	PathChatCompletions = "/v1/chat/completions"
	// PathGenerate is SGLang's native API: "text" or "input_ids", one
	// prompt or a list; in P/D each bootstrap field is then a list with
	// one entry (and a distinct room) per prompt.
	PathGenerate = "/generate"
)

var openAIPaths = []string{PathCompletions, PathChatCompletions}

// Spec is one engine's row of the capability matrix.
type Spec struct {
	Name        Name
	KVExact     bool      // the engine publishes a KV event feed the gateway can consume
	PD          bool      // the gateway can drive this engine's P/D protocol
	Algos       []string  // hash algorithms coherent with this engine
	DefaultAlgo string    // taken when kvHashAlgo is omitted
	Transport   Transport // how KV events arrive
	Flow        PDFlow
	// PDPaths are the POST paths a P/D rule runs through Flow; other
	// requests go to a decode endpoint as they are.
	PDPaths      []string
	MultiRank    bool // kvDpRankCount > 1 is meaningful
	SeedRequired bool // KV-exact needs LLB_KV_NONE_HASH_SEED (vLLM's PYTHONHASHSEED)
	// Rank is how a request names the data-parallel rank that must serve
	// it; the zero value means the engine offers no way to.
	Rank RankTarget
}

// RankTarget is how one engine is told which data-parallel rank serves a
// request. Without it the engine's own balancer picks a rank (SGLang's
// data-parallel controller round-robins, vLLM's API server takes the least
// loaded engine core), which need not be the rank whose cache the gateway
// scored.
type RankTarget struct {
	// BodyFields are top-level JSON fields of the request body set to the
	// rank, all of them: an engine version reads the first one it knows.
	BodyFields []string
	// Header is a request header set to the rank.
	Header string
	// PDPrefillField is the body field that tells a P/D decode server
	// which prefill rank holds the request's KV cache.
	PDPrefillField string
	// LoadLabel is the label that names the data-parallel rank on the
	// engine's running/waiting gauges, when each rank's scheduler
	// publishes its own; "" when the engine publishes none per rank.
	LoadLabel string
}

// Targets reports whether the engine can be told a rank.
func (t RankTarget) Targets() bool { return len(t.BodyFields) > 0 || t.Header != "" }

// Wire names of the rank selectors, as the engines read them.
const (
	// SGLangRankField is read by SGLang's OpenAI-compatible API
	// (CompletionRequest, ChatCompletionRequest); its data-parallel controller sends a request naming it straight to
	// that rank, whatever the load-balance method.
	SGLangRankField = "routed_dp_rank"
	// SGLangLegacyRankField is the older name of the same selector: the
	// only one releases before routed_dp_rank know, a deprecated alias
	// (copied into routed_dp_rank when that is unset) in later ones.
	SGLangLegacyRankField = "data_parallel_rank"
	// SGLangPrefillRankField tells an SGLang decode server the prefill
	// rank of a disaggregated request.
	SGLangPrefillRankField = "disagg_prefill_dp_rank"
	// SGLangRankLabel labels each data-parallel scheduler's gauges
	// (sglang:num_running_reqs, sglang:num_queue_reqs, ...) with its rank,
	// next to model_name, engine_type, tp_rank and pp_rank
	// (python/sglang/srt/managers/scheduler_metrics_mixin.py: set when
	// the scheduler has a dp_rank).
	SGLangRankLabel = "dp_rank"
	// VLLMRankHeader is read by vLLM's OpenAI-compatible server (one API
	// server in front of a data-parallel deployment) and passed to the
	// engine client as data_parallel_rank, which then skips its load
	// balancing. vLLM reads no body field for it.
	VLLMRankHeader = "X-data-parallel-rank"
)

var matrix = map[Name]Spec{
	VLLM: {Name: VLLM, KVExact: true, PD: true, Algos: []string{AlgoSHA256CBOR, AlgoXXHashCBOR},
		DefaultAlgo: AlgoSHA256CBOR, Transport: TransportZMQ, Flow: PDSequential, PDPaths: openAIPaths, MultiRank: true, SeedRequired: true,
		Rank: RankTarget{Header: VLLMRankHeader}},
	SGLang: {Name: SGLang, KVExact: true, PD: true, Algos: []string{AlgoSHA256SGLang},
		DefaultAlgo: AlgoSHA256SGLang, Transport: TransportZMQPerRank, Flow: PDConcurrentRoom, MultiRank: true,
		PDPaths: append(openAIPaths[:len(openAIPaths):len(openAIPaths)], PathGenerate),
		Rank: RankTarget{BodyFields: []string{SGLangRankField, SGLangLegacyRankField}, PDPrefillField: SGLangPrefillRankField,
			LoadLabel: SGLangRankLabel}},
	TRTLLM: {Name: TRTLLM, KVExact: true, PD: true, Algos: []string{AlgoBlockHashTRTLLM},
		DefaultAlgo: AlgoBlockHashTRTLLM, Transport: TransportHTTPDrain, Flow: PDContextThenGen, PDPaths: openAIPaths},
	LlamaCpp: {Name: LlamaCpp, Transport: TransportNone, Flow: PDNone},
}

// Lookup returns the row for name; the empty name is the default engine.
func Lookup(name string) (Spec, bool) {
	if name == "" {
		name = string(Default)
	}
	s, ok := matrix[Name(name)]
	return s, ok
}

// Names lists the known engines, sorted.
func Names() []string {
	out := make([]string, 0, len(matrix))
	for n := range matrix {
		out = append(out, string(n))
	}
	sort.Strings(out)
	return out
}

// All returns every row, sorted by name.
func All() []Spec {
	out := make([]Spec, 0, len(matrix))
	for _, n := range Names() {
		out = append(out, matrix[Name(n)])
	}
	return out
}

// AllowsAlgo reports whether algo is coherent with the engine.
func (s Spec) AllowsAlgo(algo string) bool {
	for _, a := range s.Algos {
		if a == algo {
			return true
		}
	}
	return false
}

// KnownAlgo reports whether algo is any engine's hash algorithm.
func KnownAlgo(algo string) bool {
	for _, a := range AllAlgos {
		if a == algo {
			return true
		}
	}
	return false
}
