// Package dataplane defines the kernel side of the load balancer as seen by
// the control plane: a small interface to install services (VIP, port,
// protocol, mode, selector) with their endpoints, flip endpoint health, and
// read verdict and per-service counters.
//
// In: desired services and endpoints from the control plane (the reconciler
// is the only writer). Out: packets balanced by the eBPF programs in bpf/,
// counters for every verdict and drop reason.
//
// Implementations:
//   - ebpf: the real data plane on github.com/cilium/ebpf (TC program for
//     modes 0-3 and 5, sk_lookup steering for mode 4).
//   - fake: an in-memory implementation for control-plane tests.
//
// Both pass the conformance suite in dataplanetest. Mode and selector numbers
// follow loxilb's rule semantics so REST rules map onto them one to one.
package dataplane
