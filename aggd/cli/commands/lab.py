"""`aggctl lab`: build, inspect and remove a namespace lab (see aggd/lab/namespaces.py)."""
from __future__ import annotations

import json

import click

from aggd_client.protocol import PAGE_MAX_ELEMENTS

from aggd.lab.namespaces import JUMBO_MAX_MTU, MAX_AGGREGATORS, MAX_WORKERS, NATIVE_MAX_MTU, PAGE_MTU, Lab, LabError

DEFAULT_NAME = "aggdlab"


class LossPercent(click.ParamType):
    """A loss rate as `2%`, `2` or `0.5%` (percent either way), 0..100."""

    name = "percent"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)):
            number = float(value)
        else:
            text = str(value).strip()
            try:
                number = float(text[:-1] if text.endswith("%") else text)
            except ValueError:
                self.fail(f"{value!r} is not a percentage (try 2%, 2 or 0.5%)", param, ctx)
        if not 0.0 <= number <= 100.0:
            self.fail(f"{value!r} is outside 0%..100%", param, ctx)
        return number


name_option = click.option("--name", default=DEFAULT_NAME, show_default=True,
                           help="Lab name; prefixes its namespaces.")


@click.group()
def lab():
    """A lab of network namespaces: one bridge, an aggregator and N workers on one host."""


@lab.command()
@click.option("--workers", "-n", type=click.IntRange(1, MAX_WORKERS), required=True,
              help="Number of worker namespaces.")
@click.option("--loss", type=LossPercent(), default="0", show_default=True,
              help="Packets dropped in transit on the bridge, e.g. 2% or 0.5%.")
@click.option("--mtu", type=click.IntRange(68, JUMBO_MAX_MTU), default=NATIVE_MAX_MTU, show_default=True,
              help=f"above {PAGE_MTU} a native XDP aggregator needs elements_per_packet above "
                   f"{PAGE_MAX_ELEMENTS} (multi-buffer frames); above {NATIVE_MAX_MTU} (native XDP's "
                   f"limit) it must run generic mode")
@click.option("--aggregators", type=click.IntRange(1, MAX_AGGREGATORS), default=1, show_default=True,
              help="Aggregator namespaces (10.77.0.1 onwards): a job sharded over several.")
@click.option("--racks", type=click.IntRange(0, MAX_AGGREGATORS - 1), default=0, show_default=True,
              help="Racks behind a spine bridge (docs/hierarchy.md): a bridge a rack with its share of the "
                   "workers and an aggregator each; the last aggregator on the spine.")
@click.option("--gro", is_flag=True,
              help="Workers receive as a NIC does: GRO in NAPI, TCP cut to the MTU at the bridge (default: "
                   "through the host's backlog, TCP passed in 64 KiB segments).")
@name_option
def up(workers, loss, mtu, aggregators, racks, gro, name):
    """Build a lab and leave it running."""
    if racks and aggregators < racks + 1:
        aggregators = racks + 1          # one a rack and the spine's
    try:
        made = Lab(name, workers, loss_percent=loss, mtu=mtu, aggregators=aggregators, racks=racks, gro=gro).up()
    except (LabError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"lab {name} is up: {workers} worker(s), loss {loss:g}%, mtu {mtu}" + (", GRO" if gro else ""))
    _print_table(made.status())
    click.echo(f"run in it:  ip netns exec {made.worker_ns(0)} <command>")
    click.echo(f"remove it:  aggctl lab down --name {name}")


@lab.command()
@name_option
def down(name):
    """Remove a lab (idempotent; also cleans up after a crashed run)."""
    try:
        existed = Lab.exists(name)
        # down() goes by name, so a stand-in removes whatever a crashed run left behind.
        target = Lab.load(name) if existed else Lab(name, 1)
        target.down()
    except (LabError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"lab {name} removed" if existed else f"no lab {name}; nothing to remove")


@lab.command()
@name_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(name, as_json):
    """Show a lab's namespaces, interfaces and addresses."""
    try:
        info = Lab.load(name).status()
    except (LabError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"lab {info['name']}: {info['workers']} worker(s), loss {info['loss_percent']:g}%,"
               f" mtu {info['mtu']}")
    _print_table(info)


@lab.command()
@name_option
@click.option("--aggregator", "-a", type=click.IntRange(0, MAX_AGGREGATORS - 1), default=0, show_default=True,
              help="Which aggregator's link (the bridge's port towards it).")
@click.option("--rate", help="Limit it to this many Mbit/s towards the aggregator (a token bucket), or `off`.")
@click.option("--state", type=click.Choice(["up", "down"]), help="Take the link down (the host is gone) or up.")
def link(name, aggregator, rate, state):
    """Shape or cut the link to an aggregator: a host behind a slower link, or one that is gone.
    (XDP_TX skips the aggregator's own veth qdisc, so the shaping is on the bridge's side.)"""
    if rate is None and state is None:
        raise click.UsageError("give --rate and/or --state")
    try:
        made = Lab.load(name)
        if rate is not None:
            mbit = None if rate == "off" else float(rate)
            made.set_aggregator_rate(aggregator, mbit)
        if state is not None:
            made.set_aggregator_link(aggregator, up=state == "up")
    except (LabError, ValueError, IndexError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"lab {name}: link to aggregator {aggregator}" + (f" rate {rate}" if rate else "")
               + (f" {state}" if state else ""))


def _port(node: dict) -> str:
    """An aggregator's bridge port as `lab link` left it: its state and any rate limit."""
    if node.get("port_state") is None:
        return "-"
    rate = node.get("rate_mbit")
    return node["port_state"] + (f", {rate:g} Mbit/s" if rate is not None else "")


def _print_table(info: dict) -> None:
    header = ("ROLE", "NAMESPACE", "IFACE", "ADDRESS", "MAC", "STATE", "BRIDGE PORT")
    keys = ("role", "namespace", "ifname", "address", "mac", "state")
    rows = [header] + [tuple(str(n[k] or "-") for k in keys) + (_port(n),) for n in info["nodes"]]
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    xdp = info["sw_agg_xdp_prog_id"]
    click.echo(f"XDP_PASS on sw-agg (lets XDP_TX from agg0 through): "
               f"{'prog id ' + str(xdp) if xdp else 'MISSING'}")
