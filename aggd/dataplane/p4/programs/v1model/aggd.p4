/* aggd on BMv2 simple_switch (v1model): the aggregator of docs/protocol.md in a switch pipeline.
 *
 * Structure (after SwitchML's pipeline, with aggd's 4-bank slots and strategies):
 *   - checks in the order of docs/protocol.md, each drop counted in `drops[bucket * 16 + reason]`;
 *   - job, member, strategy and service tables written by aggd/dataplane/p4.py over P4Runtime;
 *   - per-slot bank state in registers (index slot * 4 + bank), one register per value lane
 *     (index (slot * 4 + bank) * AGGD_PASSES + pass), recirculation for the next AGGD_LANES values;
 *   - results multicast through the packet replication engine (group job + 1), answers to one
 *     sender sent back out of its port;
 *   - everything else forwarded by an L2 table.
 * The slot rules are those of aggd/core/model.py (the reference model), bank by bank, unrolled; async
 * admission as docs/protocol.md and the XDP program have it (fewer than 3 banks open).
 * docs/p4.md explains the design and how to run it. Build: `make p4` (p4c-bm2-ss --arch v1model). */
#include <core.p4>
#include <v1model.p4>

#include "../common/parser.p4"

#define BANK_FIELDS(i) \
    bit<8> st##i; bit<32> rd##i; bit<32> ch##i; bit<8> kd##i; bit<32> to##i; bit<48> tf##i; bit<8> hd##i; \
    bit<64> bm##i; bit<64> hl##i; bit<16> cr##i;

/* Metadata. Fields marked @field_list(1) survive recirculation (the later passes of one packet). */
struct aggd_meta_t {
    @field_list(1) bit<8>  pass;        /* which block of AGGD_LANES values this pass adds */
    @field_list(1) bit<8>  spins;       /* recirculations spent waiting for a locked slot */
    @field_list(1) bit<9>  in_port;     /* the port the packet came in on (answers go back there) */
    @field_list(1) bit<1>  work;        /* lanes work in flight: the slot is locked */
    @field_list(1) bit<32> slot;        /* global slot index */
    @field_list(1) bit<1>  do_add;      /* the payload goes into bank add_cell */
    @field_list(1) bit<32> add_cell;    /* first lane cell of the bank added into */
    @field_list(1) bit<32> add_bank;    /* its bank index (slot * 4 + bank) */
    @field_list(1) bit<1>  fresh;       /* first contribution of the bank: copy, do not add */
    @field_list(1) bit<8>  sa;          /* right shift of the stored sum (exponent alignment) */
    @field_list(1) bit<8>  sb;          /* right shift of the incoming values */
    @field_list(1) bit<1>  ovf;         /* a value sent did not fit int32 in some pass */
    @field_list(1) bit<1>  do_out;      /* a bank's values go back in the packet */
    @field_list(1) bit<32> out_cell;
    @field_list(1) bit<1>  out_is_add;  /* the values sent are the sums just made */
    @field_list(1) bit<1>  to_group;    /* multicast to the job's group, else back to the sender */
    bit<1>  recirc;
    bit<1>  csum;                       /* recompute the IPv4 checksum (rewritten addresses) */
    bit<1>  flood;
    bit<1>  is_aggd;
    bit<1>  fwd;                        /* forward by the L2 table (not ours, or for the daemon) */
    /* jobs table */
    bit<1>  job_ok;
    bit<8>  world;
    bit<64> all_members;
    bit<32> n_slots;
    bit<32> slot_base;
    bit<32> switch_slots;
    bit<32> max_chunks;
    bit<32> group_ip;
    bit<48> group_mac;
    bit<16> result_port;
    bit<16> mcast_grp;
    /* members table */
    bit<1>  member_ok;
    bit<32> member_ip;
    bit<16> member_port;
    bit<64> member_tag;      /* the tag its packets carry in contributors (0: none) */
    /* strategy table */
    bit<32> s_round;
    bit<16> s_version;
    bit<8>  s_kind;
    bit<8>  s_param;
    bit<32> s_timeout;
}

parser AggdParser(packet_in pkt, out headers_t hdr, inout aggd_meta_t meta,
                  inout standard_metadata_t sm) {
    AggdCommonParser() common;
    state start {
        common.apply(pkt, hdr);
        transition accept;
    }
}

control AggdVerifyChecksum(inout headers_t hdr, inout aggd_meta_t meta) {
    apply { }
}

/* Everything aggd does to a packet; AggdIngress forwards what it leaves alone (meta.fwd). */
control AggdPipeline(inout headers_t hdr, inout aggd_meta_t meta, inout standard_metadata_t sm) {
    /* ---- counters -------------------------------------------------------------------------- */
    counter(AGGD_JOB_ROWS * AGGD_DROP_STRIDE, CounterType.packets) drops;
    /* Per-job counters grow by packet, byte and element counts: registers, read-modify-write. */
    register<bit<64>>(AGGD_JOB_ROWS * AGGD_COUNTER_STRIDE) job_counters;
    /* Highest round a member of the job sent, plus one (0: none): hot swaps start after it. */
    register<bit<32>>(AGGD_MAX_JOBS) max_round;
    /* 0: the switch's clock; anything else: frozen time in microseconds (tests). */
    register<bit<48>>(1) clock;

    /* ---- slots ----------------------------------------------------------------------------- */
    register<bit<1>>(AGGD_SLOTS) slot_lock;
    /* the smallest key rule 3 refused under ssp/async, plus one (0: none): no later key
     * opens before it (aggd/core/model.py, Slot.pending) */
    register<bit<64>>(AGGD_SLOTS) slot_pending;
    /* 1 once a key of chunk n_slots or beyond came: the slot serves several chunk indices a round
     * (Slot.shared) */
    register<bit<8>>(AGGD_SLOTS) slot_shared;
    register<bit<8>>(AGGD_BANK_CELLS) bank_state;
    register<bit<32>>(AGGD_BANK_CELLS) bank_round;
    register<bit<32>>(AGGD_BANK_CELLS) bank_chunk;
    register<bit<64>>(AGGD_BANK_CELLS) bank_bitmap;
    register<bit<64>>(AGGD_BANK_CELLS) bank_late;
    register<bit<16>>(AGGD_BANK_CELLS) bank_n;
    register<bit<16>>(AGGD_BANK_CELLS) bank_exp;
    register<bit<8>>(AGGD_BANK_CELLS) bank_flags;
    register<bit<16>>(AGGD_BANK_CELLS) bank_version;
    register<bit<8>>(AGGD_BANK_CELLS) bank_kind;
    register<bit<8>>(AGGD_BANK_CELLS) bank_param;
    register<bit<32>>(AGGD_BANK_CELLS) bank_timeout;
    register<bit<48>>(AGGD_BANK_CELLS) bank_t_first;
    /* 1: released by its deadline, not yet announced: the first answer from it goes to the group */
    register<bit<8>>(AGGD_BANK_CELLS) bank_unannounced;
    /* 1: opened by a carry (rule 4), no member's own contribution yet: outside the slot's key
     * order, admission (but async's count of open banks) and the quorum deadline; the chunk's
     * next round adopts it */
    register<bit<8>>(AGGD_BANK_CELLS) bank_holding;
    /* members known to hold the bank's result (Bank.held): a released ssp/async bank is reused
     * only once it has every awaited member */
    register<bit<64>>(AGGD_BANK_CELLS) bank_held;
    /* the round's count, which its results carry (Bank.count) */
    register<bit<16>>(AGGD_BANK_CELLS) bank_count;
    /* late contributions carried into the bank: a quorum round takes at most the world's, so it
     * holds at most the 2 * world terms its members quantise for (Bank.carried) */
    register<bit<16>>(AGGD_BANK_CELLS) bank_carried;
    /* Per member, the steps (0..7) of its contributions this round took: a bitmask, index
     * bank * 64 + rank. Every strategy deduplicates by (member, step); step >= 8 counts as taken. */
    register<bit<8>>(AGGD_BANK_CELLS * AGGD_MAX_MEMBERS) bank_steps;
    /* Per member of a slot (index slot * 64 + rank), its late memory (rule 4): its step-0 late
     * contributions to one round (late_round = round + 1; 0: none), one bit per chunk index in the
     * slot (chunk / n_slots, below 64): refused busy (not counted: a retransmission is carried) and
     * carried with no released result of the chunk to answer with (counted: a retransmission is
     * answered once there is one). A retransmission whose round's bank is gone is otherwise stale. */
    register<bit<64>>(AGGD_SLOTS * AGGD_MAX_MEMBERS) late_round;
    register<bit<64>>(AGGD_SLOTS * AGGD_MAX_MEMBERS) late_refused;
    register<bit<64>>(AGGD_SLOTS * AGGD_MAX_MEMBERS) late_carried;
    /* The values: one register per lane (SwitchML), index bank * AGGD_PASSES + pass. */
/* Exact sums (docs/protocol.md, "Overflow"): 64-bit lanes; what is sent is narrowed to int32. */
#define AGGD_LANE_REGISTER(i) register<bit<64>>(AGGD_LANE_CELLS) lane_##i;
    AGGD_FOR_LANES(AGGD_LANE_REGISTER)

    /* ---- tables ---------------------------------------------------------------------------- */
    action drop() {
        mark_to_drop(sm);
    }

    action aggd_serve() {
        meta.is_aggd = 1;
    }

    /* The aggregator's address: UDP to (address, port) is aggd's; results come from there. */
    table aggd_service {
        key = {
            hdr.ipv4.dst_addr: exact;
            hdr.udp.dst_port: exact;
        }
        actions = { aggd_serve; @defaultonly NoAction; }
        default_action = NoAction();
        size = 16;
    }

    action set_job(bit<8> world, bit<64> all_members, bit<32> n_slots, bit<32> slot_base,
                   bit<32> switch_slots, bit<32> max_chunks, bit<32> group_ip, bit<48> group_mac,
                   bit<16> result_port, bit<16> mcast_grp) {
        meta.job_ok = 1;
        meta.world = world;
        meta.all_members = all_members;
        meta.n_slots = n_slots;
        meta.slot_base = slot_base;
        meta.switch_slots = switch_slots;
        meta.max_chunks = max_chunks;
        meta.group_ip = group_ip;
        meta.group_mac = group_mac;
        meta.result_port = result_port;
        meta.mcast_grp = mcast_grp;
    }

    table jobs {
        key = { hdr.aggd.job: exact; }
        actions = { set_job; @defaultonly NoAction; }
        default_action = NoAction();
        size = AGGD_MAX_JOBS;
    }

    action set_member(bit<32> ip, bit<16> port, bit<64> tag) {
        meta.member_ok = 1;
        meta.member_ip = ip;
        meta.member_port = port;
        meta.member_tag = tag;
    }

    table members {
        key = {
            hdr.aggd.job: exact;
            hdr.aggd.rank: exact;
        }
        actions = { set_member; @defaultonly NoAction; }
        default_action = NoAction();
        size = 16384;   /* AGGD_MAX_JOBS * AGGD_MAX_MEMBERS */
    }

    action set_strategy(bit<16> version, bit<8> kind, bit<8> param, bit<32> timeout_us) {
        meta.s_version = version;
        meta.s_kind = kind;
        meta.s_param = param;
        meta.s_timeout = timeout_us;
    }

    /* The versioned strategy table: job exact, round range. The control plane writes one entry per
     * distinct from_round, [from_round, next from_round - 1], the first from round 0 (docs/p4.md). */
    table strategy {
        key = {
            hdr.aggd.job: exact;
            meta.s_round: range;
        }
        actions = { set_strategy; }
        default_action = set_strategy(0, 0, 0, 0);   /* sync, version 0 */
        size = 1024;   /* AGGD_MAX_JOBS * AGGD_STRATEGY_VERSIONS */
    }

    /* ---- helpers ----------------------------------------------------------------------------- */
    bit<64> cv;
#define BUMP(c, n) \
    job_counters.read(cv, (bit<32>)hdr.aggd.job * AGGD_COUNTER_STRIDE + (bit<32>)(c)); \
    job_counters.write((bit<32>)hdr.aggd.job * AGGD_COUNTER_STRIDE + (bit<32>)(c), cv + (bit<64>)(n));
#define COUNT_DROP(bucket, reason) \
    drops.count((bit<32>)(bucket) * AGGD_DROP_STRIDE + (bit<32>)(reason));

    action nack(bit<8> code) {
        /* A bare header back to the sender: job, rank, round, chunk echoed, code set, rest 0. */
        hdr.aggd.type = AGGD_MSG_TYPE_NACK;
        hdr.aggd.code = code;
        hdr.aggd.count = 0;
        hdr.aggd.strategy_version = 0;
        hdr.aggd.exponent = 0;
        hdr.aggd.flags = 0;
        hdr.aggd.contributors = 0;
        hdr.aggd.n_contrib = 0;
        hdr.aggd.step = 0;
        hdr.aggd.strategy = 0;
        hdr.aggd.param = 0;
        hdr.aggd.skip = 0;
        hdr.lanes.setInvalid();
#if AGGD_PASSES > 1
        hdr.tail[0].setInvalid();
#if AGGD_PASSES > 2
        hdr.tail[1].setInvalid();
#endif
#if AGGD_PASSES > 3
        hdr.tail[2].setInvalid();
#endif
#endif
        hdr.ipv4.total_len = 20 + 8 + 40;
        hdr.udp.length = 8 + 40;
        truncate(14 + 20 + 8 + 40);
        meta.do_out = 1;
        meta.to_group = 0;
    }

    action to_sender() {
        bit<48> mac = hdr.ethernet.src_addr;
        bit<32> ip = hdr.ipv4.src_addr;
        bit<16> port = hdr.udp.src_port;
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.ethernet.dst_addr = mac;
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr;
        hdr.ipv4.dst_addr = ip;
        hdr.ipv4.ttl = 64;
        hdr.ipv4.identification = 0;   /* a fixed ID with DF: a receiver's GRO coalesces */
        hdr.ipv4.flags = 2;
        hdr.ipv4.frag_offset = 0;
        hdr.udp.src_port = hdr.udp.dst_port;
        hdr.udp.dst_port = port;
        hdr.udp.checksum = 0;
        sm.egress_spec = meta.in_port;
        meta.csum = 1;
    }

    action to_group() {
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.ethernet.dst_addr = meta.group_mac;
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr;
        hdr.ipv4.dst_addr = meta.group_ip;
        hdr.ipv4.ttl = 64;
        hdr.ipv4.identification = 0;   /* a fixed ID with DF: a receiver's GRO coalesces */
        hdr.ipv4.flags = 2;
        hdr.ipv4.frag_offset = 0;
        hdr.udp.src_port = AGGD_PORT;
        hdr.udp.dst_port = meta.result_port;
        hdr.udp.checksum = 0;
        sm.mcast_grp = meta.mcast_grp;
        meta.csum = 1;
    }

    apply {
        /* Locals of the slot rules (declared once: the bank scan below is unrolled by macros). */
        BANK_FIELDS(0) BANK_FIELDS(1) BANK_FIELDS(2) BANK_FIELDS(3)
        bit<48> now;
        bit<64> key;
        bit<64> k;
        bit<64> bit_x;
        bit<32> used = 0;
        bit<32> nopen = 0;
        bit<32> nhold = 0;         /* holding banks (open, outside the key order) */
        bit<32> nfree = 0;         /* empty or released banks */
        bit<32> timeouts = 0;
        bit<32> settled = 0;       /* rounds released by rule 0 for members declared gone */
        bit<32> min_open = 0xFFFFFFFF;
        bit<8> ifree = NO_BANK;
        bit<8> ik = NO_BANK;
        bit<8> itarget = NO_BANK;
        bit<8> irel_old = NO_BANK;
        bit<8> irel_chunk = NO_BANK;
        bit<64> newest = 0;
        bit<64> chunk_newest = 0;  /* newest key of the packet's chunk, holding banks aside */
        bit<1> have_chunk = 0;
        bit<8> iheld = NO_BANK;    /* the chunk's open holding bank with the smallest key */
        bit<64> held_key = 0;
        bit<64> target_key = 0xFFFFFFFFFFFFFFFF;
        bit<32> nempty = 0;
        bit<1> kept = 0;
        bit<1> old_kept = 0;       /* the oldest released bank is kept */
        bit<1> kept_q = 0;         /* ... and from a quorum round too (a slot serving several chunk indices) */
        bit<1> old_kept_q = 0;
        bit<8> shared;             /* slot_shared */
        bit<1> uncarried = 0;      /* a late quorum contribution answered, not added */
        bit<64> rel_chunk_key = 0;
        bit<8> add = NO_BANK;
        bit<8> out = NO_BANK;
        bit<8> reason = 0xFF;
        bit<1> late = 0;
        bit<1> carried = 0;
        bit<1> want_open = 0;
        bit<1> hold = 0;           /* the bank to open is a carry's holding bank */
        bit<1> passed_full = 0;    /* rule 4 passed over a later round full of carries (Bank.full) */
        bit<64> hold_newest = 0;   /* the largest key of the chunk's holding banks (0: none) */
        bit<16> t_carried;
        bit<1> refuse_late = 0;    /* a carry refused busy: remembered in the late memory */
        bit<33> r2;
        bit<1> fresh = 0;
        bit<1> released = 0;
        bit<1> partial = 0;
        bit<32> open_round = 0;
        bit<8> pick = NO_BANK;
        bit<8> b_state;
        bit<8> b_kind;
        bit<8> b_param;
        bit<8> b_flags;
        bit<16> b_n;
        bit<16> b_exp;
        bit<16> b_count;           /* bank_count of the bank sent back */
        bit<16> b_version;
        bit<32> b_round;
        bit<32> b_chunk;
        bit<8> b_steps;
        bit<8> b_unannounced;
        bit<32> ridx;
        bit<32> kidx;
        bit<64> kbit = 0;
        bit<1> remembered = 0;
        bit<1> known = 0;
        bit<64> l_round;
        bit<64> l_refused;
        bit<64> l_carried;
        bit<8> b_holding;
        bit<64> pending;           /* slot_pending: a key refused before, plus one (0: none) */
        bit<32> nfree_q = 0;       /* as nfree and irel_old, for a new round quorum governs: */
        bit<8> irel_old_q = NO_BANK;   /* no released bank is kept (Slot.reusable) */
        bit<64> rel_old_key_q = 0xFFFFFFFFFFFFFFFF;
        bit<64> b_bitmap;
        bit<64> b_late;
        bit<32> base;
        bit<32> payload_len;
        bit<32> slot_idx;
        bit<32> mr;
        bit<1> locked;
        bit<1> counted;

        if (meta.pass == 0 && meta.spins == 0) {
            meta.in_port = sm.ingress_port;
        }
        if (hdr.udp.isValid()) {
            aggd_service.apply();
        }
        if (meta.is_aggd == 0 && meta.pass == 0) {
            meta.fwd = 1;              /* not ours: a plain L2 switch */
            return;
        }
        if (hdr.aggd.isValid()) {
            jobs.apply();
        }

        if (meta.pass == 0) {
            /* ---- checks, in the order of docs/protocol.md ------------------------------------ */
            if (meta.spins == 0) {
                if (!hdr.aggd.isValid() || hdr.udp.length < 8 + 40 ||
                    sm.packet_length < 14 + 20 + (bit<32>)hdr.udp.length) {
                    COUNT_DROP(AGGD_NO_JOB, AGGD_DROP_REASON_TOO_SHORT)
                    drop();
                    return;
                }
                if (hdr.aggd.magic != (bit<16>)AGGD_MAGIC) {
                    COUNT_DROP(AGGD_NO_JOB, AGGD_DROP_REASON_BAD_MAGIC)
                    drop();
                    return;
                }
                if (hdr.aggd.version != (bit<8>)AGGD_VERSION) {
                    COUNT_DROP(AGGD_NO_JOB, AGGD_DROP_REASON_BAD_VERSION)
                    drop();
                    return;
                }
                if (hdr.aggd.type == AGGD_MSG_TYPE_JOIN || hdr.aggd.type == AGGD_MSG_TYPE_JOIN_ACK ||
                    hdr.aggd.type == AGGD_MSG_TYPE_RESULT || hdr.aggd.type == AGGD_MSG_TYPE_SHARDS) {
                    meta.fwd = 1;      /* membership, shard maps and a rack job's upper results: the daemon's */
                    return;
                }
                if (hdr.aggd.type != AGGD_MSG_TYPE_CONTRIB && hdr.aggd.type != AGGD_MSG_TYPE_REREAD) {
                    COUNT_DROP(AGGD_NO_JOB, AGGD_DROP_REASON_BAD_TYPE)
                    drop();
                    return;
                }
                payload_len = (bit<32>)hdr.udp.length - 48;
                /* the bytes `count` values take in the payload's Precision (int32 if it names none) */
                bit<32> needed = (bit<32>)hdr.aggd.count * 4;
                if (hdr.aggd.code == AGGD_PRECISION_INT16) {
                    needed = (bit<32>)hdr.aggd.count * 2;
                } else if (hdr.aggd.code == AGGD_PRECISION_INT8) {
                    needed = (bit<32>)hdr.aggd.count;
                }
                if (hdr.aggd.count == 0 || (bit<32>)hdr.aggd.count > AGGD_ELEMENTS || needed > payload_len) {
                    COUNT_DROP(AGGD_NO_JOB, AGGD_DROP_REASON_BAD_COUNT)
                    drop();
                    return;
                }
                if (meta.job_ok == 0) {
                    COUNT_DROP(AGGD_NO_JOB, AGGD_DROP_REASON_UNKNOWN_JOB)
                    nack(AGGD_NACK_CODE_UNKNOWN_JOB);
                    to_sender();
                    return;
                }
                BUMP(AGGD_COUNTER_RX_PACKETS, 1)
                BUMP(AGGD_COUNTER_RX_BYTES, hdr.udp.length - 8)
                if ((hdr.aggd.flags & AGGD_FLAG_RETRANSMIT) != 0) {
                    BUMP(AGGD_COUNTER_RETRANSMITS, 1)
                }
                if (hdr.aggd.rank >= (bit<16>)meta.world) {
                    COUNT_DROP(hdr.aggd.job, AGGD_DROP_REASON_BAD_RANK)
                    nack(AGGD_NACK_CODE_NOT_MEMBER);
                    to_sender();
                    return;
                }
                members.apply();
                if (meta.member_ok == 0 || meta.member_ip != hdr.ipv4.src_addr ||
                    meta.member_port != hdr.udp.src_port) {
                    COUNT_DROP(hdr.aggd.job, AGGD_DROP_REASON_NOT_MEMBER)
                    nack(AGGD_NACK_CODE_NOT_MEMBER);
                    to_sender();
                    return;
                }
                if (hdr.aggd.contributors != meta.member_tag) {  /* forged: never NACKed */
                    COUNT_DROP(hdr.aggd.job, AGGD_DROP_REASON_BAD_TAG)
                    drop();
                    return;
                }
                if (hdr.aggd.chunk >= meta.max_chunks || meta.n_slots == 0) {
                    COUNT_DROP(hdr.aggd.job, AGGD_DROP_REASON_BAD_CHUNK)
                    drop();
                    return;
                }
                slot_idx = hdr.aggd.chunk % meta.n_slots;
                if (payload_len != 4 * AGGD_ELEMENTS || hdr.aggd.code != AGGD_PRECISION_INT32 ||
                    slot_idx >= meta.switch_slots) {   /* int8/int16 lanes: user space, for now */
                    BUMP(AGGD_COUNTER_TO_USERSPACE, 1)
                    meta.fwd = 1;      /* the daemon's user-space path serves it */
                    return;
                }
                max_round.read(mr, (bit<32>)hdr.aggd.job);
                if ((bit<33>)hdr.aggd.round + 1 > (bit<33>)mr) {
                    max_round.write((bit<32>)hdr.aggd.job, hdr.aggd.round + 1);
                }
                meta.slot = meta.slot_base + slot_idx;
            }

            /* ---- one packet at a time in a slot while its passes are in flight ---------------- */
            slot_lock.read(locked, meta.slot);
            if (locked == 1) {
                if (meta.spins < 64) {
                    meta.spins = meta.spins + 1;
                    meta.recirc = 1;
                    sm.egress_spec = meta.in_port;
                } else {
                    COUNT_DROP(hdr.aggd.job, AGGD_DROP_REASON_BUSY)
                    drop();
                }
                return;
            }

            /* ---- the slot rules (aggd/core/model.py, docs/protocol.md "Strategies") --------------- */
            clock.read(now, 0);
            if (now == 0) {
                now = sm.ingress_global_timestamp;   /* microseconds */
            }
            key = hdr.aggd.round ++ hdr.aggd.chunk;
            bit_x = (bit<64>)1 << (bit<8>)hdr.aggd.rank;
            base = meta.slot * AGGD_BANKS;
            slot_pending.read(pending, meta.slot);
            slot_shared.read(shared, meta.slot);
            if ((hdr.aggd.chunk >= meta.n_slots || (hdr.aggd.flags & AGGD_FLAG_ORDERED) != 0) && shared == 0) {
                shared = 1;                /* a round with more chunks than slots, or ORDERED */
                slot_shared.write(meta.slot, shared);
            }

            /* Rule 0 (expiry) and the scan of the four banks. A carry's holding bank (bank_holding)
             * has no deadline and counts only as a target for later carries of its chunk, as the
             * bank the chunk's next round adopts (and in async's count of open banks): not in the
             * slot's or the chunk's newest key, `used`, the open banks admission looks at, or the
             * banks a new round may take. */
#define SCAN(i) \
            bank_state.read(st##i, base + i); \
            bank_round.read(rd##i, base + i); \
            bank_chunk.read(ch##i, base + i); \
            bank_kind.read(kd##i, base + i); \
            bank_timeout.read(to##i, base + i); \
            bank_t_first.read(tf##i, base + i); \
            bank_holding.read(hd##i, base + i); \
            bank_bitmap.read(bm##i, base + i); \
            bank_held.read(hl##i, base + i); \
            bank_carried.read(cr##i, base + i); \
            if (st##i != BANK_EMPTY) { \
                /* the sender holds this round's result (Slot.note_sender) */ \
                if ((bit<33>)hdr.aggd.round >= (bit<33>)rd##i + (bit<33>)AGGD_RESULT_WINDOW || \
                    (hdr.aggd.step == 0 && hdr.aggd.round == rd##i && hdr.aggd.chunk > ch##i) || \
                    (hdr.aggd.round > rd##i && (ch##i >= meta.n_slots || hdr.aggd.chunk >= meta.n_slots || \
                                                (hdr.aggd.flags & AGGD_FLAG_ORDERED) != 0))) { \
                    hl##i = hl##i | bit_x; \
                    bank_held.write(base + i, hl##i); \
                } \
                if (pending == (rd##i ++ ch##i) + 1) { \
                    pending = 0;   /* a bank holds the pending key now */ \
                } \
            } \
            if (st##i == BANK_OPEN && kd##i == AGGD_STRATEGY_KIND_QUORUM && hd##i == 0 && \
                now - tf##i >= (bit<48>)to##i) { \
                st##i = BANK_RELEASED; \
                bank_state.write(base + i, BANK_RELEASED); \
                bank_unannounced.write(base + i, 1); \
                timeouts = timeouts + 1; \
            } else if (st##i == BANK_OPEN && kd##i != AGGD_STRATEGY_KIND_QUORUM && hd##i == 0 && \
                       (bm##i & meta.all_members) == meta.all_members) { \
                /* it waited for a member declared gone since it opened, and has the others */ \
                st##i = BANK_RELEASED; \
                bank_state.write(base + i, BANK_RELEASED); \
                bank_unannounced.write(base + i, 1); \
                settled = settled + 1; \
            } \
            if (st##i == BANK_EMPTY) { \
                if (ifree == NO_BANK) { ifree = i; } \
                nfree = nfree + 1; \
                nfree_q = nfree_q + 1; \
                nempty = nempty + 1; \
            } else { \
                k = rd##i ++ ch##i; \
                if (k == key) { ik = i; } \
                if (ch##i == hdr.aggd.chunk && hd##i == 0 && (have_chunk == 0 || k > chunk_newest)) { \
                    chunk_newest = k; \
                    have_chunk = 1; \
                } \
            } \
            if (st##i != BANK_EMPTY && hd##i != 0) { \
                nhold = nhold + 1; \
                if (ch##i == hdr.aggd.chunk && k > key && kd##i == AGGD_STRATEGY_KIND_QUORUM && \
                    cr##i >= (bit<16>)meta.world) { \
                    passed_full = 1;   /* full of carries (Bank.full) */ \
                } else if (ch##i == hdr.aggd.chunk && k > key && k < target_key) { \
                    target_key = k; \
                    itarget = i; \
                } \
                if (ch##i == hdr.aggd.chunk && k > hold_newest) { \
                    hold_newest = k; \
                } \
                if (st##i == BANK_OPEN && ch##i == hdr.aggd.chunk && (iheld == NO_BANK || k < held_key)) { \
                    held_key = k; \
                    iheld = i; \
                } \
            } else if (st##i != BANK_EMPTY) { \
                used = used + 1; \
                if (used == 1 || k > newest) { newest = k; } \
                if (st##i == BANK_OPEN) { \
                    nopen = nopen + 1; \
                    if (rd##i < min_open) { min_open = rd##i; } \
                    if (ch##i == hdr.aggd.chunk && k > key && kd##i == AGGD_STRATEGY_KIND_QUORUM && \
                        cr##i >= (bit<16>)meta.world) { \
                        passed_full = 1; \
                    } else if (ch##i == hdr.aggd.chunk && k > key && k < target_key) { \
                        target_key = k; \
                        itarget = i; \
                    } \
                } else { \
                    /* an ssp/async round is kept from new rounds while an awaited member may */ \
                    /* re-read it, unless quorum governs the new round; in a slot serving */ \
                    /* several chunk indices an ssp, async or quorum one from every new round */ \
                    /* (Slot.reusable); */ \
                    /* released banks go oldest first (Slot.free_bank) */ \
                    kept = 0; \
                    kept_q = 0; \
                    if ((hl##i & meta.all_members) != meta.all_members) { \
                        if (shared == 1 && (kd##i == AGGD_STRATEGY_KIND_SSP || \
                            kd##i == AGGD_STRATEGY_KIND_ASYNC || kd##i == AGGD_STRATEGY_KIND_QUORUM)) { \
                            kept = 1; \
                            kept_q = 1; \
                        } else if (kd##i == AGGD_STRATEGY_KIND_SSP || kd##i == AGGD_STRATEGY_KIND_ASYNC) { \
                            kept = 1; \
                        } \
                    } \
                    if (kept == 0) { nfree = nfree + 1; } \
                    if (kept_q == 0) { nfree_q = nfree_q + 1; } \
                    if (k < rel_old_key_q) { \
                        rel_old_key_q = k; \
                        irel_old_q = i; \
                        old_kept = kept; \
                        old_kept_q = kept_q; \
                    } \
                    if (ch##i == hdr.aggd.chunk && (irel_chunk == NO_BANK || k > rel_chunk_key)) { \
                        rel_chunk_key = k; \
                        irel_chunk = i; \
                    } \
                } \
            }
            SCAN(0)
            SCAN(1)
            SCAN(2)
            SCAN(3)
            /* a kept oldest released bank leaves none to a new round quorum does not govern */
            if (old_kept == 1) {
                nfree = nempty;
            } else {
                irel_old = irel_old_q;
            }
            if (old_kept_q == 1) {
                nfree_q = nempty;
                irel_old_q = NO_BANK;
            }
            pick = ifree;
            if (pick == NO_BANK) {
                pick = irel_old;
            }

            if (ik != NO_BANK) {
                bank_state.read(b_state, base + (bit<32>)ik);
                bank_kind.read(b_kind, base + (bit<32>)ik);
                bank_bitmap.read(b_bitmap, base + (bit<32>)ik);
                bank_late.read(b_late, base + (bit<32>)ik);
                bank_steps.read(b_steps, (base + (bit<32>)ik) * AGGD_MAX_MEMBERS + (bit<32>)hdr.aggd.rank);
                bank_holding.read(b_holding, base + (bit<32>)ik);
                /* (member, step) taken: step >= 8, or its bit in the member's step mask */
                counted = 0;
                if (hdr.aggd.step >= 8) {
                    counted = 1;
                } else if (((b_steps >> (bit<8>)hdr.aggd.step) & 1) == 1) {
                    counted = 1;
                }
            }

            if (hdr.aggd.type == AGGD_MSG_TYPE_REREAD) {
                if (ik != NO_BANK && b_state == BANK_RELEASED) {
                    out = ik;
                } else if (ik != NO_BANK || used == 0 || key > newest) {
                    reason = AGGD_DROP_REASON_NOT_READY;
                } else {
                    reason = AGGD_DROP_REASON_STALE;
                }
            } else if (ik != NO_BANK) {
                if (b_state == BANK_OPEN) {
                    if (counted == 1) {                                   /* rule 1 */
                        reason = AGGD_DROP_REASON_DUPLICATE;
                    } else if (b_holding != 0 && pending != 0 && key >= pending) {
                        reason = AGGD_DROP_REASON_BUSY;   /* a round proper after the pending key */
                    } else {
                        add = ik;
                    }
                } else if (counted == 1) {     /* rule 2 (a carried step is marked counted too) */
                    out = ik;
                } else {
                    late = 1;
                }
            } else if (used == 0 || key > newest) {                       /* rule 3 */
                want_open = 1;
                open_round = hdr.aggd.round;
            } else {
                late = 1;                                                 /* rule 4 */
            }

            if (late == 1 && (meta.all_members & bit_x) == 0) {
                /* a member declared gone: answered with its chunk's newest result, never carried
                 * (its own contribution may be in the next round already) */
                if (irel_chunk != NO_BANK) {
                    out = irel_chunk;
                } else {
                    reason = AGGD_DROP_REASON_STALE;
                }
            } else if (late == 1) {
                /* The member's late memory of this slot: step 0 of a chunk whose index in the slot
                 * is below 64, for one round (a newer round's replaces it). */
                ridx = meta.slot * AGGD_MAX_MEMBERS + (bit<32>)hdr.aggd.rank;
                kidx = hdr.aggd.chunk / meta.n_slots;
                if (hdr.aggd.step == 0 && kidx < 64) {
                    remembered = 1;
                    kbit = (bit<64>)1 << (bit<8>)kidx;
                }
                late_round.read(l_round, ridx);
                late_refused.read(l_refused, ridx);
                late_carried.read(l_carried, ridx);
                if (remembered == 1 && l_round == (bit<64>)hdr.aggd.round + 1) {
                    known = 1;
                }
                if (ik == NO_BANK && (hdr.aggd.flags & AGGD_FLAG_RETRANSMIT) != 0 &&
                    !(known == 1 && (l_refused & kbit) != 0)) {
                    if (known == 1 && (l_carried & kbit) != 0) {
                        /* counted before with nothing to answer: answer now, if there is a result */
                        if (irel_chunk != NO_BANK) {
                            out = irel_chunk;
                        } else {
                            reason = AGGD_DROP_REASON_NOT_READY;
                        }
                    } else {
                        /* a quorum went on without the sender, its round gone: the quorum's */
                        /* newest result of the chunk (never carried: it could be a copy of one */
                        /* counted) */
                        b_kind = 0;
                        if (irel_chunk != NO_BANK) {
                            bank_kind.read(b_kind, base + (bit<32>)irel_chunk);
                        }
                        if (irel_chunk != NO_BANK && b_kind == AGGD_STRATEGY_KIND_QUORUM) {
                            out = irel_chunk;
                        } else {
                            reason = AGGD_DROP_REASON_STALE;   /* could be a copy of one counted */
                        }
                    }
                } else {
                    carried = 1;
                    if (itarget != NO_BANK) {
                        add = itarget;
                    } else {
                        /* the next round of the chunk, after the slot's newest key too (its members
                         * will still come to it), as a holding bank that leaves a bank free */
                        if (have_chunk == 1) {
                            r2 = (bit<33>)chunk_newest[63:32] + 1;
                        } else {
                            r2 = (bit<33>)hdr.aggd.round + 1;
                        }
                        if (hold_newest != 0 && (bit<33>)hold_newest[63:32] + 1 > r2) {
                            r2 = (bit<33>)hold_newest[63:32] + 1;   /* after full holding banks too */
                        }
                        if (r2 <= 0xFFFFFFFF && used != 0 && (r2[31:0] ++ hdr.aggd.chunk) <= newest) {
                            if (hdr.aggd.chunk > newest[31:0]) {
                                r2 = (bit<33>)newest[63:32];
                            } else {
                                r2 = (bit<33>)newest[63:32] + 1;
                            }
                        }
                        if (r2 > 0xFFFFFFFF) {
                            reason = AGGD_DROP_REASON_BUSY;
                            refuse_late = 1;
                            carried = 0;
                        } else {
                            open_round = r2[31:0];
                            want_open = 1;
                            hold = 1;
                        }
                    }
                }
            }

            if (want_open == 1) {
                /* Rule 3: admission under the entry governing the new round, then the bank. */
                meta.s_round = open_round;
                strategy.apply();
                /* the bank, and whether another stays free, for a round of this kind (Slot.reusable) */
                if (meta.s_kind == AGGD_STRATEGY_KIND_QUORUM) {
                    nfree = nfree_q;
                    if (ifree == NO_BANK) {
                        pick = irel_old_q;
                    }
                }
                bit<1> admitted = 0;
                bit<8> rel_kind = 0;     /* the kind of the chunk's newest released bank */
                if (hold == 1 && ik == NO_BANK && irel_chunk != NO_BANK) {
                    bank_kind.read(rel_kind, base + (bit<32>)irel_chunk);
                }
                /* a round of a chunk opens only once its predecessor, `skip` rounds before it, has:
                 * at most that many after the chunk's newest (SKIP_MAX: at least); no wrap in 48 bits */
                bit<1> in_order = 1;
                if (hold == 0 && have_chunk == 1) {
                    if (hdr.aggd.skip < (bit<16>)AGGD_SKIP_MAX) {
                        if ((bit<48>)open_round >
                            (bit<48>)chunk_newest[63:32] + 1 + (bit<48>)hdr.aggd.skip) {
                            in_order = 0;
                        }
                    } else if ((bit<48>)open_round <
                               (bit<48>)chunk_newest[63:32] + 1 + (bit<48>)AGGD_SKIP_MAX) {
                        in_order = 0;
                    }
                }
                if (hold == 0 && pending != 0 && key >= pending) {
                    in_order = 0;          /* a key refused before goes first (Slot.pending) */
                }
                if (hold == 1) {
                    /* a carry's holding bank: no admission, no order; only while another bank
                     * stays free for the rounds in progress */
                    if (nfree >= 2) {
                        admitted = 1;
                    }
                } else if (meta.s_kind == AGGD_STRATEGY_KIND_ASYNC) {
                    /* docs/protocol.md: while fewer than 3 banks are open, holding ones included
                     * (one released bank is kept for re-reads); the XDP program does the same. */
                    if (nopen + nhold < AGGD_BANKS - 1) {
                        admitted = 1;
                    }
                } else if (meta.s_kind == AGGD_STRATEGY_KIND_SSP) {
                    if (nopen == 0 || (bit<33>)min_open + (bit<33>)meta.s_param >= (bit<33>)open_round) {
                        admitted = 1;
                    }
                } else if (nopen == 0) {
                    admitted = 1;
                }
                if (hold == 0 && in_order == 1 && iheld != NO_BANK) {
                    /* the chunk's holding bank becomes this round (its carries wait for it): no
                     * admission, this round's strategy; the add below starts the round proper */
                    bank_round.write(base + (bit<32>)iheld, open_round);
                    bank_version.write(base + (bit<32>)iheld, meta.s_version);
                    bank_kind.write(base + (bit<32>)iheld, meta.s_kind);
                    bank_param.write(base + (bit<32>)iheld, meta.s_param);
                    bank_timeout.write(base + (bit<32>)iheld, meta.s_timeout);
                    bank_held.write(base + (bit<32>)iheld, 0);
                    add = iheld;
                } else if ((admitted == 0 || pick == NO_BANK) && hold == 1 && (shared == 1 || passed_full == 1) &&
                           ((ik != NO_BANK && b_state == BANK_RELEASED && b_kind == AGGD_STRATEGY_KIND_QUORUM) ||
                            (ik == NO_BANK && irel_chunk != NO_BANK && rel_kind == AGGD_STRATEGY_KIND_QUORUM))) {
                    /* a quorum round of a slot serving several chunk indices, kept for this
                     * straggler (or, its round gone, the chunk's newest quorum result) answers it
                     * though no bank is free to carry its values into (dropped, as a quorum may) */
                    carried = 0;
                    uncarried = 1;
                    if (ik != NO_BANK) {
                        out = ik;
                        bank_steps.write((base + (bit<32>)ik) * AGGD_MAX_MEMBERS + (bit<32>)hdr.aggd.rank,
                                         b_steps | ((bit<8>)1 << (bit<8>)hdr.aggd.step));
                    } else {
                        out = irel_chunk;
                    }
                } else if (admitted == 0 || in_order == 0 || pick == NO_BANK) {
                    reason = AGGD_DROP_REASON_BUSY;
                    if (carried == 1) {
                        refuse_late = 1;
                    }
                    carried = 0;
                    /* refused under ssp/async: it goes first once sent again (Slot.pending) */
                    if (hold == 0 && (meta.s_kind == AGGD_STRATEGY_KIND_SSP || meta.s_kind == AGGD_STRATEGY_KIND_ASYNC) &&
                        (pending == 0 || key + 1 < pending)) {
                        pending = key + 1;
                    }
                } else {
                    bank_state.write(base + (bit<32>)pick, BANK_OPEN);
                    bank_round.write(base + (bit<32>)pick, open_round);
                    bank_chunk.write(base + (bit<32>)pick, hdr.aggd.chunk);
                    bank_bitmap.write(base + (bit<32>)pick, 0);
                    bank_late.write(base + (bit<32>)pick, 0);
                    bank_n.write(base + (bit<32>)pick, 0);
                    bank_flags.write(base + (bit<32>)pick, 0);
                    bank_exp.write(base + (bit<32>)pick, (bit<16>)AGGD_ZERO_EXPONENT);
                    bank_version.write(base + (bit<32>)pick, meta.s_version);
                    bank_kind.write(base + (bit<32>)pick, meta.s_kind);
                    bank_param.write(base + (bit<32>)pick, meta.s_param);
                    bank_timeout.write(base + (bit<32>)pick, meta.s_timeout);
                    bank_t_first.write(base + (bit<32>)pick, now);
                    bank_unannounced.write(base + (bit<32>)pick, 0);
                    bank_holding.write(base + (bit<32>)pick, (bit<8>)hold);
                    bank_held.write(base + (bit<32>)pick, 0);
                    bank_count.write(base + (bit<32>)pick, hdr.aggd.count);
                    bank_carried.write(base + (bit<32>)pick, 0);
                    /* the step masks of the new round start empty (64 cells) */
#define CLEAR_STEP(r) bank_steps.write((base + (bit<32>)pick) * AGGD_MAX_MEMBERS + r, 0);
                    AGGD_LANES_64(CLEAR_STEP)
                    add = pick;
                    fresh = 1;
                }
            }

            if (hold == 0 && want_open == 1 && add != NO_BANK && pending == key + 1) {
                pending = 0;               /* the pending key opened, or was adopted */
            }
            slot_pending.write(meta.slot, pending);

            /* A carry refused busy: remembered, so that its retransmission is carried. */
            if (refuse_late == 1 && remembered == 1) {
                if (known == 0) {
                    late_round.write(ridx, (bit<64>)hdr.aggd.round + 1);
                    late_carried.write(ridx, 0);
                    l_refused = 0;
                }
                late_refused.write(ridx, l_refused | kbit);
            }

            /* The carried contribution's origin remembers it (if the new round did not take it),
             * and the answer is its own round's result if still there, else the newest released
             * result of the chunk, chosen after the carry. */
            if (carried == 1 && add != NO_BANK) {
                if (known == 1) {
                    l_refused = l_refused & ~kbit;
                    late_refused.write(ridx, l_refused);
                }
                if (ik != NO_BANK && !(fresh == 1 && pick == ik)) {
                    bank_late.write(base + (bit<32>)ik, b_late | bit_x);
                    /* per (member, step): a later wbsp step of the member is carried too */
                    bank_steps.write((base + (bit<32>)ik) * AGGD_MAX_MEMBERS + (bit<32>)hdr.aggd.rank,
                                     b_steps | ((bit<8>)1 << (bit<8>)hdr.aggd.step));
                }
                out = irel_chunk;
                if (fresh == 1 && pick == irel_chunk) {
                    out = NO_BANK;   /* it was the chunk's only released bank */
                }
                if (ik != NO_BANK && b_state == BANK_RELEASED && !(fresh == 1 && pick == ik)) {
                    out = ik;        /* its own round's result: a later round may hold another tensor */
                }
                if (out == NO_BANK && remembered == 1) {
                    /* nothing to answer with: its retransmission will be answered */
                    if (known == 0) {
                        late_round.write(ridx, (bit<64>)hdr.aggd.round + 1);
                        late_refused.write(ridx, 0);
                        l_carried = 0;
                    }
                    late_carried.write(ridx, l_carried | kbit);
                }
            }

            /* Rule 1 after the duplicate test, or a carry: the bank's bookkeeping. */
            if (add != NO_BANK) {
                bank_bitmap.read(b_bitmap, base + (bit<32>)add);
                bank_kind.read(b_kind, base + (bit<32>)add);
                bank_param.read(b_param, base + (bit<32>)add);
                bank_n.read(b_n, base + (bit<32>)add);
                bank_exp.read(b_exp, base + (bit<32>)add);
                bank_flags.read(b_flags, base + (bit<32>)add);
                if (carried == 0) {
                    bank_holding.read(b_holding, base + (bit<32>)add);
                    if (b_holding != 0) {
                        /* a member's own contribution: the round proper starts (its order,
                         * admission and deadline) */
                        bank_holding.write(base + (bit<32>)add, 0);
                        bank_t_first.write(base + (bit<32>)add, now);
                        bank_count.write(base + (bit<32>)add, hdr.aggd.count);
                    }
                    if (hdr.aggd.step == 0) {   /* a later step must not stand in for step 0 */
                        b_bitmap = b_bitmap | bit_x;
                    }
                    bank_bitmap.write(base + (bit<32>)add, b_bitmap);
                    bank_steps.read(b_steps, (base + (bit<32>)add) * AGGD_MAX_MEMBERS + (bit<32>)hdr.aggd.rank);
                    bank_steps.write((base + (bit<32>)add) * AGGD_MAX_MEMBERS + (bit<32>)hdr.aggd.rank,
                                     b_steps | ((bit<8>)1 << (bit<8>)hdr.aggd.step));
                    if (b_kind == AGGD_STRATEGY_KIND_QUORUM) {
                        /* popcount of the bitmap (SWAR) against k */
                        bit<64> p = b_bitmap - ((b_bitmap >> 1) & 0x5555555555555555);
                        p = (p & 0x3333333333333333) + ((p >> 2) & 0x3333333333333333);
                        p = (p + (p >> 4)) & 0x0F0F0F0F0F0F0F0F;
                        p = (p * 0x0101010101010101) >> 56;
                        if (p >= (bit<64>)b_param) {
                            released = 1;
                        }
                    } else if ((b_bitmap & meta.all_members) == meta.all_members) {
                        released = 1;
                    }
                    if (released == 1) {
                        out = add;
                        meta.to_group = 1;
                        bank_state.write(base + (bit<32>)add, BANK_RELEASED);
                    } else if (b_kind == AGGD_STRATEGY_KIND_ASYNC) {
                        out = add;     /* no barrier: the running sum goes back at once */
                        partial = 1;
                    }
                } else {
                    b_flags = b_flags | AGGD_FLAG_CARRIED;
                    bank_flags.write(base + (bit<32>)add, b_flags);
                    bank_carried.read(t_carried, base + (bit<32>)add);
                    bank_carried.write(base + (bit<32>)add, t_carried + 1);
                }
                /* Exponents: the first contribution sets it; later ones align to the smaller. */
                meta.sa = 0;
                meta.sb = 0;
                if (fresh == 1) {
                    bank_exp.write(base + (bit<32>)add, hdr.aggd.exponent);
                } else if ((int<16>)hdr.aggd.exponent < (int<16>)b_exp) {
                    int<32> d = (int<32>)(int<16>)b_exp - (int<32>)(int<16>)hdr.aggd.exponent;
                    meta.sa = d > 63 ? 8w63 : (bit<8>)(bit<32>)d;     /* the 64-bit sum */
                    bank_exp.write(base + (bit<32>)add, hdr.aggd.exponent);
                } else {
                    int<32> d = (int<32>)(int<16>)hdr.aggd.exponent - (int<32>)(int<16>)b_exp;
                    meta.sb = d > 31 ? 8w31 : (bit<8>)(bit<32>)d;     /* the int32 value */
                }
                /* a rack aggregator's partial sum holds that many contributions; a worker's (0) one */
                bit<16> weight = hdr.aggd.n_contrib == 0 ? 16w1 : hdr.aggd.n_contrib;
                bank_n.write(base + (bit<32>)add, b_n + weight);
                meta.do_add = 1;
                meta.fresh = fresh;
                meta.add_bank = base + (bit<32>)add;
                meta.add_cell = (base + (bit<32>)add) * AGGD_PASSES;
            }

            /* ---- counters ---------------------------------------------------------------------- */
            if (timeouts != 0) {
                BUMP(AGGD_COUNTER_TIMEOUTS, timeouts)
                BUMP(AGGD_COUNTER_RELEASED, timeouts)
            }
            if (settled != 0) {
                BUMP(AGGD_COUNTER_RELEASED, settled)
            }
            if (reason != 0xFF) {
                COUNT_DROP(hdr.aggd.job, reason)
                drop();
                return;
            }
            if (uncarried == 1) {
                BUMP(AGGD_COUNTER_UNCARRIED, 1)
            }
            if (add != NO_BANK) {
                BUMP(AGGD_COUNTER_CONTRIBUTIONS, 1)
                BUMP(AGGD_COUNTER_ELEMENTS, hdr.aggd.count)
                if (carried == 1) {
                    BUMP(AGGD_COUNTER_CARRIED, 1)
                }
                if (released == 1) {
                    BUMP(AGGD_COUNTER_RELEASED, 1)
                }
                if (partial == 1) {
                    BUMP(AGGD_COUNTER_PARTIALS, 1)
                }
            }

            /* ---- the result header (values follow lane by lane) ------------------------------ */
            if (out != NO_BANK) {
                bank_round.read(b_round, base + (bit<32>)out);
                bank_chunk.read(b_chunk, base + (bit<32>)out);
                bank_bitmap.read(b_bitmap, base + (bit<32>)out);
                bank_n.read(b_n, base + (bit<32>)out);
                bank_exp.read(b_exp, base + (bit<32>)out);
                bank_flags.read(b_flags, base + (bit<32>)out);
                bank_version.read(b_version, base + (bit<32>)out);
                bank_kind.read(b_kind, base + (bit<32>)out);
                bank_param.read(b_param, base + (bit<32>)out);
                bank_count.read(b_count, base + (bit<32>)out);
                if (meta.to_group == 0 && partial == 0) {
                    bank_unannounced.read(b_unannounced, base + (bit<32>)out);
                    if (b_unannounced == 1) {
                        /* the first answer from a deadline release announces it to the group */
                        bank_unannounced.write(base + (bit<32>)out, 0);
                        meta.to_group = 1;
                    } else {
                        BUMP(AGGD_COUNTER_REREADS, 1)
                        b_flags = b_flags | AGGD_FLAG_REREAD;
                    }
                }
                hdr.aggd.type = AGGD_MSG_TYPE_RESULT;
                hdr.aggd.rank = 0xFFFF;
                hdr.aggd.round = b_round;
                hdr.aggd.chunk = b_chunk;
                hdr.aggd.count = b_count;
                hdr.aggd.exponent = b_exp;
                hdr.aggd.flags = b_flags;
                hdr.aggd.code = 0;
                hdr.aggd.strategy_version = b_version;
                hdr.aggd.strategy = b_kind;
                hdr.aggd.param = b_param;
                hdr.aggd.skip = 0;
                hdr.aggd.contributors = b_bitmap;
                hdr.aggd.n_contrib = b_n;
                hdr.aggd.step = 0;
                meta.do_out = 1;
                meta.out_is_add = out == add ? 1w1 : 1w0;
                meta.out_cell = (base + (bit<32>)out) * AGGD_PASSES;
            }
            if (meta.do_add == 0 && meta.do_out == 0) {
                drop();
                return;
            }
            if (AGGD_PASSES > 1) {
                slot_lock.write(meta.slot, 1);
                meta.work = 1;
            }
        }

        /* ---- lanes: this pass's AGGD_LANES values ------------------------------------------ */
        /* Sums are exact in 64 bits; a value sent is the sum's low 32 bits, and the result is
         * flagged when a sum lies outside int32 (sum + 2**31 has high bits). */
        bit<64> lx;
        bit<64> ly;
        bit<64> lz;
        if (meta.do_add == 1) {
#define ADD_LANE(i) \
            lane_##i.read(lx, meta.add_cell + (bit<32>)meta.pass); \
            if (meta.fresh == 1) { lx = 0; } \
            ly = (bit<64>)(int<64>)(int<32>)AGGD_SWAP(hdr.lanes.v##i); \
            lx = (bit<64>)((int<64>)lx >> meta.sa); \
            ly = (bit<64>)((int<64>)ly >> meta.sb); \
            lz = lx + ly; \
            lane_##i.write(meta.add_cell + (bit<32>)meta.pass, lz); \
            if (meta.out_is_add == 1) { \
                if ((lz + 0x80000000)[63:32] != 0) { meta.ovf = 1; } \
                hdr.lanes.v##i = AGGD_SWAP(lz[31:0]); \
            }
            AGGD_FOR_LANES(ADD_LANE)
        }
        if (meta.do_out == 1 && meta.out_is_add == 0) {
#define OUT_LANE(i) \
            lane_##i.read(lx, meta.out_cell + (bit<32>)meta.pass); \
            if ((lx + 0x80000000)[63:32] != 0) { meta.ovf = 1; } \
            hdr.lanes.v##i = AGGD_SWAP(lx[31:0]);
            AGGD_FOR_LANES(OUT_LANE)
        }
        /* The block just done goes behind the others (see block_h). */
        hdr.lanes_out = hdr.lanes;
        hdr.lanes.setInvalid();

        if (meta.pass + 1 < AGGD_PASSES) {
            meta.pass = meta.pass + 1;
            meta.recirc = 1;
            sm.egress_spec = meta.in_port;
            return;
        }

        /* ---- last pass: overflow, unlock, send ----------------------------------------------- */
        if (meta.ovf == 1 && meta.do_out == 1) {
            hdr.aggd.flags = hdr.aggd.flags | AGGD_FLAG_OVERFLOW;   /* a result outside int32 */
            BUMP(AGGD_COUNTER_OVERFLOWS, 1)
        }
        if (meta.work == 1) {
            slot_lock.write(meta.slot, 0);
        }
        if (meta.do_out == 0) {
            drop();            /* absorbed into the slot */
        } else if (meta.to_group == 1) {
            to_group();
        } else {
            to_sender();
        }
    }
}

control AggdIngress(inout headers_t hdr, inout aggd_meta_t meta, inout standard_metadata_t sm) {
    AggdPipeline() aggd;

    action drop() {
        mark_to_drop(sm);
    }

    action l2_forward(bit<9> port) {
        sm.egress_spec = port;
    }

    action l2_flood() {
        sm.mcast_grp = AGGD_FLOOD_GROUP;
        meta.flood = 1;
    }

    /* Non-aggd traffic, and aggd messages handed to the daemon (XDP_PASS): by destination MAC. */
    table forward {
        key = { hdr.ethernet.dst_addr: exact; }
        actions = { l2_forward; l2_flood; drop; }
        default_action = l2_flood();
        size = 1024;
    }

    apply {
        aggd.apply(hdr, meta, sm);
        if (meta.fwd == 1) {
            forward.apply();
        }
    }
}

control AggdEgress(inout headers_t hdr, inout aggd_meta_t meta, inout standard_metadata_t sm) {
    apply {
        if (meta.recirc == 1) {
            recirculate_preserving_field_list(1);
        } else if (meta.flood == 1 && sm.egress_port == meta.in_port) {
            mark_to_drop(sm);  /* a flooded frame does not go back where it came from */
        }
    }
}

control AggdComputeChecksum(inout headers_t hdr, inout aggd_meta_t meta) {
    apply {
        update_checksum(meta.csum == 1 && hdr.ipv4.isValid(),
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len,
              hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl,
              hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr },
            hdr.ipv4.hdr_checksum, HashAlgorithm.csum16);
    }
}

control AggdDeparser(packet_out pkt, in headers_t hdr) {
    apply {
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.aggd);
        pkt.emit(hdr.lanes);
#if AGGD_PASSES > 1
        pkt.emit(hdr.tail);
#endif
        pkt.emit(hdr.lanes_out);
    }
}

V1Switch(AggdParser(), AggdVerifyChecksum(), AggdIngress(), AggdEgress(), AggdComputeChecksum(),
         AggdDeparser()) main;
