"""``aggctl config check FILE``: the daemon's own config checks, without a daemon."""
from __future__ import annotations

import json

import click

from aggd.daemon.config import ConfigError, load


@click.group()
def config():
    """The daemon's config file."""


@config.command()
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def check(path, as_json):
    """Check FILE as aggd would load it: every unknown key and bad value, by key path; and what this
    host lacks of it (the network namespace, the interface and its address), as a start would."""
    try:
        cfg = load(path)
    except ConfigError as exc:
        _fail(path, exc.problems, as_json)
    from aggd.daemon.service import host_problems   # pyroute2: only for the check that needs it
    host = host_problems(cfg)
    if host:
        _fail(path, host, as_json)
    if cfg.dataplane.kind == "p4":
        _check_p4(path, cfg, as_json)
        return
    if as_json:
        click.echo(json.dumps({"ok": True, "file": path, "config": cfg.to_dict(),
                               "kernel_slots_estimate": cfg.kernel_slots}, indent=2))
    else:
        click.echo(f"{path}: OK (the kernel memory holds about {cfg.kernel_slots} slots; "
                   f"`aggctl status` shows the exact number)")


def _fail(path: str, problems: list[str], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"ok": False, "file": path, "problems": problems}, indent=2))
    else:
        click.echo(f"{path}: {len(problems)} problem(s)", err=True)
        for p in problems:
            click.echo(f"  {p}", err=True)
    raise SystemExit(1)


def _check_p4(path: str, cfg, as_json: bool) -> None:
    """What can be checked of a P4 config without the switch: the P4Info (every object the backend
    uses, the packet size) and the files the daemon will read."""
    from pathlib import Path

    from aggd.dataplane.p4 import P4Error
    from aggd.dataplane.p4.backend import P4DataPlane
    from aggd.dataplane.p4.p4info import P4INFO, TNA_P4INFO, P4Info

    p4 = cfg.p4
    info_path = p4.p4info or str(TNA_P4INFO if p4.target == "tofino" else P4INFO)
    problems, info = [], None
    try:
        info = P4Info(info_path)
        P4DataPlane.check_program(info, p4.target)
    except P4Error as exc:
        problems.append(f"p4.p4info: {info_path}: {exc}")
    if info is not None and not problems:
        if info.elements != cfg.dataplane.elements_per_packet:
            problems.append(f"dataplane.elements_per_packet: the P4 program adds {info.elements} values a packet, "
                            f"not {cfg.dataplane.elements_per_packet}")
        if p4.slots > info.slots:
            problems.append(f"p4.slots: the P4 program has {info.slots} slots, not {p4.slots}")
    if p4.device_config and not Path(p4.device_config).is_file():
        problems.append(f"p4.device_config: no file {p4.device_config} (build it with `make p4`)")
    if problems:
        _fail(path, problems, as_json)
    slots = p4.slots or info.slots
    if as_json:
        click.echo(json.dumps({"ok": True, "file": path, "config": cfg.to_dict(), "switch_slots": slots}, indent=2))
    else:
        click.echo(f"{path}: OK (P4 {p4.target} switch at {p4.grpc}, {slots} switch slots, "
                   f"{info.elements} values a packet; the switch itself is reached at start)")
