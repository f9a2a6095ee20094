"""``aggctl status``: what the daemon is doing."""
from __future__ import annotations

import click

from aggd.cli.commands._daemon import ago, call, duration, echo_json, job_cells, job_columns, json_option, table


@click.command()
@json_option
def status(as_json):
    """The daemon: data plane, kernel memory, user-space path, jobs and where their slots live."""
    s = call("status")
    if as_json:
        echo_json(s)
        return
    dp, k, us = s["dataplane"], s["kernel"], s["userspace"]
    where = f" in netns {dp['netns']}" if dp["netns"] else ""
    click.echo(f"aggd pid {s['pid']}, up {duration(s['uptime'])}, config {s['config'] or '-'}")
    if dp.get("kind") == "p4":
        p4 = dp["p4"]
        click.echo(f"data plane: P4 {p4['target']} switch at {p4['grpc']} "
                   f"({'connected' if dp['attached'] else 'DISCONNECTED'}), {dp['address']}:{dp['port']}, "
                   f"{dp['elements']} elements a packet; user-space port {dp['userspace_port']}")
        click.echo(f"switch slots: {k['budget_slots']} (of the program's {p4.get('program_slots', '-')}); "
                   f"{k['used_slots']} used, {k['free_slots']} free (largest run {k['largest_free_run']})")
    else:
        click.echo(f"data plane: XDP {dp['mode']} on {dp['interface']}{where} "
                   f"({'attached' if dp['attached'] else 'DETACHED'}), {dp['address']}:{dp['port']}, "
                   f"{dp['elements']} elements a packet; user-space port {dp['userspace_port']}")
        held = k["budget_slots"] * k["slot_bytes"]
        # a reload may ask for more than the array loaded at start holds (it grows at a restart
        # with --reset-kernel-state): say both
        more = (f" (kernel_memory asks {k['budget_bytes']} bytes: the rest after a restart with "
                f"--reset-kernel-state)" if k["budget_bytes"] > held + k["slot_bytes"] else "")
        click.echo(f"kernel memory: {k['budget_slots']} slots of {k['slot_bytes']} B = {held} bytes{more}; "
                   f"{k['used_slots']} used, {k['free_slots']} free (largest run {k['largest_free_run']})")
    click.echo(f"user-space path: {'running' if us['alive'] else 'STOPPED'}, {us['errors']} errors, "
               f"{us['send_errors']} send errors")
    for path, drops in (s.get("no_job_drops") or {}).items():
        shown = ", ".join(f"{reason} {n}" for reason, n in sorted(drops.items()) if n)
        if shown:
            click.echo(f"dropped before reaching a job ({path}): {shown}")
    if not s["jobs"]:
        click.echo("no jobs (create one with `aggctl jobs create NAME --world N`)")
        return
    table(job_columns("SWITCH" if dp.get("kind") == "p4" else "KERNEL") + ("STRAGGLERS",),
          [job_cells(j) + (_stragglers(j.get("policy")),) for j in s["jobs"]])
    for j in s["jobs"]:
        for path, drops in (j.get("drops") or {}).items():
            if drops:
                shown = ", ".join(f"{reason} {n}" for reason, n in sorted(drops.items()))
                click.echo(f"{j['name']}: dropped ({path}): {shown}")
        decision_lines(j["name"], j.get("policy"), last_only=True)


def _stragglers(p: dict | None) -> str | None:
    if not p:
        return None
    return ",".join(str(r) for r in p.get("stragglers_now") or []) or "none"


def decision_lines(job: str, p: dict | None, last_only: bool = False) -> None:
    """The policy's switches of ``job`` (aggd/core/policy.py), newest last, with their reasons."""
    if not p:
        return
    shown = p["decisions"][-1:] if last_only else p["decisions"]
    for d in shown:
        click.echo(f"{job}: {ago(d['time'])} policy switched {d['from']} -> {d['strategy']} from round "
                   f"{d['from_round']}: {d['reason']}")
    if p.get("note"):
        click.echo(f"{job}: policy: {p['note']}")
