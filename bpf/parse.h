/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Bounds-checked parsing of Ethernet/IPv4/{TCP,UDP,SCTP} into struct pkt. */
#ifndef LB_PARSE_H
#define LB_PARSE_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>
#include "consts.h"

#define TCPF_FIN 0x01
#define TCPF_SYN 0x02
#define TCPF_RST 0x04
#define TCPF_ACK 0x10

#define IP_MF 0x2000
#define IP_OFFMASK 0x1fff

/* What the program needs from a packet, all in network order. */
struct pkt {
	__u32 saddr;
	__u32 daddr;
	__u16 sport;
	__u16 dport;
	__u8 proto;
	__u8 tcp_flags;
	__u8 ttl;
	__u8 tos;
	__u32 l4off;     /* offset of the L4 header from the frame start */
	__u32 csum_off;  /* offset of the L4 checksum, 0 if none to update */
	__u16 tot_len;   /* IPv4 total length, host order */
	__u8 is_frag;
	__u8 pad;
};

/* Ports sit at the same offsets in TCP, UDP and SCTP headers. */
struct l4ports {
	__be16 source;
	__be16 dest;
};

#define PARSE_OK 0
#define PARSE_PASS 1 /* not for us: counter already chosen */
#define PARSE_DROP 2

/* lb_parse fills p; on PARSE_PASS/PARSE_DROP *cnt names the counter to bump. */
static __always_inline int lb_parse(struct __sk_buff *skb, struct pkt *p, __u32 *cnt)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) > data_end) {
		*cnt = CNT_DROP_MALFORMED;
		return PARSE_DROP;
	}
	if (eth->h_proto != bpf_htons(ETH_P_IP)) {
		*cnt = CNT_PASS_NOT_IPV4;
		return PARSE_PASS;
	}

	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end) {
		/* Headers may sit outside the linear area (GRO'd or odd drivers). */
		if (bpf_skb_pull_data(skb, ETH_HLEN + 60 + sizeof(struct tcphdr)) &&
		    bpf_skb_pull_data(skb, ETH_HLEN + sizeof(struct iphdr))) {
			*cnt = CNT_DROP_MALFORMED;
			return PARSE_DROP;
		}
		data = (void *)(long)skb->data;
		data_end = (void *)(long)skb->data_end;
		ip = data + ETH_HLEN;
		if ((void *)(ip + 1) > data_end) {
			*cnt = CNT_DROP_MALFORMED;
			return PARSE_DROP;
		}
	}
	if (ip->version != 4 || ip->ihl < 5) {
		*cnt = CNT_DROP_MALFORMED;
		return PARSE_DROP;
	}
	p->proto = ip->protocol;
	if (p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP && p->proto != IPPROTO_SCTP) {
		*cnt = CNT_PASS_NOT_L4;
		return PARSE_PASS;
	}
	p->saddr = ip->saddr;
	p->daddr = ip->daddr;
	p->ttl = ip->ttl;
	p->tos = ip->tos;
	p->tot_len = bpf_ntohs(ip->tot_len);
	p->is_frag = (ip->frag_off & bpf_htons(IP_MF | IP_OFFMASK)) != 0;
	p->l4off = ETH_HLEN + ((__u32)ip->ihl & 0xf) * 4;
	p->tcp_flags = 0;
	p->csum_off = 0;
	p->sport = 0;
	p->dport = 0;
	if (p->is_frag)
		return PARSE_OK; /* caller decides: fragments to a service are dropped */

	__u32 need = p->proto == IPPROTO_TCP ? sizeof(struct tcphdr) :
		     p->proto == IPPROTO_UDP ? sizeof(struct udphdr) : sizeof(struct l4ports);
	if (data + p->l4off + need > data_end) {
		if (bpf_skb_pull_data(skb, p->l4off + need)) {
			*cnt = CNT_DROP_MALFORMED;
			return PARSE_DROP;
		}
		data = (void *)(long)skb->data;
		data_end = (void *)(long)skb->data_end;
	}
	__u32 off = p->l4off;
	if (off > ETH_HLEN + 60)
		return PARSE_DROP;
	struct l4ports *ports = data + off;
	if ((void *)(ports + 1) > data_end) {
		*cnt = CNT_DROP_MALFORMED;
		return PARSE_DROP;
	}
	p->sport = ports->source;
	p->dport = ports->dest;
	if (p->proto == IPPROTO_TCP) {
		struct tcphdr *tcp = data + off;
		if ((void *)(tcp + 1) > data_end) {
			*cnt = CNT_DROP_MALFORMED;
			return PARSE_DROP;
		}
		p->tcp_flags = ((__u8 *)tcp)[13];
		p->csum_off = off + offsetof(struct tcphdr, check);
	} else if (p->proto == IPPROTO_UDP) {
		struct udphdr *udp = data + off;
		if ((void *)(udp + 1) > data_end) {
			*cnt = CNT_DROP_MALFORMED;
			return PARSE_DROP;
		}
		p->csum_off = off + offsetof(struct udphdr, check);
	}
	return PARSE_OK;
}

#endif
