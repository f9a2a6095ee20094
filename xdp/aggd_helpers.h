/* Small always-inline helpers: checksums and address rewrites. They must not touch maps: bcc
 * rewrites map calls (`stats.lookup`) only in the main source file, not in headers. */
#ifndef AGGD_HELPERS_H
#define AGGD_HELPERS_H

#include "aggd_maps.h"

static __always_inline __u16 ip_checksum(struct iphdr *ip)
{
	__u32 sum = 0;
	__u16 *w = (__u16 *)ip;
	ip->check = 0;
#pragma unroll
	for (int i = 0; i < (int)(sizeof(struct iphdr) / 2); i++)
		sum += w[i];
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return ~sum;
}

/* Turn a worker's packet into one for the job's multicast group: source becomes this host. */
static __always_inline void address_to_group(struct ethhdr *eth, struct iphdr *ip, struct udphdr *udp,
					     struct job_cfg *cfg)
{
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, cfg->group_mac, ETH_ALEN);
	ip->saddr = ip->daddr;
	ip->daddr = cfg->group_ip;
	ip->ttl = 64;
	ip->check = ip_checksum(ip);
	udp->source = htons(AGGD_PORT);
	udp->dest = cfg->result_port;
	udp->check = 0; /* optional for IPv4; recomputing it would cost a pass over the payload */
}

/* Send a packet back where it came from. */
static __always_inline void address_to_sender(struct ethhdr *eth, struct iphdr *ip, struct udphdr *udp)
{
	__u8 mac[ETH_ALEN];
	__be32 a = ip->saddr;
	__be16 p = udp->source;

	__builtin_memcpy(mac, eth->h_source, ETH_ALEN);
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, mac, ETH_ALEN);
	ip->saddr = ip->daddr;
	ip->daddr = a;
	ip->ttl = 64;
	ip->check = ip_checksum(ip);
	udp->source = udp->dest;
	udp->dest = p;
	udp->check = 0;
}

static __always_inline int clamp_shift(int s, int max)
{
	return s > max ? max : s;
}

/* A zero-extended int32 x xor LANE_FLIP is x - 2**31 modulo 2**64 for every x: one xor instead of
 * a sign extension (the upper bits keep the compiler from narrowing it to a 32-bit xor). */
#define LANE_FLIP 0xFFFFFFFF80000000ULL
#define SUM_BIAS (1ULL << 31) /* what one contribution's LANE_FLIP takes off each lane */

#endif /* AGGD_HELPERS_H */
