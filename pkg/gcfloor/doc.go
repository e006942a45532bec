// Package gcfloor keeps the garbage collector from running more often than
// a floor of heap growth between cycles allows.
//
// Why: the daemon's live heap is small when its tables are (a few MB for
// a proxy-only node), and Go's default pacing (GOGC=100) collects every
// time the heap doubles: at 20,000 small proxied requests a second, each
// leaving about 2 KB of garbage, that was a cycle every 3,000 requests,
// six a second, each marking the live heap and turning on the write
// barrier, and on a host with an idle core running mark workers there.
// Letting the heap grow by at least the floor between cycles makes them
// rare (one per 30,000 such requests with 64 MiB), at the price of at
// most the floor in memory; a large live heap (big KV indexes) is paced
// as Go's default paces it, so what the floor costs does not scale with
// the heap. Sweeping and span set-up follow the allocation, not the
// cycles, and are not saved (BENCHMARKS.md, proxy efficiency).
//
// How: after every GC cycle (a cleanup on a sentinel object, so no timer
// and no goroutine between cycles), the live heap the cycle marked, with
// the stacks and globals it scanned, is read from runtime/metrics and
// GOGC is set to the percentage that puts the next goal at live+Floor,
// or Go's default if that is higher (Percent). A heap under the
// runtime's 4 MiB minimum counts as 4 MiB, whose minimum goal also
// scales with GOGC.
// A memory limit (GOMEMLIMIT) still applies: the runtime collects earlier
// when the heap nears it. The daemon leaves pacing alone when GOGC is set
// in its environment, the operator's choice.
//
// In: the floor in bytes. Out: the runtime's GC percentage. Neighbours:
// only the daemon's start (cmd/loxilb) uses it.
package gcfloor
