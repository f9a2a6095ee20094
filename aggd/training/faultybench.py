"""``aggctl bench faulty``: real training with one faulty member, and what each defence keeps.

The digits MLP (``aggd.training``) trained by a lab's workers through a real daemon under ``sync``,
once per *variant*: ``clean`` (nobody faulty, a summing job), and with one member sending its step
times ``scale`` from a round on: ``plain`` (a summing job: nothing stops it), ``bound`` (a
per-member bound, ``max_abs``, and quarantine after 3 offences: the XDP program drops its
contributions), ``median`` and ``zeno`` (robust jobs in user space, quarantine after 3 score
windows). Reported per variant and seed: the final accuracy (the mean of the last five
evaluations: one evaluation of 450 images moves by more than the point compared), its distance
from the clean run of the same seed, the wall time of a round, and who was quarantined and why.
``plot`` draws test accuracy against the round.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from aggd.training import precisionbench

#: variant -> the job's keys (aggctl jobs create's), and whether a member is faulty
VARIANTS = {"clean": ({}, False), "plain": ({}, True),
            "bound": ({"max_abs": 0.6, "quarantine_after": 3}, True),
            "median": ({"combine": "median", "score_after": 3}, True),
            "zeno": ({"combine": "zeno", "score_after": 3}, True)}
COLORS = {"clean": "#1f77b4", "plain": "#7f7f7f", "bound": "#2ca02c", "median": "#ff7f0e", "zeno": "#d62728"}


@dataclass(frozen=True)
class Config:
    workers: int = 4
    rounds: int = 300
    seeds: tuple[int, ...] = (0,)
    faulty_rank: int = 3
    faulty_from: int = 20
    scale: float = -10.0
    variants: tuple[str, ...] = tuple(VARIANTS)


def check_variants(names: list[str]) -> tuple[str, ...]:
    return precisionbench.check_variants(names, VARIANTS)


def _end_accuracy(curve: list) -> float:
    tail = [a for _, a in curve[-5:]]
    return sum(tail) / len(tail) if tail else 0.0


def run(cfg: Config, on_row=None) -> list[dict]:
    """Every variant and seed of ``cfg`` in one lab and one daemon; a row per (variant, seed)."""
    from aggd.lab.namespaces import Lab
    from aggd.training.labtrain import RunParams, lab_daemon
    from aggd.training.labtrain import run as train_run

    rows = []
    with Lab("bf" + uuid.uuid4().hex[:6], cfg.workers) as lab, lab_daemon(lab) as daemon:
        for seed in cfg.seeds:
            params = RunParams(workers=cfg.workers, rounds=cfg.rounds, seed=seed, step_only=True)
            for name in cfg.variants:
                options, faulty = VARIANTS[name]
                t = time.monotonic()
                corrupt = (cfg.faulty_rank, cfg.faulty_from, cfg.scale) if faulty else None
                row = {"variant": name, "seed": seed, "job": options, "faulty": corrupt}
                try:
                    res = train_run(lab, daemon, "sync", "none", params, tag=f"-{name}", corrupt=corrupt,
                                    job_options=options)
                except RuntimeError as exc:      # the model diverged: NaN steps stopped the workers
                    if "NaN or infinity" not in str(exc):
                        raise
                    row.update(diverged=True, final_accuracy=None, curve=[], quarantined=[],
                               seconds_per_round=None, members=[])
                else:
                    gone = [{"rank": m["rank"], "reason": m["gone"]["reason"]} for m in res.members
                            if m.get("gone") and m["gone"].get("quarantined")]
                    row.update(diverged=False, final_accuracy=_end_accuracy(res.curve),
                               curve=[(r, a) for (_, a), (_, r) in zip(res.curve, res.rounds_curve)],
                               quarantined=gone, seconds_per_round=res.seconds / max(1, res.rounds),
                               members=[{k: m.get(k) for k in ("rank", "gone", "offences", "score")}
                                        for m in res.members])
                row["wall_s"] = time.monotonic() - t
                rows.append(row)
                if on_row:
                    on_row(row)
    return rows


def markdown_table(rows: list[dict]) -> str:
    """Per variant over the seeds: mean final accuracy, its mean distance from clean, the largest
    distance, time a round relative to clean, and who was quarantined."""
    clean = {r["seed"]: r for r in rows if r["variant"] == "clean" and not r["diverged"]}
    lines = ["| variant | final accuracy (mean) | vs clean, mean | vs clean, worst | time a round vs clean | "
             "quarantined |", "|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        ok = [r for r in mine if not r["diverged"]]
        if not ok:
            lines.append(f"| {name} | diverged ({len(mine)} of {len(mine)}) | | | | |")
            continue
        acc = sum(r["final_accuracy"] for r in ok) / len(ok)
        deltas = [100 * (r["final_accuracy"] - clean[r["seed"]]["final_accuracy"]) for r in ok if r["seed"] in clean]
        times = [r["seconds_per_round"] / clean[r["seed"]]["seconds_per_round"] for r in ok if r["seed"] in clean]
        who = sorted({q["rank"] for r in ok for q in r["quarantined"]})
        diverged = f" ({len(mine) - len(ok)} of {len(mine)} diverged)" if len(ok) < len(mine) else ""
        lines.append(f"| {name} | {acc:.3f}{diverged} | "
                     f"{sum(deltas) / len(deltas):+.1f} pt | {max(deltas, key=abs):+.1f} pt | "
                     f"{sum(times) / len(times):.2f}x | {', '.join(f'rank {w}' for w in who) or '-'} |"
                     if deltas else f"| {name} | {acc:.3f}{diverged} | | | | |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path) -> None:
    """Test accuracy against the round, a curve per variant of the first seed (a diverged one has none)."""
    seed = rows[0]["seed"] if rows else 0
    precisionbench.draw_accuracy([(r["variant"], r["curve"], COLORS.get(r["variant"]), r["variant"] == "plain")
                                  for r in rows if r["seed"] == seed],
                                 "digits MLP, sync, 4 workers, one sending its step x-10 from round 20", path)
