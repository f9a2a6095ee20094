/* aggd's XDP data plane: sums workers' int32 gradient chunks into per-job slots and multicasts the
 * released sum back to the job's group. Wire format: aggd_proto.h (generated), semantics:
 * docs/protocol.md. Compiled at run time by bcc with -DELEMS, -DTOTAL_SLOTS, -DAGGD_PORT. */
#include <uapi/linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include <linux/udp.h>

#ifndef AGGD_PORT
#define AGGD_PORT 47000
#endif

#include "aggd_helpers.h"

/* Counters live here, not in a header: bcc rewrites map calls only in the main file. */
static __always_inline struct job_stats *stats_of(__u32 bucket)
{
	return stats.lookup(&bucket);
}

static __always_inline int count_drop(__u32 bucket, __u32 reason)
{
	struct job_stats *st = stats_of(bucket);
	if (st && reason < AGGD_DROP_REASON__COUNT)
		st->drop[reason]++;
	return XDP_DROP;
}

static __always_inline void count(__u32 bucket, __u32 which, __u64 n)
{
	struct job_stats *st = stats_of(bucket);
	if (st && which < AGGD_COUNTER__COUNT)
		st->counter[which] += n;
}

#define NACK_LEN (sizeof(struct ethhdr) + sizeof(struct iphdr) + sizeof(struct udphdr) + sizeof(struct aggd_hdr))

enum slot_outcome { OUT_ABSORBED, OUT_RELEASE, OUT_RESEND, OUT_DROP };

/* Refuse a packet: answer the sender with a header-only NACK (never larger than what it sent). */
static __always_inline int nack(struct xdp_md *ctx, __u8 code)
{
	void *data = (void *)(long)ctx->data, *data_end = (void *)(long)ctx->data_end;
	int delta = (int)NACK_LEN - (int)(data_end - data);

	if (delta < 0 && bpf_xdp_adjust_tail(ctx, delta))
		return XDP_DROP;
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	struct udphdr *udp = (void *)(ip + 1);
	struct aggd_hdr *h = (void *)(udp + 1);
	if ((void *)(h + 1) > data_end)
		return XDP_DROP;
	ip->tot_len = htons(sizeof(struct iphdr) + sizeof(struct udphdr) + sizeof(struct aggd_hdr));
	udp->len = htons(sizeof(struct udphdr) + sizeof(struct aggd_hdr));
	h->type = AGGD_MSG_TYPE_NACK;
	h->code = code;
	h->count = 0;
	h->strategy_version = 0;
	h->exponent = 0;
	h->flags = 0;
	h->contributors = 0;
	h->n_contrib = 0;
	h->step = 0;
	h->reserved = 0;
	address_to_sender(eth, ip, udp);
	return XDP_TX;
}

/* The strategy entry governing `round`: the newest valid one whose from_round has been reached. */
static __always_inline struct strategy_entry *strategy_for(struct job_cfg *cfg, __u32 round)
{
	struct strategy_entry *best = 0;
#pragma unroll
	for (int i = 0; i < AGGD_STRATEGY_VERSIONS; i++) {
		struct strategy_entry *e = &cfg->strategy[i];
		if (e->valid && e->from_round <= round && (!best || e->from_round >= best->from_round))
			best = e;
	}
	return best;
}

int aggd_xdp(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data, *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end || eth->h_proto != htons(ETH_P_IP))
		return XDP_PASS;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end || ip->ihl != 5 || ip->protocol != IPPROTO_UDP ||
	    (ip->frag_off & htons(0x3fff)))
		return XDP_PASS;
	struct udphdr *udp = (void *)(ip + 1);
	if ((void *)(udp + 1) > data_end || udp->dest != htons(AGGD_PORT))
		return XDP_PASS;

	/* From here on the packet is ours: it is aggregated, answered, passed up, or dropped and counted. */
	struct aggd_hdr *h = (void *)(udp + 1);
	__u32 udp_len = ntohs(udp->len);
	if ((void *)(h + 1) > data_end || udp_len < sizeof(*udp) + sizeof(*h) ||
	    (void *)udp + udp_len > data_end)
		return count_drop(NO_JOB, AGGD_DROP_REASON_TOO_SHORT);
	if (h->magic != htons(AGGD_MAGIC))
		return count_drop(NO_JOB, AGGD_DROP_REASON_BAD_MAGIC);
	if (h->version != AGGD_VERSION)
		return count_drop(NO_JOB, AGGD_DROP_REASON_BAD_VERSION);
	__u8 type = h->type;
	if (type == AGGD_MSG_TYPE_JOIN)
		return XDP_PASS; /* membership is the daemon's business */
	if (type != AGGD_MSG_TYPE_CONTRIB && type != AGGD_MSG_TYPE_REREAD)
		return count_drop(NO_JOB, AGGD_DROP_REASON_BAD_TYPE);
	__u32 payload_len = udp_len - sizeof(*udp) - sizeof(*h);
	__u32 n = ntohs(h->count);
	if (n == 0 || n > ELEMS || n * 4 > payload_len)
		return count_drop(NO_JOB, AGGD_DROP_REASON_BAD_COUNT);

	__u32 job = ntohs(h->job);
	struct job_cfg *cfg = job < AGGD_MAX_JOBS ? jobs.lookup(&job) : 0;
	if (!cfg || !cfg->active) {
		count_drop(NO_JOB, AGGD_DROP_REASON_UNKNOWN_JOB);
		return nack(ctx, AGGD_NACK_CODE_UNKNOWN_JOB);
	}
	count(job, AGGD_COUNTER_RX_PACKETS, 1);
	count(job, AGGD_COUNTER_RX_BYTES, udp_len - sizeof(*udp));
	if (h->flags & AGGD_FLAG_RETRANSMIT)
		count(job, AGGD_COUNTER_RETRANSMITS, 1);
	__u32 rank = ntohs(h->rank);
	if (rank >= cfg->world || rank >= AGGD_MAX_MEMBERS) {
		count_drop(job, AGGD_DROP_REASON_BAD_RANK);
		return nack(ctx, AGGD_NACK_CODE_NOT_MEMBER);
	}
	__u32 midx = job * AGGD_MAX_MEMBERS + rank;
	struct member *m = members.lookup(&midx);
	if (!m || !m->valid || m->ip != ip->saddr || m->port != udp->source) {
		count_drop(job, AGGD_DROP_REASON_NOT_MEMBER);
		return nack(ctx, AGGD_NACK_CODE_NOT_MEMBER);
	}
	__u32 chunk = ntohl(h->chunk);
	if (chunk >= cfg->max_chunks || cfg->n_slots == 0)
		return count_drop(job, AGGD_DROP_REASON_BAD_CHUNK);
	__u32 slot_idx = chunk % cfg->n_slots;
	if (payload_len != ELEMS * 4 || slot_idx >= cfg->kernel_slots) {
		/* The kernel cannot hold it: the daemon's user-space path serves it. */
		count(job, AGGD_COUNTER_TO_USERSPACE, 1);
		return XDP_PASS;
	}
	__u32 gidx = cfg->slot_base + slot_idx;
	struct slot *s = slots.lookup(&gidx);
	if (!s)
		return count_drop(job, AGGD_DROP_REASON_BAD_CHUNK);
	__s32 *payload = (void *)(h + 1);
	if ((void *)(payload + ELEMS) > data_end)
		return count_drop(job, AGGD_DROP_REASON_TOO_SHORT);

	__u32 round = ntohl(h->round);
	struct strategy_entry *st = strategy_for(cfg, round);
	__u16 version = st ? st->version : 0;
	__u64 key = ((__u64)round << 32) | chunk;
	__u64 bit = 1ULL << rank;
	__u64 all = cfg->all_members;
	__s16 exp_in = (__s16)ntohs(h->exponent);

	int outcome = OUT_DROP, reason = AGGD_DROP_REASON_STALE;
	__u64 out_bitmap = 0;
	__u16 out_n = 0, out_version = 0;
	__s16 out_exp = 0;
	__u8 out_flags = 0;
	__s32 ovf = 0;
	int overflowed = 0;

	bpf_spin_lock(&s->lock);
	__u32 cur = s->cur & 1;
	struct bank *b = &s->bank[cur];
	struct bank *o = &s->bank[cur ^ 1];
	struct bank *res = 0;

	if (b->state == BANK_RELEASED && b->key == key) {
		res = b;
	} else if (o->state == BANK_RELEASED && o->key == key) {
		res = o;
	} else if (type == AGGD_MSG_TYPE_REREAD) {
		reason = (key >= b->key || b->state == BANK_EMPTY) ? AGGD_DROP_REASON_NOT_READY
								    : AGGD_DROP_REASON_STALE;
	} else {
		int fresh = 0;
		if (b->state == BANK_OPEN && b->key == key) {
			if (b->bitmap & bit)
				reason = AGGD_DROP_REASON_DUPLICATE;
			else
				outcome = OUT_ABSORBED;
		} else if (b->state == BANK_EMPTY || key > b->key) {
			if (b->state == BANK_OPEN) {
				reason = AGGD_DROP_REASON_BUSY;
			} else {
				if (b->state == BANK_RELEASED) {
					cur ^= 1;
					s->cur = cur;
					b = o;
				}
				b->key = key;
				b->bitmap = 0;
				b->n_contrib = 0;
				b->flags = 0;
				b->state = BANK_OPEN;
				b->version = version;
				fresh = 1;
				outcome = OUT_ABSORBED;
			}
		}
		if (outcome == OUT_ABSORBED) {
			__u64 bm = b->bitmap | bit;
			int release = (bm & all) == all;
			__s32 *v = b->values;
			if (fresh) {
				b->exponent = exp_in;
				for (int i = 0; i < ELEMS; i++)
					v[i] = payload[i];
			} else {
				int se = b->exponent, sa = 0, sb = 0;
				if (exp_in < se) {
					sa = clamp_shift(se - exp_in);
					b->exponent = exp_in;
				} else {
					sb = clamp_shift(exp_in - se);
				}
				if (sa == 0 && sb == 0) {
					if (release) {
						for (int i = 0; i < ELEMS; i++) {
							__s32 x = v[i], y = payload[i];
							__s32 z = (__s32)((__u32)x + (__u32)y);
							ovf |= (x ^ z) & (y ^ z);
							v[i] = z;
							payload[i] = z;
						}
					} else {
						for (int i = 0; i < ELEMS; i++) {
							__s32 x = v[i], y = payload[i];
							__s32 z = (__s32)((__u32)x + (__u32)y);
							ovf |= (x ^ z) & (y ^ z);
							v[i] = z;
						}
					}
				} else {
					for (int i = 0; i < ELEMS; i++) {
						__s32 x = v[i] >> sa, y = payload[i] >> sb;
						__s32 z = (__s32)((__u32)x + (__u32)y);
						ovf |= (x ^ z) & (y ^ z);
						v[i] = z;
					}
					if (release) /* rare: exponents differ on the releasing packet */
						res = b;
				}
			}
			if (ovf < 0)
				b->flags |= AGGD_FLAG_OVERFLOW;
			overflowed = ovf < 0;
			b->bitmap = bm;
			b->n_contrib++;
			if (release) {
				b->state = BANK_RELEASED;
				outcome = OUT_RELEASE; /* fresh (world of one): the payload is the sum */
			}
			out_bitmap = b->bitmap;
			out_n = b->n_contrib;
			out_exp = b->exponent;
			out_flags = b->flags;
			out_version = b->version;
		}
	}
	if (res) {
		/* Write a stored result into the packet: a re-send, or a release whose sum was not
		 * produced in the packet by the adding loop. */
		__s32 *v = res->values;
		for (int i = 0; i < ELEMS; i++)
			payload[i] = v[i];
		if (outcome != OUT_RELEASE)
			outcome = OUT_RESEND;
		out_bitmap = res->bitmap;
		out_n = res->n_contrib;
		out_exp = res->exponent;
		out_flags = res->flags;
		out_version = res->version;
	}
	bpf_spin_unlock(&s->lock);

	/* if/else, not switch: clang may turn a switch into a jump table BPF cannot run. */
	if (outcome == OUT_DROP)
		return count_drop(job, reason);
	if (outcome == OUT_ABSORBED || outcome == OUT_RELEASE) {
		count(job, AGGD_COUNTER_CONTRIBUTIONS, 1);
		count(job, AGGD_COUNTER_ELEMENTS, n);
		if (overflowed)
			count(job, AGGD_COUNTER_OVERFLOWS, 1);
	}
	if (outcome == OUT_ABSORBED)
		return XDP_DROP;
	if (outcome == OUT_RELEASE) {
		count(job, AGGD_COUNTER_RELEASED, 1);
	} else {
		count(job, AGGD_COUNTER_REREADS, 1);
		out_flags |= AGGD_FLAG_REREAD;
	}
	h->type = AGGD_MSG_TYPE_RESULT;
	h->rank = htons(0xffff);
	h->exponent = htons((__u16)out_exp);
	h->flags = out_flags;
	h->code = 0;
	h->strategy_version = htons(out_version);
	h->contributors = __builtin_bswap64(out_bitmap);
	h->n_contrib = htons(out_n);
	h->step = 0;
	if (outcome == OUT_RESEND)
		address_to_sender(eth, ip, udp); /* only the worker that lost it needs it again */
	else
		address_to_group(eth, ip, udp, cfg);
	return XDP_TX;
}
