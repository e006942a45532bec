/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Sizes, modes, selectors and counter indices shared with the Go loader in
 * pkg/dataplane/ebpf. Every value here has a twin there; keep them in step. */
#ifndef LB_CONSTS_H
#define LB_CONSTS_H

#define MAX_SERVICES 256   /* services with a kernel data path */
#define MAX_EPS 64         /* endpoints per service */
#define SLOTS_PER_GEN 4096 /* slot table size per service and generation */
#define CT_MAX 262144      /* conntrack entries (two per flow) */
#define AFFINITY_MAX 65536 /* persist selector client->endpoint entries */
#define PROXY_VIPS_MAX 1024
#define PROXY_SOCKS_MAX 64
#define FILTER_LINE_SHIFT 5 /* the address prefilter (lb_filter) has 2^5 lines */
#define FILTER_BITS (512 << FILTER_LINE_SHIFT) /* of 512 bits (one cache line) each */

/* Service modes (loxilb numbering). */
#define MODE_DNAT 0
#define MODE_ONEARM 1
#define MODE_FULLNAT 2
#define MODE_DSR 3
#define MODE_FULLPROXY 4
#define MODE_HOSTONEARM 5

/* Endpoint selectors (loxilb numbering). */
#define SEL_RR 0
#define SEL_HASH 1
#define SEL_PRIORITY 2
#define SEL_PERSIST 3
#define SEL_LC 4
#define SEL_MAGLEV 8

/* backend.flags */
#define BE_F_ACTIVE 0x01

/* ct_val.flags */
#define CT_F_XLATE_SRC 0x01 /* rewrite saddr/sport to new_saddr/new_sport */
#define CT_F_XLATE_DST 0x02 /* rewrite daddr/dport to new_daddr/new_dport */
#define CT_F_REPLY 0x04     /* entry matches the reply direction */
#define CT_F_DSR 0x08       /* no rewrite; forward to new_daddr as next hop */
#define CT_F_LC_HELD 0x10   /* the flow holds a least-connection count */

/* ct_val.state */
#define CT_NEW 0
#define CT_EST 1
#define CT_FIN 2
#define CT_CLOSED 3

/* Timeouts for states other than established (seconds). */
#define CT_SYN_TIMEOUT 60
#define CT_FIN_TIMEOUT 10

/* lb_ep_epoch: the service generation is the high half of an epoch. */
#define EPOCH_SVC_SHIFT 16

/* Conntrack times (last_seen, fib_stamp) count units of 2^CT_TIME_SHIFT ns
 * (~1.05 ms) of the coarse CLOCK_MONOTONIC. */
#define CT_TIME_SHIFT 20

/* A FIB result cached in a conntrack entry is used while lb_fib_gen is
 * unchanged and for at most FIB_TTL time units (~1 s): Go bumps the
 * generation on routing and neighbour changes, and the lifetime bounds
 * what no notification announces (a path-MTU exception, or changes while
 * no daemon watches). FIB_IDLE_MAX: a flow idle for that many units
 * (~34 s) looks its FIB result up again, which keeps the 16-bit stamp's
 * comparison exact (see fib_cached). */
#define FIB_TTL 1000
#define FIB_IDLE_MAX 32768

/* Ports handed out for full NAT (mode 2) when the client port collides. */
#define SNAT_PORT_MIN 32768
#define SNAT_PORT_SPAN 28232
/* Ports for one-arm SNAT (modes 1, 5), whose source is an address of the LB
 * itself: 61000-65535, outside the host stack's ephemeral range (Go keeps it
 * there via ip_local_reserved_ports when ip_local_port_range overlaps), so a
 * translated flow never takes the 4-tuple of a socket on the LB. Twin of
 * snatLocalPortMin/Max in pkg/dataplane/ebpf. */
#define SNAT_LOCAL_PORT_MIN 61000
#define SNAT_LOCAL_PORT_SPAN 4536
#define SNAT_TRIES 8

/* Counter indices: one per verdict and drop reason. */
enum lb_counter {
	CNT_PASS_NOT_IPV4 = 0,   /* non-IPv4 frame, left to the stack */
	CNT_PASS_NOT_L4,         /* IPv4 but not TCP/UDP/SCTP */
	CNT_PASS_NO_SERVICE,     /* no conntrack entry and no service: not ours */
	CNT_CT_HIT_ORIG,         /* packet of a known flow, client direction */
	CNT_CT_HIT_REPLY,        /* packet of a known flow, reply direction */
	CNT_NEW_FLOW,            /* connection created (selector ran) */
	CNT_FWD_REDIRECT,        /* sent out after a FIB lookup (Go reports it plus CNT_FIB_CACHED) */
	CNT_FWD_STACK,           /* handed to the stack for forwarding */
	CNT_FLOW_REOPENED,       /* SYN reused a closed flow's tuple */
	CNT_DROP_MALFORMED,      /* truncated or bad headers */
	CNT_PASS_FRAGMENT,       /* IPv4 fragment: no L4 header to match, left to the stack */
	CNT_DROP_NOT_SYN,        /* mid-stream TCP packet to a VIP with no conntrack entry */
	CNT_DROP_NO_ENDPOINT,    /* service has no active endpoint */
	CNT_DROP_CT_INSERT,      /* conntrack insert failed */
	CNT_DROP_SNAT_EXHAUSTED, /* no free source port for SNAT */
	CNT_DROP_REWRITE,        /* a packet rewrite helper failed */
	CNT_DROP_NO_ROUTE,       /* DSR packet without a route to the endpoint */
	CNT_DROP_UNSUPPORTED,    /* service mode/protocol the kernel path cannot do */
	CNT_PROXY_STEERED,       /* sk_lookup: connection handed to the proxy listener */
	CNT_PROXY_NO_LISTENER,   /* sk_lookup: mode-4 VIP but no listener registered */
	CNT_PROXY_ASSIGN_FAILED, /* sk_lookup: bpf_sk_assign refused the socket */
	CNT_FLOW_STALE,          /* packet of a flow whose endpoint or service is gone: entries dropped */
	CNT_RST_SENT,            /* TCP RST sent for a mid-stream packet of an unknown flow */
	/* A hit redirected with the FIB result cached in its conntrack entry
	 * bumps one of these two instead of CNT_CT_HIT_* (one per-CPU counter
	 * per packet, not two); Go adds them back to the hit counters and to
	 * fwd_redirect, and reports their sum as fib_cached. */
	CNT_FIB_CACHED,          /* client direction */
	CNT_FIB_CACHED_REPLY,    /* reply direction */
	CNT_MAX,
};

#endif
