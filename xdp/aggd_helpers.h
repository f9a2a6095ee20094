/* Small always-inline helpers: checksums and address rewrites. They must not touch maps: bcc
 * rewrites map calls (`stats.lookup`) only in the main source file, not in headers. */
#ifndef AGGD_HELPERS_H
#define AGGD_HELPERS_H

#include "aggd_maps.h"

/* A header field at its own width: struct aggd_hdr is packed, so clang reads and writes its fields a
 * byte at a time (a load or store, a shift and an or per byte). In the frame the header starts 42
 * bytes in, so a field is 2-byte aligned at worst, which the verifier and the JIT take as it is
 * (unaligned packet access is allowed where the CPU has it, as x86 and arm64 do). */
#define HDR(h, type, field) (*(type *)((void *)(h) + __builtin_offsetof(struct aggd_hdr, field)))

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

/* The UDP checksum of a result to workers (their GRO coalesces a train of datagrams only when
 * each carries one: udp_gro_receive_segment), over the pseudo-header, the UDP and aggd headers and
 * the values at `values` (in the frame, or the copy stored into it): ELEMS 32-bit words, every
 * result's 4 * ELEMS bytes (int32 values, or an int8 job's int16 pairs). Sums of native-order words
 * folded to 16 bits give the checksum in the order it is stored (every word starts at an even
 * offset of the datagram). */
static __always_inline void result_udp_csum(struct iphdr *ip, struct udphdr *udp, const __u32 *values)
{
	__u64 sum = (__u64)ip->saddr + ip->daddr + ((__u32)htons(IPPROTO_UDP) | ((__u32)udp->len << 16));
	const __u32 *w = (const __u32 *)udp; /* the UDP header and the aggd header: 48 bytes */
	udp->check = 0;
#pragma unroll
	for (int i = 0; i < (int)((sizeof(struct udphdr) + sizeof(struct aggd_hdr)) / 4); i++)
		sum += w[i];
	_Pragma("clang loop unroll_count(8)")
	for (int i = 0; i < ELEMS; i++)
		sum += values[i];
	sum = (sum & 0xffffffff) + (sum >> 32);
	sum = (sum & 0xffffffff) + (sum >> 32);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	__u16 c = ~(__u16)sum;
	udp->check = c ? c : 0xffff; /* 0 would mean "no checksum" */
}

/* A MAC address as a 4-byte and a 2-byte word, not six single bytes (alignment: see HDR). */
static __always_inline void mac_copy(__u8 *dst, const __u8 *src)
{
	*(__u32 *)dst = *(const __u32 *)src;
	*(__u16 *)(dst + 4) = *(const __u16 *)(src + 4);
}

static __always_inline int mac_equal(const __u8 *a, const __u8 *b)
{
	return *(const __u32 *)a == *(const __u32 *)b && *(const __u16 *)(a + 4) == *(const __u16 *)(b + 4);
}

/* TTL, and a fixed ID with don't-fragment: a receiver's GRO then coalesces a train of results
 * (the ID of the worker's packet each came from would break every train), then the checksum. */
static __always_inline void fresh_ip(struct iphdr *ip)
{
	ip->ttl = 64;
	ip->id = 0;
	ip->frag_off = htons(0x4000); /* IP_DF */
	ip->check = ip_checksum(ip);
}

/* Turn a worker's packet into one for the job's multicast group: source becomes this host. */
static __always_inline void address_to_group(struct ethhdr *eth, struct iphdr *ip, struct udphdr *udp,
					     struct job_cfg *cfg)
{
	mac_copy(eth->h_source, eth->h_dest);
	mac_copy(eth->h_dest, cfg->group_mac);
	ip->saddr = ip->daddr;
	ip->daddr = cfg->group_ip;
	fresh_ip(ip);
	udp->source = htons(AGGD_PORT);
	udp->dest = cfg->result_port;
	udp->check = 0; /* a result's is computed once its values are written (result_udp_csum) */
}

/* From a rack job's own address (the packet may have come to another group) to `mac`, `daddr`,
 * `dport`: its group (an upper result relayed) or its upper aggregator (a sum going up). */
static __always_inline void address_from_rack(struct ethhdr *eth, struct iphdr *ip, struct udphdr *udp,
					      struct job_cfg *cfg, const __u8 *mac, __be32 daddr, __be16 dport)
{
	mac_copy(eth->h_source, cfg->self_mac);
	mac_copy(eth->h_dest, mac);
	ip->saddr = cfg->self_ip;
	ip->daddr = daddr;
	fresh_ip(ip);
	udp->source = htons(AGGD_PORT);
	udp->dest = dport;
	udp->check = 0;
}

/* Make the header a result of round `key` with its bank's fields (job and count stay). */
static __always_inline void write_result(struct aggd_hdr *h, __u64 key, __u16 version, __s16 exponent,
					 __u8 flags, __u64 bitmap, __u16 n_contrib, __u8 kind, __u8 param)
{
	h->type = AGGD_MSG_TYPE_RESULT;
	HDR(h, __be16, rank) = htons(0xffff);
	HDR(h, __be32, round) = htonl((__u32)(key >> 32));
	HDR(h, __be32, chunk) = htonl((__u32)key);
	HDR(h, __be16, strategy_version) = htons(version);
	HDR(h, __be16, exponent) = htons((__u16)exponent);
	h->flags = flags;
	h->code = 0;
	HDR(h, __be64, contributors) = __builtin_bswap64(bitmap);
	HDR(h, __be16, n_contrib) = htons(n_contrib);
	HDR(h, __be16, step) = 0;
	h->strategy = kind;
	h->param = param;
	HDR(h, __be16, skip) = 0;
}

/* Bytes of a value in a contribution's (or re-read's) payload, and in a result's, by the header's
 * `code` (Precision; int32 when it names none). */
static __always_inline __u32 contrib_width(__u8 code)
{
	return code == AGGD_PRECISION_INT8 ? 1 : code == AGGD_PRECISION_INT16 ? 2 : 4;
}

static __always_inline __u32 result_width(__u8 code)
{
	return code == AGGD_PRECISION_INT8 ? 2 : 4;
}

/* Values a packet carries for each of its ELEMS lanes: an int8 job's two (added four to a bank lane:
 * aggd_lanes.h, "Packed lanes"), so that its result fills 4 * ELEMS bytes as every other result does. */
static __always_inline __u32 per_lane(__u8 code)
{
	return code == AGGD_PRECISION_INT8 ? 2 : 1;
}

/* Send a packet back where it came from. */
static __always_inline void address_to_sender(struct ethhdr *eth, struct iphdr *ip, struct udphdr *udp)
{
	__u32 mac_hi = *(__u32 *)eth->h_source;
	__u16 mac_lo = *(__u16 *)(eth->h_source + 4);
	__be32 a = ip->saddr;
	__be16 p = udp->source;

	mac_copy(eth->h_source, eth->h_dest);
	*(__u32 *)eth->h_dest = mac_hi;
	*(__u16 *)(eth->h_dest + 4) = mac_lo;
	ip->saddr = ip->daddr;
	ip->daddr = a;
	fresh_ip(ip);
	udp->source = udp->dest;
	udp->dest = p;
	udp->check = 0;
}

/* min(x, max) without a branch (x - max must not overflow): the mask is hidden from clang, which
 * would otherwise see a min and emit one (a branch gives the verifier two states, and it walks the
 * alignment loop once for each). */
static __always_inline __s64 min_nobranch(__s64 x, __s64 max)
{
	__s64 d = x - max, m = d >> 63;
	asm volatile("" : "+r"(m));
	return max + (d & m);
}

/* A zero-extended int32 x xor LANE_FLIP is x - 2**31 modulo 2**64 for every x: one xor instead of
 * a sign extension (the upper bits keep the compiler from narrowing it to a 32-bit xor). */
#define LANE_FLIP 0xFFFFFFFF80000000ULL
#define SUM_BIAS (1ULL << 31) /* what one contribution's LANE_FLIP takes off each lane */

#endif /* AGGD_HELPERS_H */
