package kvevents

import (
	"bytes"

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
//
// The names are matched case-insensitively without lowering a copy: this
// runs for every block event, and strings.ToLower allocated for each
// upper-case "GPU".
func mediumTier(m []byte) (t kvindex.Tier, ok bool) {
	switch {
	case len(m) == 0 || bytes.EqualFold(m, []byte("gpu")):
		return kvindex.TierGPU, true
	case len(m) >= len("lmcache") && bytes.EqualFold(m[:len("lmcache")], []byte("lmcache")):
		return kvindex.TierCPU, true
	}
	for _, name := range offloadMedia {
		if bytes.EqualFold(m, []byte(name)) {
			return kvindex.TierCPU, true
		}
	}
	return kvindex.TierGPU, false
}

// offloadMedia are the media names (lower case) of offloaded copies, bar
// LMCache's "lmcache..." prefix.
var offloadMedia = [...]string{"cpu", "cpu_pinned", "disk", "storage", "external", "localcpubackend", "localdiskbackend"}
