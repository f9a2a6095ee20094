"""aggctl: the operator CLI. Each sub-command group lives in ``aggd/commands/``."""
from __future__ import annotations

import importlib

import click

# (module, attribute) of each sub-command; imported lazily so `aggctl --help` stays fast and a
# group's heavy imports (bcc, numba) load only when it runs.
_COMMANDS = {
    "lab": ("aggd.cli.commands.lab", "lab"),
    "bench": ("aggd.cli.commands.bench", "bench"),
    "demo": ("aggd.cli.commands.demo", "demo"),
    "status": ("aggd.cli.commands.status", "status"),
    "workers": ("aggd.cli.commands.workers", "workers"),
    "jobs": ("aggd.cli.commands.jobs", "jobs"),
    "strategy": ("aggd.cli.commands.strategy", "strategy"),
    "config": ("aggd.cli.commands.config", "config"),
    "top": ("aggd.cli.commands.top", "top"),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(_COMMANDS)

    def get_command(self, ctx, name):
        if name not in _COMMANDS:
            return None
        module, attr = _COMMANDS[name]
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup)
@click.version_option(package_name="aggd")
@click.option("--socket", "socket_path", envvar="AGGD_SOCKET", default="/run/aggd/control.sock",
              show_default=True, help="The daemon's control socket (or $AGGD_SOCKET).")
@click.pass_context
def main(ctx, socket_path):
    """Drive the aggd gradient aggregator."""
    ctx.obj = {"socket": socket_path}


if __name__ == "__main__":
    main()
