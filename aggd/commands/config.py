"""``aggctl config check FILE``: the daemon's own config checks, without a daemon."""
from __future__ import annotations

import json

import click

from aggd.config import ConfigError, load


@click.group()
def config():
    """The daemon's config file."""


@config.command()
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def check(path, as_json):
    """Check FILE as aggd would load it: every unknown key and bad value, by key path."""
    try:
        cfg = load(path)
    except ConfigError as exc:
        if as_json:
            click.echo(json.dumps({"ok": False, "file": path, "problems": exc.problems}, indent=2))
        else:
            click.echo(f"{path}: {len(exc.problems)} problem(s)", err=True)
            for p in exc.problems:
                click.echo(f"  {p}", err=True)
        raise SystemExit(1)
    if as_json:
        click.echo(json.dumps({"ok": True, "file": path, "config": cfg.to_dict(),
                               "kernel_slots_estimate": cfg.kernel_slots}, indent=2))
    else:
        click.echo(f"{path}: OK (the kernel memory holds about {cfg.kernel_slots} slots; "
                   f"`aggctl status` shows the exact number)")
