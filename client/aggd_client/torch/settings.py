"""Where the "aggd" process group finds its aggregator and job: ``pg_options`` first, then the
environment (``AGGD_<NAME>``), then the defaults below. Every problem is a ``SettingsError`` at
``init_process_group`` that names the setting.

=================  ======================  =========================================================
option             environment             meaning
=================  ======================  =========================================================
``server``         ``AGGD_SERVER``         the daemon's ``host:port`` (required); several, comma-
                                           separated, shard the job over those aggregator hosts
                                           (docs/sharding.md)
``job``            ``AGGD_JOB``            the job's name, or its id (digits) (required)
``token``          ``AGGD_TOKEN``          the job's token (``aggctl jobs show``) (required)
``bind``           ``AGGD_BIND``           this worker's address, ``host`` or ``host:port``
                                           (default: any address, a free port)
``give_up_after``  ``AGGD_GIVE_UP_AFTER``  seconds without any answer before a round fails (60)
``join_timeout``   ``AGGD_JOIN_TIMEOUT``   seconds to wait for the JOIN answer (10)
``accept_newer``   ``AGGD_ACCEPT_NEWER``   1: a quorum/async straggler's round answered by a newer
                                           round is used (same tensor every call); 0: an error (0)
``weights``        ``AGGD_WEIGHTS``        with several servers: the shard map's weights, comma-
                                           separated, one a server (default even)
``rebalance_every``  ``AGGD_REBALANCE_EVERY``  with several servers: move partitions between them
                                           every N allreduces, agreed through the group's store
                                           (default: never)
``failover_after``   ``AGGD_FAILOVER_AFTER``  with several servers: drop one that answers nothing for
                                           this many seconds, agreed through the group's store
                                           (default: never; sync jobs)
``probe_every``      ``AGGD_PROBE_EVERY``   with failover and rebalance_every: seconds between rank
                                           0's JOINs to a failed-over server; once one answers,
                                           every rank joins it again at the next agreed allreduce
                                           (5; 0: never)
``rank``             ``AGGD_RANK``          this worker's rank in the aggd job, when that is not its
                                           group rank: ``local`` (torchrun's LOCAL_RANK: a rack
                                           job a node, docs/hierarchy.md) or a number (default:
                                           the group rank)
``error_feedback``   ``AGGD_ERROR_FEEDBACK``  ``on`` or ``off``: keep each tensor's rounding residual
                                           and add it to its next allreduce, resetting every
                                           ``error_reset`` calls (``aggd_client.feedback``; default:
                                           on when the job's precision is 8 or 16 bits)
``error_reset``      ``AGGD_ERROR_RESET``   H: the residuals are allreduced and applied every H-th
                                           allreduce of a tensor (CSER's error reset); 0: never (16)
=================  ======================  =========================================================
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Mapping

__all__ = ["Settings", "SettingsError", "ENV_PREFIX"]

ENV_PREFIX = "AGGD_"


class SettingsError(ValueError):
    """A setting of the "aggd" process group is missing or malformed (the message names it)."""


def _host_port(text: str, what: str, *, port_required: bool) -> tuple[str, int]:
    host, sep, port = str(text).strip().rpartition(":")
    if not sep:
        if port_required:
            raise SettingsError(f"{what} must be host:port, not {text!r}")
        host, port = str(text).strip(), "0"
    if not host:
        raise SettingsError(f"{what} must be host:port, not {text!r}")
    try:
        p = int(port)
    except ValueError:
        raise SettingsError(f"{what}: port {port!r} is not a number") from None
    if not 0 <= p <= 65535 or (port_required and p == 0):
        raise SettingsError(f"{what}: port {p} is out of range")
    return host, p


def _seconds(value, what: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise SettingsError(f"{what} must be a number of seconds, not {value!r}") from None
    if not v > 0:
        raise SettingsError(f"{what} must be positive, not {value!r}")
    return v


def _is_zero(value) -> bool:
    """0 in any spelling ("0", "0.0", "0.00", 0): a setting's "never"."""
    try:
        return float(value) == 0
    except (TypeError, ValueError):
        return False


def _flag(value, what: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise SettingsError(f"{what} must be 0 or 1, not {value!r}")


def _on_off(value, what: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{what} must be on or off, not {value!r}")


@dataclass(frozen=True)
class Settings:
    server: tuple[str, int]
    job: int | str
    token: str
    bind: tuple[str, int] = ("0.0.0.0", 0)
    give_up_after: float = 60.0
    join_timeout: float = 10.0
    accept_newer: bool = False
    #: every aggregator host of the job, ``server`` first (one: not sharded)
    servers: tuple[tuple[str, int], ...] = ()
    weights: tuple[float, ...] | None = None
    rebalance_every: int | None = None
    failover_after: float | None = None
    #: seconds between probes of a failed-over server (None: never)
    probe_every: float | None = 5.0
    #: the member's rank in the job: None (the group rank), "local" (LOCAL_RANK) or a number
    rank: int | str | None = None
    #: error feedback: None (on for a job of precision 8 or 16), True or False
    error_feedback: bool | None = None
    #: the error reset's period H in allreduces of one tensor (0: never)
    error_reset: int = 16

    def feedback_for(self, precision_bits: int) -> bool:
        """Whether error feedback is on for a job of ``precision_bits``."""
        return precision_bits < 32 if self.error_feedback is None else self.error_feedback

    def member_rank(self, group_rank: int, environ: Mapping[str, str] | None = None) -> int:
        """The rank this worker joins the job as."""
        if self.rank is None:
            return group_rank
        if self.rank == "local":
            env = os.environ if environ is None else environ
            if "LOCAL_RANK" not in env:
                raise SettingsError(f"{ENV_PREFIX}RANK=local needs LOCAL_RANK (torchrun sets it)")
            return int(env["LOCAL_RANK"])
        return int(self.rank)

    def __post_init__(self) -> None:
        if not self.servers:
            object.__setattr__(self, "servers", (self.server,))

    @classmethod
    def resolve(cls, options: Mapping | "Settings" | None = None,
                environ: Mapping[str, str] | None = None) -> "Settings":
        """The settings from ``options`` (a mapping of the names above, or a Settings), falling
        back to ``environ`` (default ``os.environ``) and the defaults."""
        if isinstance(options, Settings):
            return options
        environ = os.environ if environ is None else environ
        names = [f.name for f in fields(cls)]
        opts = dict(options or {})
        unknown = sorted(set(opts) - set(names))
        if unknown:
            raise SettingsError(f"unknown aggd pg_options {unknown}; known: {names}")

        def raw(name: str):
            if opts.get(name) is not None:
                return opts[name], f"pg_options[{name!r}]"
            env = ENV_PREFIX + name.upper()
            return environ.get(env) or None, env

        def required(name: str, hint: str):
            value, where = raw(name)
            if value is None or str(value).strip() == "":
                raise SettingsError(f"{ENV_PREFIX}{name.upper()} is not set ({hint}; or pass "
                                    f"pg_options={{{name!r}: ...}} to init_process_group)")
            return value, where

        server, where = required("server", "the aggd daemon's host:port")
        if isinstance(server, tuple) and server and isinstance(server[0], tuple):
            servers = tuple(server)
        elif isinstance(server, tuple):
            servers = (server,)
        else:
            servers = tuple(_host_port(t, where, port_required=True) for t in str(server).split(","))
        if len(set(servers)) != len(servers):
            raise SettingsError(f"{where} names a server twice: {server!r}")
        server = servers[0]
        job, where = required("job", "the job's name or id, as `aggctl jobs create` made it")
        if isinstance(job, str):
            job = int(job) if job.strip().isdigit() else job.strip()
        elif not isinstance(job, int):
            raise SettingsError(f"{where} must be a job name or id, not {job!r}")
        token, where = required("token", "the job's token, from `aggctl jobs show JOB`")
        kw = {"server": (str(server[0]), int(server[1])), "job": job, "token": str(token).strip(),
              "servers": tuple((str(h), int(p)) for h, p in servers)}
        value, where = raw("weights")
        if value is not None:
            try:
                from ..shard_map import ShardMap
                w = value if isinstance(value, (tuple, list)) else [float(t) for t in str(value).split(",")]
                kw["weights"] = ShardMap(tuple(w)).weights
            except ValueError as e:
                raise SettingsError(f"{where}: {e}") from None
            if len(kw["weights"]) != len(servers):
                raise SettingsError(f"{where} has {len(kw['weights'])} weights for {len(servers)} servers")
        value, where = raw("rebalance_every")
        if value is not None:
            try:
                every = int(value)
            except (TypeError, ValueError):
                raise SettingsError(f"{where} must be a whole number of allreduces, not {value!r}") from None
            if every < 1:
                raise SettingsError(f"{where} must be at least 1, not {value!r}")
            if len(servers) < 2:
                raise SettingsError(f"{where} needs several servers in {ENV_PREFIX}SERVER")
            kw["rebalance_every"] = every
        value, where = raw("failover_after")
        if value is not None:
            if len(servers) < 2:
                raise SettingsError(f"{where} needs several servers in {ENV_PREFIX}SERVER")
            kw["failover_after"] = _seconds(value, where)
        value, where = raw("probe_every")
        if value is not None:
            kw["probe_every"] = None if _is_zero(value) else _seconds(value, where)
        bind, where = raw("bind")
        if bind is not None:
            kw["bind"] = bind if isinstance(bind, tuple) else _host_port(bind, where, port_required=False)
        for name in ("give_up_after", "join_timeout"):
            value, where = raw(name)
            if value is not None:
                kw[name] = _seconds(value, where)
        value, where = raw("accept_newer")
        if value is not None:
            kw["accept_newer"] = _flag(value, where)
        value, where = raw("error_feedback")
        if value is not None:
            kw["error_feedback"] = _on_off(value, where)
        value, where = raw("error_reset")
        if value is not None:
            try:
                h = int(str(value).strip())
            except (TypeError, ValueError):
                raise SettingsError(f"{where} must be a whole number of allreduces (0: never), not "
                                    f"{value!r}") from None
            if h < 0:
                raise SettingsError(f"{where} must be 0 (never) or more, not {value!r}")
            kw["error_reset"] = h
        value, where = raw("rank")
        if value is not None:
            text = str(value).strip()
            if text != "local" and not (text.isdigit() and int(text) < 64):
                raise SettingsError(f"{where} must be `local` or a rank 0..63, not {value!r}")
            kw["rank"] = text if text == "local" else int(text)
        return cls(**kw)
