/* aggd on Tofino (TNA): sync and quorum in one pass, after SwitchML's pipeline.
 *
 * WRITTEN WITHOUT THE SDE: never compiled by bf-p4c, never run. docs/p4.md, "Tofino", lists what
 * differs from the BMv2 program and what remains to be checked on a real switch.
 *
 * The control plane is the same as BMv2's (aggd/dataplane/p4.py, target="tofino"): the tables
 * aggd_service, jobs, members, strategy (job exact + round range, same actions and parameters)
 * and forward have the names, keys and action parameters of the v1model program, so the P4Info
 * bf-p4c writes for this program carries the same names.
 *
 * What a Tofino pass allows, and so what this program does:
 *   - every register is touched once per pass by one RegisterAction (stateful ALU): a slot keeps
 *     two banks chosen by the round's parity (SwitchML's shadow copy), not four;
 *   - one pass of AGGD_LANES values: the daemon runs with elements_per_packet = AGGD_LANES
 *     (SwitchML's 64-value packets); multi-pass recirculation is BMv2-only for now;
 *   - the stateful ALU cannot shift: every contribution of a round must carry the exponent of the
 *     round's first one (SwitchML's shared scaling factor); another is dropped as bad_count;
 *   - no modulo: a job's slot count is a power of two (the backend checks it for target="tofino");
 *   - sync releases once every member of the jobs entry's all_members is in the bank's bitmap
 *     (members declared gone are not), and a survivor's retransmission to a round that has them
 *     all releases it to the group (rule 0);
 *   - quorum releases at k contributions or at its deadline; a straggler's late contribution is
 *     answered with the result but not carried into the next round (counted stale): carrying needs
 *     a second access to the lane registers, i.e. a recirculation;
 *   - ssp, async and wbsp need more than two banks: refused by the backend for this target.
 * Build: bf-p4c --target tofino --arch tna -DAGGD_ELEMENTS=32 -DAGGD_LANES=32 \
 *        --p4runtime-files aggd.p4info.txtpb -o build aggd.p4 (see `make p4`). */
#include <core.p4>
#include <tna.p4>

#include "../common/parser.p4"

#if AGGD_PASSES != 1
#error "the TNA program adds one block of AGGD_LANES values in one pass: set AGGD_ELEMENTS = AGGD_LANES"
#endif

#define TNA_BANKS 2
#define TNA_CELLS (AGGD_SLOTS * TNA_BANKS)

const bit<8> ROUND_NEW = 1;     /* a newer round takes the bank */
const bit<8> ROUND_SAME = 2;    /* the bank holds this round */
const bit<8> ROUND_OLD = 3;     /* the bank moved past this round */

struct aggd_meta_t {
    bit<1>  is_aggd;
    bit<1>  fwd;
    bit<1>  job_ok;
    bit<1>  member_ok;
    bit<1>  to_group;
    bit<1>  do_out;
    bit<8>  world;
    bit<32> n_slots;            /* a power of two */
    bit<32> slot_base;
    bit<32> switch_slots;
    bit<32> max_chunks;
    bit<32> group_ip;
    bit<48> group_mac;
    bit<16> result_port;
    bit<16> mcast_grp;
    bit<32> member_ip;
    bit<16> member_port;
    bit<64> member_tag;      /* the tag its packets carry in contributors (0: none) */
    bit<32> s_round;
    bit<16> s_version;
    bit<8>  s_kind;
    bit<8>  s_param;
    bit<32> s_timeout;
    bit<32> cell;               /* (slot * 2 + round parity) */
    bit<32> round1;             /* round + 1 (0 marks an empty bank) */
    bit<32> bit_lo;             /* the sender's bit among ranks 0..31 */
    bit<32> bit_hi;             /* ... among ranks 32..63 */
    bit<8>  round_state;
    bit<32> seen_lo;
    bit<32> seen_hi;
    bit<16> n;
    bit<32> now;
    bit<32> t_first;
    bit<16> exp;
    bit<1>  release;
    bit<1>  was_released;
    bit<1>  settle;             /* released now by a packet not counted: rule 0, members gone */
    bit<32> awaited_lo;         /* the members a round waits for (the jobs entry's all_members) */
    bit<32> awaited_hi;
    bit<8>  reason;
}

parser AggdIngressParser(packet_in pkt, out headers_t hdr, out aggd_meta_t meta,
                         out ingress_intrinsic_metadata_t ig_intr_md) {
    AggdCommonParser() common;
    state start {
        pkt.extract(ig_intr_md);
        pkt.advance(PORT_METADATA_SIZE);
        transition parse_aggd_packet;
    }
    state parse_aggd_packet {
        common.apply(pkt, hdr);
        transition accept;
    }
}

control AggdPipeline(inout headers_t hdr, inout aggd_meta_t meta,
                     in ingress_intrinsic_metadata_t ig_intr_md,
                     inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                     inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    /* ---- counters -------------------------------------------------------------------------- */
    Counter<bit<32>, bit<32>>(AGGD_JOB_ROWS * AGGD_DROP_STRIDE, CounterType_t.PACKETS) drops;
    /* per-job counters that grow by one per packet (the byte and element counts of BMv2's
     * job_counters register are not kept here) */
    Counter<bit<32>, bit<32>>(AGGD_JOB_ROWS * AGGD_COUNTER_STRIDE, CounterType_t.PACKETS) job_events;

    /* ---- slot registers, index slot * 2 + (round & 1) -------------------------------------- */
    /* round + 1 of the bank's round; 0: empty (the control plane clears it) */
    Register<bit<32>, bit<32>>(TNA_CELLS) bank_round;
    RegisterAction<bit<32>, bit<32>, bit<8>>(bank_round) claim_round = {
        void apply(inout bit<32> value, out bit<8> state) {
            if (value == meta.round1) {
                state = ROUND_SAME;
            } else if (value < meta.round1) {
                value = meta.round1;
                state = ROUND_NEW;
            } else {
                state = ROUND_OLD;
            }
        }
    };

    /* a re-read never opens a round: it only looks */
    RegisterAction<bit<32>, bit<32>, bit<8>>(bank_round) peek_round = {
        void apply(inout bit<32> value, out bit<8> state) {
            if (value == meta.round1) {
                state = ROUND_SAME;
            } else if (value < meta.round1) {
                state = ROUND_NEW;
            } else {
                state = ROUND_OLD;
            }
        }
    };

    Register<bit<32>, bit<32>>(TNA_CELLS) bitmap_lo;
    RegisterAction<bit<32>, bit<32>, bit<32>>(bitmap_lo) mark_lo_new = {
        void apply(inout bit<32> value, out bit<32> seen) { seen = 0; value = meta.bit_lo; }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(bitmap_lo) mark_lo = {
        void apply(inout bit<32> value, out bit<32> seen) { seen = value; value = value | meta.bit_lo; }
    };
    Register<bit<32>, bit<32>>(TNA_CELLS) bitmap_hi;
    RegisterAction<bit<32>, bit<32>, bit<32>>(bitmap_hi) mark_hi_new = {
        void apply(inout bit<32> value, out bit<32> seen) { seen = 0; value = meta.bit_hi; }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(bitmap_hi) mark_hi = {
        void apply(inout bit<32> value, out bit<32> seen) { seen = value; value = value | meta.bit_hi; }
    };

    Register<bit<16>, bit<32>>(TNA_CELLS) bank_n;
    RegisterAction<bit<16>, bit<32>, bit<16>>(bank_n) count_new = {
        void apply(inout bit<16> value, out bit<16> n) { value = 1; n = 1; }
    };
    RegisterAction<bit<16>, bit<32>, bit<16>>(bank_n) count_one = {
        void apply(inout bit<16> value, out bit<16> n) { value = value + 1; n = value; }
    };
    RegisterAction<bit<16>, bit<32>, bit<16>>(bank_n) count_read = {
        void apply(inout bit<16> value, out bit<16> n) { n = value; }
    };

    Register<bit<32>, bit<32>>(TNA_CELLS) bank_t_first;
    RegisterAction<bit<32>, bit<32>, bit<32>>(bank_t_first) start_clock = {
        void apply(inout bit<32> value, out bit<32> t) { value = meta.now; t = meta.now; }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(bank_t_first) read_clock = {
        void apply(inout bit<32> value, out bit<32> t) { t = value; }
    };

    Register<bit<16>, bit<32>>(TNA_CELLS) bank_exp;
    RegisterAction<bit<16>, bit<32>, bit<16>>(bank_exp) set_exp = {
        void apply(inout bit<16> value, out bit<16> e) { value = hdr.aggd.exponent; e = hdr.aggd.exponent; }
    };
    RegisterAction<bit<16>, bit<32>, bit<16>>(bank_exp) get_exp = {
        void apply(inout bit<16> value, out bit<16> e) { e = value; }
    };

    /* released: 1 once the bank's round went out (the shadow copy answers re-reads from then on) */
    Register<bit<8>, bit<32>>(TNA_CELLS) bank_released;
    RegisterAction<bit<8>, bit<32>, bit<8>>(bank_released) open_bank = {
        void apply(inout bit<8> value, out bit<8> was) { was = 0; value = (bit<8>)meta.release; }
    };
    RegisterAction<bit<8>, bit<32>, bit<8>>(bank_released) update_released = {
        void apply(inout bit<8> value, out bit<8> was) {
            was = value;
            if (meta.release == 1) { value = 1; }
        }
    };

    /* The values: one register per lane and three actions each (load, add, read), SwitchML style.
     * The stateful ALUs see the lanes already byte-swapped to host order (see the lanes step). */
#define TNA_LANE(i) \
    Register<bit<32>, bit<32>>(TNA_CELLS) lane_##i; \
    RegisterAction<bit<32>, bit<32>, bit<32>>(lane_##i) load_##i = { \
        void apply(inout bit<32> value, out bit<32> rv) { value = hdr.lanes.v##i; rv = value; } \
    }; \
    RegisterAction<bit<32>, bit<32>, bit<32>>(lane_##i) add_##i = { \
        void apply(inout bit<32> value, out bit<32> rv) { value = value + hdr.lanes.v##i; rv = value; } \
    }; \
    RegisterAction<bit<32>, bit<32>, bit<32>>(lane_##i) read_##i = { \
        void apply(inout bit<32> value, out bit<32> rv) { rv = value; } \
    };
    AGGD_FOR_LANES(TNA_LANE)

    /* ---- tables (names, keys and parameters as in the v1model program) ------------------------ */
    action aggd_serve() {
        meta.is_aggd = 1;
    }

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
        meta.awaited_lo = all_members[31:0];
        meta.awaited_hi = all_members[63:32];
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
        size = 16384;
    }

    action set_strategy(bit<16> version, bit<8> kind, bit<8> param, bit<32> timeout_us) {
        meta.s_version = version;
        meta.s_kind = kind;
        meta.s_param = param;
        meta.s_timeout = timeout_us;
    }

    table strategy {
        key = {
            hdr.aggd.job: exact;
            meta.s_round: range;
        }
        actions = { set_strategy; }
        default_action = set_strategy(0, 0, 0, 0);
        size = 1024;
    }

    /* The sender's bit: a table instead of a 64-bit shift (one entry per rank, const). */
    action rank_bit(bit<32> lo, bit<32> hi) {
        meta.bit_lo = lo;
        meta.bit_hi = hi;
    }

    table rank_bits {
        key = { hdr.aggd.rank: exact; }
        actions = { rank_bit; @defaultonly NoAction; }
        default_action = NoAction();
        size = 64;
    }

    action drop() {
        ig_dprsr_md.drop_ctl = 1;
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
        ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port;
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
        ig_tm_md.mcast_grp_a = meta.mcast_grp;
    }

    apply {
        meta.reason = 0xFF;
        if (hdr.udp.isValid()) {
            aggd_service.apply();
        }
        if (meta.is_aggd == 0) {
            meta.fwd = 1;
            return;
        }
        if (hdr.aggd.isValid()) {
            jobs.apply();
            members.apply();
            rank_bits.apply();
        }
        /* checks, in the order of docs/protocol.md (the frame length is known only to egress
         * on Tofino: a truncated payload is caught by the parser, not by too_short) */
        if (!hdr.aggd.isValid() || hdr.udp.length < 48) {
            drops.count(AGGD_NO_JOB * AGGD_DROP_STRIDE + (bit<32>)AGGD_DROP_REASON_TOO_SHORT);
            drop();
            return;
        }
        if (hdr.aggd.magic != (bit<16>)AGGD_MAGIC) {
            drops.count(AGGD_NO_JOB * AGGD_DROP_STRIDE + (bit<32>)AGGD_DROP_REASON_BAD_MAGIC);
            drop();
            return;
        }
        if (hdr.aggd.version != (bit<8>)AGGD_VERSION) {
            drops.count(AGGD_NO_JOB * AGGD_DROP_STRIDE + (bit<32>)AGGD_DROP_REASON_BAD_VERSION);
            drop();
            return;
        }
        if (hdr.aggd.type == AGGD_MSG_TYPE_JOIN || hdr.aggd.type == AGGD_MSG_TYPE_JOIN_ACK ||
            hdr.aggd.type == AGGD_MSG_TYPE_RESULT || hdr.aggd.type == AGGD_MSG_TYPE_SHARDS) {
            meta.fwd = 1;      /* membership, shard maps and a rack job's upper results: the daemon's */
            return;
        }
        if (hdr.aggd.type != AGGD_MSG_TYPE_CONTRIB && hdr.aggd.type != AGGD_MSG_TYPE_REREAD) {
            drops.count(AGGD_NO_JOB * AGGD_DROP_STRIDE + (bit<32>)AGGD_DROP_REASON_BAD_TYPE);
            drop();
            return;
        }
        if (hdr.aggd.count == 0 || hdr.aggd.count > AGGD_ELEMENTS) {
            drops.count(AGGD_NO_JOB * AGGD_DROP_STRIDE + (bit<32>)AGGD_DROP_REASON_BAD_COUNT);
            drop();
            return;
        }
        if (meta.job_ok == 0) {
            drops.count(AGGD_NO_JOB * AGGD_DROP_STRIDE + (bit<32>)AGGD_DROP_REASON_UNKNOWN_JOB);
            hdr.aggd.type = AGGD_MSG_TYPE_NACK;
            hdr.aggd.code = AGGD_NACK_CODE_UNKNOWN_JOB;
            hdr.aggd.skip = 0;          /* the contribution's skip is not echoed */
            hdr.lanes.setInvalid();
            to_sender();
            return;
        }
        job_events.count((bit<32>)hdr.aggd.job * AGGD_COUNTER_STRIDE + (bit<32>)AGGD_COUNTER_RX_PACKETS);
        if (hdr.aggd.rank >= (bit<16>)meta.world || meta.member_ok == 0 ||
            meta.member_ip != hdr.ipv4.src_addr || meta.member_port != hdr.udp.src_port) {
            drops.count((bit<32>)hdr.aggd.job * AGGD_DROP_STRIDE + (bit<32>)AGGD_DROP_REASON_NOT_MEMBER);
            hdr.aggd.type = AGGD_MSG_TYPE_NACK;
            hdr.aggd.code = AGGD_NACK_CODE_NOT_MEMBER;
            hdr.aggd.skip = 0;
            hdr.lanes.setInvalid();
            to_sender();
            return;
        }
        if (hdr.aggd.contributors != meta.member_tag) {   /* forged: never NACKed */
            drops.count((bit<32>)hdr.aggd.job * AGGD_DROP_STRIDE + (bit<32>)AGGD_DROP_REASON_BAD_TAG);
            drop();
            return;
        }
        if (hdr.aggd.chunk >= meta.max_chunks) {
            drops.count((bit<32>)hdr.aggd.job * AGGD_DROP_STRIDE + (bit<32>)AGGD_DROP_REASON_BAD_CHUNK);
            drop();
            return;
        }
        bit<32> slot_idx = hdr.aggd.chunk & (meta.n_slots - 1);
        if (!hdr.lanes.isValid() || hdr.aggd.code != AGGD_PRECISION_INT32 || slot_idx >= meta.switch_slots) {
            job_events.count((bit<32>)hdr.aggd.job * AGGD_COUNTER_STRIDE + (bit<32>)AGGD_COUNTER_TO_USERSPACE);
            meta.fwd = 1;
            return;
        }

        /* ---- the slot: two banks by round parity ------------------------------------------------ */
        meta.s_round = hdr.aggd.round;
        strategy.apply();
        meta.now = ig_intr_md.ingress_mac_tstamp[41:10];      /* ~microseconds */
        meta.cell = ((meta.slot_base + slot_idx) << 1) | (bit<32>)hdr.aggd.round[0:0];
        meta.round1 = hdr.aggd.round + 1;
        if (hdr.aggd.type == AGGD_MSG_TYPE_REREAD) {
            meta.round_state = peek_round.execute(meta.cell);
            if (meta.round_state == ROUND_NEW) {
                drops.count((bit<32>)hdr.aggd.job * AGGD_DROP_STRIDE + (bit<32>)AGGD_DROP_REASON_NOT_READY);
                drop();
                return;
            }
        } else {
            meta.round_state = claim_round.execute(meta.cell);
        }
        if (meta.round_state == ROUND_OLD) {
            drops.count((bit<32>)hdr.aggd.job * AGGD_DROP_STRIDE + (bit<32>)AGGD_DROP_REASON_STALE);
            drop();
            return;
        }
        if (hdr.aggd.type == AGGD_MSG_TYPE_REREAD || (hdr.aggd.flags & AGGD_FLAG_RETRANSMIT) != 0) {
            /* not counted again: only look (a re-read, or a retransmission that may be counted) */
            meta.seen_lo = mark_lo.execute(meta.cell);
            meta.seen_hi = mark_hi.execute(meta.cell);
        } else if (meta.round_state == ROUND_NEW) {
            meta.seen_lo = mark_lo_new.execute(meta.cell);
            meta.seen_hi = mark_hi_new.execute(meta.cell);
        } else {
            meta.seen_lo = mark_lo.execute(meta.cell);
            meta.seen_hi = mark_hi.execute(meta.cell);
        }
        bit<1> dup = ((meta.seen_lo & meta.bit_lo) | (meta.seen_hi & meta.bit_hi)) != 0 ? 1w1 : 1w0;
        if (meta.round_state == ROUND_NEW) {
            meta.n = count_new.execute(meta.cell);
            meta.t_first = start_clock.execute(meta.cell);
            meta.exp = set_exp.execute(meta.cell);
        } else if (dup == 1 || hdr.aggd.type == AGGD_MSG_TYPE_REREAD) {
            meta.n = count_read.execute(meta.cell);
            meta.t_first = read_clock.execute(meta.cell);
            meta.exp = get_exp.execute(meta.cell);
        } else {
            meta.n = count_one.execute(meta.cell);
            meta.t_first = read_clock.execute(meta.cell);
            meta.exp = get_exp.execute(meta.cell);
        }
        if (meta.s_kind == AGGD_STRATEGY_KIND_QUORUM) {
            if (meta.n >= (bit<16>)meta.s_param || meta.now - meta.t_first >= meta.s_timeout) {
                meta.release = 1;
            }
        } else {
            /* every member the round waits for is in (the sender too, unless it only reads):
             * members declared gone are not awaited (docs/protocol.md, "Members declared gone") */
            bit<32> have_lo = meta.seen_lo;
            bit<32> have_hi = meta.seen_hi;
            if (hdr.aggd.type != AGGD_MSG_TYPE_REREAD) {
                have_lo = have_lo | meta.bit_lo;
                have_hi = have_hi | meta.bit_hi;
            }
            if ((have_lo & meta.awaited_lo) == meta.awaited_lo && (have_hi & meta.awaited_hi) == meta.awaited_hi) {
                meta.release = 1;
            }
        }
        if (meta.round_state == ROUND_NEW) {
            meta.was_released = (bit<1>)open_bank.execute(meta.cell);
        } else {
            meta.was_released = (bit<1>)update_released.execute(meta.cell);
        }

        if (hdr.aggd.type == AGGD_MSG_TYPE_REREAD || dup == 1) {
            if (meta.was_released == 1) {
                meta.do_out = 1;                 /* a re-send from the bank (read lanes below) */
                hdr.aggd.flags = AGGD_FLAG_REREAD;
            } else if (meta.release == 1) {
                /* rule 0: the round waited only for members declared gone since it opened; the
                 * survivors' retransmission releases it, to the whole group (read lanes below) */
                meta.do_out = 1;
                meta.to_group = 1;
                meta.settle = 1;
                hdr.aggd.flags = 0;
            } else if (dup == 1) {
                meta.reason = AGGD_DROP_REASON_DUPLICATE;
            } else {
                meta.reason = AGGD_DROP_REASON_NOT_READY;
            }
        } else if (meta.was_released == 1) {
            meta.reason = AGGD_DROP_REASON_STALE;    /* a straggler: not carried on Tofino */
        } else if (meta.round_state != ROUND_NEW && meta.exp != hdr.aggd.exponent) {
            meta.reason = AGGD_DROP_REASON_BAD_COUNT;  /* the register ALU cannot realign */
        } else if (meta.release == 1) {
            meta.do_out = 1;
            meta.to_group = 1;
            hdr.aggd.flags = 0;
        }
        if (meta.reason != 0xFF) {
            drops.count((bit<32>)hdr.aggd.job * AGGD_DROP_STRIDE + (bit<32>)meta.reason);
            drop();
            return;
        }

        /* ---- lanes ---------------------------------------------------------------------------- */
        /* little-endian on the wire: swapped in the MAU, before and after the stateful ALUs */
#define TNA_SWAP_IN(i) hdr.lanes.v##i = AGGD_SWAP(hdr.lanes.v##i);
        AGGD_FOR_LANES(TNA_SWAP_IN)
        bit<32> rv;
#define TNA_LANE_APPLY(i) \
        if (meta.round_state == ROUND_NEW) { \
            rv = load_##i.execute(meta.cell); \
        } else if (meta.do_out == 1 && (meta.to_group == 0 || meta.settle == 1)) { \
            rv = read_##i.execute(meta.cell); \
        } else { \
            rv = add_##i.execute(meta.cell); \
        } \
        hdr.lanes.v##i = AGGD_SWAP(rv);
        AGGD_FOR_LANES(TNA_LANE_APPLY)

        job_events.count((bit<32>)hdr.aggd.job * AGGD_COUNTER_STRIDE + (bit<32>)AGGD_COUNTER_CONTRIBUTIONS);
        if (meta.do_out == 0) {
            drop();                               /* absorbed */
            return;
        }
        hdr.aggd.type = AGGD_MSG_TYPE_RESULT;
        hdr.aggd.rank = 0xFFFF;
        hdr.aggd.n_contrib = meta.n;
        hdr.aggd.exponent = meta.exp;
        hdr.aggd.strategy_version = meta.s_version;
        hdr.aggd.strategy = meta.s_kind;
        hdr.aggd.param = meta.s_param;
        hdr.aggd.code = 0;
        hdr.aggd.step = 0;
        hdr.aggd.skip = 0;
        hdr.aggd.contributors = (bit<64>)((meta.seen_hi | meta.bit_hi) ++ (meta.seen_lo | meta.bit_lo));
        if (meta.to_group == 1) {
            job_events.count((bit<32>)hdr.aggd.job * AGGD_COUNTER_STRIDE + (bit<32>)AGGD_COUNTER_RELEASED);
            to_group();
        } else {
            job_events.count((bit<32>)hdr.aggd.job * AGGD_COUNTER_STRIDE + (bit<32>)AGGD_COUNTER_REREADS);
            to_sender();
        }
    }
}

control AggdIngress(inout headers_t hdr, inout aggd_meta_t meta,
                    in ingress_intrinsic_metadata_t ig_intr_md,
                    in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                    inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                    inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    AggdPipeline() aggd;

    action l2_forward(bit<9> port) {
        ig_tm_md.ucast_egress_port = port;
    }

    action l2_flood() {
        ig_tm_md.mcast_grp_a = AGGD_FLOOD_GROUP;
    }

    action drop() {
        ig_dprsr_md.drop_ctl = 1;
    }

    table forward {
        key = { hdr.ethernet.dst_addr: exact; }
        actions = { l2_forward; l2_flood; drop; }
        default_action = l2_flood();
        size = 1024;
    }

    apply {
        aggd.apply(hdr, meta, ig_intr_md, ig_dprsr_md, ig_tm_md);
        if (meta.fwd == 1) {
            forward.apply();
        }
    }
}

control AggdIngressDeparser(packet_out pkt, inout headers_t hdr, in aggd_meta_t meta,
                            in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    Checksum() ipv4_checksum;
    apply {
        hdr.ipv4.hdr_checksum = ipv4_checksum.update({
            hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len,
            hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl,
            hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr });
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.aggd);
        pkt.emit(hdr.lanes);
    }
}

struct egress_meta_t { }

parser AggdEgressParser(packet_in pkt, out headers_t hdr, out egress_meta_t meta,
                        out egress_intrinsic_metadata_t eg_intr_md) {
    state start {
        pkt.extract(eg_intr_md);
        transition accept;
    }
}

control AggdEgress(inout headers_t hdr, inout egress_meta_t meta, in egress_intrinsic_metadata_t eg_intr_md,
                   in egress_intrinsic_metadata_from_parser_t eg_prsr_md,
                   inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md,
                   inout egress_intrinsic_metadata_for_output_port_t eg_oport_md) {
    apply { }
}

control AggdEgressDeparser(packet_out pkt, inout headers_t hdr, in egress_meta_t meta,
                           in egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {
    apply { }
}

Pipeline(AggdIngressParser(), AggdIngress(), AggdIngressDeparser(),
         AggdEgressParser(), AggdEgress(), AggdEgressDeparser()) pipe;

Switch(pipe) main;
