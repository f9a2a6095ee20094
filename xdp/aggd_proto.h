/* GENERATED from client/aggd_client/protocol/definition.py by codegen.py: do not edit. */
#ifndef AGGD_PROTO_H
#define AGGD_PROTO_H

#define AGGD_MAGIC 0xa66d
#define AGGD_VERSION 2
#define AGGD_DEFAULT_PORT 47000
#define AGGD_DEFAULT_RESULT_PORT 47001
#define AGGD_DEFAULT_ELEMENTS 256
#define AGGD_PAGE_MAX_ELEMENTS 832
#define AGGD_NATIVE_MAX_MTU 9000
#define AGGD_NATIVE_MAX_ELEMENTS 2233
#define AGGD_MAX_ELEMENTS 8192
#define AGGD_MAX_MEMBERS 64
#define AGGD_MAX_JOBS 256
#define AGGD_STRATEGY_VERSIONS 4
#define AGGD_ZERO_EXPONENT 16383
#define AGGD_SKIP_MAX 65535
#define AGGD_RESULT_WINDOW 3
#define AGGD_INT8_MAX_CONTRIBUTIONS 256
#define AGGD_HDR_SIZE 40

enum aggd_msg_type {
	AGGD_MSG_TYPE_CONTRIB = 1,
	AGGD_MSG_TYPE_RESULT = 2,
	AGGD_MSG_TYPE_REREAD = 3,
	AGGD_MSG_TYPE_NACK = 4,
	AGGD_MSG_TYPE_JOIN = 5,
	AGGD_MSG_TYPE_JOIN_ACK = 6,
	AGGD_MSG_TYPE_SHARDS = 7,
};

enum aggd_flag {
	AGGD_FLAG_RETRANSMIT = 1,
	AGGD_FLAG_OVERFLOW = 2,
	AGGD_FLAG_USERSPACE = 4,
	AGGD_FLAG_CARRIED = 8,
	AGGD_FLAG_REREAD = 16,
	AGGD_FLAG_ORDERED = 32,
};

enum aggd_nack_code {
	AGGD_NACK_CODE_NONE = 0,
	AGGD_NACK_CODE_UNKNOWN_JOB = 1,
	AGGD_NACK_CODE_NOT_MEMBER = 2,
	AGGD_NACK_CODE_BAD_CHUNK = 3,
	AGGD_NACK_CODE_STALE = 4,
	AGGD_NACK_CODE_BAD_TOKEN = 5,
	AGGD_NACK_CODE_BAD_REQUEST = 6,
	AGGD_NACK_CODE__COUNT = 7,
};

enum aggd_precision {
	AGGD_PRECISION_INT32 = 0,
	AGGD_PRECISION_INT16 = 1,
	AGGD_PRECISION_INT8 = 2,
	AGGD_PRECISION__COUNT = 3,
};

enum aggd_strategy_kind {
	AGGD_STRATEGY_KIND_SYNC = 0,
	AGGD_STRATEGY_KIND_QUORUM = 1,
	AGGD_STRATEGY_KIND_SSP = 2,
	AGGD_STRATEGY_KIND_ASYNC = 3,
	AGGD_STRATEGY_KIND_WBSP = 4,
	AGGD_STRATEGY_KIND__COUNT = 5,
};

enum aggd_drop_reason {
	AGGD_DROP_REASON_TOO_SHORT = 0,
	AGGD_DROP_REASON_BAD_MAGIC = 1,
	AGGD_DROP_REASON_BAD_VERSION = 2,
	AGGD_DROP_REASON_BAD_TYPE = 3,
	AGGD_DROP_REASON_BAD_COUNT = 4,
	AGGD_DROP_REASON_UNKNOWN_JOB = 5,
	AGGD_DROP_REASON_BAD_RANK = 6,
	AGGD_DROP_REASON_NOT_MEMBER = 7,
	AGGD_DROP_REASON_BAD_CHUNK = 8,
	AGGD_DROP_REASON_DUPLICATE = 9,
	AGGD_DROP_REASON_STALE = 10,
	AGGD_DROP_REASON_BUSY = 11,
	AGGD_DROP_REASON_NOT_READY = 12,
	AGGD_DROP_REASON_BAD_TAG = 13,
	AGGD_DROP_REASON_BAD_PRECISION = 14,
	AGGD_DROP_REASON_OUT_OF_BOUNDS = 15,
	AGGD_DROP_REASON_BAD_STEP = 16,
	AGGD_DROP_REASON__COUNT = 17,
};

enum aggd_counter {
	AGGD_COUNTER_RX_PACKETS = 0,
	AGGD_COUNTER_RX_BYTES = 1,
	AGGD_COUNTER_ELEMENTS = 2,
	AGGD_COUNTER_CONTRIBUTIONS = 3,
	AGGD_COUNTER_RELEASED = 4,
	AGGD_COUNTER_REREADS = 5,
	AGGD_COUNTER_OVERFLOWS = 6,
	AGGD_COUNTER_TO_USERSPACE = 7,
	AGGD_COUNTER_RETRANSMITS = 8,
	AGGD_COUNTER_CARRIED = 9,
	AGGD_COUNTER_TIMEOUTS = 10,
	AGGD_COUNTER_PARTIALS = 11,
	AGGD_COUNTER_FORWARDED = 12,
	AGGD_COUNTER_RELAYED = 13,
	AGGD_COUNTER_UNCARRIED = 14,
	AGGD_COUNTER__COUNT = 15,
};

/* Header fields are big-endian; the int32 payload that follows is little-endian. */
struct aggd_hdr {
	__be16 magic;	/* 0xA66D; anything else is dropped */
	__u8 version;	/* protocol version, 2 */
	__u8 type;	/* MsgType */
	__be16 job;	/* job id, 0..MAX_JOBS-1 */
	__be16 rank;	/* sender's rank (contributions, re-reads); 0xFFFF in results */
	__be32 round;	/* the job's allreduce number */
	__be32 chunk;	/* packet-sized piece of the round's tensor; selects slot chunk % slots */
	__be16 count;	/* values that carry data (the payload may be padded beyond) */
	__be16 strategy_version;	/* strategy-table version that governs this round (results) */
	__be16 exponent;	/* values are int32 * 2**-exponent; the sum uses the smallest */
	__u8 flags;	/* Flag bits */
	__u8 code;	/* NACKs: NackCode; contributions, re-reads and results: the payload's Precision (0 int32 in and out, 1 int16 in / int32 out, 2 int8 in / int16 out) */
	__be64 contributors;	/* results: bitmap of ranks summed (bit i = rank i); contributions and re-reads: the sender's member tag (JOIN_ACK ``tag``), 0 if it has none */
	__be16 n_contrib;	/* results: contributions summed (may exceed popcount under wbsp); contributions: how many one holds (a rack aggregator's partial sum), 0 from a worker (counts as 1) */
	__be16 step;	/* local step within the round (wbsp); 0 otherwise */
	__u8 strategy;	/* StrategyKind that governed the round (results), so clients adapt */
	__u8 param;	/* that strategy's parameter: quorum k or ssp staleness */
	__be16 skip;	/* contributions and re-reads: rounds since the chunk's previous round that did not include it (0 when it took part in the round before, or never took part); SKIP_MAX: that many or more. 0 in results and NACKs */
} __attribute__((packed));

#endif /* AGGD_PROTO_H */
