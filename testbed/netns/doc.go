// Package netns builds the network-namespace lab the data plane is tested
// in, and holds its end-to-end tests and benchmarks.
//
// Topology (all addresses live only inside namespaces the lab creates):
//
//	cli  c0 172.30.1.2/24 ── l0 172.30.1.1 ┐
//	be1  e0 172.30.11.2/24 ── b1 172.30.11.1 ├─ lb (ip_forward=1, tc_lb on l0,b1..bN)
//	be2  e0 172.30.12.2/24 ── b2 172.30.12.1 │
//	be3  e0 172.30.13.2/24 ── b3 172.30.13.1 ┘
//
// The client and the backends route everything via the LB, as loxilb's own
// test topology does, so mode 0 (DNAT) replies come back through it. VIPs are
// in 172.30.100.0/24 and are not assigned anywhere (mode 3 backends hold
// theirs on lo; mode 4 VIPs are made local on the LB by the data plane).
//
// A second lab (ha.go, TestSeveralNodes) puts three gateway nodes, each a
// real daemon with its data plane, on one etcd behind a router that
// spreads a VIP over them with an ECMP multipath route; see HALab.
//
// lab.sh builds the first topology by hand for exploration; the Go tests build
// their own with unique names and always delete it.
package netns
