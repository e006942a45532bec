//go:build ignore

/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * ref_dnat: the smallest mode-0 DNAT that does what tc_lb does on a
 * conntrack hit, kept only as a yardstick for BenchmarkVIPThroughput (it is
 * not part of the product). One hash lookup per packet, the same rewrite as
 * bpf/nat.h (L4 checksum through bpf_l4_csum_replace, IP header and ports
 * written directly, TTL decremented), the MACs and egress device cached in
 * the entry, bpf_redirect. No prefilter, no tail call, no counters, no
 * endpoint epoch, no FIB generation, no timestamps, no TCP state: what
 * tc_lb's hit costs above this program is what those buy; what this costs
 * above an empty program is the floor of any DNAT hit on the machine.
 *
 * One service (ref_vip:ref_vport -> ref_backend:ref_bport, TCP), set by the
 * benchmark before loading. A SYN to the VIP creates both directions'
 * entries; entries are never aged (the LRU evicts the oldest when full, and
 * the benchmark removes the program and its map after each scenario).
 */

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include <linux/tcp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#ifndef AF_INET
#define AF_INET 2
#endif

char __license[] SEC("license") = "Dual BSD/GPL";

volatile const __u32 ref_vip = 0;     /* network order */
volatile const __u32 ref_backend = 0; /* network order */
volatile const __u16 ref_vport = 0;   /* network order */
volatile const __u16 ref_bport = 0;   /* network order */

struct ref_key {
	__u32 saddr;
	__u32 daddr;
	__u16 sport;
	__u16 dport;
};

/* 24 bytes: with the kernel's element header and the 16-byte rounded key
 * the element is 88 bytes (tc_lb's: 128). */
struct ref_val {
	__u32 addr;    /* the new address: the source's if is_src, else the destination's */
	__u16 port;
	__u8 is_src;
	__u8 pad;
	__u32 ifindex; /* egress device, 0 until the first FIB lookup */
	__u8 macs[12]; /* destination then source MAC */
};

/* The same kind and size as tc_lb's lb_conntrack (LRU, CT_MAX entries),
 * so the comparison is of the programs, not of the tables; the LRU also
 * makes room for new flows in connection-per-request runs, as entries are
 * never deleted here. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 262144);
	__type(key, struct ref_key);
	__type(value, struct ref_val);
} ref_ct SEC(".maps");

static __always_inline __u32 csum_add4(__u32 sum, __u32 from, __u32 to)
{
	return sum + (~from & 0xffff) + (~from >> 16) + (to & 0xffff) + (to >> 16);
}

SEC("tc")
int ref_dnat(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	struct tcphdr *tcp = (void *)(ip + 1);

	if ((void *)(tcp + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP) || ip->ihl != 5 ||
	    ip->protocol != IPPROTO_TCP || ip->ttl <= 1 || (ip->frag_off & bpf_htons(0x3fff)))
		return TC_ACT_OK;

	struct ref_key k = {.saddr = ip->saddr, .daddr = ip->daddr, .sport = tcp->source, .dport = tcp->dest};
	struct ref_val *v = bpf_map_lookup_elem(&ref_ct, &k);
	if (!v) {
		if (k.daddr != ref_vip || k.dport != ref_vport || !tcp->syn || tcp->ack)
			return TC_ACT_OK;
		struct ref_key rk = {.saddr = ref_backend, .daddr = k.saddr, .sport = ref_bport, .dport = k.sport};
		struct ref_val rv = {.addr = ref_vip, .port = ref_vport, .is_src = 1};
		struct ref_val fv = {.addr = ref_backend, .port = ref_bport};
		if (bpf_map_update_elem(&ref_ct, &rk, &rv, BPF_ANY) || bpf_map_update_elem(&ref_ct, &k, &fv, BPF_ANY))
			return TC_ACT_SHOT;
		v = bpf_map_lookup_elem(&ref_ct, &k);
		if (!v)
			return TC_ACT_SHOT;
	}

	__u8 is_src = v->is_src;
	__u32 old = is_src ? k.saddr : k.daddr, addr = v->addr;
	__u16 oldp = is_src ? k.sport : k.dport, port = v->port;
	__u32 csum_off = ETH_HLEN + sizeof(struct iphdr) + offsetof(struct tcphdr, check);
	if (bpf_l4_csum_replace(skb, csum_off, old, addr, BPF_F_PSEUDO_HDR | sizeof(addr)) ||
	    (oldp != port && bpf_l4_csum_replace(skb, csum_off, oldp, port, sizeof(port))))
		return TC_ACT_SHOT;

	if (!v->ifindex) {
		/* First packet of this direction: ask the FIB once and keep the
		 * answer (the reference never invalidates it). */
		struct bpf_fib_lookup fib = {};
		fib.family = AF_INET;
		fib.l4_protocol = IPPROTO_TCP;
		fib.ipv4_src = is_src ? addr : k.saddr;
		fib.ipv4_dst = is_src ? k.daddr : addr;
		fib.ifindex = skb->ingress_ifindex;
		if (bpf_fib_lookup(skb, &fib, sizeof(fib), 0) == BPF_FIB_LKUP_RET_SUCCESS) {
			__builtin_memcpy(v->macs, fib.dmac, ETH_ALEN);
			__builtin_memcpy(v->macs + ETH_ALEN, fib.smac, ETH_ALEN);
			v->ifindex = fib.ifindex;
		}
	}

	/* The helpers invalidated the packet pointers. */
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	eth = data;
	ip = (void *)(eth + 1);
	tcp = (void *)(ip + 1);
	if ((void *)(tcp + 1) > data_end)
		return TC_ACT_SHOT;
	/* IP checksum: the address (RFC 1624) and the TTL, in one update. */
	__u32 sum = csum_add4((__u16)~ip->check, old, addr) + bpf_htons(0xfeff); /* ~0x0100: TTL - 1 */
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	ip->check = (__u16)~sum;
	ip->ttl--;
	if (is_src) {
		ip->saddr = addr;
		tcp->source = port;
	} else {
		ip->daddr = addr;
		tcp->dest = port;
	}
	__u32 ifindex = v->ifindex;
	if (!ifindex)
		return TC_ACT_OK; /* no neighbour yet: the stack forwards this one */
	__builtin_memcpy(eth->h_dest, v->macs, ETH_ALEN);
	__builtin_memcpy(eth->h_source, v->macs + ETH_ALEN, ETH_ALEN);
	return bpf_redirect(ifindex, 0);
}
