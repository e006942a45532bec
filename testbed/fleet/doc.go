// Package fleet starts and stops sets of emulated inference engines on
// loopback ports for tests, the demo and the benchmarks.
//
// In: a list of enginesim.Config (one per engine). Out: the running engines'
// addresses (HTTP, ZMQ PUB per rank, replay ROUTER per rank, SGLang
// bootstrap). Engines run either in-process (Start: goroutines, fast, the
// Member.Sim handle gives direct access) or as engine-sim processes
// (StartProcesses: closer to a deployment, addresses read from each
// process's ready line). Unset ports are picked free on 127.0.0.1; ZMQ ports
// are allocated as a contiguous run base..base+ranks-1 with replay at
// base+1000+rank, the layout engines and the gateway assume.
//
// Neighbours: testbed/enginesim (the emulator) and testbed/cmd/engine-sim
// (its binary). Nothing under pkg/ imports this package.
package fleet
