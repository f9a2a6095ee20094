"""``aggctl strategy``: show a job's strategy versions, or set a new one from a round on."""
from __future__ import annotations

import click

from aggd.cli.commands._daemon import call, checked_strategy, echo_json, json_option, table


@click.group()
def strategy():
    """A job's synchronization strategy (versioned; a new version takes effect from a round)."""


def _print(s: dict) -> None:
    now = s["in_force"]
    line = (f"job {s['job']} ({s['id']}): {now['strategy']} (version {now['version']}) in force, "
            f"round {'-' if s['round'] is None else s['round']}")
    if now["version"] != s["version"]:
        newest = s["versions"][-1]
        line += f"; {s['current']} (version {s['version']}) from round {newest['from_round']}"
    click.echo(line)
    table(("VERSION", "FROM ROUND", "STRATEGY"), [(v["version"], v["from_round"], v["strategy"]) for v in s["versions"]])


@strategy.command()
@click.argument("job")
@json_option
def show(job, as_json):
    """JOB's strategy table."""
    s = call("strategy.show", job=job)
    echo_json(s) if as_json else _print(s)


@strategy.command("set")
@click.argument("job")
@click.argument("text", metavar="STRATEGY")
@click.option("--from-round", type=click.IntRange(0, (1 << 32) - 1),
              help="First round the new strategy governs (default: a little after the job's current round).")
@json_option
def set_(job, text, from_round, as_json):
    """Switch JOB to STRATEGY (sync, quorum:K[:TIMEOUT], ssp:S, async, wbsp) from a round on."""
    args = {"job": job, "strategy": checked_strategy(text)}
    if from_round is not None:
        args["from_round"] = from_round
    s = call("strategy.set", **args)
    if as_json:
        echo_json(s)
        return
    v = s["versions"][-1]
    click.echo(f"job {s['job']}: {v['strategy']} from round {v['from_round']} (version {v['version']})")
