/* GENERATED from client/aggd_client/protocol/definition.py by codegen.py: do not edit. */
#ifndef AGGD_PROTO_P4
#define AGGD_PROTO_P4

const bit<32> AGGD_MAGIC = 42605;
const bit<32> AGGD_VERSION = 2;
const bit<32> AGGD_DEFAULT_PORT = 47000;
const bit<32> AGGD_DEFAULT_RESULT_PORT = 47001;
const bit<32> AGGD_DEFAULT_ELEMENTS = 256;
const bit<32> AGGD_PAGE_MAX_ELEMENTS = 832;
const bit<32> AGGD_NATIVE_MAX_MTU = 9000;
const bit<32> AGGD_NATIVE_MAX_ELEMENTS = 2233;
const bit<32> AGGD_MAX_ELEMENTS = 8192;
const bit<32> AGGD_MAX_MEMBERS = 64;
const bit<32> AGGD_MAX_JOBS = 256;
const bit<32> AGGD_STRATEGY_VERSIONS = 4;
const bit<32> AGGD_ZERO_EXPONENT = 16383;
const bit<32> AGGD_SKIP_MAX = 65535;
const bit<32> AGGD_RESULT_WINDOW = 3;
const bit<32> AGGD_INT8_MAX_CONTRIBUTIONS = 256;
const bit<32> AGGD_HDR_SIZE = 40;

const bit<8> AGGD_MSG_TYPE_CONTRIB = 1;
const bit<8> AGGD_MSG_TYPE_RESULT = 2;
const bit<8> AGGD_MSG_TYPE_REREAD = 3;
const bit<8> AGGD_MSG_TYPE_NACK = 4;
const bit<8> AGGD_MSG_TYPE_JOIN = 5;
const bit<8> AGGD_MSG_TYPE_JOIN_ACK = 6;
const bit<8> AGGD_MSG_TYPE_SHARDS = 7;

const bit<8> AGGD_FLAG_RETRANSMIT = 1;
const bit<8> AGGD_FLAG_OVERFLOW = 2;
const bit<8> AGGD_FLAG_USERSPACE = 4;
const bit<8> AGGD_FLAG_CARRIED = 8;
const bit<8> AGGD_FLAG_REREAD = 16;
const bit<8> AGGD_FLAG_ORDERED = 32;

const bit<8> AGGD_NACK_CODE_NONE = 0;
const bit<8> AGGD_NACK_CODE_UNKNOWN_JOB = 1;
const bit<8> AGGD_NACK_CODE_NOT_MEMBER = 2;
const bit<8> AGGD_NACK_CODE_BAD_CHUNK = 3;
const bit<8> AGGD_NACK_CODE_STALE = 4;
const bit<8> AGGD_NACK_CODE_BAD_TOKEN = 5;
const bit<8> AGGD_NACK_CODE_BAD_REQUEST = 6;

const bit<8> AGGD_PRECISION_INT32 = 0;
const bit<8> AGGD_PRECISION_INT16 = 1;
const bit<8> AGGD_PRECISION_INT8 = 2;

const bit<8> AGGD_STRATEGY_KIND_SYNC = 0;
const bit<8> AGGD_STRATEGY_KIND_QUORUM = 1;
const bit<8> AGGD_STRATEGY_KIND_SSP = 2;
const bit<8> AGGD_STRATEGY_KIND_ASYNC = 3;
const bit<8> AGGD_STRATEGY_KIND_WBSP = 4;

const bit<8> AGGD_DROP_REASON_TOO_SHORT = 0;
const bit<8> AGGD_DROP_REASON_BAD_MAGIC = 1;
const bit<8> AGGD_DROP_REASON_BAD_VERSION = 2;
const bit<8> AGGD_DROP_REASON_BAD_TYPE = 3;
const bit<8> AGGD_DROP_REASON_BAD_COUNT = 4;
const bit<8> AGGD_DROP_REASON_UNKNOWN_JOB = 5;
const bit<8> AGGD_DROP_REASON_BAD_RANK = 6;
const bit<8> AGGD_DROP_REASON_NOT_MEMBER = 7;
const bit<8> AGGD_DROP_REASON_BAD_CHUNK = 8;
const bit<8> AGGD_DROP_REASON_DUPLICATE = 9;
const bit<8> AGGD_DROP_REASON_STALE = 10;
const bit<8> AGGD_DROP_REASON_BUSY = 11;
const bit<8> AGGD_DROP_REASON_NOT_READY = 12;
const bit<8> AGGD_DROP_REASON_BAD_TAG = 13;
const bit<8> AGGD_DROP_REASON_BAD_PRECISION = 14;
const bit<8> AGGD_DROP_REASON_OUT_OF_BOUNDS = 15;
const bit<8> AGGD_DROP_REASON_BAD_STEP = 16;

const bit<8> AGGD_COUNTER_RX_PACKETS = 0;
const bit<8> AGGD_COUNTER_RX_BYTES = 1;
const bit<8> AGGD_COUNTER_ELEMENTS = 2;
const bit<8> AGGD_COUNTER_CONTRIBUTIONS = 3;
const bit<8> AGGD_COUNTER_RELEASED = 4;
const bit<8> AGGD_COUNTER_REREADS = 5;
const bit<8> AGGD_COUNTER_OVERFLOWS = 6;
const bit<8> AGGD_COUNTER_TO_USERSPACE = 7;
const bit<8> AGGD_COUNTER_RETRANSMITS = 8;
const bit<8> AGGD_COUNTER_CARRIED = 9;
const bit<8> AGGD_COUNTER_TIMEOUTS = 10;
const bit<8> AGGD_COUNTER_PARTIALS = 11;
const bit<8> AGGD_COUNTER_FORWARDED = 12;
const bit<8> AGGD_COUNTER_RELAYED = 13;
const bit<8> AGGD_COUNTER_UNCARRIED = 14;

header aggd_h {
    bit<16> magic;  // 0xA66D; anything else is dropped
    bit<8> version;  // protocol version, 2
    bit<8> type;  // MsgType
    bit<16> job;  // job id, 0..MAX_JOBS-1
    bit<16> rank;  // sender's rank (contributions, re-reads); 0xFFFF in results
    bit<32> round;  // the job's allreduce number
    bit<32> chunk;  // packet-sized piece of the round's tensor; selects slot chunk % slots
    bit<16> count;  // values that carry data (the payload may be padded beyond)
    bit<16> strategy_version;  // strategy-table version that governs this round (results)
    bit<16> exponent;  // values are int32 * 2**-exponent; the sum uses the smallest
    bit<8> flags;  // Flag bits
    bit<8> code;  // NACKs: NackCode; contributions, re-reads and results: the payload's Precision (0 int32 in and out, 1 int16 in / int32 out, 2 int8 in / int16 out)
    bit<64> contributors;  // results: bitmap of ranks summed (bit i = rank i); contributions and re-reads: the sender's member tag (JOIN_ACK ``tag``), 0 if it has none
    bit<16> n_contrib;  // results: contributions summed (may exceed popcount under wbsp); contributions: how many one holds (a rack aggregator's partial sum), 0 from a worker (counts as 1)
    bit<16> step;  // local step within the round (wbsp); 0 otherwise
    bit<8> strategy;  // StrategyKind that governed the round (results), so clients adapt
    bit<8> param;  // that strategy's parameter: quorum k or ssp staleness
    bit<16> skip;  // contributions and re-reads: rounds since the chunk's previous round that did not include it (0 when it took part in the round before, or never took part); SKIP_MAX: that many or more. 0 in results and NACKs
}

#endif
