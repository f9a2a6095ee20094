/* The payload loops: a bank's u64 lanes against the packet's int32 values (an int8 or int16 job's:
 * "Packed lanes" below). Each runs over all its lanes (a constant trip count after the one bounds check up
 * front, as the verifier wants).
 *
 * A lane holds an exact sum kept biased: the true sum is (__s64)(lane + bias), bias being the
 * bank's. Adding a contribution x adds x ^ LANE_FLIP (x - 2**31) and 2**31 to the bias, so the
 * common loop needs no sign extension and no overflow test. When a sum is sent, t = true sum + 2**31
 * lies in [0, 2**32) exactly when it fits int32: every t is ORed and the high half tested once
 * (`above` = bias + 2**31, so t = lane + above). The int32 sent is the low half of the true sum, which
 * is the low half of the lane itself when the bias is a multiple of 2**32 ("even"), else of t with
 * its top bit flipped.
 *
 * What a lane costs here is instructions and stores: the JIT turns each BPF instruction into about
 * one x86 instruction, and stores that alternate between two cache lines (packet, bank) retire one
 * a cycle where stores to one line retire two. So the loops that write both handle lanes two at a
 * time, each pair's packet stores together and its bank stores together. */
#ifndef AGGD_LANES_H
#define AGGD_LANES_H

#include "aggd_helpers.h"

/* Ends one lane pair of an unrolled loop: without it clang 14 hoists every pair's loads to the
 * top, runs out of BPF's ten registers and spills to the stack. */
#define LANE_DONE() asm volatile("" ::: "memory")

#define LANE_PAIRS (ELEMS / 2)

/* |x| without a branch */
static __always_inline __u64 abs64(__s64 x)
{
	__s64 sign = x >> 63;
	return (__u64)((x ^ sign) - sign);
}

/* Packed lanes: a narrow job's bank lane j holds the sums of several of its values in fields of
 * their own, each kept biased by half the field's range a contribution, so that a field's sum is
 * never negative, never carries into the next, and one u64 add a lane adds them all:
 * - Quad lanes (an int8 job): values 4j .. 4j+3 in four 16-bit fields, a value v added as v + 128
 *   (0..255, its byte with the top bit flipped). Up to 257 contributions a field stays below 2**16;
 *   its true sum, (field - its bias) modulo 2**16 as int16, is exact while it fits int16, which up
 *   to AGGD_INT8_MAX_CONTRIBUTIONS contributions of -128..127 it does.
 * - Dual lanes (an int16 job): values 2j and 2j+1 in two 32-bit fields, v added as v + 32768
 *   (0..65535). A field stays below 2**32 up to 65537 contributions, more than a bank takes
 *   (aggd_xdp.c), and its true sum, (field - its bias) modulo 2**32 as int32, always fits.
 * The bank's `bias` holds the contributions' bias added in each field (Q8_BIAS, D16_BIAS each). The
 * result's values (int16 or int32, as wide as the fields) are the fields less that bias as they
 * lie, so sending a lane is one per-field subtraction. Half the lanes of a 32-bit bank
 * (PACKED_LANES) serve a packet's 2 * ELEMS int8 or ELEMS int16 values.
 *
 * The loops below take a layout's constants as arguments: always inlined, each caller's are
 * immediates, so each precision has its own copy of each loop. */
#define PACKED_LANES ((ELEMS + 1) / 2)
#define Q8_BIAS 0x0080008000800080ULL  /* 128 in every field: one contribution's bias */
#define Q8_TOP 0x8000800080008000ULL   /* every field's top bit */
#define Q8_ONES 0x0001000100010001ULL
#define D16_BIAS 0x0000800000008000ULL
#define D16_TOP 0x8000000080000000ULL
#define D16_ONES 0x0000000100000001ULL

/* Four int8 values (w's bytes, the first lowest) as a contribution to a quad lane: each byte with
 * its top bit flipped (v + 128) into a field of its own. */
static __always_inline __u64 q8_spread(__u32 w)
{
	__u64 t = w ^ 0x80808080U;
	t = (t | (t << 16)) & 0x0000FFFF0000FFFFULL;
	return (t | (t << 8)) & 0x00FF00FF00FF00FFULL;
}

/* Two int16 values (w's halves, the first lowest) as a contribution to a dual lane (v + 32768). */
static __always_inline __u64 d16_spread(__u32 w)
{
	__u64 t = w ^ 0x80008000U;
	return (t | (t << 16)) & 0x0000FFFF0000FFFFULL;
}

/* x - c field by field, modulo each field's range (no borrow crosses a field); `top` has every
 * field's top bit. */
static __always_inline __u64 packed_sub(__u64 x, __u64 c, __u64 top)
{
	return ((x | top) - (c & ~top)) ^ ((x ^ ~c) & top);
}

/* `top`'s bit of each field of x that is the field's most negative value (its top bit alone), else
 * 0: -32768, the one int16 an int8 sum (-128 * 256) reaches outside the symmetric range results
 * keep (docs/protocol.md, "Precision"); -2**31, which no int16 sum a bank holds reaches. */
static __always_inline __u64 packed_min(__u64 x, __u64 top, __u64 ones)
{
	__u64 t = x ^ top;
	return (t - ones) & ~t & top;
}

/* What the packed loops below return for a result: bit 32 (the int32 lanes' overflow bit, as their
 * `high`) if a value is its field's most negative, else 0. */
static __always_inline __u64 packed_high(__u64 min)
{
	return ((min | -min) >> 63) << 32; /* without a branch */
}

/* A fresh bank takes the contribution (its bias one contribution's). */
static __always_inline void packed_set(__u64 *v, __u64 *p)
{
	_Pragma("clang loop unroll_count(8)")
	for (int j = 0; j < PACKED_LANES; j++)
		v[j] = p[j];
}

/* ... and also sends it: the packet's lanes become their values (`bias` one contribution's). */
static __always_inline __u64 packed_set_send(__u64 *v, __u64 *p, __u64 bias, __u64 top, __u64 ones)
{
	__u64 min = 0;
	_Pragma("clang loop unroll_count(4)")
	for (int j = 0; j < PACKED_LANES; j++) {
		__u64 x = p[j], o = packed_sub(x, bias, top);
		v[j] = x;
		p[j] = o;
		min |= packed_min(o, top, ones);
		LANE_DONE();
	}
	return packed_high(min);
}

/* The common case: one load, one add, one store a lane (the bias grows by one contribution's). */
static __always_inline void packed_add(__u64 *v, __u64 *p)
{
	_Pragma("clang loop unroll_count(8)")
	for (int j = 0; j < PACKED_LANES; j++)
		v[j] += p[j];
}

/* Add the contribution and send the sum (the bank's bias `bias`, this contribution's included). */
static __always_inline __u64 packed_add_send(__u64 *v, __u64 *p, __u64 bias, __u64 top, __u64 ones)
{
	__u64 min = 0;
	_Pragma("clang loop unroll_count(4)")
	for (int j = 0; j < PACKED_LANES; j++) {
		__u64 s = v[j] + p[j], o = packed_sub(s, bias, top);
		v[j] = s;
		p[j] = o;
		min |= packed_min(o, top, ones);
		LANE_DONE();
	}
	return packed_high(min);
}

/* Send a bank's sum (bias `bias`) without adding to it. */
static __always_inline __u64 packed_send(__u64 *v, __u64 *p, __u64 bias, __u64 top, __u64 ones)
{
	__u64 min = 0;
	_Pragma("clang loop unroll_count(4)")
	for (int j = 0; j < PACKED_LANES; j++) {
		__u64 o = packed_sub(v[j], bias, top);
		p[j] = o;
		min |= packed_min(o, top, ones);
		LANE_DONE();
	}
	return packed_high(min);
}

/* x + y field by field, modulo each field's range (no carry crosses a field). */
static __always_inline __u64 packed_add2(__u64 x, __u64 y, __u64 top)
{
	return ((x & ~top) + (y & ~top)) ^ ((x ^ y) & top);
}

/* A packed layout's constants, picked without a branch from `dual`: all ones for dual lanes, 0 for
 * quad lanes. A value, not a constant, so that both layouts take the one copy of a loop that uses
 * it (the verifier walks it once, not once a layout). */
struct packed_layout {
	__u64 one;    /* one contribution's bias, 2**m in every field (m = 7 or 15) */
	__u64 top;    /* every field's top bit, 2**(w-1) (w = 16 or 32) */
	__u64 ones;   /* a one in every field */
	__u64 field;  /* the lowest field's bits */
	__s64 m, w;
};

static __always_inline struct packed_layout packed_layout(__u64 dual)
{
	struct packed_layout l = {
		.one = Q8_BIAS ^ (dual & (Q8_BIAS ^ D16_BIAS)),
		.top = Q8_TOP ^ (dual & (Q8_TOP ^ D16_TOP)),
		.ones = Q8_ONES ^ (dual & (Q8_ONES ^ D16_ONES)),
		.field = 0xFFFF | (dual & 0xFFFF0000ULL),
		.m = 7 + (__s64)(dual & 8),
		.w = 16 + (__s64)(dual & 16),
	};
	return l;
}

/* Add a contribution at a finer exponent than the bank's (which keeps its own): only the values are
 * shifted, floor(y / 2**sb), the common way workers' exponents differ. A field's y + one (one = 2**m,
 * its bias) is what the packet's field holds, x, and for sb <= m floor(y / 2**sb) + one is
 * (x >> sb) + one - (one >> sb): one shift of the lane, a mask and an add of a constant, in [0, 2**w)
 * as a contribution's field is, so the lane takes it as it takes one (the bias grows by one). A y
 * below 2**m floors to the same for every sb >= m. */
static __always_inline void packed_add_shifted(__u64 *v, __u64 *p, int sb, __u64 dual)
{
	struct packed_layout l = packed_layout(dual);
	sb = (int)min_nobranch(sb, l.m);
	__u64 mask = (l.field >> sb) * l.ones, k = l.one - (l.one >> sb);
	_Pragma("clang loop unroll_count(4) vectorize(disable) interleave(disable)")
	for (int j = 0; j < PACKED_LANES; j++) {
		v[j] += ((p[j] >> sb) & mask) + k;
		LANE_DONE();
	}
}

/* Add a contribution at a coarser exponent than the bank's: each field's true sum is shifted right
 * by sa (floor: aligned to the contribution's scale, as the int32 lanes are), the contribution
 * added, and the lane kept under the new bias. Every field of a lane at once: a field is first taken
 * to offset binary (its true value X as X + 2**(w-1), w bits wide), where floor(X / 2**sa) is a
 * shift of the whole lane, a mask and an add of 2**(w-1) - 2**(w-1-sa) (sa < w). A w-bit X gives
 * the same floor for every sa >= w - 1, so the shift stops there. */
static __always_inline void packed_add_aligned(__u64 *v, __u64 *p, __u64 bias, int sa, __u64 dual)
{
	struct packed_layout l = packed_layout(dual);
	sa = (int)min_nobranch(sa, l.w - 1);
	__u64 to_ob = packed_sub(l.top, bias, l.top);     /* a bank field's X + c to X + 2**(w-1) */
	__u64 x_ob = l.top - l.one;                       /* ... a contribution's y + one (no carry) */
	__u64 mask = (l.field >> sa) * l.ones, add = l.top - (l.top >> sa);
	__u64 bias_new = bias + l.one;
	/* not vectorised: clang would add a second copy of the loop, two lanes an iteration behind a
	 * test that v and p do not overlap, and the verifier would walk both */
	_Pragma("clang loop unroll(disable) vectorize(disable) interleave(disable)")
	for (int j = 0; j < PACKED_LANES; j++) {
		__u64 s = ((packed_add2(v[j], to_ob, l.top) >> sa) & mask) + add;  /* each < 2**w */
		/* s plus the contribution in offset binary (p[j] + x_ob) is the sum plus 2**w in each
		 * field: modulo 2**w, the sum */
		v[j] = packed_add2(packed_add2(s, p[j] + x_ob, l.top), bias_new, l.top);
		LANE_DONE();
	}
}

/* A fresh bank: the lanes take the contribution (bias 2**31). */
static __always_inline void lanes_set(__u64 *v, __u32 *p)
{
	_Pragma("clang loop unroll_count(8)")
	for (int i = 0; i < ELEMS; i++)
		v[i] = p[i] ^ LANE_FLIP;
}

/* The common case: one load, one xor, one add, one store a lane (the bias grows by 2**31). */
static __always_inline void lanes_add(__u64 *v, __u32 *p)
{
	_Pragma("clang loop unroll_count(8)")
	for (int i = 0; i < ELEMS; i++)
		v[i] += p[i] ^ LANE_FLIP;
}

/* Add the contribution and send the sum back in the same pass, for a new bias (old + 2**31) that is
 * even. The lanes keep the sum under that bias (keep_t == 0: a released result, whose re-reads are
 * then the cheap even copy), or t, i.e. bias -2**31 (keep_t == 1: a bank that stays open, so the
 * next contribution's new bias is even again). Returns the OR of every t. */
static __always_inline __u64 lanes_add_send_even(__u64 *v, __u32 *p, __u64 above, const int keep_t)
{
	__u64 high = 0;
	_Pragma("clang loop unroll_count(4)")
	for (int j = 0; j < LANE_PAIRS; j++) {
		__u32 *q = p + 2 * j;
		__u64 *w = v + 2 * j;
		__u64 s0 = w[0] + (q[0] ^ LANE_FLIP);
		__u64 s1 = w[1] + (q[1] ^ LANE_FLIP);
		q[0] = (__u32)s0;
		q[1] = (__u32)s1;
		__u64 t0 = s0 + above, t1 = s1 + above;
		w[0] = keep_t ? t0 : s0;
		w[1] = keep_t ? t1 : s1;
		high |= t0 | t1;
		LANE_DONE();
	}
	if (ELEMS & 1) {
		int i = ELEMS - 1;
		__u64 s = v[i] + (p[i] ^ LANE_FLIP), t = s + above;
		p[i] = (__u32)s;
		v[i] = keep_t ? t : s;
		high |= t;
	}
	return high;
}

/* The same for an odd new bias: the lanes keep the sum, the int32 is t's low half, top bit flipped. */
static __always_inline __u64 lanes_add_send_odd(__u64 *v, __u32 *p, __u64 above)
{
	__u64 high = 0;
	_Pragma("clang loop unroll_count(4)")
	for (int i = 0; i < ELEMS; i++) {
		__u64 s = v[i] + (p[i] ^ LANE_FLIP), t = s + above;
		v[i] = s;
		high |= t;
		p[i] = (__u32)(t ^ LANE_FLIP);
		LANE_DONE();
	}
	return high;
}

/* Send a bank's sum (bias + 2**31 = above) without adding to it. Returns the OR of every t. */
static __always_inline __u64 lanes_send(__u64 *v, __u32 *p, __u64 above, __u64 bias)
{
	__u64 high = 0;
	if ((__u32)bias == 0) {
		_Pragma("clang loop unroll_count(8)")
		for (int i = 0; i < ELEMS; i++) {
			__u64 lane = v[i];
			p[i] = (__u32)lane;
			high |= lane + above;
			LANE_DONE();
		}
	} else {
		_Pragma("clang loop unroll_count(8)")
		for (int i = 0; i < ELEMS; i++) {
			__u64 t = v[i] + above;
			high |= t;
			p[i] = (__u32)(t ^ LANE_FLIP);
			LANE_DONE();
		}
	}
	return high;
}

/* Send a bank's sum whose overflow is already known: the int32s only. */
static __always_inline void lanes_copy(__u64 *v, __u32 *p, __u64 bias)
{
	if ((__u32)bias == 0) {
		_Pragma("clang loop unroll_count(8)")
		for (int i = 0; i < ELEMS; i++)
			p[i] = (__u32)v[i];
	} else {
		_Pragma("clang loop unroll_count(8)")
		for (int i = 0; i < ELEMS; i++)
			p[i] = (__u32)(v[i] ^ LANE_FLIP);
	}
}

#endif /* AGGD_LANES_H */
