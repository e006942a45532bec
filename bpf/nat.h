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

#define IP_CSUM_OFF (ETH_HLEN + offsetof(struct iphdr, check))
#define IP_SADDR_OFF (ETH_HLEN + offsetof(struct iphdr, saddr))
#define IP_DADDR_OFF (ETH_HLEN + offsetof(struct iphdr, daddr))
#define IP_TTL_OFF (ETH_HLEN + offsetof(struct iphdr, ttl))

/* l4_flags returns the checksum-update flags for the packet's protocol: UDP
 * may carry no checksum (0), which must stay 0 and never be produced. */
static __always_inline __u64 l4_flags(const struct pkt *p)
{
	return p->proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
}

/* rewrite_addr replaces the source (is_src) or destination address and port.
 * The pseudo-header is part of the L4 checksum, hence the address update of
 * the L4 checksum too. Works for CHECKSUM_PARTIAL skbs (GSO) as well. */
static __always_inline int rewrite_addr(struct __sk_buff *skb, struct pkt *p, int is_src,
					__u32 new_addr, __u16 new_port)
{
	__u32 old_addr = is_src ? p->saddr : p->daddr;
	__u16 old_port = is_src ? p->sport : p->dport;
	__u32 addr_off = is_src ? IP_SADDR_OFF : IP_DADDR_OFF;
	__u32 port_off = p->l4off + (is_src ? 0 : 2);
	__u64 lf = l4_flags(p);

	if (p->csum_off) {
		if (bpf_l4_csum_replace(skb, p->csum_off, old_addr, new_addr,
					BPF_F_PSEUDO_HDR | lf | sizeof(new_addr)))
			return -1;
		if (old_port != new_port &&
		    bpf_l4_csum_replace(skb, p->csum_off, old_port, new_port, lf | sizeof(new_port)))
			return -1;
	}
	if (bpf_l3_csum_replace(skb, IP_CSUM_OFF, old_addr, new_addr, sizeof(new_addr)))
		return -1;
	if (bpf_skb_store_bytes(skb, addr_off, &new_addr, sizeof(new_addr), 0))
		return -1;
	if (old_port != new_port && bpf_skb_store_bytes(skb, port_off, &new_port, sizeof(new_port), 0))
		return -1;
	if (is_src) {
		p->saddr = new_addr;
		p->sport = new_port;
	} else {
		p->daddr = new_addr;
		p->dport = new_port;
	}
	return 0;
}

/* dec_ttl does what the stack's forwarding path would: TTL-1 and fix the IP
 * checksum. The 16-bit word holding TTL and protocol is replaced as a unit. */
static __always_inline int dec_ttl(struct __sk_buff *skb, struct pkt *p)
{
	__u16 old = bpf_htons(((__u16)p->ttl << 8) | p->proto);
	__u16 new = bpf_htons(((__u16)(p->ttl - 1) << 8) | p->proto);
	__u8 ttl = p->ttl - 1;

	if (bpf_l3_csum_replace(skb, IP_CSUM_OFF, old, new, sizeof(new)))
		return -1;
	if (bpf_skb_store_bytes(skb, IP_TTL_OFF, &ttl, sizeof(ttl), 0))
		return -1;
	p->ttl = ttl;
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
