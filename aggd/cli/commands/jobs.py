"""``aggctl jobs``: create, list, show and delete jobs."""
from __future__ import annotations

import click

from aggd_client.protocol import MAX_ELEMENTS, MAX_MEMBERS
from aggd_client.quant import MAX_HEADROOM

from aggd.cli.commands._daemon import (call, checked_strategy, echo_json, job_cells, job_columns, json_option,
                                      slot_range, table)

COUNTERS = ("rx_packets", "contributions", "released", "rereads", "to_userspace", "retransmits", "overflows")


@click.group()
def jobs():
    """Jobs: a training run's workers, token, strategy and slots."""


@jobs.command("list")
@json_option
def list_(as_json):
    """All jobs."""
    rows = call("jobs.list")
    if as_json:
        echo_json(rows)
        return
    if not rows:
        click.echo("no jobs")
        return
    table(job_columns() + ("VALUES/PACKET",), [job_cells(j) + (j.get("values_per_packet", j["elements"]),)
                                                 for j in rows])


@jobs.command()
@click.argument("name")
@click.option("--world", "-n", type=click.IntRange(1, MAX_MEMBERS), required=True, help="Number of workers.")
@click.option("--strategy", default="sync", show_default=True, help="sync, quorum:K[:TIMEOUT], ssp:S, async, wbsp")
@click.option("--slots", type=click.IntRange(1), help="Slots of the job's pool (default: jobs.default_slots).")
@click.option("--elements", type=click.IntRange(1, MAX_ELEMENTS),
              help="Values a packet (default: the kernel's; another size is served in user space).")
@click.option("--kernel-slots", type=click.IntRange(0),
              help="At most this many slots in the kernel (default: as many as fit; 0: user space only).")
@click.option("--headroom", type=click.IntRange(1, MAX_HEADROOM),
              help=f"Contributions per member a round is quantised for (default {MAX_HEADROOM}: room for every "
                   f"strategy; 1: two bits finer sums, sync/ssp/async only; 2: also quorum).")
@click.option("--precision", type=click.Choice(["32", "16", "8"]),
              help="Bits of a contribution value (default 32). 16 and 8 send half and a quarter of the "
                   "bytes, summed exactly into 32- and 16-bit results; workers round stochastically and "
                   "feed the rounding back (docs/precision.md). The XDP program adds them in the kernel (in "
                   "user space with jumbo packets in generic mode, or behind a P4 switch).")
@click.option("--max-abs", type=click.FloatRange(min=0, min_open=True),
              help="The largest magnitude a member's contribution may have: one with a value beyond it is "
                   "dropped and counted against the member (OFFENCES in `aggctl workers`; docs/protocol.md "
                   "\"Bounds\").")
@click.option("--max-norm", type=click.FloatRange(0, min_open=True),
              help="The largest L2 norm a member's contribution (one packet's values) may have: one beyond it "
                   "is dropped and counted against the member, as for --max-abs.")
@click.option("--quarantine-after", type=click.IntRange(0),
              help="Quarantine a member (declared gone, its packets and JOINs refused until `aggctl workers "
                   "readmit`) after this many contributions beyond --max-abs or --max-norm (default 0: never).")
@click.option("--combine", metavar="sum|median|trimmed:T|zeno",
              help="How a round's contributions are combined (default sum). The others keep every member's "
                   "contribution apart, in user space, so one bad member cannot move the result far: the "
                   "coordinate-wise median, the trimmed mean (the T largest and T smallest values of each "
                   "coordinate dropped), or zeno (the mean of the contributions that score at least 0 against "
                   "the median: as good as a sum while all are honest). sync, quorum and ssp only "
                   "(docs/protocol.md \"Robust jobs\").")
@click.option("--score-rho", type=click.FloatRange(0), help="A robust job's weight of |x|^2 in each member's "
                                                           "score (default 0.05; docs/security.md).")
@click.option("--score-after", type=click.IntRange(0),
              help="Quarantine a member of a robust job after this many policy windows in a row with a score "
                   "below -0.5 (default 0: never; SCORE in `aggctl workers`).")
@click.option("--token", help="The job's token (default: a new one). A job sharded over several aggregator "
                                "hosts is created on each with the token the first one printed.")
@click.option("--upstream", metavar="HOST:PORT/JOB",
              help="Make it a rack job: its complete rounds go up to job JOB (name or id) of the aggd at "
                   "HOST:PORT, which this daemon joins (docs/hierarchy.md). Needs the three options below.")
@click.option("--upstream-token", help="The upper job's token.")
@click.option("--upstream-rank", type=click.IntRange(0, MAX_MEMBERS - 1), help="This rack's rank in the upper job.")
@click.option("--span", type=click.IntRange(1), help="Workers under the upper aggregator, every rack's: the "
                                                     "members quantise for them.")
@json_option
def create(name, world, strategy, slots, elements, kernel_slots, headroom, precision, max_abs, max_norm, quarantine_after,
           combine, score_rho, score_after, token, upstream, upstream_token, upstream_rank, span, as_json):
    """Create job NAME and print its token (workers join with it)."""
    args = {"name": name, "world": world, "strategy": checked_strategy(strategy)}
    for key, value in (("slots", slots), ("elements", elements), ("kernel_slots", kernel_slots),
                       ("headroom", headroom), ("token", token),
                       ("precision", None if precision is None else int(precision)), ("max_abs", max_abs), ("max_norm", max_norm),
                       ("quarantine_after", quarantine_after), ("combine", combine), ("score_rho", score_rho),
                       ("score_after", score_after)):
        if value is not None:
            args[key] = value
    rack = {"--upstream-token": upstream_token, "--upstream-rank": upstream_rank, "--span": span}
    if upstream is not None:
        server, sep, upper = upstream.rpartition("/")
        if not sep or not server or not upper:
            raise click.BadParameter(f"{upstream!r} is not HOST:PORT/JOB", param_hint="--upstream")
        missing = [k for k, v in rack.items() if v is None]
        if missing:
            raise click.UsageError(f"--upstream needs {', '.join(missing)}")
        args["upstream"] = {"server": server, "job": upper, "token": upstream_token, "rank": upstream_rank,
                            "span": span}
    elif any(v is not None for v in rack.values()):
        raise click.UsageError(f"{', '.join(k for k, v in rack.items() if v is not None)} only with --upstream")
    j = call("jobs.create", **args)
    if as_json:
        echo_json(j)
        return
    p = j["placement"]
    click.echo(f"job {j['name']} created: id {j['id']}, world {j['world']}, {j['strategy']}, "
               f"{j.get('precision', 32)}-bit contributions{_combined(j)}, {j['slots']} slots (kernel {slot_range(p['kernel']['slots'])}, "
               f"user space {slot_range(p['userspace']['slots'])})")
    click.echo(f"token: {j['token']}")
    click.echo(f"workers: aggd_client.join(server, {j['name']!r}, rank, token)")


def _combined(j: dict) -> str:
    """", combined by median" for a robust job; nothing for a summing one."""
    return "" if j.get("combine", "sum") == "sum" else f", combined by {j['combine']}"


@jobs.command()
@click.argument("job")
@json_option
def delete(job, as_json):
    """Delete JOB (its kernel slots are freed)."""
    r = call("jobs.delete", job=job)
    if as_json:
        echo_json(r)
        return
    click.echo(f"job {r['name']} ({r['id']}) deleted; {r['freed_kernel_slots']} kernel slots freed")


@jobs.command()
@click.argument("job")
@json_option
def show(job, as_json):
    """A job's parameters, token, members, and which chunks each path serves."""
    j = call("jobs.show", job=job)
    if as_json:
        echo_json(j)
        return
    p = j["placement"]
    click.echo(f"job {j['name']} (id {j['id']}), world {j['world']}, {j['joined']} joined, "
               f"round {'-' if j['round'] is None else j['round']}")
    click.echo(f"token:     {j['token']}")
    then = "".join(f"; {p['strategy']} (version {p['version']}) from round {p['from_round']}"
                   for p in j.get("pending") or [])
    click.echo(f"strategy:  {j['strategy']} (version {j['strategy_version']}) in force{then}")
    bounds = ", ".join(f"{k} {j[k]:g}" for k in ("max_abs", "max_norm") if j.get(k) is not None)
    if bounds:
        after = j.get("quarantine_after") or 0
        click.echo(f"bounds:    {bounds} a member's contribution; "
                   f"{f'quarantine after {after} offences' if after else 'no quarantine'}")
    if j.get("combine", "sum") != "sum":
        after = j.get("score_after") or 0
        click.echo(f"combine:   {j['combine']} (one row a member; score rho {j.get('score_rho')}, "
                   f"{f'quarantine after {after} windows below -0.5' if after else 'no quarantine by score'})")
    click.echo(f"results:   {j['group'][0]}:{j['group'][1]}; workers send to port {j['port']}, "
               f"{j.get('values_per_packet', j['elements'])} values a packet")
    click.echo(f"slots:     {j['slots']} ({p['rule']})")
    sh = j.get("shards")
    if sh:
        rates = ", ".join("-" if r is None else f"{r / 1e6:.1f}M/s" for r in sh["rates"])
        click.echo(f"shards:    map version {sh['version']} (call {sh['call']}), this host is aggregator "
                   f"{sh['index']} of {len(sh['weights'])} with {sh['share']:.1%} of every tensor; weights "
                   f"{', '.join(f'{w:g}' for w in sh['weights'])}; rates {rates} values")
        for ch in sh["changes"][-5:]:
            click.echo(f"  version {ch['version']} from call {ch['call']}: "
                       f"{', '.join(f'{w:g}' for w in ch['weights'])} ({ch['reason']})")
    up = j.get("upstream")
    if up:
        link = up.get("link") or {}
        click.echo(f"upstream:  job {up['job']} at {up['server'][0]}:{up['server'][1]} as rank {up['rank']}, "
                   f"{up['span']} workers in all; link {link.get('state', '-')}"
                   + (f" ({link['reason']})" if link.get("reason") else ""))
    switch = j.get("dataplane") == "p4"        # the fast path is a P4 switch, not the kernel
    karray = p["kernel"]["array"]
    click.echo(f"  {'switch' if switch else 'kernel'}:     slots {slot_range(p['kernel']['slots'])}"
               + (f" ({'switch' if switch else 'kernel'} array {slot_range(karray)})" if karray else ""))
    click.echo(f"  user space: slots {slot_range(p['userspace']['slots'])}")
    paths = j["paths"]
    fast = paths["kernel"]["counters"]
    # a counter the switch does not keep (a Tofino's) shows "-", not 0
    table(("COUNTER", "SWITCH" if switch else "KERNEL", "USERSPACE"),
          [(c, fast.get(c, None if switch else 0), paths["userspace"]["counters"].get(c, 0)) for c in COUNTERS])
    drops = {k: (paths["kernel"]["drops"].get(k, 0), paths["userspace"]["drops"].get(k, 0))
             for k in sorted(set(paths["kernel"]["drops"]) | set(paths["userspace"]["drops"]))}
    nonzero = [(f"dropped {k}", a, b) for k, (a, b) in drops.items() if a or b]
    if nonzero:
        table(("DROPS", "KERNEL", "USERSPACE"), nonzero)
    if j["members"]:
        table(("RANK", "ADDRESS"), [(m["rank"], f"{m['address'][0]}:{m['address'][1]}") for m in j["members"].values()])
