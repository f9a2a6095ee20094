/* The one aggd parser, shared by the v1model and TNA programs (each calls it from its own
 * architecture-specific top-level parser).
 *
 * ethernet -> ipv4 (no options, not a fragment) -> udp -> aggd header (UDP to AGGD_PORT) ->
 * payload lanes and tail blocks, only when the UDP length is exactly a full packet
 * (8 + AGGD_HDR_SIZE + 4 * AGGD_ELEMENTS). Anything else stops early: non-aggd traffic is forwarded
 * untouched, and an aggd message of another size is checked (too_short, bad_count) and then handed
 * to the daemon's user-space path like XDP_PASS does. */
#ifndef AGGD_PARSER_P4
#define AGGD_PARSER_P4

#include "headers.p4"

#define AGGD_FULL_UDP_LEN (8 + 40 + 4 * AGGD_ELEMENTS)

parser AggdCommonParser(packet_in pkt, out headers_t hdr) {
    state start {
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }

    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.ihl, hdr.ipv4.flags[0:0], hdr.ipv4.frag_offset, hdr.ipv4.protocol) {
            (4w5, 1w0, 13w0, IP_PROTO_UDP): parse_udp;
            default: accept;
        }
    }

    state parse_udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            AGGD_PORT: parse_aggd;
            default: accept;
        }
    }

    state parse_aggd {
        pkt.extract(hdr.aggd);
        transition select(hdr.udp.length) {
            AGGD_FULL_UDP_LEN: parse_lanes;
            default: accept;
        }
    }

    state parse_lanes {
        pkt.extract(hdr.lanes);
#if AGGD_PASSES > 1
        transition parse_tail;
#else
        transition accept;
#endif
    }

#if AGGD_PASSES > 1
    state parse_tail {
        pkt.extract(hdr.tail.next);
        transition select(hdr.tail.lastIndex) {
            (bit<32>)(AGGD_PASSES - 2): accept;
            default: parse_tail;
        }
    }
#endif
}

#endif
