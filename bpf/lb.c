//go:build ignore

/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * tc_lb: the L4 load balancer, attached to TC ingress (TCX) of the interfaces
 * the daemon is configured with. It parses and runs the address prefilter;
 * packets that may be ours go on by a tail call to tc_lb_nat, which handles
 * both directions: conntrack first, then the service table for connection
 * starts.
 *
 * sk_lookup_proxy: steers connections for mode-4 (fullproxy) VIPs to the Go
 * proxy's listening socket, so the proxy accepts them with the VIP as its
 * local address.
 */

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "consts.h"
#include "structs.h"
#include "maps.h"
#include "parse.h"
#include "nat.h"

#ifndef AF_INET
#define AF_INET 2
#endif

char __license[] SEC("license") = "Dual BSD/GPL";

/* Load-time settings, written by the Go loader before the program is loaded. */
volatile const __u8 cfg_fib_forward = 1;      /* forward NATed packets with bpf_redirect_neigh */
volatile const __u32 cfg_hash_seed = 0x9e3779b9; /* seed of the flow hash */

static __always_inline void count(__u32 idx)
{
	__u64 *v = bpf_map_lookup_elem(&lb_counters, &idx);
	if (v)
		*v += 1; /* per-CPU slot: no atomic needed */
}

/* svc_flow counts a new connection of service idx and the conntrack
 * entries it inserted. Packets and bytes are not counted here: they are
 * in the flow's entries, which the GC sums per service (see lb_svc_gc),
 * so a conntrack hit reads no service statistics. */
static __always_inline void svc_flow(__u32 idx, __u64 entries)
{
	struct svc_stats *s = bpf_map_lookup_elem(&lb_svc_stats, &idx);
	if (!s)
		return;
	s->flows += 1;
	s->entries += entries;
}

/* filter_hash is the bit of {addr, port, proto} in lb_filter (twin of
 * filterHash in Go): the address alone picks the 64-byte line, the whole
 * key the bit in it (Fibonacci hashing), so the packets of one address
 * keep touching one cache line whatever their ports. */
static __always_inline __u32 filter_hash(__u32 addr, __u16 port, __u8 proto)
{
	__u32 line = (addr * 0x9E3779B1U) >> (32 - FILTER_LINE_SHIFT);
	__u64 k = ((__u64)addr << 32) | ((__u32)port << 8) | proto;
	return (line << 9) | (__u32)((k * 0x9E3779B97F4A7C15ULL) >> (64 - 9));
}

/* filter_match reports whether the packet may belong to the load balancer:
 * its destination is a frontend or its source an endpoint (a reply). Every
 * conntrack entry's tuple matches one of the two, so a packet matching
 * neither is passed without touching the large conntrack table.
 *
 * The side with the lower port is tested first: a frontend or an endpoint
 * listens on a service port and its peer uses an ephemeral one, so both a
 * request (destination) and a reply (source) usually match on the first
 * test and read one line of the filter, not two. The answer is the same
 * in either order. */
static __always_inline int filter_match(const struct pkt *p)
{
	__u32 zero = 0;
	struct lb_filter *f = bpf_map_lookup_elem(&lb_filter, &zero);
	if (!f)
		return 1;
	__u32 first = filter_hash(p->daddr, p->dport, p->proto);
	__u32 second = filter_hash(p->saddr, p->sport, p->proto);
	if (bpf_ntohs(p->sport) < bpf_ntohs(p->dport)) {
		__u32 t = first;
		first = second;
		second = t;
	}
	if (f->bits[(first >> 6) & (FILTER_BITS / 64 - 1)] & (1ULL << (first & 63)))
		return 1;
	return (f->bits[(second >> 6) & (FILTER_BITS / 64 - 1)] & (1ULL << (second & 63))) != 0;
}

/* fib_gen reads the low 16 bits of the FIB generation, the part a
 * conntrack entry keeps (0 when unreadable, or when those bits are 0:
 * nothing is cached or used then). */
static __always_inline __u16 fib_gen(void)
{
	__u32 zero = 0;
	__u32 *g = bpf_map_lookup_elem(&lb_fib_gen, &zero);
	return g ? (__u16)*g : 0;
}

/* fib_cached reports whether ct holds a FIB result valid for this packet:
 * same generation, fresh, same ingress device and TOS, and a length the
 * FIB's MTU check already passed. The length test needs no GSO test
 * before it (whose skb_shared_info read is a cache miss of its own): a
 * GSO packet whose total length passes has segments that pass too, and
 * larger ones ask the FIB, which skips the MTU check for GSO.
 *
 * The stamp is 16 bits of a ~1 ms clock, so it wraps every ~69 s; the
 * difference is still exact because a result is only used by a flow
 * whose previous packet came less than FIB_IDLE_MAX units ago (active),
 * and every lookup that is not stored clears fib_gen: so while fib_gen is
 * set, the flow's last packet came less than FIB_TTL after the stamp, and
 * the packet at hand less than FIB_TTL + FIB_IDLE_MAX < 2^16 units after
 * it. A 16-bit generation repeats after 65,536 changes, which cannot all
 * come within one FIB_TTL. */
static __always_inline int fib_cached(const struct ct_val *ct, const struct pkt *p, __u16 gen, __u16 stamp, __u32 iif,
				      int active)
{
	return gen && active && ct->fib_gen == gen && (__u16)(stamp - ct->fib_stamp) < FIB_TTL &&
	       ct->fib_iif == iif && ct->fib_tos == p->tos && p->tot_len <= ct->fib_len;
}

/* fib_store caches a successful lookup in ct. It is written by whichever CPU
 * misses, so the generation goes last and is cleared first: a reader sees
 * either the old complete result or an invalid entry. Devices whose index
 * does not fit 16 bits are not cached. */
static __always_inline void fib_store(struct ct_val *ct, const struct bpf_fib_lookup *fib, const struct pkt *p,
				      __u16 gen, __u16 stamp, __u32 iif)
{
	__u16 len = p->tot_len;
	if (ct->fib_gen == gen && ct->fib_ifindex == fib->ifindex && ct->fib_iif == iif && ct->fib_tos == p->tos &&
	    ct->fib_len > len)
		len = ct->fib_len; /* same path: keep the largest length seen */
	ct->fib_gen = 0;
	if (fib->ifindex > 0xffff || iif > 0xffff)
		return;
	asm volatile("" ::: "memory");
	ct->fib_ifindex = fib->ifindex;
	ct->fib_iif = iif;
	__builtin_memcpy(ct->fib_dmac, fib->dmac, ETH_ALEN);
	__builtin_memcpy(ct->fib_smac, fib->smac, ETH_ALEN);
	ct->fib_stamp = stamp;
	ct->fib_len = len;
	ct->fib_tos = p->tos;
	asm volatile("" ::: "memory");
	ct->fib_gen = gen;
}

/* hit_count counts a conntrack hit by its direction; ct_hit leaves it to
 * lb_forward, whose cached redirect counts the hit and the verdict in one
 * counter (CNT_FIB_CACHED*). */
static __always_inline void hit_count(const struct ct_val *ct)
{
	count(ct->flags & CT_F_REPLY ? CNT_CT_HIT_REPLY : CNT_CT_HIT_ORIG);
}

/* lb_forward sends a rewritten packet on. With cfg_fib_forward the FIB picks
 * the egress device and the MACs (bpf_redirect_neigh resolves them when the
 * neighbour is not known yet), skipping the stack's forwarding path;
 * otherwise the stack routes it. dsr_nh is the DSR
 * endpoint used as next hop (the destination stays the VIP). ct, when
 * given, is the flow's entry for this direction, and the packet a hit not
 * counted yet: a resolved FIB result is cached there and reused by the
 * next packets (see fib_cached); tick is the conntrack clock now, active
 * whether the flow's previous packet is recent enough for the cache to be
 * used. */
static __always_inline int lb_forward(struct __sk_buff *skb, struct pkt *p, __u32 dsr_nh, struct ct_val *ct, __u32 tick,
				      int active)
{
	if (!cfg_fib_forward && !dsr_nh) {
		if (ct)
			hit_count(ct);
		count(CNT_FWD_STACK);
		return TC_ACT_OK;
	}

	__u32 iif = skb->ingress_ifindex ? skb->ingress_ifindex : skb->ifindex;
	__u16 gen = fib_gen(); /* read before the lookup: a change after it invalidates */
	__u16 stamp = (__u16)tick;
	if (ct && p->ttl > 1 && fib_cached(ct, p, gen, stamp, iif, active)) {
		if (dec_ttl(skb, p, ct->fib_dmac)) {
			hit_count(ct);
			count(CNT_DROP_REWRITE);
			return TC_ACT_SHOT;
		}
		/* The hit and its verdict in one per-CPU counter. */
		count(ct->flags & CT_F_REPLY ? CNT_FIB_CACHED_REPLY : CNT_FIB_CACHED);
		return bpf_redirect(ct->fib_ifindex, 0);
	}
	if (ct)
		hit_count(ct);

	int gso = skb->gso_size != 0;
	struct bpf_fib_lookup fib = {};
	fib.family = AF_INET;
	fib.tos = p->tos;
	fib.l4_protocol = p->proto;
	fib.sport = p->sport;
	fib.dport = p->dport;
	/* GSO super-packets exceed the MTU by design; the MTU check is for the rest. */
	fib.tot_len = gso ? 0 : p->tot_len;
	fib.ipv4_src = p->saddr;
	fib.ipv4_dst = dsr_nh ? dsr_nh : p->daddr;
	fib.ifindex = iif;

	long rc = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
	if (ct) {
		/* Whatever the outcome, the entry's cache now holds this lookup
		 * or nothing (fib_cached relies on it). */
		if (rc == BPF_FIB_LKUP_RET_SUCCESS && gen && !gso && p->ttl > 1)
			fib_store(ct, &fib, p, gen, stamp, iif);
		else if (ct->fib_gen)
			ct->fib_gen = 0;
	}
	if ((rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH) && p->ttl > 1) {
		/* When the neighbour is known, write the MACs too and skip the
		 * neighbour lookup bpf_redirect_neigh would repeat. */
		__u8 macs[2 * ETH_ALEN];
		__builtin_memcpy(macs, fib.dmac, ETH_ALEN);
		__builtin_memcpy(macs + ETH_ALEN, fib.smac, ETH_ALEN);
		if (dec_ttl(skb, p, rc == BPF_FIB_LKUP_RET_SUCCESS ? macs : NULL)) {
			count(CNT_DROP_REWRITE);
			return TC_ACT_SHOT;
		}
		count(CNT_FWD_REDIRECT);
		if (rc == BPF_FIB_LKUP_RET_SUCCESS)
			return bpf_redirect(fib.ifindex, 0);
		if (dsr_nh) {
			struct bpf_redir_neigh nh = {};
			nh.nh_family = AF_INET;
			nh.ipv4_nh = dsr_nh;
			return bpf_redirect_neigh(fib.ifindex, &nh, sizeof(nh), 0);
		}
		return bpf_redirect_neigh(fib.ifindex, NULL, 0, 0);
	}
	if (dsr_nh) {
		/* The stack would route a DSR packet by its VIP destination: wrong. */
		count(CNT_DROP_NO_ROUTE);
		return TC_ACT_SHOT;
	}
	count(CNT_FWD_STACK);
	return TC_ACT_OK; /* the stack forwards, or answers with ICMP (TTL, MTU) */
}

/* csum_fold16 folds a 32-bit one's complement sum to 16 bits. */
static __always_inline __u16 csum_fold16(__s64 sum)
{
	__u32 s = (__u32)sum;
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)~s;
}

struct rst_pseudo {
	__u32 saddr;
	__u32 daddr;
	__u8 zero;
	__u8 proto;
	__be16 len;
};

/* send_rst answers a TCP packet of a flow the LB no longer has (endpoint or
 * service removed, entry expired or evicted) with a RST from the address
 * it was sent to, out of the interface it came in on, so the client fails
 * at once instead of retransmitting into a drop. Returns the verdict, or -1
 * when no RST can be sent (the caller drops). */
static __always_inline int send_rst(struct __sk_buff *skb, const struct pkt *p)
{
	if (p->proto != IPPROTO_TCP || (p->tcp_flags & TCPF_RST) || p->l4off != ETH_HLEN + sizeof(struct iphdr))
		return -1;
	__u8 macs[2 * ETH_ALEN];
	__be32 seqack[2];
	__u8 doff;
	if (bpf_skb_load_bytes(skb, 0, macs, sizeof(macs)) ||
	    bpf_skb_load_bytes(skb, p->l4off + 4, seqack, sizeof(seqack)) ||
	    bpf_skb_load_bytes(skb, p->l4off + 12, &doff, 1))
		return -1;
	__u32 hlen = (doff >> 4) * 4;
	__u32 plen = p->tot_len > sizeof(struct iphdr) + hlen ? p->tot_len - sizeof(struct iphdr) - hlen : 0;

	struct iphdr ip = {};
	struct tcphdr tcp = {};
	__u8 eth[ETH_HLEN];
	__builtin_memcpy(eth, macs + ETH_ALEN, ETH_ALEN);
	__builtin_memcpy(eth + ETH_ALEN, macs, ETH_ALEN);
	eth[12] = ETH_P_IP >> 8;
	eth[13] = ETH_P_IP & 0xff;
	ip.version = 4;
	ip.ihl = 5;
	ip.tot_len = bpf_htons(sizeof(struct iphdr) + sizeof(struct tcphdr));
	ip.frag_off = bpf_htons(0x4000); /* DF */
	ip.ttl = 64;
	ip.protocol = IPPROTO_TCP;
	ip.saddr = p->daddr;
	ip.daddr = p->saddr;
	tcp.source = p->dport;
	tcp.dest = p->sport;
	tcp.doff = 5;
	tcp.rst = 1;
	if (p->tcp_flags & TCPF_ACK) {
		tcp.seq = seqack[1]; /* RFC 9293: <SEQ=SEG.ACK><CTL=RST> */
	} else {
		__u32 ack = bpf_ntohl(seqack[0]) + plen + ((p->tcp_flags & (TCPF_SYN | TCPF_FIN)) ? 1 : 0);
		tcp.ack_seq = bpf_htonl(ack);
		tcp.ack = 1;
	}
	ip.check = csum_fold16(bpf_csum_diff(0, 0, (__be32 *)&ip, sizeof(ip), 0));
	struct rst_pseudo ph = {.saddr = ip.saddr, .daddr = ip.daddr, .proto = IPPROTO_TCP,
				.len = bpf_htons(sizeof(struct tcphdr))};
	__s64 sum = bpf_csum_diff(0, 0, (__be32 *)&ph, sizeof(ph), 0);
	tcp.check = csum_fold16(bpf_csum_diff(0, 0, (__be32 *)&tcp, sizeof(tcp), (__wsum)sum));

	if (bpf_skb_change_tail(skb, ETH_HLEN + sizeof(ip) + sizeof(tcp), 0) ||
	    bpf_skb_store_bytes(skb, 0, eth, sizeof(eth), 0) ||
	    bpf_skb_store_bytes(skb, ETH_HLEN, &ip, sizeof(ip), 0) ||
	    bpf_skb_store_bytes(skb, ETH_HLEN + sizeof(ip), &tcp, sizeof(tcp), 0))
		return -1;
	count(CNT_RST_SENT);
	return bpf_redirect(skb->ifindex, 0);
}

/* apply_xlate performs the rewrites a conntrack entry asks for. */
static __always_inline int apply_xlate(struct __sk_buff *skb, struct pkt *p, const struct ct_val *ct)
{
	__u32 saddr = ct->new_saddr, daddr = ct->new_daddr;
	__u16 sport = ct->new_sport, dport = ct->new_dport;
	__u8 flags = ct->flags;

	if ((flags & CT_F_XLATE_DST) && rewrite_addr(skb, p, 0, daddr, dport))
		return -1;
	if ((flags & CT_F_XLATE_SRC) && rewrite_addr(skb, p, 1, saddr, sport))
		return -1;
	return 0;
}

/* ct_stale reports whether the flow's endpoint cell has moved on (endpoint
 * removed or replaced, service deleted or re-created): its entries are left
 * over and must neither forward nor touch the cell's counter. */
static __always_inline int ct_stale(const struct ct_val *ct)
{
	__u32 i = (__u32)ct->svc_idx * MAX_EPS + ct->cell;
	__u32 *e = bpf_map_lookup_elem(&lb_ep_epoch, &i);
	return !e || *e != ct->epoch;
}

/* ct_same_service reports whether the flow's service still holds its index
 * (same service generation, see lb_ep_epoch), stale or not: its counts are
 * then still that service's. */
static __always_inline int ct_same_service(const struct ct_val *ct)
{
	__u32 i = (__u32)ct->svc_idx * MAX_EPS + ct->cell;
	__u32 *e = bpf_map_lookup_elem(&lb_ep_epoch, &i);
	return e && (*e >> EPOCH_SVC_SHIFT) == (ct->epoch >> EPOCH_SVC_SHIFT);
}

static __always_inline void lc_release(struct ct_val *ct)
{
	if (!(ct->flags & CT_F_LC_HELD))
		return;
	ct->flags &= ~CT_F_LC_HELD;
	if (ct_stale(ct))
		return; /* the cell was reset; the count is not ours any more */
	__u32 i = (__u32)ct->svc_idx * MAX_EPS + ct->cell;
	__s64 *n = bpf_map_lookup_elem(&lb_active_conns, &i);
	if (n)
		__sync_fetch_and_add(n, -1);
}

/* ct_track advances the TCP state of an entry (and its peer on close). */
static __always_inline void ct_track(struct ct_val *ct, const struct pkt *p)
{
	__u8 st = ct->state, next = st;

	if (p->proto != IPPROTO_TCP) {
		next = CT_EST; /* datagrams: a second packet in either direction */
	} else if (p->tcp_flags & TCPF_RST) {
		next = CT_CLOSED;
	} else if (p->tcp_flags & TCPF_FIN) {
		if (st < CT_FIN)
			next = CT_FIN;
	} else if (st == CT_NEW && (p->tcp_flags & TCPF_ACK)) {
		next = CT_EST;
	}
	if (next != st)
		ct->state = next;
	if (next >= CT_FIN)
		lc_release(ct);
}

/* peer_close moves the other direction's entry to the closing state too, so
 * neither entry outlives the connection by the long established timeout. The
 * peer key is the rewritten tuple reversed. */
static __always_inline void peer_close(const struct pkt *p, __u8 state)
{
	struct ct_key pk = {};
	pk.saddr = p->daddr;
	pk.daddr = p->saddr;
	pk.sport = p->dport;
	pk.dport = p->sport;
	pk.proto = p->proto;
	struct ct_val *peer = bpf_map_lookup_elem(&lb_conntrack, &pk);
	if (peer && peer->state < state) {
		peer->state = state;
		lc_release(peer);
	}
}

static __always_inline int ct_hit(struct __sk_buff *skb, struct pkt *p, struct ct_val *ct)
{
	__u8 before = ct->state;

	/* The coarse clock reads the tick-updated time (no clocksource read:
	 * kvm-clock or hpet cost tens to hundreds of ns); its lag of at most
	 * one tick does not matter against timeouts of seconds. */
	__u32 tick = (__u32)(bpf_ktime_get_coarse_ns() >> CT_TIME_SHIFT);
	int active = tick - ct->last_seen < FIB_IDLE_MAX;
	ct->last_seen = tick;
	/* Plain adds: a flow direction's packets are handled by one CPU at a
	 * time in practice (RSS, one veth queue), and an atomic read-modify-
	 * write costs more than the rare lost increment of a statistic. */
	ct->pkts += 1;
	ct->bytes += skb->len;
	ct_track(ct, p);
	__u8 after = ct->state;

	/* lb_forward counts the hit (see hit_count). */
	if (ct->flags & CT_F_DSR)
		return lb_forward(skb, p, ct->new_daddr, ct, tick, active);
	if (apply_xlate(skb, p, ct)) {
		hit_count(ct);
		count(CNT_DROP_REWRITE);
		return TC_ACT_SHOT;
	}
	if (after >= CT_FIN && after != before)
		peer_close(p, after);
	return lb_forward(skb, p, 0, ct, tick, active);
}

struct lc_scan {
	__s64 best;
	__u32 be_base;
	__u32 cnt_base;
	int ep;
	__u32 pad;
};

/* lc_step looks at endpoint i for the least-connection scan. */
static long lc_step(__u32 i, void *data)
{
	struct lc_scan *s = data;
	__u32 key = s->be_base + i;
	struct backend *be = bpf_map_lookup_elem(&lb_backends, &key);
	if (!be || !(be->flags & BE_F_ACTIVE) || be->cell >= MAX_EPS)
		return 0;
	key = s->cnt_base + be->cell;
	__s64 *c = bpf_map_lookup_elem(&lb_active_conns, &key);
	__s64 v = c ? *c : 0;
	if (v < s->best) {
		s->best = v;
		s->ep = i;
	}
	return 0;
}

/* select_ep runs the service's selector. It returns the endpoint index, or
 * -1 when the service has no active endpoint. */
static __always_inline int select_ep(const struct pkt *p, const struct svc_val *svc, __u64 now)
{
	__u32 idx = svc->idx;
	__u32 gen = svc->gen & 1;
	__u32 n = svc->slot_count;
	__u32 slot, key;

	if (idx >= MAX_SERVICES || n == 0 || n > SLOTS_PER_GEN)
		return -1;
	__u32 be_base = (idx * 2 + gen) * MAX_EPS;

	switch (svc->sel) {
	case SEL_PERSIST: {
		struct affinity_key ak = {.client = p->saddr, .svc_idx = idx};
		struct affinity_val *av = bpf_map_lookup_elem(&lb_affinity, &ak);
		if (av && av->expires_ns > now && av->ep < MAX_EPS) {
			key = be_base + av->ep;
			struct backend *be = bpf_map_lookup_elem(&lb_backends, &key);
			if (be && (be->flags & BE_F_ACTIVE) && be->addr == av->addr)
				return av->ep;
		}
		slot = hash_client(p, cfg_hash_seed) % n;
		break;
	}
	case SEL_LC: {
		struct lc_scan scan = {.be_base = be_base, .cnt_base = idx * MAX_EPS,
				       .best = 0x7fffffffffffffffLL, .ep = -1};
		__u32 n_eps = svc->ep_count;
		/* bpf_loop verifies the body once; an unrolled scan with a
		 * data-dependent minimum explodes the verifier's state space. */
		bpf_loop(n_eps < MAX_EPS ? n_eps : MAX_EPS, lc_step, &scan, 0);
		return scan.ep;
	}
	case SEL_HASH:
	case SEL_MAGLEV:
		slot = hash_tuple(p, cfg_hash_seed) % n;
		break;
	default: { /* SEL_RR, SEL_PRIORITY: weights are expanded into the slots */
		key = idx;
		__u32 *cur = bpf_map_lookup_elem(&lb_rr_cursor, &key);
		if (!cur)
			return -1;
		slot = __sync_fetch_and_add(cur, 1) % n;
		break;
	}
	}

	key = (idx * 2 + gen) * SLOTS_PER_GEN + slot;
	__u32 *e = bpf_map_lookup_elem(&lb_slots, &key);
	if (!e || *e >= MAX_EPS)
		return -1;
	return *e;
}

/* snat_insert stores the reply-direction entry for a source-NATed flow,
 * choosing a source port whose reply tuple is free. Full NAT tries the
 * client's port, then a few hashed ports; one-arm (the LB's own address)
 * only hashed ports of the range the host's stack does not use, so a
 * socket on the LB never shares a tuple with a translated flow.
 * Returns the port or 0. */
static __always_inline __u16 snat_insert(const struct pkt *p, struct ct_key *rk, struct ct_val *rv, int local)
{
	__u32 h = hash_tuple(p, cfg_hash_seed ^ 0x5bd1e995);

	for (int i = 0; i <= SNAT_TRIES; i++) {
		__u16 port = p->sport;
		if (local)
			port = bpf_htons(SNAT_LOCAL_PORT_MIN + (fmix32(h + i) % SNAT_LOCAL_PORT_SPAN));
		else if (i > 0)
			port = bpf_htons(SNAT_PORT_MIN + (fmix32(h + i) % SNAT_PORT_SPAN));
		rk->dport = port;
		if (!bpf_map_update_elem(&lb_conntrack, rk, rv, BPF_NOEXIST))
			return port;
	}
	return 0;
}

static __always_inline int new_flow(struct __sk_buff *skb, struct pkt *p, const struct svc_val *svc)
{
	__u64 now = bpf_ktime_get_coarse_ns();
	__u8 mode = svc->mode;

	if (p->proto == IPPROTO_TCP &&
	    (p->tcp_flags & (TCPF_SYN | TCPF_ACK | TCPF_RST | TCPF_FIN)) != TCPF_SYN) {
		/* Only a SYN may start a flow: an evicted or unknown flow must not
		 * be silently re-balanced mid-stream. */
		count(CNT_DROP_NOT_SYN);
		/* ... and the client learns at once that the flow is gone. */
		int v = send_rst(skb, p);
		return v < 0 ? TC_ACT_SHOT : v;
	}
	if (mode == MODE_FULLPROXY || mode > MODE_HOSTONEARM ||
	    (p->proto == IPPROTO_SCTP && mode != MODE_DSR)) {
		/* SCTP's CRC32c cannot be updated incrementally. */
		count(CNT_DROP_UNSUPPORTED);
		return TC_ACT_SHOT;
	}

	int ep = select_ep(p, svc, now);
	if (ep < 0 || ep >= MAX_EPS) {
		count(CNT_DROP_NO_ENDPOINT);
		return TC_ACT_SHOT;
	}
	__u32 idx = svc->idx;
	__u32 key = (idx * 2 + (svc->gen & 1)) * MAX_EPS + ep;
	struct backend *be = bpf_map_lookup_elem(&lb_backends, &key);
	if (!be || !(be->flags & BE_F_ACTIVE)) {
		count(CNT_DROP_NO_ENDPOINT);
		return TC_ACT_SHOT;
	}
	__u32 be_addr = be->addr, snat_addr = be->snat_addr;
	__u16 be_port = be->port;
	__u32 cell = be->cell;
	if (cell >= MAX_EPS) {
		count(CNT_DROP_NO_ENDPOINT);
		return TC_ACT_SHOT;
	}
	__u32 cell_key = idx * MAX_EPS + cell;
	__u32 *epoch = bpf_map_lookup_elem(&lb_ep_epoch, &cell_key);
	if (!epoch) {
		count(CNT_DROP_NO_ENDPOINT);
		return TC_ACT_SHOT;
	}

	struct ct_key fk = {};
	fk.saddr = p->saddr;
	fk.daddr = p->daddr;
	fk.sport = p->sport;
	fk.dport = p->dport;
	fk.proto = p->proto;

	struct ct_val fv = {};
	fv.last_seen = (__u32)(now >> CT_TIME_SHIFT);
	fv.svc_idx = idx;
	fv.cell = cell;
	fv.epoch = *epoch;
	fv.state = CT_NEW;

	if (mode == MODE_DSR) {
		fv.flags = CT_F_DSR;
		fv.new_daddr = be_addr;
	} else {
		struct ct_key rk = {};
		rk.saddr = be_addr;
		rk.sport = be_port;
		rk.proto = p->proto;
		struct ct_val rv = fv;
		rv.flags = CT_F_REPLY | CT_F_XLATE_SRC;
		rv.new_saddr = p->daddr;
		rv.new_sport = p->dport;

		fv.flags = CT_F_XLATE_DST;
		fv.new_daddr = be_addr;
		fv.new_dport = be_port;
		if (mode == MODE_DNAT) {
			rk.daddr = p->saddr;
			rk.dport = p->sport;
			/* A stale reply entry with this tuple belongs to a dead flow. */
			if (bpf_map_update_elem(&lb_conntrack, &rk, &rv, BPF_ANY)) {
				count(CNT_DROP_CT_INSERT);
				return TC_ACT_SHOT;
			}
		} else {
			rk.daddr = snat_addr;
			rv.flags |= CT_F_XLATE_DST;
			rv.new_daddr = p->saddr;
			rv.new_dport = p->sport;
			__u16 port = snat_insert(p, &rk, &rv, mode != MODE_FULLNAT);
			if (!port) {
				count(CNT_DROP_SNAT_EXHAUSTED);
				return TC_ACT_SHOT;
			}
			fv.flags |= CT_F_XLATE_SRC;
			fv.new_saddr = snat_addr;
			fv.new_sport = port;
		}
	}

	/* The connection's first packet is counted in its entry (the reply
	 * entry, copied from fv above, starts at zero). */
	fv.pkts = 1;
	fv.bytes = skb->len;
	if (svc->sel == SEL_LC) {
		__s64 *c = bpf_map_lookup_elem(&lb_active_conns, &cell_key);
		if (c) {
			__sync_fetch_and_add(c, 1);
			fv.flags |= CT_F_LC_HELD;
		}
	}
	if (bpf_map_update_elem(&lb_conntrack, &fk, &fv, BPF_ANY)) {
		count(CNT_DROP_CT_INSERT);
		return TC_ACT_SHOT;
	}
	if (svc->sel == SEL_PERSIST) {
		struct affinity_key ak = {.client = p->saddr, .svc_idx = idx};
		struct affinity_val av = {};
		av.expires_ns = now + (__u64)svc->persist_s * 1000000000ULL;
		av.addr = be_addr;
		av.ep = ep;
		bpf_map_update_elem(&lb_affinity, &ak, &av, BPF_ANY);
	}
	count(CNT_NEW_FLOW);
	svc_flow(idx, mode == MODE_DSR ? 1 : 2);

	if (mode == MODE_DSR)
		return lb_forward(skb, p, be_addr, NULL, 0, 0);
	if (apply_xlate(skb, p, &fv)) {
		count(CNT_DROP_REWRITE);
		return TC_ACT_SHOT;
	}
	return lb_forward(skb, p, 0, NULL, 0, 0);
}

/* ct_fold adds the packets and bytes of entries the program removed to
 * their service's statistics, so what the GC has not summed yet is not
 * lost, and takes them off the service's entry count. */
static __always_inline void ct_fold(__u32 idx, __u64 pkts, __u64 bytes, __u64 removed)
{
	struct svc_stats *s = bpf_map_lookup_elem(&lb_svc_stats, &idx);
	if (!s)
		return;
	s->pkts += pkts;
	s->bytes += bytes;
	s->entries -= removed;
}

/* ct_forget removes a finished or stale flow's entries before its tuple is
 * reused. Their counts go to the service's statistics while the service
 * still holds its index; a previous service's entries are dropped with
 * their counts (its statistics went with it). */
static __always_inline void ct_forget(struct ct_key *k, struct ct_val *ct)
{
	struct ct_key rk = {};
	rk.proto = k->proto;
	if (ct->flags & CT_F_XLATE_DST) {
		rk.saddr = ct->new_daddr;
		rk.sport = ct->new_dport;
	} else {
		rk.saddr = k->daddr;
		rk.sport = k->dport;
	}
	if (ct->flags & CT_F_XLATE_SRC) {
		rk.daddr = ct->new_saddr;
		rk.dport = ct->new_sport;
	} else {
		rk.daddr = k->saddr;
		rk.dport = k->sport;
	}
	lc_release(ct);
	/* Counts are read before the deletes (an element may be reused at once
	 * after) and folded only for the deletes that succeed: an entry the GC
	 * removed meanwhile is the GC's to count. */
	__u64 pkts = 0, bytes = 0, removed = 0;
	if (!(ct->flags & CT_F_DSR)) {
		struct ct_val *peer = bpf_map_lookup_elem(&lb_conntrack, &rk);
		__u64 pp = 0, pb = 0;
		if (peer && peer->svc_idx == ct->svc_idx) {
			pp = peer->pkts;
			pb = peer->bytes;
		}
		if (!bpf_map_delete_elem(&lb_conntrack, &rk)) {
			pkts += pp;
			bytes += pb;
			removed++;
		}
	}
	__u64 own_pkts = ct->pkts, own_bytes = ct->bytes;
	__u32 idx = ct->svc_idx;
	int fold = ct_same_service(ct);
	if (!bpf_map_delete_elem(&lb_conntrack, k)) {
		pkts += own_pkts;
		bytes += own_bytes;
		removed++;
	}
	if (fold && removed)
		ct_fold(idx, pkts, bytes, removed);
}

/* tc_lb_nat is the part of tc_lb that may rewrite the packet, entered by a
 * tail call once the packet passed the prefilter (see tc_lb). */
SEC("tc")
int tc_lb_nat(struct __sk_buff *skb)
{
	struct pkt p = {};
	__u32 cnt = CNT_DROP_MALFORMED;

	/* Parsed again: a tail call keeps only the skb. The headers are in
	 * the linear area by now (tc_lb pulled them), so this is a few loads. */
	int r = lb_parse(skb, &p, &cnt);
	if (r == PARSE_PASS || (r == PARSE_OK && p.is_frag)) {
		count(r == PARSE_PASS ? cnt : CNT_PASS_FRAGMENT);
		return TC_ACT_OK;
	}
	if (r != PARSE_OK) {
		count(cnt);
		return TC_ACT_SHOT;
	}

	struct ct_key k = {};
	k.saddr = p.saddr;
	k.daddr = p.daddr;
	k.sport = p.sport;
	k.dport = p.dport;
	k.proto = p.proto;

	int syn = p.proto == IPPROTO_TCP && (p.tcp_flags & (TCPF_SYN | TCPF_ACK)) == TCPF_SYN;
	struct ct_val *ct = bpf_map_lookup_elem(&lb_conntrack, &k);
	if (ct && ct_stale(ct)) {
		/* Left over by a removed endpoint or service: drop both entries
		 * and treat the packet as one without a flow. */
		count(CNT_FLOW_STALE);
		ct_forget(&k, ct);
		ct = NULL;
	}
	if (ct) {
		if (!syn || ct->state < CT_FIN)
			return ct_hit(skb, &p, ct);
		if (ct->flags & CT_F_REPLY) {
			/* A new connection that happens to reuse a dead flow's reply
			 * tuple (e.g. a direct client->backend connection): not ours. */
			count(CNT_PASS_NO_SERVICE);
			return TC_ACT_OK;
		}
		/* The client reuses the port of a closed flow: start afresh. */
		count(CNT_FLOW_REOPENED);
		ct_forget(&k, ct);
	}

	struct svc_key sk = {};
	sk.vip = p.daddr;
	sk.port = p.dport;
	sk.proto = p.proto;
	struct svc_val *svc = bpf_map_lookup_elem(&lb_services, &sk);
	if (!svc) {
		count(CNT_PASS_NO_SERVICE);
		return TC_ACT_OK;
	}
	struct svc_val sv = *svc; /* snapshot: Go may switch the generation meanwhile */
	return new_flow(skb, &p, &sv);
}

/* lb_progs holds tc_lb_nat for tc_lb's tail call, filled at load. */
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__array(values, int(void *));
} lb_progs SEC(".maps") = {
	.values = {[0] = (void *)&tc_lb_nat},
};

/* tc_lb is what is attached: parse, then the prefilter. Only packets that
 * may be the load balancer's go on, by a tail call, to tc_lb_nat. The split
 * keeps the non-VIP path small and free of direct packet writes: a program
 * that writes the packet directly starts by making a cloned skb writable
 * (bpf_skb_pull_data, reading the shared info at the end of its buffer),
 * which every TCP data packet would otherwise pay. */
SEC("tc")
int tc_lb(struct __sk_buff *skb)
{
	struct pkt p = {};
	__u32 cnt = CNT_DROP_MALFORMED;

	int r = lb_parse(skb, &p, &cnt);
	if (r == PARSE_PASS) {
		count(cnt);
		return TC_ACT_OK;
	}
	if (r != PARSE_OK) {
		count(cnt);
		return TC_ACT_SHOT;
	}
	if (p.is_frag) {
		count(CNT_PASS_FRAGMENT);
		return TC_ACT_OK;
	}
	if (!filter_match(&p)) {
		count(CNT_PASS_NO_SERVICE);
		return TC_ACT_OK;
	}
	bpf_tail_call(skb, &lb_progs, 0);
	/* Not reached while lb_progs holds tc_lb_nat (it is filled at load). */
	count(CNT_FWD_STACK);
	return TC_ACT_OK;
}

SEC("sk_lookup")
int sk_lookup_proxy(struct bpf_sk_lookup *ctx)
{
	if (ctx->family != AF_INET || ctx->protocol != IPPROTO_TCP)
		return SK_PASS;

	struct svc_key k = {};
	k.vip = ctx->local_ip4;
	k.port = bpf_htons(ctx->local_port);
	k.proto = IPPROTO_TCP;
	struct proxy_val *pv = bpf_map_lookup_elem(&lb_proxy_vips, &k);
	if (!pv)
		return SK_PASS;

	__u32 slot = pv->sock_idx;
	struct bpf_sock *sk = bpf_map_lookup_elem(&lb_proxy_socks, &slot);
	if (!sk) {
		/* Let the regular lookup run: a listener bound to the VIP may exist. */
		count(CNT_PROXY_NO_LISTENER);
		return SK_PASS;
	}
	long err = bpf_sk_assign(ctx, sk, 0);
	bpf_sk_release(sk);
	count(err ? CNT_PROXY_ASSIGN_FAILED : CNT_PROXY_STEERED);
	return SK_PASS;
}

/* Referenced so the enum lands in BTF and bpf2go emits Go constants for it. */
const enum lb_counter *unused_lb_counter __attribute__((unused));
