/* The payload loops: a bank's u64 lanes against the packet's int32 values. Each runs over all ELEMS
 * lanes (a constant trip count after the one bounds check up front, as the verifier wants).
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

/* Packed lanes: an int8 job's lane i holds its values 2i and 2i+1, a and b (sign-extended), as the
 * int32 a + 65536 * b (|65536 * b| <= 2**23), so a lane's sum is the a's sum plus 65536 times the
 * b's, added by the loops below as any int32. The a's sum is the sum's low 16 bits, sign-extended,
 * and the b's is (sum - that) >> 16: exact while the a's sum fits int16, i.e. up to
 * AGGD_INT8_MAX_CONTRIBUTIONS contributions (aggd_xdp.c). */

/* The lane of an int8 pair read as one little-endian int16 (a its low byte, b its high). */
static __always_inline __u32 lane_pack(__s16 w)
{
	return (__u32)((__s32)(__s8)w + (__s32)(w >> 8) * 65536);
}

/* With `pack` all ones (an int8 job), x's low value (x's low 16 bits, sign-extended; its high one is
 * then (x - that) >> 16); with `pack` 0 x itself (and that high one 0). Without a branch, so that the
 * loops using it serve both kinds of lane in one walk of the verifier. */
static __always_inline __s64 lane_lo(__s64 x, __s64 pack)
{
	return x ^ ((x ^ (__s16)x) & pack);
}

/* |x| without a branch */
static __always_inline __u64 abs64(__s64 x)
{
	__s64 sign = x >> 63;
	return (__u64)((x ^ sign) - sign);
}

/* 1 if x is beyond the symmetric int16 range [-32767, 32767], else 0, without a branch. */
static __always_inline __u64 beyond_int16(__s64 x)
{
	return (__u64)((x + 32767) | (32767 - x)) >> 63;
}

/* An int8 job's lane as sent (the low 32 bits v of its sum) into its int16 pair in place (the pair
 * takes the lane's four bytes): lo = v's low 16 bits, hi = (v - lo) >> 16 (in 64 bits: v - lo may be
 * 2**31), each sent as its low 16 bits. Returns 1 if either is beyond [-32767, 32767] (a sum outside
 * it, or a's -32768), else 0. */
static __always_inline __u64 lane_split(__u32 *lane)
{
	__s32 v = (__s32)*lane;
	__s64 lo = (__s16)v, hi = ((__s64)v - lo) >> 16;
	*lane = (__u32)(__u16)lo | (__u32)(__u16)hi << 16;
	return beyond_int16(lo) | beyond_int16(hi);
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
