// Package gcfloor keeps the garbage collector from running more often than
// a floor of heap growth between cycles allows.
//
// Why: the daemon's live heap is small when its tables are (a few MB for
// a proxy-only node), and Go's default pacing (GOGC=100) collects every
// time the heap doubles: at 20,000 small proxied requests a second, each
// leaving about 2 KB of garbage, that was a cycle every 3,000 requests and
// about 2.3 µs of GC CPU per request, a twentieth of the proxy's CPU.
// Letting the heap grow by at least Floor bytes between cycles cuts that
// to a fraction, at the price of at most Floor more memory; a large live
// heap (big KV indexes) is paced as Go's default paces it, so the memory
// the floor costs is bounded and does not scale with the heap.
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
