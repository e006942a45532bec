/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Address/port rewrites with incremental checksum updates, TTL decrement and
 * the hash used by the selectors. */
#ifndef LB_NAT_H
#define LB_NAT_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "parse.h"


/* l4_flags returns the checksum-update flags for the packet's protocol: UDP
 * may carry no checksum (0), which must stay 0 and never be produced. */
static __always_inline __u64 l4_flags(const struct pkt *p)
{
	return p->proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
}

/* csum_replace4 updates a 16-bit one's complement checksum for a 32-bit
 * word changing from "from" to "to" (RFC 1624, eqn. 3). */
static __always_inline __u16 csum_replace4(__u16 check, __u32 from, __u32 to)
{
	__u32 sum = (__u16)~check;
	sum += (~from & 0xffff) + (~from >> 16) + (to & 0xffff) + (to >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)~sum;
}

/* rewrite_addr replaces the source (is_src) or destination address and port.
 * The pseudo-header is part of the L4 checksum, hence the address update of
 * the L4 checksum too; that goes through bpf_l4_csum_replace, which knows
 * how to treat CHECKSUM_PARTIAL skbs (GSO). The IP header (always fully
 * checksummed) and the port are written directly: no helper call each. */
static __always_inline int rewrite_addr(struct __sk_buff *skb, struct pkt *p, int is_src,
					__u32 new_addr, __u16 new_port)
{
	__u32 old_addr = is_src ? p->saddr : p->daddr;
	__u16 old_port = is_src ? p->sport : p->dport;
	__u64 lf = l4_flags(p);

	if (p->csum_off) {
		if (bpf_l4_csum_replace(skb, p->csum_off, old_addr, new_addr,
					BPF_F_PSEUDO_HDR | lf | sizeof(new_addr)))
			return -1;
		if (old_port != new_port &&
		    bpf_l4_csum_replace(skb, p->csum_off, old_port, new_port, lf | sizeof(new_port)))
			return -1;
	}
	/* The helpers invalidate packet pointers: take them afresh. */
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct iphdr *ip = data + ETH_HLEN;
	if ((void *)(ip + 1) > data_end)
		return -1;
	ip->check = csum_replace4(ip->check, old_addr, new_addr);
	if (is_src)
		ip->saddr = new_addr;
	else
		ip->daddr = new_addr;
	if (old_port != new_port) {
		__u32 off = p->l4off;
		if (off > ETH_HLEN + 60)
			return -1;
		struct l4ports *ports = data + off;
		if ((void *)(ports + 1) > data_end)
			return -1;
		if (is_src)
			ports->source = new_port;
		else
			ports->dest = new_port;
	}
	if (is_src) {
		p->saddr = new_addr;
		p->sport = new_port;
	} else {
		p->daddr = new_addr;
		p->dport = new_port;
	}
	return 0;
}

/* dec_ttl does what the stack's forwarding path would: TTL-1 and the
 * incremental IP checksum update of ip_decrease_ttl. With macs it also
 * writes the destination and source MAC (6 bytes each). Direct writes. */
static __always_inline int dec_ttl(struct __sk_buff *skb, struct pkt *p, const __u8 *macs)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end)
		return -1;
	__u32 check = ip->check;
	check += bpf_htons(0x0100);
	ip->check = (__u16)(check + (check >= 0xFFFF));
	ip->ttl = p->ttl - 1;
	p->ttl--;
	if (macs) {
		__builtin_memcpy(eth->h_dest, macs, ETH_ALEN);
		__builtin_memcpy(eth->h_source, macs + ETH_ALEN, ETH_ALEN);
	}
	return 0;
}

static __always_inline __u32 rotl32(__u32 x, __u32 r)
{
	return (x << r) | (x >> (32 - r));
}

/* murmur3 block mixing; one call per 32-bit word. */
static __always_inline __u32 mix_word(__u32 h, __u32 k)
{
	k *= 0xcc9e2d51;
	k = rotl32(k, 15);
	k *= 0x1b873593;
	h ^= k;
	h = rotl32(h, 13);
	return h * 5 + 0xe6546b64;
}

/* fmix32: murmur3 finaliser, full avalanche so low bits are usable for modulo. */
static __always_inline __u32 fmix32(__u32 h)
{
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	h ^= h >> 16;
	return h;
}

static __always_inline __u32 hash_tuple(const struct pkt *p, __u32 seed)
{
	__u32 h = seed;
	h = mix_word(h, p->saddr);
	h = mix_word(h, p->daddr);
	h = mix_word(h, ((__u32)p->sport << 16) | p->dport);
	h = mix_word(h, p->proto);
	return fmix32(h ^ 13);
}

static __always_inline __u32 hash_client(const struct pkt *p, __u32 seed)
{
	return fmix32(mix_word(seed, p->saddr) ^ 4);
}

#endif
