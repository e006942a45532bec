package bench

import (
	"fmt"
	"time"
)

// DefaultFleet is four vLLM emulators sized so the default suite runs in a
// few minutes on two cores: 1,024 blocks of 16 tokens each (16k tokens per
// engine, 64k for the fleet), 50 us per uncached prompt token (a 2k-token
// miss costs ~100 ms), 5 ms per decode step, and two running sequences per
// engine, which stands in for a prefill-bound GPU: a long recomputation
// holds the engine and later requests queue behind it.
func DefaultFleet() FleetConfig {
	return FleetConfig{Engines: 4, BlockSize: 16, CapacityBlocks: 1024,
		PrefillUsPerToken: 50, DecodeUsPerToken: 5000, MaxRunning: 2, TimeScale: 1,
		HashSeed: "4242", Net: 77, Port: 28000, ZMQPort: 25557, VIPPort: 28080}
}

// SGLangFleet is DefaultFleet as SGLang engines with two data-parallel
// ranks each: the same KV capacity (512 blocks per rank), cost model and
// running sequences per engine, so the two fleets' figures compare; the
// gateway must name the rank holding a prefix for a hit to land.
func SGLangFleet() FleetConfig {
	f := DefaultFleet()
	f.Engine, f.DPRanks, f.CapacityBlocks = "sglang", 2, 512
	return f
}

// FleetFor returns the default fleet of an engine kind: vllm or sglang.
func FleetFor(engine string) (FleetConfig, error) {
	switch engine {
	case "", "vllm":
		return DefaultFleet(), nil
	case "sglang":
		return SGLangFleet(), nil
	}
	return FleetConfig{}, fmt.Errorf("engine %q: want vllm or sglang", engine)
}

// DefaultWorkloads are the workloads of the default suite for fleet f: six
// on token ids through /v1/completions, then the chat-path ones.
func DefaultWorkloads(seed uint64, f FleetConfig) []Workload {
	const sys = 2048
	sysBlocks := sys / f.BlockSize
	g100 := f.TotalBlocks() / sysBlocks // system prompts fill the fleet
	g40 := g100 * 40 / 100
	return append([]Workload{
		SharedPrefix(WShared40, seed, SharedPrefixSpec{Groups: g40, PerGroup: 12, SystemTokens: sys, QuestionTokens: 128,
			OutputTokens: 2, RatePerSec: 90, FillOfFleetPercent: 100 * g40 * sysBlocks / f.TotalBlocks()}),
		SharedPrefix(WShared100, seed, SharedPrefixSpec{Groups: g100, PerGroup: 12, SystemTokens: sys, QuestionTokens: 128,
			OutputTokens: 2, RatePerSec: 90, FillOfFleetPercent: 100 * g100 * sysBlocks / f.TotalBlocks()}),
		MultiTurn(WMultiTurn, seed, MultiTurnSpec{Users: 16, Turns: 12, SystemTokens: 512, UserContextTokens: 1024,
			QuestionTokens: 128, AnswerTokens: 64, OutputTokens: 2, Interval: 130 * time.Millisecond, Stagger: 8 * time.Millisecond}),
		MultiTurnLong(seed),
		SiblingBursts(WSiblings, seed, SiblingSpec{Bursts: 12, Siblings: 8, PrefixTokens: 3072, QuestionTokens: 64,
			OutputTokens: 2, BurstGap: 250 * time.Millisecond, MaxSpread: 10 * time.Millisecond}),
		HotPrefix(WHotPrefix, seed, HotPrefixSpec{Prefixes: 16, Requests: 270, HotShare: 0.5, ZipfS: 1.1, PrefixTokens: sys,
			QuestionTokens: 128, OutputTokens: 2, RatePerSec: 90}),
	}, ChatWorkloads(seed, f)...)
}

// MultiTurnLong is the multi-turn chat of the default suite with sessions
// of 16 turns instead of 12: the same users, per-turn sizes and arrival
// pattern, so the 16 cold first turns are 6% of the requests instead of 8%.
// The longest histories (4.6k tokens) still fit the fleet (the fleet-LRU
// bound equals the unbounded one), but four sessions on one engine fill it
// in the last turns.
func MultiTurnLong(seed uint64) Workload {
	w := MultiTurn(WMultiTurnLong, seed, MultiTurnSpec{Users: 16, Turns: 16, SystemTokens: 512, UserContextTokens: 1024,
		QuestionTokens: 128, AnswerTokens: 64, OutputTokens: 2, Interval: 130 * time.Millisecond, Stagger: 8 * time.Millisecond})
	w.Title = "Multi-turn chat, longer sessions"
	return w
}

// ExtraWorkloads can be selected by name (llmbench -workloads) besides the
// default ones.
func ExtraWorkloads(seed uint64, f FleetConfig) []Workload {
	return []Workload{
		MultiTurn(WMultiTurnShort, seed, MultiTurnSpec{Users: 16, Turns: 6, SystemTokens: 512, QuestionTokens: 320, AnswerTokens: 96,
			OutputTokens: 2, Interval: 145 * time.Millisecond, Stagger: 9 * time.Millisecond}),
	}
}

// DefaultSuite is the suite `make bench-routing` runs, on the vLLM fleet.
func DefaultSuite(seed uint64) Suite { return SuiteOn(seed, DefaultFleet()) }

// SuiteOn is the default suite on fleet f.
func SuiteOn(seed uint64, f FleetConfig) Suite {
	return Suite{Name: "default", Seed: seed, Fleet: f, Workloads: DefaultWorkloads(seed, f), Arms: DefaultArms(), Runs: 3}
}

// TinySuite runs in seconds: two engines, small workloads, the round-robin
// and KV-exact arms. Tests and smoke runs use it.
func TinySuite(seed uint64, net int) Suite {
	f := DefaultFleet()
	f.Engines, f.CapacityBlocks, f.Net, f.TimeScale = 2, 256, net, 0.2
	f.Port, f.ZMQPort, f.VIPPort = 28100, 25657, 28180
	return Suite{Name: "tiny", Seed: seed, Fleet: f, Arms: []Arm{ArmRR, ArmKV}, Workloads: []Workload{
		SharedPrefix(WShared100, seed, SharedPrefixSpec{Groups: 4, PerGroup: 6, SystemTokens: 1024, QuestionTokens: 64,
			OutputTokens: 2, RatePerSec: 50, FillOfFleetPercent: 100 * 4 * 64 / f.TotalBlocks()}),
		MultiTurn(WMultiTurn, seed, MultiTurnSpec{Users: 4, Turns: 3, SystemTokens: 512, QuestionTokens: 64, AnswerTokens: 32,
			OutputTokens: 2, Interval: 60 * time.Millisecond, Stagger: 15 * time.Millisecond}),
	}}
}

// DemoSuite is what `make demo` runs: four engines, round robin against
// KV-exact, a shared-prefix workload and a multi-turn chat of about ten
// seconds each.
func DemoSuite(seed uint64, net int) Suite {
	f := DefaultFleet()
	f.Net = net
	f.Port, f.ZMQPort, f.VIPPort = 28200, 25757, 28280
	const sys = 2048
	groups := f.TotalBlocks() / (sys / f.BlockSize)
	return Suite{Name: "demo", Seed: seed, Fleet: f, Arms: []Arm{ArmRR, ArmKV}, Workloads: []Workload{
		SharedPrefix(WShared100, seed, SharedPrefixSpec{Groups: groups, PerGroup: 8, SystemTokens: sys, QuestionTokens: 128,
			OutputTokens: 2, RatePerSec: 90, FillOfFleetPercent: 100}),
		MultiTurn(WMultiTurn, seed, MultiTurnSpec{Users: 16, Turns: 8, SystemTokens: 512, UserContextTokens: 1024,
			QuestionTokens: 128, AnswerTokens: 64, OutputTokens: 2, Interval: 130 * time.Millisecond, Stagger: 8 * time.Millisecond}),
	}}
}
