/* Sizes shared by the aggd P4 programs (v1model and TNA) and, through the P4Info, by the control
 * plane (aggd/dataplane/p4_layout.py reads them back from register sizes). Every value can be set
 * with -D at compile time (`make p4 P4FLAGS="-DAGGD_LANES=32"`).
 *
 * A switch cannot loop over 256 values: each pass through the pipeline adds AGGD_LANES int32 lanes
 * (one register per lane, SwitchML's layout) and the packet is recirculated until all
 * AGGD_ELEMENTS values of its payload went through: AGGD_PASSES = AGGD_ELEMENTS / AGGD_LANES. */
#ifndef AGGD_LAYOUT_P4
#define AGGD_LAYOUT_P4

#ifndef AGGD_ELEMENTS
#define AGGD_ELEMENTS 256          /* int32 values a packet: the daemon's elements_per_packet */
#endif
#ifndef AGGD_LANES
#define AGGD_LANES 64              /* int32 values added per pass: 32 or 64 */
#endif
#define AGGD_PASSES (AGGD_ELEMENTS / AGGD_LANES)
#define AGGD_BLOCK_BITS (AGGD_LANES * 32)

#ifndef AGGD_SLOTS
#define AGGD_SLOTS 1024            /* slots the switch holds, shared by all jobs */
#endif
#define AGGD_BANKS 4               /* banks a slot (docs/protocol.md, "Slot state") */
#define AGGD_BANK_CELLS (AGGD_SLOTS * AGGD_BANKS)
#define AGGD_LANE_CELLS (AGGD_BANK_CELLS * AGGD_PASSES)

#ifndef AGGD_PORT
#define AGGD_PORT 47000            /* UDP port of the aggd protocol (parser constant) */
#endif

/* Counter layouts: per-job rows of a fixed stride, row AGGD_NO_JOB for packets without a job. */
#define AGGD_NO_JOB 256
#define AGGD_COUNTER_STRIDE 16     /* >= number of Counter values (12) */
#define AGGD_DROP_STRIDE 32        /* >= number of DropReason values (17) */
#define AGGD_JOB_ROWS 257          /* AGGD_MAX_JOBS + 1 */

/* Multicast groups of the packet replication engine: job j's results use group j + 1; flooding
 * of non-aggd traffic uses AGGD_FLOOD_GROUP. */
#define AGGD_FLOOD_GROUP 0x0200

#define BANK_EMPTY 0
#define BANK_OPEN 1
#define BANK_RELEASED 2
#define NO_BANK 0xFF

#endif
