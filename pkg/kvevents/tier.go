package kvevents

import (
	"strings"

	"github.com/loxilb-llm/loxilb/pkg/kvindex"
)

// TierSink is a Sink that records which storage tier a block copy is on.
// *kvindex.Index implements it. With a plain Sink, events for offloaded
// copies are skipped (reason "medium"): crediting them as GPU-resident
// would overstate the hit.
type TierSink interface {
	StoreTier(service uint32, ep int, rank int, tier kvindex.Tier, keys []uint64)
	RemoveTier(service uint32, ep int, rank int, tier kvindex.Tier, keys []uint64)
}

// mediumTier maps an event's medium to a tier. vLLM publishes "GPU" for
// its prefix cache and "CPU" for its offloading connector's host copies;
// SGLang "CPU_PINNED" for host (L2) pages and "DISK"/"EXTERNAL" further
// down; LMCache-backed publishers name their backend ("LMCache",
// "LocalCPUBackend", "LocalDiskBackend"). Every non-GPU tier is an
// offloaded copy and weighs as CPU. An absent medium (engines before the
// field existed) is GPU. ok is false for a medium nobody documents: such
// blocks are skipped and counted rather than guessed onto a tier.
func mediumTier(m []byte) (t kvindex.Tier, ok bool) {
	switch s := strings.ToLower(string(m)); {
	case s == "" || s == "gpu":
		return kvindex.TierGPU, true
	case s == "cpu", s == "cpu_pinned", s == "disk", s == "storage", s == "external",
		strings.HasPrefix(s, "lmcache"), s == "localcpubackend", s == "localdiskbackend":
		return kvindex.TierCPU, true
	}
	return kvindex.TierGPU, false
}
