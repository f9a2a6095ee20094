"""``aggctl bench precision``: real training at 32, 16 and 8 bits a contribution value.

The digits MLP (``aggd.training``) trained data-parallel by a lab's workers through a real daemon,
under ``sync``, once per *variant*: ``32`` (the int32 job), ``16`` and ``8`` (narrow jobs, each worker
with error feedback and error reset, ``aggd_client.feedback``), and ``8-nofb`` (8 bits, stochastic
rounding alone: what feedback buys). Every variant trains the same model from the same seed on the
same shards, so they differ only by what the aggregation loses. Reported per variant: final test
accuracy, the first evaluated round at the target accuracy, wall time, and the bytes a worker sent
a round (from the precision). ``plot`` draws test accuracy against the round.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from aggd_client.protocol import LANES, PRECISION_OF_BITS

#: variant -> (bits a contribution value, error feedback)
VARIANTS = {"32": (32, True), "16": (16, True), "8": (8, True), "8-nofb": (8, False)}
COLORS = {"32": "#1f77b4", "16": "#2ca02c", "8": "#d62728", "8-nofb": "#7f7f7f"}


@dataclass(frozen=True)
class Config:
    workers: int = 4
    rounds: int = 300
    target: float = 0.95
    seed: int = 0
    reset_every: int | None = None      #: error reset every this many rounds (None: the client's default)
    compute_ms: float = 20.0
    variants: tuple[str, ...] = tuple(VARIANTS)


def check_variants(names: list[str], known=VARIANTS) -> tuple[str, ...]:
    """``names`` if each is one of ``known`` (a bench's variants); ValueError naming those that are not."""
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"unknown variant {', '.join(bad) or '(none)'}: use {', '.join(known)}")
    return tuple(names)


def run(cfg: Config, on_row=None) -> list[dict]:
    """Every variant of ``cfg`` in one lab and one daemon; a row per variant."""
    from aggd.lab.namespaces import Lab
    from aggd.training.labtrain import RunParams, lab_daemon
    from aggd.training.labtrain import run as train_run

    params = RunParams(workers=cfg.workers, rounds=cfg.rounds, target=cfg.target, seed=cfg.seed,
                       compute_ms=cfg.compute_ms)
    rows = []
    with Lab("bp" + uuid.uuid4().hex[:6], cfg.workers) as lab, lab_daemon(lab) as daemon:
        for name in cfg.variants:
            bits, feedback = VARIANTS[name]
            t = time.monotonic()
            res = train_run(lab, daemon, "sync", "none", params, tag=f"-p{bits}",
                            precision=None if bits == 32 else bits, feedback=feedback,
                            error_reset=cfg.reset_every)
            lanes = LANES[PRECISION_OF_BITS[bits]]
            row = {"variant": name, "bits": bits, "feedback": feedback and bits != 32,
                   "final_accuracy": res.final_accuracy, "rounds_to_target": res.rounds_to_target,
                   "time_to_target_s": res.time_to_target_s, "seconds": res.seconds, "rounds": res.rounds,
                   "bytes_up_per_value": lanes.contrib_bytes, "bytes_down_per_value": lanes.result_bytes,
                   "replicas_equal": len({w["params_sha"] for w in res.workers}) == 1,
                   "curve": [(r, a) for (_, a), (_, r) in zip(res.curve, res.rounds_curve)],
                   "wall_s": time.monotonic() - t}
            rows.append(row)
            if on_row:
                on_row(row)
    return rows


def markdown_table(rows: list[dict], target: float) -> str:
    head = ("| variant | bytes up / down a value | final accuracy | vs 32-bit | rounds to "
            f"{target:.0%} | vs 32-bit | replicas identical |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    base = next((r for r in rows if r["variant"] == "32"), None)
    for r in rows:
        d_acc = "" if base is None else f"{100 * (r['final_accuracy'] - base['final_accuracy']):+.1f} pt"
        rt = r["rounds_to_target"]
        d_rt = "" if base is None or base["rounds_to_target"] is None or rt is None else \
            f"{rt / base['rounds_to_target']:.2f}x"
        lines.append(f"| {r['variant']} | {r['bytes_up_per_value']} / {r['bytes_down_per_value']} | "
                     f"{r['final_accuracy']:.3f} | {d_acc} | {'never' if rt is None else rt} | {d_rt} | "
                     f"{'yes' if r['replicas_equal'] else 'no'} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], target: float, path) -> None:
    draw_accuracy([(f"{r['variant']} bits" if r["variant"] != "8-nofb" else "8 bits, no feedback", r["curve"],
                    COLORS.get(r["variant"]), r["variant"] == "8-nofb") for r in rows],
                  "digits MLP, sync, 4 workers: accuracy by contribution precision", path, ymin=0.5, target=target)


def draw_accuracy(curves: list[tuple], title: str, path, ymin: float = 0.0, target: float | None = None) -> None:
    """A PNG of test accuracy against the round: ``curves`` of (label, [(round, accuracy)], colour,
    dotted); a dashed line at ``target``. The training benches' plot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, points, colour, dotted in curves:
        if points:
            x, y = zip(*points)
            ax.plot(x, y, label=label, color=colour, lw=1.4, ls=":" if dotted else "-")
    if target is not None:
        ax.axhline(target, color="#999999", lw=0.8, ls="--")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(ymin, 1.0)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
