// Package bench measures routing quality end to end: it drives the real
// loxilb daemon (a process) and a fleet of emulated vLLM engines through the
// mode-4 proxy on a loopback VIP, with seeded workloads modelled on the
// published KV-aware routing benchmarks, and compares routing arms
// (round robin, consistent hashing with bounded load, KV-exact with and
// without spill relief).
//
// In: a Suite (fleet size, engine cost model, workloads, arms) and the
// daemon binary. Out: a Report per run — per workload and arm the engines'
// own cache hit ratio (deltas of GET /sim/stats), time to first token at the
// client (streaming), throughput, per-endpoint load, routing receipts
// summarised by tier, and an offline upper bound on the hit ratio computed
// from the trace — written as JSON, a text table and one SVG chart per
// workload.
//
// Prompts are sent as token ids (/v1/completions accepts them), so the
// gateway and the engines hash exactly the blocks the workload generator
// produced and the offline bound replays the same block sequence.
//
// Neighbours: testbed/enginesim (the engines), cmd/loxilb (the daemon under
// test), testbed/bench/cmd/llmbench (the command line), testbed/demo.
// Nothing under pkg/ imports this package.
package bench
