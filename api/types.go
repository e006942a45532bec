package api

import (
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

// BasePath prefixes every route.
const BasePath = "/netlox/v1"

// ErrorBody is the stable shape of every error response.
type ErrorBody struct {
	Code       int    `json:"code"`
	Message    string `json:"message"`
	Field      string `json:"field,omitempty"`
	ReasonCode string `json:"reason_code,omitempty"`
}

// ResultBody answers successful changes, as loxilb does.
type ResultBody struct {
	Result    string `json:"result"`
	ServiceID uint32 `json:"serviceID,omitempty"`
	Created   *bool  `json:"created,omitempty"`
	Deleted   int    `json:"deleted,omitempty"`
	// Inert lists the fields the created rule sets that this gateway
	// accepts and echoes but does not act on, each with the reason.
	Inert []lbrule.InertField `json:"inert,omitempty"`
}

// LBList is the body of GET /config/loadbalancer/all.
type LBList struct {
	LBAttr []lbrule.Rule `json:"lbAttr"`
}

// Capability is one entry of GET /status/capabilities. Clients must ignore
// names they do not know.
type Capability struct {
	Name       string `json:"name"`
	Ready      bool   `json:"ready"`
	ReasonCode string `json:"reason_code,omitempty"`
	Reason     string `json:"reason,omitempty"`
	// Counts is set on the "rules" entry: rules by status (applied,
	// degraded, failed).
	Counts map[string]int `json:"counts,omitempty"`
}

// Capabilities is the body of GET /status/capabilities.
type Capabilities struct {
	Capabilities []Capability `json:"capabilities"`
}

// MetricsState is the body of GET/POST/DELETE /config/metrics.
type MetricsState struct {
	Enabled bool `json:"enabled"`
}

// InventoryBlock is one block of an endpoint's KV inventory. BlockIdx is a
// synthetic index in listing order, not a position in any prompt.
type InventoryBlock struct {
	BlockIdx int    `json:"block_idx"`
	Hash     uint64 `json:"hash_uint64"`
}

// Inventory is the body of GET /config/ai/kv/inventory.
type Inventory struct {
	ServiceID uint32           `json:"service_id"`
	EPIdx     int              `json:"ep_idx"`
	Endpoint  string           `json:"endpoint"`
	HashAlgo  string           `json:"hash_algo"`
	Blocks    []InventoryBlock `json:"blocks"`
	Total     int              `json:"total"`
	Limit     int              `json:"limit"`
	Truncated bool             `json:"truncated"`
	// Subscriber carries the ingestion state: connection, sequence numbers,
	// gaps, replays, resets, decode errors and the parity verdict.
	Subscriber any `json:"subscriber,omitempty"`
	// KVExcluded is true while strict attestation (kvParityStrict,
	// --kv-parity-strict) keeps Tier-1.5 traffic off the endpoint because
	// its parity verdict (subscriber.parity.verdict) is a mismatch.
	KVExcluded bool `json:"kv_excluded"`
	// PrefillSlots is the endpoint's prefill admission budget; absent when
	// the daemon has no prefill queue.
	PrefillSlots *PrefillSlots `json:"prefill_slots,omitempty"`
	// RankLoad is the gateway's load of each data-parallel rank, for a
	// rule whose requests name the rank (kvDpRankCount > 1 on an engine
	// that can be told one); absent otherwise.
	RankLoad []RankLoad `json:"rank_load,omitempty"`
}

// RankLoad is one data-parallel rank's load as the gateway sees it and
// its rank choice reads.
type RankLoad struct {
	Rank int `json:"rank"`
	// InFlight is the requests the gateway sent to the rank and has not
	// seen end.
	InFlight int `json:"in_flight"`
	// PlacedRecently is the requests sent to the rank within the
	// speculative TTL (the rank choice's memory of recent placements).
	PlacedRecently int `json:"placed_recently"`
	// Running and Waiting are the engine's own per-rank gauges as last
	// scraped (SGLang's dp_rank-labelled sglang:num_running_reqs and
	// sglang:num_queue_reqs); -1 when the engine publishes none per rank
	// or the last sample is stale.
	Running int `json:"running"`
	Waiting int `json:"waiting"`
}

// PrefillSlots is the prefill admission budget the gateway applies to an
// endpoint: at most Slots requests forwarded before their first byte.
type PrefillSlots struct {
	// Slots is 0 when requests are not queued (source none or off).
	Slots int `json:"slots"`
	// Source is server_info or observed (learned from the engine),
	// configured (LOXILB_KV_PREFILL_SLOTS=N), none (not learned yet) or
	// off (LOXILB_KV_PREFILL_SLOTS=0).
	Source string `json:"source"`
}

// Version is the body of GET /version.
type Version struct {
	Version string `json:"version"`
}

// EndpointDrain is the body of GET/POST/DELETE on an endpoint's drain
// route: its maintenance state after the call.
type EndpointDrain struct {
	ServiceID uint32 `json:"serviceID"`
	EPIdx     int    `json:"ep_idx"`
	Endpoint  string `json:"endpoint"` // host:port
	Draining  bool   `json:"draining"`
	// Changed is false when the endpoint already was in that state.
	Changed bool `json:"changed"`
	// InFlight is the mode-4 requests still open to the endpoint; a
	// draining endpoint is idle at 0. Absent without a mode-4 proxy.
	InFlight *int `json:"inflight,omitempty"`
}
