"""``aggctl demo``: the main job on an embedded default lab."""
from __future__ import annotations

import time
import uuid

import click

MIB = 1 << 20
#: (label, float32 elements): tiny to large, including the packet-size edges
SIZES = [("1 element", 1), ("1 packet", 256), ("1 packet + 1", 257), ("64 KiB", 16384),
         ("1 MiB", MIB // 4), ("16 MiB", 16 * MIB // 4)]


@click.command()
@click.option("--workers", default=4, show_default=True)
@click.option("--rounds", default=3, show_default=True, help="allreduces per size")
@click.option("--loss", default=0.0, show_default=True, help="random loss in percent on every link")
def demo(workers, rounds, loss):
    """Allreduce random tensors of several sizes through aggd's XDP path in a lab of namespaces,
    check every result against numpy, and summarise."""
    from tqdm import tqdm

    from aggd.lab import Lab
    from aggd.labrun import LabJob, run_workers, xdp_aggregator

    name = "demo" + uuid.uuid4().hex[:4]
    click.echo(f"lab {name}: bridge, aggregator and {workers} worker namespaces; "
               f"XDP aggregator on agg0 (native mode)" + (f"; {loss}% loss" if loss else ""))
    with Lab(name, workers, loss_percent=loss) as lab, xdp_aggregator(lab) as dp:
        job = LabJob(job=1, workers=list(range(workers)), slots=4096)
        dp.install_job(job.config(lab))
        total = workers * rounds * len(SIZES)
        bar = tqdm(total=total, unit="allreduce", desc="allreducing", ncols=90)
        t0 = time.monotonic()
        runs = run_workers(lab, job, timeout=1800, on_record=lambda rank, rec: bar.update(1),
                           extra=["--sizes", ",".join(str(n) for _, n in SIZES),
                                  "--rounds", str(rounds), "--give-up-after", "30"])
        bar.close()
        wall = time.monotonic() - t0
        failed = [r for r in runs if r.returncode != 0]
        if failed:
            raise click.ClickException(f"worker {failed[0].rank} failed:\n{failed[0].stderr[-2000:]}")
        stats = dp.job_stats(1)
    click.echo(f"\n{'size':<14}{'median ms':>10}{'max |error|':>14}{'bound':>12}  check")
    ok_all = True
    for label, n in SIZES:
        recs = [rec for r in runs for rec in r.records if rec["size"] == n]
        per_round = sorted(max(rec["seconds"] for rec in recs if rec["round"] == i) for i in range(rounds))
        ok = all(rec["within_bound"] for rec in recs)
        ok_all &= ok
        click.echo(f"{label:<14}{per_round[len(per_round) // 2] * 1e3:>10.2f}"
                   f"{max(rec['max_abs_error'] for rec in recs):>14.3g}"
                   f"{max(rec['error_bound'] for rec in recs):>12.3g}  {'ok' if ok else 'WRONG'}")
    c = stats.counters
    click.echo(f"\n{total} allreduces by {workers} workers in {wall:.1f} s; kernel aggregated "
               f"{c['elements']:,} int32 values in {c['contributions']:,} packets, released "
               f"{c['released']:,} results, {c['retransmits']} retransmissions, {c['rereads']} re-reads.")
    click.echo("every result matched numpy's float64 sum within the documented bound" if ok_all
               else "SOME RESULTS WERE WRONG")
    if not ok_all:
        raise SystemExit(1)
