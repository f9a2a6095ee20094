/* Maps and their value layouts. Userspace reads these layouts from bcc (ctypes types generated
 * from this file), so there is no hand-written copy to drift. Names are checked at start-up by
 * aggd/xdp_loader.py (MAP_NAMES). */
#ifndef AGGD_MAPS_H
#define AGGD_MAPS_H

#include "aggd_proto.h"

#ifndef ELEMS
#define ELEMS AGGD_DEFAULT_ELEMENTS
#endif
#ifndef TOTAL_SLOTS
#define TOTAL_SLOTS 4096
#endif

#define NO_JOB AGGD_MAX_JOBS /* counter bucket for packets not (yet) tied to a job */

/* FORWARDED: a rack job's round, complete here and sent up to its upper aggregator, whose result
 * releases it (docs/protocol.md, "Two levels"); open for admission, not a bank to reuse. */
enum bank_state { BANK_EMPTY = 0, BANK_OPEN = 1, BANK_RELEASED = 2, BANK_FORWARDED = 3 };

/* Banks a slot keeps: ssp:2 needs three open rounds plus one released round kept for re-reads. */
#define NBANKS 4

/* One entry of a job's strategy ring: governs rounds >= from_round until a newer entry does. */
struct strategy_entry {
	__u32 from_round;
	__u16 version;
	__u8 kind;     /* enum aggd_strategy_kind */
	__u8 valid;
	__u16 param;   /* quorum k / ssp staleness */
	__u16 _pad;
	__u32 timeout_us;
};

struct job_cfg {
	__u8 active;
	__u8 precision;      /* Precision of its contributions and results (docs/protocol.md) */
	__u16 world;
	__u32 slot_base;     /* first slot of the job's pool in `slots` */
	__u32 n_slots;       /* pool size: chunk c uses slot c % n_slots */
	__u32 kernel_slots;  /* slots held in the kernel; the rest are served in user space */
	__u32 max_chunks;    /* chunk numbers at or above are malformed */
	__be32 group_ip;     /* results go to this multicast group ... */
	__be16 result_port;  /* ... on this UDP port */
	__u8 group_mac[6];
	__u64 all_members;   /* bitmap with the world's bits set */
	struct strategy_entry strategy[AGGD_STRATEGY_VERSIONS];
	/* A rack job (docs/protocol.md, "Two levels"): complete rounds go up to the upper job as one
	 * contribution, from this host (self_*) to the upper aggregator (up_*, up_mac its next hop);
	 * its results come back through `upstreams`. */
	__u8 upstream;       /* 0: results are final here; 1: a rack job not linked yet; 2: linked */
	__u8 up_mac[6];
	__u8 _pad1;
	__u16 up_job;
	__u16 up_rank;
	__be32 up_ip;
	__be16 up_port;
	__u8 self_mac[6];
	__be32 self_ip;
	__u32 _pad2;
	__u64 up_tag;        /* the rack's member tag in the upper job */
	/* A per-member bound on a contribution's values, bound_mant * 2**bound_exp (docs/protocol.md,
	 * "Bounds"): a value q * 2**-e is within it when |q| <= bound_mant << (bound_exp + e). */
	__u32 bound_mant;
	__s16 bound_exp;
	__u8 bounded;
	__u8 _pad3;
	/* ... and on their L2 norm, norm_mant * 2**norm_exp: within it when the sum of q**2 is at most
	 * norm_mant**2 shifted by 2 * (norm_exp + e) (aggd_xdp.c: beyond_norm). */
	__u32 norm_mant;
	__s16 norm_exp;
	__u8 norm_bounded;
	__u8 _pad4;
};

/* Whose results a result is: the upper aggregator's address and job -> the rack job. */
struct upstream_key {
	__be32 ip;
	__be16 port;
	__u16 job;
};

struct member {
	__be32 ip;
	__be16 port;
	__u8 valid;
	__u8 _pad;
	__u64 tag;           /* its JOIN_ACK's tag, which its packets carry in contributors (0: none) */
};

/* One round of one chunk (docs/protocol.md, "Strategies"). */
struct bank {
	__u64 key;           /* (round << 32) | chunk */
	__u64 bitmap;        /* members whose own contribution was added */
	__u64 late;          /* members whose late contribution to this round was carried on */
	__u64 t_first;       /* ns of the first contribution (quorum deadline) */
	__u32 timeout_us;
	__u16 n_contrib;
	__s16 exponent;
	__u16 version;       /* strategy entry governing this round, copied when it opened */
	__u8 state;          /* enum bank_state */
	__u8 flags;          /* AGGD_FLAG_CARRIED; AGGD_FLAG_OVERFLOW once a released sum that does
	                      * not fit int32 has been sent (later answers copy it unchecked) */
	__u8 kind;
	__u8 param;
	__u8 unannounced;    /* released by its deadline: the next answer from it goes to the group */
	__u8 holding;        /* opened by a carry, no own contribution yet: outside the key order,
	                      * admission and deadline (docs/protocol.md, rule 4) */
	__u16 skip;          /* the opening packet's skip: a rack job's forwarded sum carries it */
	__u16 count;         /* the round's count (the opening packet's; in a carry's holding bank,
	                      * the first own contribution's): its results carry it, not a late
	                      * packet's, maybe another tensor's (Bank.count) */
	__u16 carried;       /* late contributions carried into it: a quorum round takes at most the
	                      * world's (Bank.carried) */
	/* members known to hold this round's result (the model's Bank.held): a released ssp/async
	 * bank is reused only once it has every awaited member */
	__u64 held;
	__u8 steps[AGGD_MAX_MEMBERS]; /* bitmask of the steps (0..7) added from each member */
	/* Exact sums, kept biased so the hot loop needs no sign extension and no overflow test: every
	 * contribution adds each int32 x as x - 2**31 (modulo 2**64) and 2**31 to `bias`, and a lane's
	 * true sum is (__s64)(values[i] + bias) (a send may rebias the lanes: aggd_lanes.h). Whether it
	 * fits int32 is decided when a result is copied out (docs/protocol.md, "Overflow"). */
	__u64 bias;
	__u64 values[ELEMS];
};

/* Working memory of one packet's decision, used only under the slot's lock. Keeping the scan's
 * results here instead of in registers lets the verifier merge the paths through the scan (values
 * read back from map memory are not tracked precisely), which keeps it far below its limits. */
struct scratch {
	__s32 ik, ifree, irel_old, itarget, irel_chunk, irel_chunk2, ihold;
	__u32 used, nopen, nhold, nfree, nempty, min_open_round, have_chunk, timeouts, settled;
	/* whether the oldest released bank is kept (ssp/async, not every awaited member holds it):
	 * released banks go oldest first, so then a new round quorum does not govern takes none;
	 * old_kept_q: kept from a quorum round too (a slot serving several chunk indices: Slot.shared) */
	__u64 old_kept, old_kept_q;
	__u64 newest, target_key, rel_chunk_key, rel_chunk2_key, chunk_newest, hold_key;
	__s32 add, out, reason;
	__u32 add_fresh, add_carried, late, out_group, partial, released, forward, in_order;
	/* the oldest released bank unless old_kept_q, and nfree counting the released banks a new
	 * round quorum governs may take (only those of a shared slot are kept from it); irel_old is
	 * the oldest unless old_kept */
	__s32 irel_old_q;
	__u32 nfree_q;
	__u64 rel_old_key_q;
	__u32 uncarried;    /* a late contribution answered without being added (rule 4) */
	__u32 passed_full;  /* rule 4 passed over a later round full of carries (Bank.carried) */
	__u64 hold_newest;  /* the largest key of the chunk's holding banks (0: none; never round 0) */
	__u64 lag_ns;       /* the added packet's lag, kept here across the copying loops */
	__u32 written;      /* the adding loop wrote the result into the packet ... */
	__u64 written_high; /* ... and this is the OR of its values + 2**31 */
};

struct slot {
	struct bpf_spin_lock lock;
	__u32 _pad;
	struct scratch sc;
	/* Per member, its late step-0 contributions to one round (round + 1; 0: none), by the chunk's
	 * index in the slot (chunk / n_slots, below 64): refused busy (not counted) and carried with
	 * no result to answer with (counted). When a retransmission arrives after its round's bank is
	 * gone, this tells it apart from a copy of one already counted (which is stale). */
	__u64 late_round[AGGD_MAX_MEMBERS];
	__u64 late_refused[AGGD_MAX_MEMBERS];
	__u64 late_carried[AGGD_MAX_MEMBERS];
	/* The smallest key rule 3 refused under ssp/async, plus one (0: none): no later key
	 * opens before it (the model's Slot.pending) */
	__u64 pending;
	/* 1 once a key of chunk n_slots or beyond came (the slot serves several chunk indices a
	 * round) or an ORDERED one (a quorum member whose tensors differ): the model's Slot.shared */
	__u64 shared;
	struct bank bank[NBANKS];
};

struct job_stats {
	__u64 counter[AGGD_COUNTER__COUNT];
	__u64 drop[AGGD_DROP_REASON__COUNT];
	__u64 max_round;     /* highest round a member sent, plus one (0: none): hot swaps start after it */
};

/* With -DAGGD_PIN_DIR="/sys/fs/bpf/aggd" the maps are pinned there and reused by the next load, so
 * jobs, members, slots and counters survive a daemon restart (the daemon checks the layout first). */
#ifdef AGGD_PIN_DIR
#define AGGD_MAP(type, leaf, name, n) BPF_TABLE_PINNED(type, u32, leaf, name, n, AGGD_PIN_DIR "/" #name)
#else
#define AGGD_MAP(type, leaf, name, n) BPF_TABLE(type, u32, leaf, name, n)
#endif

AGGD_MAP("array", struct job_cfg, jobs, AGGD_MAX_JOBS);
AGGD_MAP("array", struct member, members, AGGD_MAX_JOBS * AGGD_MAX_MEMBERS);
AGGD_MAP("array", struct slot, slots, TOTAL_SLOTS);
AGGD_MAP("percpu_array", struct job_stats, stats, AGGD_MAX_JOBS + 1);
/* Per member: how late it starts its rounds, for the straggler detector and the lag metrics.
 * lag = arrival of its step-0 chunk 0 - the round's first contribution (0 for the first arriver),
 * summed in ns; its other chunks follow the others' answers and come in step. */
struct member_stats {
	__u64 contributions;  /* own contributions added (carried ones included) */
	__u64 lag_ns_sum;     /* sum of lags of its calls' starts (step-0 chunk 0, not carried) */
	__u64 last_round;     /* highest round contributed, plus one (0: none) */
	__u64 last_ns;        /* time of the last contribution */
	__u64 late;           /* contributions that arrived after their round was released */
	__u64 offences;       /* contributions dropped beyond the job's bound */
};
AGGD_MAP("percpu_array", struct member_stats, member_stats, AGGD_MAX_JOBS * AGGD_MAX_MEMBERS);
/* Time source: 0 means bpf_ktime_get_ns(); tests freeze time by writing a value. */
AGGD_MAP("array", __u64, clock, 1);
/* The interface's own MAC, once attached: a unicast frame for another host (a switch floods one
 * whose destination it has not learnt, e.g. a dead aggregator's) is not ours to answer. */
struct self_addr {
	__u8 mac[6];
	__u8 set;
	__u8 _pad;
};
AGGD_MAP("array", struct self_addr, self_addr, 1);
#ifdef AGGD_PIN_DIR
BPF_TABLE_PINNED("hash", struct upstream_key, __u32, upstreams, AGGD_MAX_JOBS, AGGD_PIN_DIR "/upstreams");
#else
BPF_TABLE("hash", struct upstream_key, __u32, upstreams, AGGD_MAX_JOBS);
#endif

#endif /* AGGD_MAPS_H */
