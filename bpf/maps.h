/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* All maps of the data plane. Every map is pinned by name so a restarted
 * daemon re-opens the same state and traffic keeps flowing meanwhile. */
#ifndef LB_MAPS_H
#define LB_MAPS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "consts.h"
#include "structs.h"

/* Services with a kernel data path (modes 0-3, 5): {vip, port, proto} -> service.
 * One update of a value switches a service to a new generation atomically. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_SERVICES);
	__type(key, struct svc_key);
	__type(value, struct svc_val);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_services SEC(".maps");

/* Slot tables, (idx*2 + gen)*SLOTS_PER_GEN + i -> endpoint index. Built in Go:
 * equal or weighted expansion for rr/hash/priority, a Maglev table for SEL_MAGLEV. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_SERVICES * 2 * SLOTS_PER_GEN);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_slots SEC(".maps");

/* Endpoints, (idx*2 + gen)*MAX_EPS + ep -> address, port, SNAT source, health. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_SERVICES * 2 * MAX_EPS);
	__type(key, __u32);
	__type(value, struct backend);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_backends SEC(".maps");

/* Round-robin cursor per service; shared (atomic add) so the order is global. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_SERVICES);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_rr_cursor SEC(".maps");

/* Open connections per endpoint cell, idx*MAX_EPS + cell, for the least-connection
 * selector. A cell belongs to one endpoint of a service while it stays in the
 * service; Go bumps the cell's epoch (lb_ep_epoch) and zeroes it when the
 * endpoint goes or the cell passes to another endpoint. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_SERVICES * MAX_EPS);
	__type(key, __u32);
	__type(value, __s64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_active_conns SEC(".maps");

/* Epoch per endpoint cell, idx*MAX_EPS + cell. A conntrack entry records the
 * epoch of its cell; once Go bumps it (endpoint removed or replaced, service
 * deleted or its mode changed) the flow is stale: its entries are dropped on
 * the next packet or by the GC, and it never touches the cell's counter.
 * The high 16 bits are the index's service generation (EPOCH_SVC_SHIFT),
 * bumped when the index passes to another service: a stale entry of the
 * same generation is a flow of the service still there (an endpoint went),
 * whose counts are still the service's; one of another generation is not. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_SERVICES * MAX_EPS);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_ep_epoch SEC(".maps");

/* Conntrack: the tuple as it arrives -> rewrite, state and counters. Two entries
 * per flow (client direction and reply direction). Aged out by Go. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, CT_MAX);
	__type(key, struct ct_key);
	__type(value, struct ct_val);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_conntrack SEC(".maps");

/* Persist selector: {service, client address} -> endpoint until expires_ns. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, AFFINITY_MAX);
	__type(key, struct affinity_key);
	__type(value, struct affinity_val);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_affinity SEC(".maps");

/* Verdict and drop-reason counters, indexed by enum lb_counter, summed by Go. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, CNT_MAX);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_counters SEC(".maps");

/* Per-service new flows, and the packets and bytes of the entries the
 * program removed, indexed by service idx (struct svc_stats). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MAX_SERVICES);
	__type(key, __u32);
	__type(value, struct svc_stats);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_svc_stats SEC(".maps");

/* The conntrack GC's per-service sums, indexed by service idx (struct
 * svc_gc). Go only: the program never reads or writes it. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_SERVICES);
	__type(key, __u32);
	__type(value, struct svc_gc);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_svc_gc SEC(".maps");

/* The address prefilter (struct lb_filter), one element. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct lb_filter);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_filter SEC(".maps");

/* FIB generation, one element: Go bumps it on every IPv4 route, rule,
 * nexthop, address, link or neighbour change and at each start, which
 * invalidates the FIB results cached in conntrack entries. Never 0. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_fib_gen SEC(".maps");

/* Mode-4 services: {vip, port, TCP} -> listener slot in lb_proxy_socks. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PROXY_VIPS_MAX);
	__type(key, struct svc_key);
	__type(value, struct proxy_val);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_proxy_vips SEC(".maps");

/* Proxy listening sockets, inserted by Go; not pinned: sockets die with the daemon. */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKMAP);
	__uint(max_entries, PROXY_SOCKS_MAX);
	__type(key, __u32);
	__type(value, __u64);
} lb_proxy_socks SEC(".maps");

#endif
