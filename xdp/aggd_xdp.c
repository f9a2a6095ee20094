/* aggd's XDP data plane: sums workers' int32 gradient chunks into per-job slots and multicasts the
 * released sum back to the job's group. Wire format: aggd_proto.h (generated), semantics:
 * docs/protocol.md. Compiled at run time by bcc with -DELEMS, -DTOTAL_SLOTS, -DAGGD_PORT. */
/* The uapi headers, not the kernel's own <linux/ip.h> and the like: those pull in most of the
 * kernel's headers (skbuff.h...) and made up half of bcc's compile time, 1 s of 2, at every load. */
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/in.h>
#include <uapi/linux/udp.h>

#ifndef AGGD_PORT
#define AGGD_PORT 47000
#endif

#include "aggd_helpers.h"
#include "aggd_lanes.h"

/* With -DAGGD_FRAGS the program is loaded with BPF_F_XDP_HAS_FRAGS (XDP multi-buffer), so native
 * XDP takes frames larger than a page (MTU 9000). Then data..data_end covers only the first buffer:
 * the headers stay there, and the payload is copied into this per-CPU buffer before the loops and
 * back into the frame after them (bpf_xdp_load_bytes / bpf_xdp_store_bytes). Without it the loops
 * work on the packet in place. */
/* Jobs of int8 and int16 contributions (docs/protocol.md, "Precision") are served here up to native
 * XDP's largest packet (in a jumbo build their loops would take the program
 * past the verifier's limit, and the daemon gives such jobs no kernel slots). An int16 job's packet
 * carries ELEMS values, added two to a lane; an int8 job's carries 2 * ELEMS (per_lane), added four
 * to a lane: each in half of the bank's lanes (aggd_lanes.h, "Packed lanes"), loops of their own.
 * Every result is 4 * ELEMS bytes (an int16 job's int32 values, an int8 job's int16 values), wider
 * than the contribution (2 * ELEMS bytes either way): a frame without room for the result
 * grows to hold it, in a frame of one page. A multi-buffer frame can grow only into its last
 * buffer's tailroom, too little for the result of a packet that needed several: there a narrow
 * frame is taken only with room, and one without goes up (the daemon re-runs it here with the room
 * added). */
#define AGGD_NARROW (ELEMS <= AGGD_NATIVE_MAX_ELEMENTS)
#ifdef AGGD_FRAGS
#define AGGD_NARROW_GROWS 0
#else
#define AGGD_NARROW_GROWS AGGD_NARROW
#endif
/* Payload bytes of a contribution of `prec` without room, of every result, and what a narrow job's
 * frame grows by from the one to the other. */
#define CONTRIB_BYTES(prec) (ELEMS * per_lane(prec) * contrib_width(prec))
#define RESULT_BYTES (ELEMS * 4)
#define RESULT_GROWTH(prec) (RESULT_BYTES - CONTRIB_BYTES(prec))
/* All ones for an int8 job's quad lanes, or an int16 job's dual lanes (lane_values below), else 0;
 * from the precision's bits, not a comparison, which clang turns into a branch (the verifier would
 * walk the loops that use it once each way). */
_Static_assert(AGGD_PRECISION_INT32 == 0 && AGGD_PRECISION_INT16 == 1 && AGGD_PRECISION_INT8 == 2 &&
	       AGGD_PRECISION__COUNT == 3, "int8 is the precision below 4 with bit 1 alone, int16 bit 0");
static __always_inline __s64 quad_mask(__u8 prec)
{
	return AGGD_NARROW ? -(__s64)((prec >> 1) & ~prec & 1) : 0;
}

static __always_inline __s64 dual_mask(__u8 prec)
{
	return AGGD_NARROW ? -(__s64)(prec & ~(prec >> 1) & 1) : 0;
}
/* An int8 job's quad lane keeps each value's sum exact in a 16-bit field (added as value + 128,
 * 0..255) while it holds at most 257 terms: up to AGGD_INT8_MAX_CONTRIBUTIONS (aggd_proto.h: 256)
 * contributions, and a result of more is flagged OVERFLOW whatever its values. The sum itself then
 * fits int16 (-32768 included, which results flag). */
_Static_assert(AGGD_INT8_MAX_CONTRIBUTIONS * 255 < 65536, "an int8 field's biased sum fits 16 bits");
/* An int16 job's dual lane keeps each sum exact in a 32-bit field (value + 32768, 0..65535) while it
 * holds at most 65537 terms. A bank takes one contribution a member a wbsp step (eight steps), and
 * late ones carried as many again at most (aggd.core.model, rule 4), far fewer. */
_Static_assert(AGGD_MAX_MEMBERS * 8 * 2 * 65535ULL < (1ULL << 32), "an int16 field's biased sum fits 32 bits");

/* Per-member bounds (docs/protocol.md, "Bounds") are checked here up to native XDP's largest packet;
 * in a jumbo build their loop would take the program past the verifier's limit, and the daemon
 * gives bounded jobs no kernel slots. */
#define AGGD_BOUNDS (ELEMS <= AGGD_NATIVE_MAX_ELEMENTS)

#if defined(AGGD_FRAGS) || AGGD_NARROW
struct payload_copy {
	__u32 v[ELEMS + (ELEMS & 1)]; /* an int8 job's quad lanes (aggd_lanes.h) take a whole u64 each */
};
BPF_PERCPU_ARRAY(payload_copy, struct payload_copy, 1);
#endif

/* -DAGGD_MAPS_ONLY builds the maps above and nothing below: a load that finds the program's
 * instructions compiled before (aggd/dataplane/xdp/program_cache.py) needs only its maps, and
 * clang's work is in the program. */
#ifndef AGGD_MAPS_ONLY
#ifdef AGGD_FRAGS
#define FRAME_LEN(ctx, data, data_end) ((__u32)bpf_xdp_get_buff_len(ctx))
#else
#define FRAME_LEN(ctx, data, data_end) ((__u32)((data_end) - (data)))
#endif
#define L4_OFF (sizeof(struct ethhdr) + sizeof(struct iphdr))
#define PAYLOAD_OFF (L4_OFF + sizeof(struct udphdr) + sizeof(struct aggd_hdr))

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

/* Once the job is known its counters are looked up once and bumped in place. */
static __always_inline int drop_in(struct job_stats *st, __u32 reason)
{
	if (reason < AGGD_DROP_REASON__COUNT)
		st->drop[reason]++;
	return XDP_DROP;
}

#define NACK_LEN (sizeof(struct ethhdr) + sizeof(struct iphdr) + sizeof(struct udphdr) + sizeof(struct aggd_hdr))


/* Refuse a packet: answer the sender with a header-only NACK (never larger than what it sent). */
static __always_inline int nack(struct xdp_md *ctx, __u8 code)
{
	void *data = (void *)(long)ctx->data, *data_end = (void *)(long)ctx->data_end;
	int delta = (int)NACK_LEN - (int)FRAME_LEN(ctx, data, data_end);

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
	h->strategy = 0;
	h->param = 0;
	h->skip = 0;
	address_to_sender(eth, ip, udp);
	return XDP_TX;
}

/* The strategy entry governing `round`: the newest valid one whose from_round has been reached. */
static __always_inline struct strategy_entry *strategy_for(struct job_cfg *cfg, __u32 round)
{
	/* The newest row whose from_round has been reached (ties: the higher version); before any
	 * row's from_round, the earliest row (as aggd.strategy.StrategyTable.governing). */
	struct strategy_entry *best = 0, *first = 0;
#pragma unroll
	for (int i = 0; i < AGGD_STRATEGY_VERSIONS; i++) {
		struct strategy_entry *e = &cfg->strategy[i];
		if (!e->valid)
			continue;
		if (e->from_round <= round &&
		    (!best || e->from_round > best->from_round ||
		     (e->from_round == best->from_round && e->version > best->version)))
			best = e;
		if (!first || e->from_round < first->from_round ||
		    (e->from_round == first->from_round && e->version > first->version))
			first = e;
	}
	return best ? best : first;
}

static __always_inline __u64 clock_now(void)
{
	__u32 zero = 0;
	__u64 *frozen = clock.lookup(&zero);
	return frozen && *frozen ? *frozen : bpf_ktime_get_ns();
}

/* May a new round open? (docs/protocol.md, Strategies, rule 3) */
static __always_inline int admits(struct strategy_entry *e, __u32 round, int nopen, int nhold,
				  __u32 min_open_round)
{
	__u8 kind = e ? e->kind : AGGD_STRATEGY_KIND_SYNC;
	if (kind == AGGD_STRATEGY_KIND_SSP)
		return nopen == 0 || (__u64)min_open_round + e->param >= round;
	if (kind == AGGD_STRATEGY_KIND_ASYNC)
		return nopen + nhold < NBANKS - 1; /* keep one released bank for re-reads */
	return nopen == 0;
}

/* A quorum round that holds the world's carries takes no more: with its members' own it then
 * holds the 2 * world terms they quantise for (Bank.carried, docs/protocol.md rule 4). */
static __always_inline int target_full(struct bank *t, struct job_cfg *cfg)
{
	return t->kind == AGGD_STRATEGY_KIND_QUORUM && t->carried >= cfg->world;
}

static __always_inline void open_bank(struct bank *b, __u64 key, struct strategy_entry *e, __u64 now,
				      __u8 holding, __u16 skip, __u16 count)
{
	b->holding = holding;
	b->skip = skip;
	b->count = count;
	b->key = key;
	b->state = BANK_OPEN;
	b->bitmap = 0;
	b->late = 0;
	b->held = 0;
	b->n_contrib = 0;
	b->carried = 0;
	b->flags = 0;
	b->unannounced = 0;
	b->t_first = now;
	b->version = e ? e->version : 0;
	b->kind = e ? e->kind : AGGD_STRATEGY_KIND_SYNC;
	b->param = e ? e->param : 0;
	b->timeout_us = e ? e->timeout_us : 0;
	__u64 *steps = (__u64 *)b->steps;
#pragma unroll
	for (int i = 0; i < AGGD_MAX_MEMBERS / 8; i++)
		steps[i] = 0;
}

/* The kernel slot of `chunk`, or NULL and *action: dropped bad_chunk, or passed up (a slot beyond
 * the job's kernel slots, or a payload of another size: the daemon's user-space path serves it). */
/* kind >> 1 == 1 names exactly the kinds whose released banks are kept (Slot.reusable) */
_Static_assert(AGGD_STRATEGY_KIND_SSP == 2 && AGGD_STRATEGY_KIND_ASYNC == 3 && AGGD_STRATEGY_KIND_QUORUM < 2 &&
	       AGGD_STRATEGY_KIND_SYNC < 2 && AGGD_STRATEGY_KIND_WBSP > 3, "kept kinds are 2 and 3");

/* 1 if x is 0, else 0, without a branch */
static __always_inline __u64 is_zero(__u64 x)
{
	return ((x | -x) >> 63) ^ 1;
}

/* Is a strategy kind one whose members run rounds apart (ssp, async: 2 and 3), so that its
 * released banks are kept for re-reads and its refused keys go first? (KEPT_KINDS; no branch) */
static __always_inline __u64 kept_kind(__u64 kind)
{
	return is_zero((kind >> 1) ^ 1);
}

/* Does the entry (NULL: sync) govern its rounds by quorum? */
static __always_inline int quorum_kind(struct strategy_entry *e)
{
	return e && e->kind == AGGD_STRATEGY_KIND_QUORUM;
}

/* Slot.free_bank's choice for a new round: an empty bank, else the oldest released one (with
 * `quorum` governing the round, whether or not it is kept; -1: none) */
static __always_inline int free_bank(volatile struct scratch *sc, int quorum)
{
	return sc->ifree >= 0 ? sc->ifree : (quorum ? sc->irel_old_q : sc->irel_old);
}

/* A contribution at exponent exp_in into bank b at exponent se (they differ): both are aligned to the
 * coarser scale, the smaller exponent, which the bank takes. The finer operand's true values are
 * shifted right (floor, exact as docs/protocol.md says): the sum's by sa (at most 63) or the
 * contribution's by sb (at most 31), the other 0. Without a branch, so that the loops after it are
 * walked once. */
static __always_inline void align_shifts(struct bank *b, __s16 exp_in, int se, int *sa, int *sb)
{
	__s64 d = (__s64)exp_in - se, neg = d >> 63;
	asm volatile("" : "+r"(neg));
	*sa = (int)min_nobranch(-d & neg, 63);
	*sb = (int)min_nobranch(d & ~neg, 31);
	b->exponent = (__s16)(se + (d & neg));
}

#if AGGD_NARROW
/* A narrow contribution `q` (packed lanes, aggd_lanes.h) into bank `b` (index `add`) at the bank's
 * exponent, or into a fresh bank: a layout's constants as its loops take them (one contribution's
 * bias, the fields' top bits, a one in each field). */
static __always_inline void add_packed(struct bank *b, __u64 *q, volatile struct scratch *sc, int add,
				       __s16 exp_in, __u64 bias1, __u64 top, __u64 ones)
{
	__u64 *v = b->values;
	if (sc->add_fresh) {
		b->exponent = exp_in;
		b->bias = bias1;
		if (sc->out == add) { /* a lone contribution is its own sum */
			sc->written_high = packed_set_send(v, q, bias1, top, ones);
			sc->written = 1;
		} else {
			packed_set(v, q);
		}
	} else if (sc->out != add) {
		b->bias += bias1;
		packed_add(v, q);
	} else {
		b->bias += bias1;
		sc->written_high = packed_add_send(v, q, b->bias, top, ones);
		sc->written = 1;
	}
}
#endif

/* 1 if a < b (unsigned), else 0, without a branch: the borrow out of a - b */
static __always_inline __u64 below(__u64 a, __u64 b)
{
	return ((~a & b) | (~(a ^ b) & (a - b))) >> 63;
}

/* 1 if `key` must wait for the slot's pending key (Slot.pending: `pending` is it plus one, 0 for
 * none): it is above it. Without a branch, as the decisions below that use it. */
static __always_inline __u64 after_pending(__u64 key, __u64 pending)
{
	return (1 ^ is_zero(pending)) & (1 ^ below(key, pending));
}

static __always_inline struct slot *kernel_slot(struct job_cfg *cfg, struct job_stats *jst, __u32 chunk,
						__u32 payload_len, int *action)
{
	if (chunk >= cfg->max_chunks || cfg->n_slots == 0) {
		*action = drop_in(jst, AGGD_DROP_REASON_BAD_CHUNK);
		return 0;
	}
	__u32 slot_idx = chunk % cfg->n_slots;
	/* exactly a packet of values (ELEMS, an int8 job's 2 * ELEMS); a narrow one may carry room for
	 * its result (docs/protocol.md, "Precision") */
	int sized = (payload_len == CONTRIB_BYTES(cfg->precision) &&
		     (AGGD_NARROW_GROWS || cfg->precision == AGGD_PRECISION_INT32))
#if AGGD_NARROW
		    || (cfg->precision != AGGD_PRECISION_INT32 && payload_len == RESULT_BYTES)
#endif
		;
	if (!sized || slot_idx >= cfg->kernel_slots
#if !AGGD_NARROW
	    || cfg->precision != AGGD_PRECISION_INT32
#endif
	) {
		jst->counter[AGGD_COUNTER_TO_USERSPACE] += 1;
		*action = XDP_PASS;
		return 0;
	}
	__u32 gidx = cfg->slot_base + slot_idx;
	struct slot *s = slots.lookup(&gidx);
	if (!s)
		*action = drop_in(jst, AGGD_DROP_REASON_BAD_CHUNK);
	return s;
}

/* The payload the loops work on (ELEMS values): the packet's own in a frame of one page, else a
 * per-CPU copy of it (`load`: filled from the frame); NULL and *action if the frame is short. */
static __always_inline __u32 *payload_of(struct xdp_md *ctx, struct aggd_hdr *h, void *data_end, int load,
					 struct job_stats *jst, int *action)
{
#ifdef AGGD_FRAGS
	__u32 zero_key = 0;
	__u32 *payload = (void *)payload_copy.lookup(&zero_key);
	if (!payload) {
		*action = XDP_ABORTED;
		return 0;
	}
	if (load && bpf_xdp_load_bytes(ctx, PAYLOAD_OFF, payload, ELEMS * 4)) {
		*action = drop_in(jst, AGGD_DROP_REASON_TOO_SHORT);
		return 0;
	}
#else
	__u32 *payload = (void *)(h + 1);
	if ((void *)(payload + ELEMS) > data_end) {
		*action = drop_in(jst, AGGD_DROP_REASON_TOO_SHORT);
		return 0;
	}
#endif
	return payload;
}

#if AGGD_NARROW
/* A narrow contribution's values spread in the per-CPU buffer, where the loops work on them (`load`
 * 0, a re-read: nothing to read): an int8 job's to quad lanes, four values in 16-bit fields, an int16
 * job's to dual lanes, two in 32-bit fields (aggd_lanes.h, "Packed lanes"). Both are 2 * ELEMS bytes.
 * Spread in place from the last lane down: a lane's bytes never cover a byte still to be read (lane
 * j reads bytes 4j..4j+3 and takes 8j..8j+7). */
static __always_inline __u32 *narrow_in(struct xdp_md *ctx, __u8 prec, int load, struct job_stats *jst,
					int *action)
{
	__u32 zero_key = 0;
	__u32 *buf = (void *)payload_copy.lookup(&zero_key);
	if (!buf) {
		*action = XDP_ABORTED;
		return 0;
	}
	if (!load)
		return buf;
	if (bpf_xdp_load_bytes(ctx, PAYLOAD_OFF, buf, ELEMS * 2)) {
		*action = drop_in(jst, AGGD_DROP_REASON_TOO_SHORT);
		return 0;
	}
	__u64 *q = (void *)buf;
	if (ELEMS & 1)
		((__u16 *)buf)[ELEMS] = 0; /* the last lane's values past the packet: zeros */
	if (prec == AGGD_PRECISION_INT8) {
		_Pragma("clang loop unroll_count(8)")
		for (int j = PACKED_LANES - 1; j >= 0; j--)
			q[j] = q8_spread(buf[j]);
	} else {
		_Pragma("clang loop unroll_count(8)")
		for (int j = PACKED_LANES - 1; j >= 0; j--)
			q[j] = d16_spread(buf[j]);
	}
	return buf;
}

/* A narrow job's result (the per-CPU buffer's, as the packed loops left it: an int16 job's int32
 * values, an int8 job's int16 values) into the frame, 4 * ELEMS bytes. Returns -1 if the frame could not take it. */
static __always_inline int narrow_out(struct xdp_md *ctx)
{
	__u32 zero_key = 0;
	__u32 *buf = (void *)payload_copy.lookup(&zero_key);
	if (!buf)
		return -1;
	if (bpf_xdp_store_bytes(ctx, PAYLOAD_OFF, buf, RESULT_BYTES))
		return -1;
	return 0;
}
#endif

#if AGGD_BOUNDS
/* The values of a contribution's 32-bit word x: with `quad` and `dual` 0 (an int32 job's packet) its
 * int32 and 0; with `quad` all ones (an int8 job) the two 16-bit fields of a quad lane, each v + 128;
 * with `dual` all ones (an int16 job) a dual lane's 32-bit field, v + 32768, and 0 (aggd_lanes.h).
 * Without a branch: the loops using it serve every precision in one walk of the verifier. */
static __always_inline void lane_values(__u32 x, __s64 quad, __s64 dual, __s64 *lo, __s64 *hi)
{
	*lo = ((__s64)(__s32)x & ~(quad | dual)) | (((__s64)(x & 0xFFFF) - 128) & quad) |
	      (((__s64)x - 32768) & dual);
	*hi = ((__s64)(x >> 16) - 128) & quad;
}

/* Whether a contribution's values (exponent `exp`) go beyond its job's bound: a |q| over
 * bound_mant << (bound_exp + exp), one shift (a shift of 40 or more, or a limit of 2**32 or more,
 * lets any int32 through). The values are the words', or with `quad` or `dual` all ones a narrow
 * job's fields (lane_values). The loop has no branch (the verifier walks it once a path): limit - |q|
 * is negative exactly when |q| is beyond. */
static __always_inline int beyond_bound(struct job_cfg *cfg, __u32 *p, __s16 exp, __s64 quad, __s64 dual)
{
	__s32 s = (__s32)cfg->bound_exp + exp;
	if (s >= 40)
		return 0;
	__u64 limit;
	if (s >= 0)
		limit = (__u64)cfg->bound_mant << (s & 63);
	else if (s > -64)
		limit = (__u64)cfg->bound_mant >> ((-s) & 63);
	else
		limit = 0;
	if (limit >> 32)
		return 0;
	__u64 under = 0;
	_Pragma("clang loop unroll_count(8)")
	for (int i = 0; i < ELEMS; i++) {
		__s64 lo, hi;
		lane_values(p[i], quad, dual, &lo, &hi);
		under |= (limit - abs64(lo)) | (limit - abs64(hi));
		LANE_DONE();
	}
	return under >> 63;
}

/* Whether a contribution's values (exponent `exp`, `quad` and `dual` as above) go beyond its job's bound on
 * their L2 norm: the sum of q**2 over norm_mant**2 shifted by 2 * (norm_exp + exp), floored; no
 * limit where that is 2**63 or more (aggd.core.model.Bound). The limit is below 2**63, so a sum
 * that reaches it is beyond: its top bit is kept in `over` and cleared, and with terms below 2**63
 * the sum never wraps (no branch in the loop, as above). */
static __always_inline int beyond_norm(struct job_cfg *cfg, __u32 *p, __s16 exp, __s64 quad, __s64 dual)
{
	__s32 s = 2 * ((__s32)cfg->norm_exp + exp);
	__u64 m2 = (__u64)cfg->norm_mant * cfg->norm_mant;
	__u64 limit;
	if (s >= 63)
		return 0;
	if (s >= 0) {
		if (m2 >> ((63 - s) & 63))
			return 0;
		limit = m2 << (s & 63);
	} else if (s > -64) {
		limit = m2 >> ((-s) & 63);
	} else {
		limit = 0;
	}
	__u64 sum = 0, over = 0;
	_Pragma("clang loop unroll_count(8)")
	for (int i = 0; i < ELEMS; i++) {
		__s64 lo, hi;
		lane_values(p[i], quad, dual, &lo, &hi);
		/* at most 2**62 (hi is 0 unless both are int8) */
		sum += (__u64)(lo * lo) + (__u64)(hi * hi);
		over |= sum;
		sum &= ~(1ULL << 63);
		LANE_DONE();
	}
	return (over >> 63) || sum > limit;
}
#endif

/* A rack job's upper results (docs/protocol.md, "Two levels") are relayed here up to native XDP's
 * largest packet: in a jumbo build (generic mode only) the relay's payload loop would take the
 * program past the verifier's million instructions, so there they go to the daemon, which gives
 * rack jobs no kernel slots (XdpDataPlane.relays). */
#define AGGD_RELAYS (ELEMS <= AGGD_NATIVE_MAX_ELEMENTS)

/* The rack job a result is an upper result of, or -1. */
static __always_inline int rack_of(struct iphdr *ip, struct udphdr *udp, struct aggd_hdr *h)
{
	struct upstream_key k = {.ip = ip->saddr, .port = udp->source, .job = ntohs(HDR(h, __be16, job))};
	__u32 *job = upstreams.lookup(&k);
	return job ? (int)*job : -1;
}

/* An upper aggregator's result for rack job `job`: kept in the forwarded round's bank (released
 * from then on) and sent to the rack's group; again to the group for a round released already. */
static __always_inline int relay(struct xdp_md *ctx, void *data, void *data_end, struct ethhdr *eth,
				 struct iphdr *ip, struct udphdr *udp, struct aggd_hdr *h, __u32 job)
{
	__u32 udp_len = ntohs(udp->len);
	if (udp_len < sizeof(*udp) + sizeof(*h) || L4_OFF + udp_len > FRAME_LEN(ctx, data, data_end))
		return count_drop(NO_JOB, AGGD_DROP_REASON_TOO_SHORT);
	__u32 payload_len = udp_len - sizeof(*udp) - sizeof(*h);
	__u32 n = ntohs(HDR(h, __be16, count));
	if (n == 0 || n > ELEMS * per_lane(h->code) || n * result_width(h->code) > payload_len)
		return count_drop(NO_JOB, AGGD_DROP_REASON_BAD_COUNT);
	struct job_cfg *cfg = job < AGGD_MAX_JOBS ? jobs.lookup(&job) : 0;
	if (!cfg || !cfg->active || cfg->upstream != 2)
		return XDP_PASS;
	struct job_stats *jst = stats_of(job);
	if (!jst)
		return XDP_ABORTED;
	jst->counter[AGGD_COUNTER_RX_PACKETS] += 1;
	jst->counter[AGGD_COUNTER_RX_BYTES] += udp_len - sizeof(*udp);
	__u32 chunk = ntohl(HDR(h, __be32, chunk));
	int action = XDP_PASS;
	if (h->code != cfg->precision)
		return drop_in(jst, AGGD_DROP_REASON_BAD_PRECISION);
	struct slot *s = kernel_slot(cfg, jst, chunk, payload_len, &action);
	if (!s)
		return action;
	__u32 *payload = payload_of(ctx, h, data_end, 1, jst, &action);
	if (!payload)
		return action;
	__u64 key = ((__u64)ntohl(HDR(h, __be32, round)) << 32) | chunk;
	__u16 n_in = ntohs(HDR(h, __be16, n_contrib));
	__s16 exp_in = (__s16)ntohs(HDR(h, __be16, exponent));
	__u8 flags_in = h->flags;
	int found = -1, fresh = 0;
	__u64 bitmap = 0;
	__u16 n_out = 0, version = 0;
	__s16 exp_out = 0;
	__u8 flags_out = 0, kind = 0, param = 0;

	bpf_spin_lock(&s->lock);
#pragma unroll
	for (int i = 0; i < NBANKS; i++) {
		struct bank *b = &s->bank[i];
		if (found < 0 && b->key == key && !b->holding &&
		    (b->state == BANK_FORWARDED || b->state == BANK_RELEASED))
			found = i;
	}
	/* Read back from the scratch: the verifier then knows only that it is a bank index, and walks
	 * the payload loop below once, not once for each bank the unrolled scan may have found. */
	volatile struct scratch *sc = &s->sc;
	sc->ik = found;
	found = sc->ik;
	if (found >= 0) {
		/* one payload loop, outside the bank scan: the verifier walks it once, not once a bank
		 * (at 8192 values a packet the program is near its limit of a million instructions) */
		struct bank *b = &s->bank[found & (NBANKS - 1)];
		if (b->state == BANK_FORWARDED) {
			lanes_set(b->values, payload); /* the upper sum is the round's result */
			b->bias = SUM_BIAS;
			b->exponent = exp_in;
			b->n_contrib = n_in;
			b->flags |= flags_in & (AGGD_FLAG_OVERFLOW | AGGD_FLAG_CARRIED);
			b->state = BANK_RELEASED;
			fresh = 1;
		}
		bitmap = b->bitmap;
		n_out = b->n_contrib;
		exp_out = b->exponent;
		flags_out = b->flags;
		version = b->version;
		kind = b->kind;
		param = b->param;
	}
	bpf_spin_unlock(&s->lock);
	if (found >= 0 && !fresh) {
		/* An upper result of a round relayed before (the answer to a re-send; under async a newer
		 * running sum, or the round's release once a running sum was relayed) goes on as it came:
		 * its values with its own exponent, n_contrib and flags, which the bank's would mislabel. */
		n_out = n_in;
		exp_out = exp_in;
		flags_out = (flags_out & ~(AGGD_FLAG_OVERFLOW | AGGD_FLAG_CARRIED)) |
			    (flags_in & (AGGD_FLAG_OVERFLOW | AGGD_FLAG_CARRIED));
	}

	if (found < 0)
		return drop_in(jst, AGGD_DROP_REASON_STALE);
	if (fresh)
		jst->counter[AGGD_COUNTER_RELEASED] += 1;
	jst->counter[AGGD_COUNTER_RELAYED] += 1;
	if (flags_out & AGGD_FLAG_OVERFLOW)
		jst->counter[AGGD_COUNTER_OVERFLOWS] += 1;
	HDR(h, __be16, job) = htons((__u16)job);
	write_result(h, key, version, exp_out, flags_out, bitmap, n_out, kind, param);
	address_from_rack(eth, ip, udp, cfg, cfg->group_mac, cfg->group_ip, cfg->result_port);
	return XDP_TX;
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
	if ((void *)(udp + 1) > data_end)
		return XDP_PASS;
	if (udp->dest != htons(AGGD_PORT)) {
		/* an upper aggregator's result to a rack job comes to its group, on another port */
		struct aggd_hdr *uh = (void *)(udp + 1);
		int rack;
		if ((void *)(uh + 1) > data_end || HDR(uh, __be16, magic) != htons(AGGD_MAGIC) ||
		    uh->version != AGGD_VERSION || uh->type != AGGD_MSG_TYPE_RESULT || (rack = rack_of(ip, udp, uh)) < 0)
			return XDP_PASS;
#if AGGD_RELAYS
		return relay(ctx, data, data_end, eth, ip, udp, uh, (__u32)rack);
#else
		return XDP_PASS;
#endif
	}
	__u32 zero_key = 0;
	struct self_addr *me = self_addr.lookup(&zero_key);
	if (me && me->set && !(eth->h_dest[0] & 1) && !mac_equal(eth->h_dest, me->mac))
		return XDP_PASS; /* another host's frame, flooded to us: the stack drops it */

	/* From here on the packet is ours: it is aggregated, answered, passed up, or dropped and counted. */
	struct aggd_hdr *h = (void *)(udp + 1);
	__u32 udp_len = ntohs(udp->len);
	if ((void *)(h + 1) > data_end || udp_len < sizeof(*udp) + sizeof(*h) ||
	    L4_OFF + udp_len > FRAME_LEN(ctx, data, data_end))
		return count_drop(NO_JOB, AGGD_DROP_REASON_TOO_SHORT);
	if (HDR(h, __be16, magic) != htons(AGGD_MAGIC))
		return count_drop(NO_JOB, AGGD_DROP_REASON_BAD_MAGIC);
	if (h->version != AGGD_VERSION)
		return count_drop(NO_JOB, AGGD_DROP_REASON_BAD_VERSION);
	__u8 type = h->type;
	if (type == AGGD_MSG_TYPE_RESULT) {
		/* a rack job's upper result (re-sent to our port); any other the daemon refuses */
		int rack = rack_of(ip, udp, h);
#if AGGD_RELAYS
		return rack < 0 ? XDP_PASS : relay(ctx, data, data_end, eth, ip, udp, h, (__u32)rack);
#else
		return XDP_PASS;
#endif
	}
	if (type == AGGD_MSG_TYPE_JOIN || type == AGGD_MSG_TYPE_JOIN_ACK || type == AGGD_MSG_TYPE_SHARDS)
		return XDP_PASS; /* membership and shard maps are the daemon's business */
	if (type == AGGD_MSG_TYPE_NACK && rack_of(ip, udp, h) >= 0)
		return XDP_PASS; /* an upper aggregator refusing a rack job's sum: the daemon joins it again */
	if (type != AGGD_MSG_TYPE_CONTRIB && type != AGGD_MSG_TYPE_REREAD)
		return count_drop(NO_JOB, AGGD_DROP_REASON_BAD_TYPE);
	__u32 payload_len = udp_len - sizeof(*udp) - sizeof(*h);
	__u32 n = ntohs(HDR(h, __be16, count));
	/* values that carry data: up to a packet's (an int8 job's 2 * ELEMS), within the payload */
	if (n == 0 || n > ELEMS * per_lane(h->code) || n * contrib_width(h->code) > payload_len)
		return count_drop(NO_JOB, AGGD_DROP_REASON_BAD_COUNT);

	__u32 job = ntohs(HDR(h, __be16, job));
	struct job_cfg *cfg = job < AGGD_MAX_JOBS ? jobs.lookup(&job) : 0;
	if (!cfg || !cfg->active) {
		count_drop(NO_JOB, AGGD_DROP_REASON_UNKNOWN_JOB);
		return nack(ctx, AGGD_NACK_CODE_UNKNOWN_JOB);
	}
	struct job_stats *jst = stats_of(job);
	if (!jst)
		return XDP_ABORTED;
	jst->counter[AGGD_COUNTER_RX_PACKETS] += 1;
	jst->counter[AGGD_COUNTER_RX_BYTES] += udp_len - sizeof(*udp);
	if (h->flags & AGGD_FLAG_RETRANSMIT)
		jst->counter[AGGD_COUNTER_RETRANSMITS] += 1;
	__u32 rank = ntohs(HDR(h, __be16, rank));
	if (rank >= cfg->world || rank >= AGGD_MAX_MEMBERS) {
		drop_in(jst, AGGD_DROP_REASON_BAD_RANK);
		return nack(ctx, AGGD_NACK_CODE_NOT_MEMBER);
	}
	__u32 midx = job * AGGD_MAX_MEMBERS + rank;
	struct member *m = members.lookup(&midx);
	if (!m || !m->valid || m->ip != ip->saddr || m->port != udp->source) {
		drop_in(jst, AGGD_DROP_REASON_NOT_MEMBER);
		return nack(ctx, AGGD_NACK_CODE_NOT_MEMBER);
	}
	/* A forged source address without the member's tag: dropped, never NACKed (a NACK would go
	 * to the real member). */
	if (__builtin_bswap64(HDR(h, __be64, contributors)) != m->tag)
		return drop_in(jst, AGGD_DROP_REASON_BAD_TAG);
	if (h->code != cfg->precision)
		return drop_in(jst, AGGD_DROP_REASON_BAD_PRECISION);
	__u32 chunk = ntohl(HDR(h, __be32, chunk));
	int action = XDP_PASS;
	struct slot *s = kernel_slot(cfg, jst, chunk, payload_len, &action);
	if (!s)
		return action;
	__u8 prec = cfg->precision;
	__s32 *payload;
#if AGGD_NARROW
	if (prec != AGGD_PRECISION_INT32) {
		/* The result is wider than the contribution: the frame grows to its size before any
		 * state changes, unless the sender gave it the room (JOIN_ACK `room`). A frame that can
		 * not grow (a small skb on native veth) goes up, and the daemon runs it through this
		 * program again on a buffer that has the room (BPF_PROG_TEST_RUN). */
		if (AGGD_NARROW_GROWS && payload_len == CONTRIB_BYTES(prec) &&
		    bpf_xdp_adjust_tail(ctx, RESULT_GROWTH(prec))) {
			jst->counter[AGGD_COUNTER_TO_USERSPACE] += 1;
			return XDP_PASS;
		}
		data = (void *)(long)ctx->data;
		data_end = (void *)(long)ctx->data_end;
		h = (void *)((char *)data + L4_OFF + sizeof(struct udphdr));
		if ((void *)(h + 1) > data_end)
			return XDP_ABORTED;
		payload = (__s32 *)narrow_in(ctx, prec, type != AGGD_MSG_TYPE_REREAD, jst, &action);
	} else
#endif
		/* a re-read's payload is only room for the result */
		payload = (__s32 *)payload_of(ctx, h, data_end, type != AGGD_MSG_TYPE_REREAD, jst, &action);
	if (!payload)
		return action;
#if AGGD_BOUNDS
	/* a narrow job's values are its packed lanes' fields: each is judged on its own */
	__s64 quad = quad_mask(prec), dual = dual_mask(prec);
	if (type == AGGD_MSG_TYPE_CONTRIB &&
	    ((cfg->bounded && beyond_bound(cfg, (__u32 *)payload, (__s16)ntohs(HDR(h, __be16, exponent)), quad, dual)) ||
	     (cfg->norm_bounded &&
	      beyond_norm(cfg, (__u32 *)payload, (__s16)ntohs(HDR(h, __be16, exponent)), quad, dual)))) {
		struct member_stats *ms = member_stats.lookup(&midx);
		if (ms)
			ms->offences++;
		return drop_in(jst, AGGD_DROP_REASON_OUT_OF_BOUNDS);
	}
#endif
#if AGGD_NARROW
	/* A narrow job's payload is the per-CPU buffer (narrow_in): the packed loops below take it
	 * from here, whose size the verifier knows (a packet's ELEMS * 4 bytes are short of the last
	 * packed lane's when ELEMS is odd, and it does not keep which of the two `payload` is). */
	__u32 packed_key = 0;
	__u64 *packed = (void *)payload_copy.lookup(&packed_key);
	if (!packed)
		return XDP_ABORTED;
#endif
	/* Read again, so that the verifier's states of both ways here are alike and it walks the
	 * slot's rules once (it does not keep which precision this is, nor, see below, the headers). */
	prec = *(volatile __u8 *)&cfg->precision;

	__u32 round = ntohl(HDR(h, __be32, round));
	if ((__u64)round + 1 > jst->max_round)
		jst->max_round = (__u64)round + 1;
	__u64 key = ((__u64)round << 32) | chunk;
	__u64 bit = 1ULL << rank;
	__u64 all = cfg->all_members;
	__s16 exp_in = (__s16)ntohs(HDR(h, __be16, exponent));
	__u32 step = ntohs(HDR(h, __be16, step));
	__u32 skip = ntohs(HDR(h, __be16, skip));
	/* a rack aggregator's partial sum holds that many contributions; a worker's (0) one */
	__u16 weight = ntohs(HDR(h, __be16, n_contrib));
	weight = weight ? weight : 1;
	int retransmit = h->flags & AGGD_FLAG_RETRANSMIT;
	/* the sender's word that it sends a slot's keys in order of answers (Flag.ORDERED) */
	__u64 ordered = 1 ^ is_zero(h->flags & AGGD_FLAG_ORDERED);
	struct strategy_entry *st_new = strategy_for(cfg, round);
	__u64 now = clock_now();

	/* The decision is taken under the lock and carried out by at most one adding loop and one
	 * copying loop: `add` is the bank the payload goes into, `out` the bank sent back. */
	__u64 out_key = 0, out_bitmap = 0;
	__u16 out_n = 0, out_version = 0;
	__s16 out_exp = 0;
	__u8 out_flags = 0, out_kind = 0, out_param = 0;
	__u16 out_skip = 0, out_count = 0;

	bpf_spin_lock(&s->lock);
	volatile struct scratch *sc = &s->sc; /* volatile: the compiler must not keep these in registers */
	sc->ik = sc->ifree = sc->irel_old = sc->itarget = sc->irel_chunk = sc->irel_chunk2 = sc->ihold = -1;
	sc->used = sc->nopen = sc->nhold = sc->nfree = sc->nempty = sc->have_chunk = sc->timeouts = sc->settled = 0;
	sc->old_kept = sc->old_kept_q = 0;
	sc->uncarried = sc->passed_full = 0;
	sc->hold_newest = 0;
	sc->min_open_round = 0xffffffff;
	sc->irel_old_q = -1;
	sc->nfree_q = 0;
	sc->rel_old_key_q = ~0ULL;
	sc->newest = sc->rel_chunk_key = sc->rel_chunk2_key = sc->chunk_newest = 0;
	sc->target_key = sc->hold_key = ~0ULL;
	sc->add = sc->out = sc->reason = -1;
	sc->add_fresh = sc->add_carried = sc->late = sc->out_group = 0;
	sc->partial = sc->released = sc->written = sc->forward = 0;
	/* The sender holds a round's result if it sends a round RESULT_WINDOW later, or step 0 of the
	 * same round and a later chunk, or any later round when the bank's chunk or the packet's is
	 * n_slots or beyond or the packet is ORDERED (Slot.note_sender; an empty bank's mark is cleared when it opens). In a
	 * loop of its own, without branches, before the scan's branches multiply the paths the
	 * verifier walks (the jumbo build is near its limit). */
	__u64 wide_sent = ((__u64)cfg->n_slots - 1 - chunk) >> 63;
	s->shared |= wide_sent | ordered; /* a round with more chunks than slots, or ORDERED (Slot.shared) */
#pragma unroll
	for (int i = 0; i < NBANKS; i++) {
		struct bank *b = &s->bank[i];
		__u64 k = b->key;
		__u64 wide = (((__u64)cfg->n_slots - 1 - (__u32)k) >> 63) | wide_sent | ordered;
		__u64 later = 1 ^ ((((__u64)round - (k >> 32) - AGGD_RESULT_WINDOW + wide * (AGGD_RESULT_WINDOW - 1))
				    >> 63) & 1);
		__u64 same = is_zero(((__u64)round ^ (k >> 32)) | step) & (((__u64)(__u32)k - chunk) >> 63);
		b->held |= bit & -(later | same);
	}
#pragma unroll
	for (int i = 0; i < NBANKS; i++) {
		struct bank *b = &s->bank[i];
		if (b->state == BANK_OPEN && !b->holding) {
			if (b->kind == AGGD_STRATEGY_KIND_QUORUM) {
				if (now - b->t_first >= (__u64)b->timeout_us * 1000) {
					b->state = BANK_RELEASED; /* deadline passed: released without the stragglers */
					b->unannounced = 1;
					sc->timeouts++;
				}
			} else if ((b->bitmap & all) == all && cfg->upstream) {
				b->state = BANK_FORWARDED; /* sent up by the next retransmission into it */
			} else if ((b->bitmap & all) == all) {
				/* it waited for a member declared gone since it opened, and has the others */
				b->state = BANK_RELEASED;
				b->unannounced = 1;
				sc->settled++;
			}
		}
		if (b->state == BANK_EMPTY) {
			if (sc->ifree < 0)
				sc->ifree = i;
			sc->nfree++;
			sc->nfree_q++;
			sc->nempty++;
			continue;
		}
		__u64 k = b->key;
		/* a bank holds the pending key now: no longer pending (Slot.pending; no branch, below) */
		s->pending *= 1 ^ is_zero((k + 1) ^ s->pending);
		if (k == key)
			sc->ik = i;
		if (b->holding) {
			/* a carry's holding bank: a target for later carries of its chunk, and the bank
			 * the chunk's next round adopts; nothing else */
			sc->nhold++;
			if ((__u32)k == chunk && k > key && target_full(b, cfg)) {
				sc->passed_full = 1;
			} else if ((__u32)k == chunk && k > key && k < sc->target_key) {
				sc->target_key = k;
				sc->itarget = i;
			}
			if ((__u32)k == chunk && k > sc->hold_newest)
				sc->hold_newest = k;
			if ((__u32)k == chunk && k < sc->hold_key) {
				sc->hold_key = k;
				sc->ihold = i;
			}
			continue;
		}
		if ((__u32)k == chunk && (!sc->have_chunk || k > sc->chunk_newest)) {
			sc->chunk_newest = k;
			sc->have_chunk = 1;
		}
		sc->used++;
		if (sc->used == 1 || k > sc->newest)
			sc->newest = k;
		if (b->state == BANK_OPEN || b->state == BANK_FORWARDED) { /* no result yet */
			sc->nopen++;
			if ((__u32)(k >> 32) < sc->min_open_round)
				sc->min_open_round = k >> 32;
			if (b->state == BANK_OPEN && (__u32)k == chunk && k > key && target_full(b, cfg)) {
				sc->passed_full = 1;
			} else if (b->state == BANK_OPEN && (__u32)k == chunk && k > key && k < sc->target_key) {
				sc->target_key = k;
				sc->itarget = i;
			}
		} else {
			/* an ssp/async round is kept from new rounds while an awaited member may re-read
			 * it, unless quorum governs the new round; in a slot serving several chunk
			 * indices an ssp, async or quorum one is kept from every new round
			 * (Slot.reusable; no branch, as above) */
			__u64 unheld = 1 ^ is_zero((b->held & all) ^ all);
			__u64 kept_q = (s->shared & 1) & (kept_kind(b->kind) | is_zero(b->kind ^ AGGD_STRATEGY_KIND_QUORUM)) & unheld;
			__u64 kept = (kept_kind(b->kind) & unheld) | kept_q;
			sc->nfree += 1 ^ kept;
			sc->nfree_q += 1 ^ kept_q;
			if (k < sc->rel_old_key_q) { /* released banks go oldest first (Slot.free_bank) */
				sc->rel_old_key_q = k;
				sc->irel_old_q = i;
				sc->old_kept = kept;
				sc->old_kept_q = kept_q;
			}
			if ((__u32)k == chunk) {
				if (sc->irel_chunk < 0 || k > sc->rel_chunk_key) {
					sc->rel_chunk2_key = sc->rel_chunk_key;
					sc->irel_chunk2 = sc->irel_chunk;
					sc->rel_chunk_key = k;
					sc->irel_chunk = i;
				} else if (sc->irel_chunk2 < 0 || k > sc->rel_chunk2_key) {
					sc->rel_chunk2_key = k;
					sc->irel_chunk2 = i;
				}
			}
		}
	}
	/* a kept oldest released bank leaves none to a new round quorum does not govern (no branch:
	 * the verifier would walk the rest twice) */
	__u32 kept_mask = -(__u32)sc->old_kept, kept_q_mask = -(__u32)sc->old_kept_q;
	sc->nfree = sc->nfree ^ ((sc->nfree ^ sc->nempty) & kept_mask);
	sc->nfree_q = sc->nfree_q ^ ((sc->nfree_q ^ sc->nempty) & kept_q_mask);
	sc->irel_old = sc->irel_old_q | (__s32)kept_mask;
	sc->irel_old_q |= (__s32)kept_q_mask;
	/* the bank a new round of the packet's round may take (Slot.free_bank) */
	int pick = free_bank(sc, quorum_kind(st_new));
	int ik = sc->ik;

	if (type == AGGD_MSG_TYPE_REREAD) {
		if (ik >= 0 && s->bank[ik & (NBANKS - 1)].state == BANK_RELEASED)
			sc->out = ik;
		else if (ik >= 0 || sc->used == 0 || key > sc->newest)
			sc->reason = AGGD_DROP_REASON_NOT_READY;
		else
			sc->reason = AGGD_DROP_REASON_STALE;
	} else if (ik >= 0) {
		struct bank *b = &s->bank[ik & (NBANKS - 1)];
		/* Every contribution is (member, step): wbsp sends several steps a round, and a step
		 * that reaches a round a swap made non-wbsp is summed into it all the same. */
		int counted = step >= 8 || (b->steps[rank & (AGGD_MAX_MEMBERS - 1)] >> step) & 1;
		if (b->state == BANK_OPEN)
			if (counted)
				sc->reason = AGGD_DROP_REASON_DUPLICATE;
			else {
				/* busy if it would make a holding bank a round proper after the pending key */
				__u64 wait = (b->holding & 1) & after_pending(key, s->pending);
				sc->add = ik | -(__s32)wait;
				sc->reason = -1 + (__s32)wait * (AGGD_DROP_REASON_BUSY + 1);
			}
		else if (counted && b->state == BANK_FORWARDED) {
			sc->out = ik; /* the upper aggregator lost it, or we its answer: send it up again */
			sc->forward = 1;
		} else if (counted) /* a carried (member, step) is marked counted in its origin too */
			sc->out = ik; /* the sender lost the result */
		else
			sc->late = 1; /* released without this contribution */
	} else if (sc->used == 0 || key > sc->newest) {
		/* Rounds of a chunk open in order: a round whose predecessor was refused (busy) must
		 * not open first, or the predecessor could never open after it. */
		__u64 after = (__u64)(__u32)(sc->chunk_newest >> 32) + 1 + skip;
		/* and a key refused before goes first (Slot.pending); kept in the scratch, read back
		 * unknown, so that the verifier's paths through this test merge */
		sc->in_order = (!sc->have_chunk ||
				(skip >= AGGD_SKIP_MAX ? (__u64)round >= after : (__u64)round <= after)) &
			       (1 ^ after_pending(key, s->pending));
		int in_order = sc->in_order;
		if (in_order && sc->ihold >= 0) {
			/* the carries held for the chunk's next round: this round takes them over */
			struct bank *hb = &s->bank[sc->ihold & (NBANKS - 1)];
			hb->key = key;
			hb->version = st_new ? st_new->version : 0;
			hb->kind = st_new ? st_new->kind : AGGD_STRATEGY_KIND_SYNC;
			hb->param = st_new ? st_new->param : 0;
			hb->timeout_us = st_new ? st_new->timeout_us : 0;
			hb->skip = skip;
			hb->held = 0;
			sc->add = sc->ihold;
		} else if (in_order && pick >= 0 && admits(st_new, round, sc->nopen, sc->nhold, sc->min_open_round)) {
			open_bank(&s->bank[pick & (NBANKS - 1)], key, st_new, now, 0, skip, n);
			sc->add = pick;
			sc->add_fresh = 1;
		} else {
			sc->reason = AGGD_DROP_REASON_BUSY;
			/* refused under ssp/async: it goes first once sent again (Slot.pending) */
			__u64 lower = is_zero(s->pending) | below(key + 1, s->pending);
			__u64 wait = lower & kept_kind(st_new ? st_new->kind : AGGD_STRATEGY_KIND_SYNC);
			s->pending ^= (s->pending ^ (key + 1)) & -wait;
		}
		/* the pending key opened (or was adopted): no longer pending */
		s->pending *= 1 ^ (((__u32)sc->add >> 31 ^ 1) & is_zero(s->pending ^ (key + 1)));
	} else {
		sc->late = 1; /* older than every bank */
	}

	__u32 mi = rank & (AGGD_MAX_MEMBERS - 1);
	if (sc->late && !(all & bit)) {
		/* a member declared gone: answered with its chunk's newest result, never carried (its
		 * own contribution to the round may be in already: a carry could exceed the world) */
		if (sc->irel_chunk >= 0)
			sc->out = sc->irel_chunk;
		else
			sc->reason = AGGD_DROP_REASON_STALE;
	} else if (sc->late) {
		__u32 kidx = chunk / cfg->n_slots;
		int remembered = step == 0 && kidx < 64;
		__u64 kbit = 1ULL << (kidx & 63);
		int known = remembered && s->late_round[mi] == (__u64)round + 1;
		/* a copy, not a late contribution: retransmitted, or a first copy of step 0 whose round
		 * a strategy other than quorum governed (released with every awaited member, its first
		 * copy counted: a delayed packet, carried, would be added twice) */
		int copy = retransmit || (step == 0 && !quorum_kind(st_new));
		if (ik < 0 && copy && !(known && (s->late_refused[mi] & kbit))) {
			if (known && (s->late_carried[mi] & kbit)) {
				/* counted before with nothing to answer: answer now, if there is a result */
				if (sc->irel_chunk >= 0)
					sc->out = sc->irel_chunk;
				else
					sc->reason = AGGD_DROP_REASON_NOT_READY;
			} else if (sc->irel_chunk >= 0 &&
				   s->bank[sc->irel_chunk & (NBANKS - 1)].kind == AGGD_STRATEGY_KIND_QUORUM) {
				/* a quorum went on without the sender, its round gone: the quorum's newest
				 * result of the chunk (never carried: it could be a copy of one counted) */
				sc->out = sc->irel_chunk;
			} else {
				sc->reason = AGGD_DROP_REASON_STALE; /* could be a copy of one counted */
			}
		} else if (sc->itarget >= 0) {
			sc->add = sc->itarget;
		} else {
			/* the next round of the chunk, after the slot's newest key too (its members
			 * will still come to it), as a holding bank that leaves a bank free; after the
			 * chunk's holding banks too (full ones: Bank.carried) */
			__u64 r2 = (__u64)(sc->have_chunk ? (__u32)(sc->chunk_newest >> 32) : round) + 1;
			if (sc->hold_newest && (sc->hold_newest >> 32) + 1 > r2)
				r2 = (sc->hold_newest >> 32) + 1;
			if (r2 <= 0xffffffffULL && sc->used && ((r2 << 32) | chunk) <= sc->newest)
				r2 = (sc->newest >> 32) + (chunk > (__u32)sc->newest ? 0 : 1);
			__u64 k2 = (r2 << 32) | chunk;
			struct strategy_entry *e2 = strategy_for(cfg, (__u32)r2);
			/* the bank, and whether another stays free, for round r2 (its kind: Slot.reusable) */
			int q2 = quorum_kind(e2);
			int pick2 = free_bank(sc, q2);
			__u32 nfree2 = q2 ? sc->nfree_q : sc->nfree;
			struct bank *ob = &s->bank[ik & (NBANKS - 1)];
			if (r2 <= 0xffffffffULL && pick2 >= 0 && nfree2 >= 2) {
				open_bank(&s->bank[pick2 & (NBANKS - 1)], k2, e2, now, 1, 0, n);
				sc->add = pick2;
				sc->add_fresh = 1;
			} else if ((s->shared || sc->passed_full) &&
				   (ik >= 0 ? ob->state == BANK_RELEASED && ob->kind == AGGD_STRATEGY_KIND_QUORUM
						  : sc->irel_chunk >= 0 &&
						    s->bank[sc->irel_chunk & (NBANKS - 1)].kind == AGGD_STRATEGY_KIND_QUORUM)) {
				/* a quorum round of a slot serving several chunk indices, kept for this
				 * straggler (or, its round gone, the chunk's newest quorum result) answers it
				 * though no bank is free to carry its values into (dropped, as a quorum may);
				 * so too past a round full of carries (refused, its call could wait on a
				 * round that waits on it) */
				sc->out = ik >= 0 ? ik : sc->irel_chunk;
				sc->uncarried = 1;
				if (ik >= 0)
					ob->steps[mi] |= 1 << (step & 7); /* its retransmission: answered (rule 2) */
			} else {
				sc->reason = AGGD_DROP_REASON_BUSY;
				if (remembered) {
					if (s->late_round[mi] != (__u64)round + 1) {
						s->late_round[mi] = (__u64)round + 1;
						s->late_refused[mi] = s->late_carried[mi] = 0;
					}
					s->late_refused[mi] |= kbit;
				}
			}
		}
		if (sc->add >= 0) {
			sc->add_carried = 1;
			if (known)
				s->late_refused[mi] &= ~kbit;
			if (ik >= 0 && ik != sc->add) { /* B still exists (the carry may have reused it) */
				struct bank *origin = &s->bank[ik & (NBANKS - 1)];
				origin->late |= bit;
				/* per (member, step): a retransmission of this one is answered, a later wbsp
				 * step of the same member is carried too */
				origin->steps[mi] |= 1 << (step & 7);
			}
			/* its own round's result if still in B (a later round may hold another tensor),
			 * else the newest released result of this chunk, not a bank just reopened */
			if (ik >= 0 && ik != sc->add && s->bank[ik & (NBANKS - 1)].state == BANK_RELEASED)
				sc->out = ik;
			else
				sc->out = (sc->add_fresh && sc->add == sc->irel_chunk) ? sc->irel_chunk2 : sc->irel_chunk;
			if (sc->out < 0 && remembered) { /* its retransmission will be answered */
				if (s->late_round[mi] != (__u64)round + 1) {
					s->late_round[mi] = (__u64)round + 1;
					s->late_refused[mi] = s->late_carried[mi] = 0;
				}
				s->late_carried[mi] |= kbit;
			}
		}
	}

	int add = sc->add;
	__u64 lag_ns = 0;
	if (add >= 0) {
		struct bank *b = &s->bank[add & (NBANKS - 1)];
		/* The lag of the start of the member's call only (its step-0 chunk 0): what a late member
		 * costs the others a round. Its later chunks follow the others' answers, which wait for it,
		 * so they come in step and would water the lag down by the chunks a call. A multiplier, not
		 * a branch: the verifier would walk the copying loops below once for each side. */
		__u64 call_start = ((__u64)(chunk | step) - 1) >> 63;
		lag_ns = (now - b->t_first) * call_start;
		if (!sc->add_carried) {
			if (b->holding) { /* the round proper starts: order, admission, deadline, count */
				b->holding = 0;
				b->t_first = now;
				b->count = n;
			}
			/* the bitmap lists members whose step 0 is in: a later wbsp step (or one sent
			 * before a swap made the round non-wbsp) must not stand in for it */
			__u64 bm = b->bitmap | (step ? 0 : bit);
			int release;
			if (b->kind == AGGD_STRATEGY_KIND_QUORUM)
				release = __builtin_popcountll(bm) >= b->param;
			else
				release = (bm & all) == all;
			b->bitmap = bm;
			b->steps[rank & (AGGD_MAX_MEMBERS - 1)] |= 1 << (step & 7);
			if (release) {
				sc->released = 1;
				sc->out = add;
				sc->out_group = 1;
				sc->forward = cfg->upstream != 0; /* a rack job's sum goes up, not out */
			} else if (b->kind == AGGD_STRATEGY_KIND_ASYNC) {
				sc->out = add; /* no barrier: the sender gets the running sum at once */
				sc->partial = 1;
			}
		} else {
			b->flags |= AGGD_FLAG_CARRIED;
			b->carried += 1;
		}
		__u64 *v = b->values;
		__u32 *p = (__u32 *)payload;
		int se = b->exponent;
#if AGGD_NARROW
		/* tested on masks, not on `prec`: the verifier would keep int32's prec (0) apart from
		 * the rest's, and walk the loops below once for each */
		__u64 dual = dual_mask(prec);
		if ((dual | quad_mask(prec)) && !sc->add_fresh && exp_in != se) {
			int sa, sb;
			align_shifts(b, exp_in, se, &sa, &sb);
			if (sa == 0) /* the contribution is the finer: it alone is shifted */
				packed_add_shifted(v, packed, sb, dual);
			else /* the bank's sum is the finer (sb is 0) */
				packed_add_aligned(v, packed, b->bias, sa, dual);
			b->bias += packed_layout(dual).one;
		} else if (prec == AGGD_PRECISION_INT8) {
			/* quad lanes (aggd_lanes.h): four values a lane, the bias 128 a value */
			add_packed(b, packed, sc, add, exp_in, Q8_BIAS, Q8_TOP, Q8_ONES);
		} else if (prec == AGGD_PRECISION_INT16) {
			/* dual lanes: two values a lane, the bias 32768 a value */
			add_packed(b, packed, sc, add, exp_in, D16_BIAS, D16_TOP, D16_ONES);
		} else
#endif
		if (sc->add_fresh) {
			b->exponent = exp_in;
			b->bias = SUM_BIAS;
			lanes_set(v, p);
			if (sc->out == add) { /* a lone contribution is its own sum: the packet holds it */
				sc->written_high = 0;
				sc->written = 1;
			}
		} else if (exp_in == se && sc->out != add) {
			b->bias += SUM_BIAS;
			lanes_add(v, p);
		} else if (exp_in == se) {
			/* This sum goes back (a release, an async running sum): add and copy out in one pass. */
			__u64 bias = b->bias + SUM_BIAS, above = bias + SUM_BIAS;
			if ((__u32)bias != 0) {
				b->bias = bias;
				sc->written_high = lanes_add_send_odd(v, p, above);
			} else if (sc->released) {
				b->bias = bias;
				sc->written_high = lanes_add_send_even(v, p, above, 0);
			} else {
				b->bias = -SUM_BIAS;
				sc->written_high = lanes_add_send_even(v, p, above, 1);
			}
			sc->written = 1;
		} else {
			int sa, sb;
			align_shifts(b, exp_in, se, &sa, &sb);
			__u64 bias = b->bias;
			b->bias = bias + SUM_BIAS;
			if (sa == 0) {
				/* the contribution is the finer (the common way): the sums stay, each value
				 * shifted is added as a contribution is (less SUM_BIAS, which the bias took) */
				_Pragma("clang loop unroll_count(8)")
				for (int i = 0; i < ELEMS; i++)
					v[i] += (__u64)((__s64)(__s32)p[i] >> sb) - SUM_BIAS;
			} else { /* the bank's sum is the finer (sb is 0): the sums are shifted */
				_Pragma("clang loop unroll(disable)")
				for (int i = 0; i < ELEMS; i++) {
					__s64 sum = (__s64)(v[i] + bias) >> sa;
					v[i] = (__u64)(sum + (__s64)(__s32)p[i]) - bias - SUM_BIAS;
				}
			}
		}
		b->n_contrib += weight;
		if (sc->released)
			b->state = sc->forward ? BANK_FORWARDED : BANK_RELEASED;
	}
	/* Kept in the scratch across the copying loops below, not in registers: the verifier then
	 * reaches those loops alike whether or not the packet was added, and walks them once. */
	sc->lag_ns = lag_ns;
	/* and the precision read again: the adding ways' knowledge of it (int8, int16, the rest) would
	 * keep them apart there too */
	prec = *(volatile __u8 *)&cfg->precision;
	int out = sc->out;
	if (out >= 0) {
		struct bank *r = &s->bank[out & (NBANKS - 1)];
		/* A released sum no longer changes: once it has been sent (by the packet that released
		 * it, or the first answer after its deadline), its overflow is in its flags and later
		 * answers copy it without the check. */
		int sent_before = r->state == BANK_RELEASED && !r->unannounced && !sc->released;
		if (r->unannounced) {
			/* the first answer from a round released by its deadline goes to the whole group,
			 * so every member (and any observer) sees that release once */
			r->unannounced = 0;
			sc->out_group = 1;
		}
		__u64 high = sc->written_high;
#if AGGD_NARROW
		/* every narrow result is checked: the check costs nothing beside the subtraction */
		if (prec == AGGD_PRECISION_INT8) {
			if (!sc->written)
				high = packed_send(r->values, packed, r->bias, Q8_TOP, Q8_ONES);
		} else if (prec == AGGD_PRECISION_INT16) {
			if (!sc->written)
				high = packed_send(r->values, packed, r->bias, D16_TOP, D16_ONES);
		} else
#endif
		if (sent_before) {
			lanes_copy(r->values, (__u32 *)payload, r->bias);
			high = 0;
		} else if (!sc->written) {
			high = lanes_send(r->values, (__u32 *)payload, r->bias + SUM_BIAS, r->bias);
		}
		if ((high >> 32) && (r->state == BANK_RELEASED || r->state == BANK_FORWARDED))
			r->flags |= AGGD_FLAG_OVERFLOW; /* a rack's members learn it from the relayed result */
		out_key = r->key;
		out_bitmap = r->bitmap;
		out_n = r->n_contrib;
		out_exp = r->exponent;
		out_flags = r->flags;
		if (high >> 32)
			out_flags |= AGGD_FLAG_OVERFLOW;
		out_version = r->version;
		out_kind = r->kind;
		out_param = r->param;
		out_skip = r->skip;
		out_count = r->count;
	}
	int timeouts = sc->timeouts, settled = sc->settled, reason = sc->reason, add_carried = sc->add_carried;
	int released = sc->released, partial = sc->partial, forward = sc->forward;
	int out_group = sc->out_group;
	int was_late = sc->late, uncarried = sc->uncarried;
	add = sc->add;
	lag_ns = sc->lag_ns;
	bpf_spin_unlock(&s->lock);

	/* The headers, found again: a narrow job's frame has grown (and the verifier walks the rules
	 * above once for every kind of frame only if no header pointer is kept across them). */
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	eth = data;
	ip = (void *)(eth + 1);
	udp = (void *)(ip + 1);
	h = (void *)(udp + 1);
	if ((void *)(h + 1) > data_end)
		return XDP_ABORTED;
#if AGGD_NARROW
	if (prec != AGGD_PRECISION_INT32 && out >= 0) {
		/* the result's size, whether the frame grew to it or came with the room */
		ip->tot_len = htons(sizeof(*ip) + sizeof(*udp) + sizeof(*h) + RESULT_BYTES);
		udp->len = htons(sizeof(*udp) + sizeof(*h) + RESULT_BYTES);
	}
#endif

	if (add >= 0) {
		struct member_stats *ms = member_stats.lookup(&midx);
		if (ms) {
			ms->contributions++;
			ms->lag_ns_sum += add_carried ? 0 : lag_ns; /* a carried one is counted as late instead */
			ms->late += was_late;
			if ((__u64)round + 1 > ms->last_round)
				ms->last_round = (__u64)round + 1;
			ms->last_ns = now;
		}
	}

	if (timeouts) {
		jst->counter[AGGD_COUNTER_TIMEOUTS] += timeouts;
		jst->counter[AGGD_COUNTER_RELEASED] += timeouts;
	}
	if (settled)
		jst->counter[AGGD_COUNTER_RELEASED] += settled;
	if (reason >= 0)
		return drop_in(jst, reason);
	if (uncarried)
		jst->counter[AGGD_COUNTER_UNCARRIED] += 1;
	if (add >= 0) {
		jst->counter[AGGD_COUNTER_CONTRIBUTIONS] += 1;
		jst->counter[AGGD_COUNTER_ELEMENTS] += n;
		if (add_carried)
			jst->counter[AGGD_COUNTER_CARRIED] += 1;
		if (released && !forward)
			jst->counter[AGGD_COUNTER_RELEASED] += 1;
		if (partial)
			jst->counter[AGGD_COUNTER_PARTIALS] += 1;
	}
	if (out < 0)
		return XDP_DROP; /* absorbed into the slot */
	if (forward) {
		if (cfg->upstream != 2)
			return XDP_DROP; /* kept: a retransmission sends it once the rack has joined */
		jst->counter[AGGD_COUNTER_FORWARDED] += 1;
#ifdef AGGD_FRAGS
		if (bpf_xdp_store_bytes(ctx, PAYLOAD_OFF, payload, ELEMS * 4))
			return XDP_ABORTED;
#endif
		/* the count, and the payload (the sum, written above), stay */
		h->type = AGGD_MSG_TYPE_CONTRIB;
		HDR(h, __be16, job) = htons(cfg->up_job);
		HDR(h, __be16, rank) = htons(cfg->up_rank);
		HDR(h, __be32, round) = htonl((__u32)(out_key >> 32));
		HDR(h, __be32, chunk) = htonl((__u32)out_key);
		HDR(h, __be16, strategy_version) = 0;
		HDR(h, __be16, exponent) = htons((__u16)out_exp);
		h->flags = released ? 0 : AGGD_FLAG_RETRANSMIT;
		h->code = 0;
		HDR(h, __be64, contributors) = __builtin_bswap64(cfg->up_tag);
		HDR(h, __be16, n_contrib) = htons(out_n);
		HDR(h, __be16, step) = 0;
		h->strategy = 0;
		h->param = 0;
		HDR(h, __be16, skip) = htons(out_skip);
		HDR(h, __be16, count) = htons(out_count);
		address_from_rack(eth, ip, udp, cfg, cfg->up_mac, cfg->up_ip, cfg->up_port);
		return XDP_TX;
	}
#if AGGD_NARROW
	if (prec != AGGD_PRECISION_INT32) {
		if (narrow_out(ctx) < 0)
			return XDP_ABORTED;
		/* an int8 sum of more contributions may not fit its field (AGGD_INT8_MAX_CONTRIBUTIONS) */
		if (prec == AGGD_PRECISION_INT8 && out_n > AGGD_INT8_MAX_CONTRIBUTIONS)
			out_flags |= AGGD_FLAG_OVERFLOW;
	}
#endif
	if (out_flags & AGGD_FLAG_OVERFLOW)
		jst->counter[AGGD_COUNTER_OVERFLOWS] += 1;
	if (!out_group && !partial) {
		jst->counter[AGGD_COUNTER_REREADS] += 1;
		out_flags |= AGGD_FLAG_REREAD;
	}
#ifdef AGGD_FRAGS
	if (prec == AGGD_PRECISION_INT32 && bpf_xdp_store_bytes(ctx, PAYLOAD_OFF, payload, ELEMS * 4))
		return XDP_ABORTED;
#endif
	write_result(h, out_key, out_version, out_exp, out_flags, out_bitmap, out_n, out_kind, out_param);
	HDR(h, __be16, count) = htons(out_count); /* the round's (Bank.count) */
	h->code = prec;
	if (out_group)
		address_to_group(eth, ip, udp, cfg);
	else
		address_to_sender(eth, ip, udp); /* re-sends, late answers and async running sums */
	result_udp_csum(ip, udp, (__u32 *)payload);
	return XDP_TX;
}

#else
/* bcc gives the maps BTF (which bpf_spin_lock needs) only from a build with a function */
int aggd_maps_only(struct xdp_md *ctx)
{
	return XDP_PASS;
}
#endif /* AGGD_MAPS_ONLY */
