/* Headers of the aggd P4 programs. `aggd_h` comes from the generated aggd_proto.p4 (the wire
 * definition in client/aggd_client/protocol/definition.py), never written here. */
#ifndef AGGD_HEADERS_P4
#define AGGD_HEADERS_P4

#include "../aggd_proto.p4"
#include "layout.p4"

const bit<16> ETHERTYPE_IPV4 = 0x0800;
const bit<8> IP_PROTO_UDP = 17;

header ethernet_h {
    bit<48> dst_addr;
    bit<48> src_addr;
    bit<16> ether_type;
}

header ipv4_h {
    bit<4>  version;
    bit<4>  ihl;
    bit<8>  diffserv;
    bit<16> total_len;
    bit<16> identification;
    bit<3>  flags;
    bit<13> frag_offset;
    bit<8>  ttl;
    bit<8>  protocol;
    bit<16> hdr_checksum;
    bit<32> src_addr;
    bit<32> dst_addr;
}

header udp_h {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> length;
    bit<16> checksum;
}

/* The first AGGD_LANES payload values, as on the wire (little-endian int32: see AGGD_SWAP). */
#define AGGD_LANE_FIELD(i) bit<32> v##i;
#define AGGD_LANES_32(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) \
    M(14) M(15) M(16) M(17) M(18) M(19) M(20) M(21) M(22) M(23) M(24) M(25) M(26) M(27) M(28) M(29) \
    M(30) M(31)
#define AGGD_LANES_64(M) AGGD_LANES_32(M) M(32) M(33) M(34) M(35) M(36) M(37) M(38) M(39) M(40) M(41) \
    M(42) M(43) M(44) M(45) M(46) M(47) M(48) M(49) M(50) M(51) M(52) M(53) M(54) M(55) M(56) M(57) \
    M(58) M(59) M(60) M(61) M(62) M(63)
#if AGGD_LANES == 64
#define AGGD_FOR_LANES(M) AGGD_LANES_64(M)
#elif AGGD_LANES == 32
#define AGGD_FOR_LANES(M) AGGD_LANES_32(M)
#else
#error "AGGD_LANES must be 32 or 64"
#endif

header lanes_h {
    AGGD_FOR_LANES(AGGD_LANE_FIELD)
}

/* The rest of the payload, one opaque block per later pass. Each pass adds the block right after
 * the aggd header and the deparser moves it behind the others (lanes_out), so after AGGD_PASSES
 * passes every block went through the lanes once and the payload is back in order. */
header block_h {
    bit<AGGD_BLOCK_BITS> data;
}

/* Byte swap of a little-endian int32 payload value (a free bit-slice shuffle on a switch). */
#define AGGD_SWAP(x) ((x)[7:0] ++ (x)[15:8] ++ (x)[23:16] ++ (x)[31:24])

struct headers_t {
    ethernet_h ethernet;
    ipv4_h     ipv4;
    udp_h      udp;
    aggd_h     aggd;
    lanes_h    lanes;
#if AGGD_PASSES > 1
    block_h[AGGD_PASSES - 1] tail;
#endif
    lanes_h    lanes_out;
}

#endif
