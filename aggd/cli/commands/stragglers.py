"""``aggctl bench stragglers``: time to a target test accuracy, per strategy and straggler scenario.

Real training (the digits MLP of ``aggd.training``, data-parallel over a lab's workers) through a
real daemon, for each strategy (``sync``, ``quorum`` = ``quorum:n-1``, ``ssp`` = ``ssp:2``, ``async``,
``wbsp``, ``dynamic`` = the daemon's policy starting from ``sync``, and ``gloo`` =
torch.distributed's allreduce over the lab network as the baseline) under each scenario (``none``,
``slow2x``/``slow3x``/``slow4x``: the last worker that many times slower throughout, ``phase``: 3x
slower for the middle of the run). Compute is a sleep of ``--compute-ms`` a step (times the
slowdown). Writes ``stragglers.json`` (every run with its accuracy curve and the daemon's
decisions), ``stragglers.png`` (test accuracy against wall time, one panel per scenario, one line
per strategy) and ``stragglers.md`` (the table) into ``--out``.
"""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import click

ALL_SCENARIOS = "none,slow2x,slow3x,slow4x,phase"
ALL_STRATEGIES = "sync,quorum,ssp,async,wbsp,dynamic,gloo"
COLORS = {"sync": "#1f77b4", "quorum": "#ff7f0e", "ssp": "#2ca02c", "async": "#d62728", "wbsp": "#9467bd",
          "dynamic": "#000000", "gloo": "#8c564b"}


def _names(text: str, known, what: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in known]
    if bad or not names:
        raise click.BadParameter(f"unknown {what} {', '.join(bad) or '(none)'}: use {', '.join(known)}")
    return names


@click.command("stragglers")
@click.option("--scenarios", default=ALL_SCENARIOS, show_default=True)
@click.option("--strategies", default=ALL_STRATEGIES, show_default=True)
@click.option("--workers", default=4, show_default=True)
@click.option("--rounds", default=300, show_default=True, help="allreduce rounds a run trains")
@click.option("--compute-ms", default=20.0, show_default=True, help="simulated compute a step")
@click.option("--target", default=0.95, show_default=True, help="target test accuracy")
@click.option("--seed", default=0, show_default=True)
@click.option("--out", "out_dir", default="bench-stragglers", show_default=True, type=click.Path(file_okay=False),
              help="folder for stragglers.json, stragglers.png and stragglers.md")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per run on stdout")
def stragglers(scenarios, strategies, workers, rounds, compute_ms, target, seed, out_dir, as_json):
    """Time to target accuracy of real training per strategy, with and without stragglers."""
    from aggd.lab.namespaces import Lab
    from aggd.training.labtrain import SCENARIOS, STRATEGIES, RunParams, lab_daemon, run

    scen = _names(scenarios, SCENARIOS, "scenario")
    strats = _names(strategies, STRATEGIES, "strategy")
    params = RunParams(workers=workers, rounds=rounds, compute_ms=compute_ms, target=target, seed=seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    t_all = time.monotonic()
    say = (lambda *a, **k: click.echo(*a, err=True, **k)) if as_json else click.echo
    with Lab("bs" + uuid.uuid4().hex[:6], workers) as lab, lab_daemon(lab) as daemon:
        for sc in scen:
            for st in strats:
                t = time.monotonic()
                res = run(lab, daemon, st, sc, params)
                row = res.to_json()
                row["wall_s"] = time.monotonic() - t
                results.append(row)
                if as_json:
                    click.echo(json.dumps({k: v for k, v in row.items() if k not in ("curve", "rounds_curve", "workers")}))
                ttt = row["time_to_target_s"]
                say(f"{sc:<7} {st:<8} time to {target:.0%}: {'never' if ttt is None else f'{ttt:6.2f} s'}  "
                    f"final {row['final_accuracy']:.3f}  run {row['seconds']:.1f} s"
                    + (f"  switches: {', '.join(d['strategy'] + ' @' + str(d['from_round']) for d in row['decisions'])}"
                       if row["decisions"] else ""))
    meta = {"command": "aggctl bench stragglers " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in (("scenarios", ",".join(scen)), ("strategies", ",".join(strats)),
                                                          ("workers", workers), ("rounds", rounds),
                                                          ("compute_ms", compute_ms), ("target", target),
                                                          ("seed", seed))),
            "seconds": time.monotonic() - t_all, "params": params.__dict__}
    (out / "stragglers.json").write_text(json.dumps({"meta": meta, "runs": results}, indent=1) + "\n")
    table = markdown_table(results, scen, strats, target)
    (out / "stragglers.md").write_text(table)
    plot(results, scen, strats, target, out / "stragglers.png")
    say(f"\n{table}\nwrote {out / 'stragglers.json'}, {out / 'stragglers.png'}, {out / 'stragglers.md'} "
        f"in {meta['seconds']:.0f} s")


def markdown_table(results: list[dict], scen: list[str], strats: list[str], target: float) -> str:
    """Time to target (s) and final accuracy, a row per scenario, a column per strategy; with the
    dynamic policy's gain over sync where both ran."""
    by = {(r["scenario"], r["strategy"]): r for r in results}
    head = "| scenario | " + " | ".join(strats) + (" | dynamic vs sync |" if {"sync", "dynamic"} <= set(strats) else " |")
    lines = [f"Time to {target:.0%} test accuracy in seconds (final accuracy in brackets; never: not reached).",
             "", head, "|" + "---|" * (head.count("|") - 1)]
    for sc in scen:
        cells = []
        for st in strats:
            r = by.get((sc, st))
            if r is None:
                cells.append("-")
                continue
            t = r["time_to_target_s"]
            cells.append(f"{'never' if t is None else f'{t:.2f}'} ({r['final_accuracy']:.3f})")
        extra = ""
        if {"sync", "dynamic"} <= set(strats):
            s, d = by.get((sc, "sync")), by.get((sc, "dynamic"))
            if s and d and s["time_to_target_s"] and d["time_to_target_s"]:
                gain = 1 - d["time_to_target_s"] / s["time_to_target_s"]
                extra = f" {-gain:+.0%} time, {100 * (d['final_accuracy'] - s['final_accuracy']):+.1f} pt |"
            else:
                extra = " - |"
        lines.append(f"| {sc} | " + " | ".join(cells) + " |" + extra)
    return "\n".join(lines) + "\n"


def plot(results: list[dict], scen: list[str], strats: list[str], target: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from aggd.training.labtrain import SCENARIOS

    n = len(scen)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    by = {(r["scenario"], r["strategy"]): r for r in results}
    for i, sc in enumerate(scen):
        ax = axes[i // cols][i % cols]
        for st in strats:
            r = by.get((sc, st))
            if r is None or not r["curve"]:
                continue
            t, acc = zip(*r["curve"])
            ax.plot(t, acc, label=st, color=COLORS.get(st), lw=2.2 if st == "dynamic" else 1.3,
                    ls="--" if st == "gloo" else "-")
            if st == "dynamic":
                for d in r["decisions"]:
                    x = _time_of_round(r, d["from_round"])
                    ax.axvline(x, color="0.2", lw=0.7, ls="-.")
                    ax.annotate("-> " + d["strategy"].split(":")[0] + ("" if d["back"] else
                                                                       ":" + d["strategy"].split(":")[1]),
                                xy=(x, 0.52), fontsize=7, rotation=90, va="bottom", ha="right", color="0.2")
        ax.axhline(target, color="0.5", lw=0.8, ls=":")
        ax.set_title(f"{sc}: {SCENARIOS[sc].description}", fontsize=9)
        ax.set_ylim(0.5, 1.0)
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=8, loc="lower right")
    for j in range(n, rows * cols):
        axes[j // cols][j % cols].axis("off")
    fig.suptitle("digits MLP, 4 workers through aggd: test accuracy against wall time", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _time_of_round(run: dict, round_: int) -> float:
    """Wall time at which rank 0 reached ``round_`` (from its evaluations)."""
    pts = run.get("rounds_curve") or []
    for t, r in pts:
        if r >= round_:
            return t
    return 0.0
