package router

import (
	"errors"
	"fmt"

	"github.com/loxilb-llm/loxilb/pkg/selector"
)

// ErrConfig marks an invalid router setting; the message names the field.
var ErrConfig = errors.New("invalid kv router setting")

// Config tunes the Tier-1.5 decision. Build it from DefaultConfig (the
// daemon sets the fields from its settings table, cmd/loxilb); New
// validates it.
type Config struct {
	// MinMatchTokens skips KV routing when the longest cached prefix is
	// shorter than this many tokens (rounded up to blocks, capped at the
	// request's block count). 0 disables the guard. Range 0..4096, default 16.
	MinMatchTokens int
	// SpillRelief forces spill relief on or off for every rule; nil means on
	// for kvExactMode 3 (single pool) and off for kvExactMode 1 (P/D).
	SpillRelief *bool
	// SpillMinLoad is the load (request-equivalents, see selector.Load) below
	// which relief never moves a request: continuous batching absorbs a few
	// concurrent requests almost for free, while a spill throws the cache hit
	// away. loxilb has no such floor, so at low load its cap (1 when one
	// request is in flight fleet-wide) spills the second request of any
	// conversation. 0 restores that behaviour. Range 0..1000, default 2.
	SpillMinLoad int
	// ColdSeedN diverts every Nth Tier-1.5 hit of a service to its
	// lowest-index cold endpoint while one exists. 0 disables. Default 16.
	ColdSeedN int
	// ColdMinBlocks: an endpoint whose inventory holds fewer blocks is cold.
	// 0 means only an empty inventory is cold. Default 16.
	ColdMinBlocks int
	// ZeroHitN is the run of zero-overlap lookups against non-empty
	// inventories that trips the watchdog. Range 1..1000000, default 50.
	ZeroHitN int
	// MeanLoadFactor (percent) sets the spill-relief cap:
	// ceil(MeanLoadFactor/100 * (L+1)/n). Range 100..1000, default 200:
	// no worker carries more than twice the fleet mean, and a burst of
	// siblings sharing one new prefix fills two workers before touching a
	// third (loxilb's 175 spreads 16 siblings on 4 workers over 3, so a
	// third worker prefills the same prefix again).
	MeanLoadFactor int
	// LoadPenalty is how many cached prefix tokens one request-equivalent of
	// load is worth in the blend score. LoadPenaltyAdaptive (the default,
	// and what an unset LOXILB_KV_LOAD_PENALTY means) prices a request of
	// load at the prefill work the service's requests have recently left
	// uncached, in tokens, so cache benefit and queued work are in one
	// unit (see Router.Decide). A fixed value overrides it; 0 makes the
	// blend pure overlap (load only breaks ties). Range -1..100000.
	LoadPenalty int
	// LoadWeights convert engine metrics into load; zero means
	// selector.DefaultLoadWeights.
	LoadWeights selector.LoadWeights
	// TierWeightCPU is what a cached block held only in host memory (a
	// CPU-offloaded or LMCache copy) is worth against a GPU-resident one
	// (weight 1): it saves the prefill but costs a host-to-device copy.
	// Range 0..1, default 0.8 (llm-d's; Dynamo uses 0.75). It takes effect
	// when the inventory reports tiers (TieredInventory).
	TierWeightCPU float64
	// ColdRendezvous places cold prefixes (a miss, or a hit whose prefix
	// every healthy candidate holds alike) by rendezvous hashing of their
	// first blocks over the candidates within the bounded-load limits,
	// instead of by the least outstanding prefill work with the fallback
	// selector breaking ties, so several gateway nodes place siblings of a
	// new prefix on one endpoint without coordination (rendezvous.go).
	// Off by default: one node alone knows all the work it sent, and the
	// daemon turns it on with a shared (etcd) rule store
	// (LOXILB_KV_CLUSTER_ROUTING).
	ColdRendezvous bool
}

// DefaultTierWeightCPU is the default Config.TierWeightCPU.
const DefaultTierWeightCPU = 0.8

// LoadPenaltyAdaptive is the Config.LoadPenalty value that derives the
// penalty from the service's recent uncached prompt tokens.
const LoadPenaltyAdaptive = -1

// DefaultConfig returns the documented defaults.
func DefaultConfig() Config {
	return Config{
		MinMatchTokens: 16,
		SpillMinLoad:   2,
		ColdSeedN:      16,
		ColdMinBlocks:  16,
		ZeroHitN:       50,
		MeanLoadFactor: 200,
		LoadPenalty:    LoadPenaltyAdaptive,
		LoadWeights:    selector.DefaultLoadWeights,
		TierWeightCPU:  DefaultTierWeightCPU,
	}
}

// Validate checks every range and names the offending setting.
func (c Config) Validate() error {
	for _, r := range []struct {
		name     string
		v, lo, h int
	}{
		{"MinMatchTokens", c.MinMatchTokens, 0, 4096},
		{"SpillMinLoad", c.SpillMinLoad, 0, 1000},
		{"ColdSeedN", c.ColdSeedN, 0, 1 << 30},
		{"ColdMinBlocks", c.ColdMinBlocks, 0, 1 << 30},
		{"ZeroHitN", c.ZeroHitN, 1, 1000000},
		{"MeanLoadFactor", c.MeanLoadFactor, 100, 1000},
		{"LoadPenalty", c.LoadPenalty, LoadPenaltyAdaptive, 100000},
	} {
		if r.v < r.lo || r.v > r.h {
			return fmt.Errorf("%w: %s=%d outside %d..%d", ErrConfig, r.name, r.v, r.lo, r.h)
		}
	}
	if !(c.TierWeightCPU >= 0 && c.TierWeightCPU <= 1) {
		return fmt.Errorf("%w: TierWeightCPU=%v outside 0..1", ErrConfig, c.TierWeightCPU)
	}
	if c.LoadWeights.Queue < 0 || c.LoadWeights.KV < 0 {
		return fmt.Errorf("%w: negative load weights %+v", ErrConfig, c.LoadWeights)
	}
	return nil
}
