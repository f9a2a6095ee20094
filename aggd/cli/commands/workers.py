"""``aggctl workers JOB`` (the members, their lag, who is gone and why), ``aggctl workers remove
JOB RANK`` (rounds stop waiting for a dead worker) and ``aggctl workers readmit JOB RANK``."""
from __future__ import annotations

import click

from aggd.cli.commands._daemon import ago, call, echo_json, json_option, table
from aggd.cli.commands.status import decision_lines


class _ShowByDefault(click.Group):
    """``aggctl workers JOB`` is ``aggctl workers show JOB``."""

    def resolve_command(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["show", *args]
        return super().resolve_command(ctx, args)


@click.group(cls=_ShowByDefault)
def workers():
    """The members of a job (``aggctl workers JOB``), and declaring one gone or back."""


@workers.command()
@click.argument("job")
@json_option
def show(job, as_json):
    """The members of JOB: registered address, when they joined, the last round they contributed
    to, the straggler detector's view, and who is gone (rounds do not wait for them) and why."""
    w = call("workers", job=job)
    if as_json:
        echo_json(w)
        return
    click.echo(f"job {w['job']} ({w['id']}), round {'-' if w['round'] is None else w['round']}")
    p = w.get("policy")
    if p:
        click.echo(f"policy: {'switching' if p['auto_switch'] and p['managed'] else 'watching only'}; "
                   f"strategy {p.get('in_force', '-')} (its own: {p.get('own', '-')})")
    table(("RANK", "ADDRESS", "JOINED", "LAST ROUND", "LAG ms", "SLOWDOWN", "WAITED s", "STRAGGLER", "OFFENCES",
           "SCORE", "GONE"),
          [(r["rank"], f"{r['address'][0]}:{r['address'][1]}" if r["address"] else "not joined",
            ago(r["joined_at"]), r["last_round"], r["lag"],
            None if r.get("slowdown") is None else f"{r['slowdown']:.2f}x",
            None if r.get("wait_s") is None else f"{r['wait_s']:.1f}",
            None if r.get("straggler") is None else ("yes" if r["straggler"] else "no"),
            r.get("offences", 0), None if r.get("score") is None else f"{r['score']:.2f}",
            None if not r.get("gone") else (f"{ago(r['gone']['since'])}, round {r['gone']['round']}"
                                            + (", quarantined" if r["gone"].get("quarantined") else "")))
           for r in w["workers"]])
    for r in w["workers"]:
        if r.get("gone"):
            click.echo(f"rank {r['rank']} gone: {r['gone']['reason']}")
    decision_lines(w["job"], p)


@workers.command()
@click.argument("job")
@click.argument("rank", type=int)
@click.option("--reason", default=None, help="Why (logged, and shown by `aggctl workers JOB`).")
@json_option
def remove(job, rank, reason, as_json):
    """Declare RANK of JOB gone: rounds stop waiting for it (the round the others are stuck in is
    released at their next retransmission). It is awaited again once it keeps pace."""
    r = call("workers.remove", job=job, rank=rank, reason=reason)
    if as_json:
        echo_json(r)
        return
    click.echo(f"job {r['job']}: rank {r['rank']} gone from round {r['round']}: {r['reason']}")


@workers.command()
@click.argument("job")
@click.argument("rank", type=int)
@json_option
def readmit(job, rank, as_json):
    """Rounds of JOB wait for RANK again."""
    r = call("workers.readmit", job=job, rank=rank)
    if as_json:
        echo_json(r)
        return
    click.echo(f"job {r['job']}: rank {r['rank']} is awaited again")
