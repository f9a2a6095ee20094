"""``aggctl bench``: benchmarks that print one JSON object per configuration."""
from __future__ import annotations

import json
import uuid

import click

from aggd_client import protocol as proto

from aggd.core.robust import CombineKind, parse_combine

SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``64M`` -> 67108864 bytes (binary multiples); ``1`` means one byte."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in SUFFIXES else (t, "")
    try:
        value = int(float(num) * SUFFIXES[unit])
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a size like 256K, 64M or 1G") from None
    if value < 1:
        raise click.BadParameter(f"size must be positive, got {text!r}")
    return value


def _int_list(text: str, hint: str | None = None) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers", param_hint=hint) from None


def _words(text: str) -> list[str]:
    """A comma-separated option's items, stripped, empty ones left out."""
    return [w.strip() for w in text.split(",") if w.strip()]


def _write_plot(plot, rows: list[dict], path: str | None, as_json: bool = False) -> None:
    """``plot(rows, path)`` where a path was given, saying so unless the output is JSON lines."""
    if path:
        plot(rows, path)
        if not as_json:
            click.echo(f"plot: {path}")


def _bits_list(text: str) -> list[int]:
    """``--precision``'s comma-separated bits a contribution value, each 8, 16 or 32."""
    bits = _int_list(text, "--precision")
    bad = [b for b in bits if b not in proto.PRECISION_OF_BITS]
    if bad:
        raise click.BadParameter(f"bits must be 8, 16 or 32, not {bad[0]}", param_hint="--precision")
    return bits


@click.group()
def bench():
    """Benchmarks (JSON lines with --json)."""


@bench.command("allreduce")
@click.option("--systems", default="aggd-xdp,aggd-user,gloo", show_default=True,
              help="aggd-xdp, aggd-xsk (aggd-xdp with the workers on AF_XDP sockets), aggd-user and/or gloo "
                   "(torch.distributed), comma-separated")
@click.option("--workers", default="4", show_default=True, help="worker counts, e.g. 2,4,8")
@click.option("--size", "sizes", default="64M", show_default=True,
              help="tensor sizes in bytes of float32, e.g. 256K,64M")
@click.option("--iters", default=5, show_default=True, help="timed allreduces per configuration")
@click.option("--warmup", default=1, show_default=True)
@click.option("--mode", type=click.Choice(["native", "generic"]), default="native", show_default=True)
@click.option("--elements", type=int, default=None,
              help=f"int32 values a packet (default: the largest that fits the MTU; without --mtu the "
                   f"largest the mode takes: native {proto.NATIVE_MAX_ELEMENTS} at MTU {proto.NATIVE_MAX_MTU}, "
                   f"generic {proto.MAX_ELEMENTS})")
@click.option("--mtu", type=int, default=None,
              help="the lab's MTU (default: what the packet needs, at least 1500)")
@click.option("--slots", type=int, default=None,
              help="slots in the job's pool (default: 4096, fewer where 4096 would hold more than "
                   "128 MiB of BPF maps)")
@click.option("--loss", "losses", default="0", show_default=True,
              help="percent of packets the lab's links drop each way, e.g. 0,1,2,5 (each system at each; "
                   "with 0 among them every row also gets its slowdown over the lossless run)")
@click.option("--cpu-hogs", "hogs", default="0", show_default=True,
              help="processes spinning on the host's cores while each system runs, e.g. 0,1 (a busy host; "
                   "with 0 among them every row also gets its slowdown over the quiet run)")
@click.option("--gro", "gros", default="off", show_default=True,
              help="the workers' receive path, e.g. off,on: on receives as a NIC does (GRO in NAPI, TCP cut to "
                   "the MTU at the bridge, aggd's results read in trains), off through the host's backlog "
                   "(TCP passed in 64 KiB segments)")
@click.option("--precision", "precisions", default="32", show_default=True,
              help="bits a contribution value of aggd's systems, e.g. 8,16,32 (docs/precision.md); the "
                   "XDP program holds 8 and 16 bits in packets of at most 2233 values (native XDP's largest)")
@click.option("--combine", "combines", default="sum", show_default=True,
              help="how aggd-user's job combines rounds, e.g. sum,median: a robust job's median or trimmed:T "
                   "(docs/protocol.md \"Robust jobs\"; each row then gets its slowdown over sum)")
@click.option("--narrow-room", type=click.Choice(["auto", "never"]), default="auto", show_default=True,
              help="aggd-xdp's 8- and 16-bit workers in native mode send room for the result (auto, as the "
                   "daemon asks them to), or not (never: each frame goes through the program's re-run)")
@click.option("--pattern", type=click.Choice(["random", "near"]), default="random", show_default=True,
              help="the workers' values, normal: worker r's scaled by 1 + r (random: a chunk's own exponents "
                   "mostly two or more steps apart, so the aggregator aligns most contributions) or by "
                   "1 + (r mod 8) / 8 (near: within a factor of two, mostly a step apart at most); real "
                   "gradients lie between (docs/benchmarks.md)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per configuration")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="write a PNG of algorithm bandwidth against size per system and worker count")
def bench_allreduce(systems, workers, sizes, iters, warmup, mode, elements, mtu, slots, losses, hogs, gros,
                    precisions, combines, narrow_room, pattern, as_json, plot_path):
    """Allreduce float32 tensors through aggd's XDP path, aggd's user-space path and Gloo, in one
    lab with the same workers; time, check and measure memory; print the ratios."""
    from aggd.bench import allreduce as ab

    chosen = _words(systems)
    unknown = [s for s in chosen if s not in ab.SYSTEMS]
    if unknown or not chosen:
        raise click.BadParameter(f"unknown system(s) {unknown}: use {', '.join(ab.SYSTEMS)}",
                                 param_hint="--systems")
    if "aggd-xsk" in chosen and mode != "native":
        raise click.BadParameter("aggd-xsk needs --mode native: its workers' veths run their XDP program in "
                                 "native mode, which generic mode's MTU is too large for", param_hint="--systems")
    if "gloo" in chosen:
        import importlib.util
        if importlib.util.find_spec("torch") is None:
            raise click.ClickException("gloo needs torch (pip install torch==2.13.0); or leave it out of --systems")
    largest = proto.NATIVE_MAX_ELEMENTS if mode == "native" else proto.MAX_ELEMENTS
    if mtu is not None:
        if not 68 + 4 <= mtu <= (proto.NATIVE_MAX_MTU if mode == "native" else 65535):
            hint = " (larger MTUs need --mode generic)" if mode == "native" else ""
            raise click.BadParameter(f"must leave room for one value and be within the {mode} mode's "
                                     f"limit{hint}", param_hint="--mtu")
        largest = min(largest, (mtu - 28 - proto.HEADER_SIZE) // 4)  # what one frame of that MTU holds
    if elements is None:
        elements = largest
    if not 1 <= elements <= largest:
        hint = " (larger packets need --mode generic)" if mode == "native" else ""
        at = f" at MTU {mtu}" if mtu is not None else ""
        raise click.BadParameter(f"must be 1..{largest} in {mode} mode{at}{hint}", param_hint="--elements")
    if slots is None:
        slots = ab.default_slots(elements)
    if slots < 1:
        raise click.BadParameter("must be at least 1", param_hint="--slots")
    worker_counts = _int_list(workers)
    if any(w < 1 for w in worker_counts):
        raise click.BadParameter("worker counts must be positive", param_hint="--workers")
    size_list = [parse_size(s) for s in sizes.split(",")]
    try:
        loss_list = tuple(sorted({float(x) for x in losses.split(",") if x.strip()}))
    except ValueError:
        raise click.BadParameter(f"{losses!r} is not a comma-separated list of percentages", param_hint="--loss") from None
    if not loss_list or any(not 0 <= x < 100 for x in loss_list):
        raise click.BadParameter("percentages must be in 0..100 (100 excluded)", param_hint="--loss")
    hog_list = tuple(sorted(set(_int_list(hogs))))
    if not hog_list or any(h < 0 or h > 64 for h in hog_list):
        raise click.BadParameter("hog counts must be in 0..64", param_hint="--cpu-hogs")
    gro_words = _words(gros)
    if not gro_words or any(g not in ("on", "off") for g in gro_words):
        raise click.BadParameter("use on and/or off, comma-separated", param_hint="--gro")
    gro_list = tuple(sorted({g == "on" for g in gro_words}))
    if iters < 1 or warmup < 0:
        raise click.BadParameter("--iters must be at least 1 and --warmup at least 0")
    bits = sorted(set(_words(precisions)), key=lambda b: -int(b) if b.isdigit() else 0)
    if not bits or any(b not in ("32", "16", "8") for b in bits):
        raise click.BadParameter("use 32, 16 or 8, comma-separated", param_hint="--precision")
    how_list = tuple(dict.fromkeys(_words(combines)))
    try:
        for how in how_list:
            if parse_combine(how).kind == CombineKind.ZENO:
                raise ValueError("zeno's results depend on the aggregator's choice of rows: the bench cannot "
                                 "check them; use median or trimmed:T")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--combine") from None
    if how_list and how_list != ("sum",) and "aggd-user" not in chosen:
        raise click.BadParameter("robust jobs run in aggd-user only: add it to --systems", param_hint="--combine")

    def show(row):
        if as_json:
            click.echo(json.dumps(row))
            return
        extra = f"  retransmits={row['retransmits']}" if "retransmits" in row else ""
        if "slowdown_over_sum" in row:
            extra += f"  {row['slowdown_over_sum']:.2f}x the summing job's time"
        agg = (f"  aggregator={row['aggregator_memory_bytes'] / 2**20:.1f} MiB ({row['aggregator_memory']})"
               if "aggregator_memory_bytes" in row else "")
        name = row["system"] + ("" if row.get("precision", 32) == 32 else f"@{row['precision']}") + \
            ("" if row.get("combine", "sum") == "sum" else f"/{row['combine']}")
        click.echo(f"{name:<12} workers={row['workers']:<2} bytes={row['bytes']:<10} "
                   f"loss={row['loss_percent']:g}% hogs={row['cpu_hogs']}{' gro' if row.get('gro') else ''}  "
                   f"{row['seconds_per_allreduce'] * 1e3:9.2f} ms  {row['algbw_gbps']:7.3f} Gbit/s  "
                   f"max_err={row['max_abs_error']:.3g} (bound {row['error_bound']:.3g})  "
                   f"worker extra RSS {row['worker_extra_rss_ratio']:.2f}x tensor{agg}{extra}")

    try:
        rows = ab.run(chosen, worker_counts, size_list, iters=iters, warmup=warmup, mode=mode,
                      elements=elements, slots=slots, mtu=mtu, lab_name="b" + uuid.uuid4().hex[:6],
                      on_row=show, losses=loss_list, hogs=hog_list, gros=gro_list, precisions=tuple(int(b) for b in bits),
                      combines=how_list or ("sum",), narrow_room=narrow_room == "auto", pattern=pattern)
    except ab.BenchError as e:
        raise click.ClickException(str(e)) from None
    for r in ab.ratios(rows):
        parts = []
        if r["xdp_over_gloo"] is not None:
            parts.append(f"aggd-xdp{'' if r['precision'] == 32 else '@' + str(r['precision'])} / gloo "
                         f"{r['xdp_over_gloo']:.2f}x")
        if r["user_over_xdp"] is not None:
            parts.append(f"aggd-user / aggd-xdp {r['user_over_xdp']:.2f}x")
        if r["xsk_over_xdp"] is not None:
            parts.append(f"aggd-xsk / aggd-xdp {r['xsk_over_xdp']:.2f}x")
        parts += [f"{system} {x:.2f}x its {base} time" for system, base, x in r["slowdown"]]
        if parts and not as_json:  # (JSON rows carry what they are computed from)
            click.echo(f"workers={r['workers']:<2} bytes={r['bytes']:<10} loss={r['loss_percent']:g}% "
                       f"hogs={r['cpu_hogs']}{' gro' if r['gro'] else ''}  " + "  ".join(parts))
    _write_plot(ab.plot, rows, plot_path, as_json)


@bench.command("train")
@click.option("--model", "models", default="cnn", show_default=True, help="cnn and/or transformer, comma-separated")
@click.option("--workers", default=4, show_default=True)
@click.option("--steps", default=100, show_default=True)
@click.option("--systems", default="aggd-xdp,aggd-user,gloo", show_default=True)
@click.option("--batch", default=32, show_default=True, help="examples per worker and step")
@click.option("--target", default=0.9, show_default=True, help="test accuracy for time-to-target")
@click.option("--slots", default=512, show_default=True, help="the aggd jobs' slot pool")
@click.option("--bucket-cap-mb", type=float, default=None, help="DDP's bucket_cap_mb (default: DDP's)")
@click.option("--precision", "precisions", default="32", show_default=True,
              help="the aggd jobs' bits a contribution value, e.g. 32,8 (8 and 16 with error feedback)")
@click.option("--strategy", default="sync", show_default=True,
              help="the aggd jobs' strategy (quorum and async take one DDP bucket a step: --bucket-cap-mb 100)")
@click.option("--eval-every", type=click.IntRange(1), default=10, show_default=True,
              help="steps between test-accuracy measurements (steps to target are known to this many)")
@click.option("--seeds", default="0", show_default=True,
              help="comma-separated seeds (initial model and shards): a run of every system each")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="write every row (one JSON object a line) to this file")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None,
              help="write a PNG: accuracy against time per model, samples/s per system")
def bench_train(models, workers, steps, systems, batch, target, slots, bucket_cap_mb, precisions, strategy,
                eval_every, seeds, json_path, png_path):
    """Train a PyTorch model with DDP under torchrun on a lab's workers through aggd-xdp, aggd-user
    and gloo in the same run: step time, samples/s, time to a target accuracy."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise click.ClickException("bench train needs torch (pip install torch==2.13.0)")
    from aggd.training import torchbench as tb
    from aggd.training.torch_models import MODELS

    chosen_models = _words(models)
    chosen = _words(systems)
    if not chosen_models or any(m not in MODELS for m in chosen_models):
        raise click.BadParameter(f"use {', '.join(MODELS)}", param_hint="--model")
    if not chosen or any(s not in tb.SYSTEMS for s in chosen):
        raise click.BadParameter(f"use {', '.join(tb.SYSTEMS)}", param_hint="--systems")
    if workers < 1 or steps < 2:
        raise click.BadParameter("--workers must be at least 1 and --steps at least 2")
    bits = _words(precisions)
    if not bits or any(b not in ("32", "16", "8") for b in bits):
        raise click.BadParameter("use 32, 16 or 8, comma-separated", param_hint="--precision")
    seed_list = tuple(dict.fromkeys(_int_list(seeds, "--seeds")))
    if any(x < 0 for x in seed_list):
        raise click.BadParameter("seeds must be non-negative", param_hint="--seeds")
    from aggd.core.strategy import parse as parse_strategy
    try:
        parse_strategy(strategy)
    except ValueError as exc:           # (StrategyError is one)
        raise click.BadParameter(str(exc), param_hint="--strategy") from None

    def show(r):
        ttt = "never" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f} s"
        stt = "never" if r["steps_to_target"] is None else str(r["steps_to_target"])
        click.echo(f"{r['model']:<12} {tb.label(r):<17} seed {r['seed']}  step {r['step_time_s'] * 1e3:8.1f} ms  "
                   f"{r['samples_per_s']:8.1f} samples/s  to {r['target_accuracy']:.0%}: {ttt:>8}, "
                   f"{stt} steps  final {r['final_accuracy']:.3f}"
                   + ("" if r["retransmits"] is None else f"  {r['retransmits']} retransmits"))

    rows = tb.run(chosen_models, workers, steps, systems=chosen, lab_name="b" + uuid.uuid4().hex[:6],
                  batch=batch, target=target, slots=slots, bucket_cap_mb=bucket_cap_mb, eval_every=eval_every,
                  precisions=tuple(int(b) for b in bits), seeds=seed_list, strategy=strategy, on_row=show)
    ratios, summary = tb.ratios(rows), tb.steps_to_target(rows)
    for r in ratios:
        ttt = "" if r["time_to_target_vs_gloo"] is None else f", time to target {r['time_to_target_vs_gloo']:.2f}x"
        click.echo(f"{r['model']:<12} {r['system']:<17} seed {r['seed']}  speed vs gloo {r['speed_vs_gloo']:.2f}x{ttt}")
    for r in summary:
        med = "never" if r["median"] is None else f"{r['median']:g}"
        vs = "" if r["vs_32_bits"] is None or r["precision"] == 32 else f"  ({r['vs_32_bits']:.2f}x 32 bits)"
        click.echo(f"{r['model']:<12} {tb.label(r):<17} steps to {target:.0%}: median {med} of "
                   f"{r['steps_to_target']}{vs}")
    if json_path:
        with open(json_path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
            for r in ratios:
                f.write(json.dumps({"bench": "train-ratio", **r}) + "\n")
            for r in summary:
                f.write(json.dumps({"bench": "train-steps-to-target", **r}) + "\n")
    _write_plot(tb.plot, rows, png_path)


@bench.command("precision")
@click.option("--variants", default="32,16,8,8-nofb", show_default=True,
              help="bits a contribution value: 32, 16, 8 (with error feedback and reset), 8-nofb (without)")
@click.option("--workers", default=4, show_default=True)
@click.option("--rounds", default=300, show_default=True, help="allreduce rounds a run trains")
@click.option("--target", default=0.95, show_default=True, help="target test accuracy")
@click.option("--reset-every", type=click.IntRange(0), default=None,
              help="error reset every this many rounds (default: aggd_client.feedback's; 0: never)")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="write every row (one JSON object a line) to this file")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None,
              help="write a PNG: test accuracy against the round per variant")
def bench_precision(variants, workers, rounds, target, reset_every, seed, json_path, png_path):
    """Train the digits MLP under sync at 32, 16 and 8 bits a contribution value (8 with and without
    error feedback) in one lab: final accuracy and rounds to the target accuracy."""
    from aggd.training import precisionbench as pb

    try:
        chosen = pb.check_variants(_words(variants))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--variants") from None
    cfg = pb.Config(workers=workers, rounds=rounds, target=target, seed=seed, reset_every=reset_every,
                    variants=chosen)

    def show(r):
        rt = "never" if r["rounds_to_target"] is None else r["rounds_to_target"]
        click.echo(f"{r['variant']:<7} final {r['final_accuracy']:.3f}  rounds to {target:.0%}: {rt:>5}  "
                   f"{r['seconds']:6.1f} s  replicas identical: {r['replicas_equal']}")

    rows = pb.run(cfg, on_row=show)
    click.echo("\n" + pb.markdown_table(rows, target))
    if json_path:
        with open(json_path, "w") as f:
            for r in rows:
                f.write(json.dumps({"bench": "precision", **r}) + "\n")
    _write_plot(lambda rows_, path: pb.plot(rows_, target, path), rows, png_path)


@bench.command("faulty")
@click.option("--variants", default="clean,plain,bound,median,zeno", show_default=True,
              help="clean (nobody faulty); with one faulty member: plain (a summing job), bound (max_abs 0.6), "
                   "median, zeno (robust jobs); each defence quarantines after 3 offences or score windows")
@click.option("--workers", default=4, show_default=True)
@click.option("--rounds", default=300, show_default=True, help="allreduce rounds a run trains")
@click.option("--seeds", default="0", show_default=True, help="comma-separated seeds: a run of every variant each")
@click.option("--scale", default=-10.0, show_default=True, help="the faulty member's step is times this")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="write every row (one JSON object a line) to this file")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None,
              help="write a PNG: test accuracy against the round per variant (the first seed)")
def bench_faulty(variants, workers, rounds, seeds, scale, json_path, png_path):
    """Train the digits MLP under sync with one member sending its step times SCALE from round 20:
    final accuracy with no defence, a per-member bound, and robust jobs, against a clean run."""
    from aggd.training import faultybench as fb

    try:
        chosen = fb.check_variants(_words(variants))
        seed_list = tuple(int(s) for s in seeds.split(",") if s.strip())
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--variants / --seeds") from None
    cfg = fb.Config(workers=workers, rounds=rounds, seeds=seed_list or (0,), scale=scale, variants=chosen)

    def show(r):
        acc = "diverged" if r["diverged"] else f"final {r['final_accuracy']:.3f}"
        who = ", ".join(f"rank {q['rank']}: {q['reason']}" for q in r["quarantined"]) or "nobody quarantined"
        click.echo(f"seed {r['seed']} {r['variant']:<7} {acc}  ({who})")

    rows = fb.run(cfg, on_row=show)
    click.echo("\n" + fb.markdown_table(rows))
    if json_path:
        with open(json_path, "w") as f:
            for r in rows:
                f.write(json.dumps({"bench": "faulty", **r}) + "\n")
    _write_plot(fb.plot, rows, png_path)


@bench.command("shards")
@click.option("--workers", default=4, show_default=True)
@click.option("--size", default="4M", show_default=True, help="bytes of the float32 tensor, e.g. 1M, 4M")
@click.option("--calls", default=40, show_default=True, help="allreduces a run")
@click.option("--steady", default=12, show_default=True, help="last calls a run's time is the median of")
@click.option("--rates", default="400,400,100", show_default=True,
              help="Mbit/s of the link towards each aggregator (one an aggregator)")
@click.option("--rebalance-every", default=4, show_default=True, help="calls between the agreed maps")
@click.option("--scale", metavar="ADD_AT:DRAIN_AT", default=None,
              help="instead: through daemons, the members start on all aggregators but the last, the leader "
                   "adds it at call ADD_AT and drains it at DRAIN_AT (scale out, then in); each phase's time")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per run")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="write a PNG of each call's time in both runs")
def bench_shards(workers, size, calls, steady, rates, rebalance_every, scale, as_json, plot_path):
    """A job sharded over aggregators behind links of different rates: the even split against the
    rebalanced one, in labs alike; or (--scale) an aggregator added and drained while it runs."""
    from aggd.bench import shards as sb

    try:
        rate_list = tuple(float(r) for r in rates.split(","))
    except ValueError:
        raise click.BadParameter(f"{rates!r} is not a comma-separated list of Mbit/s", param_hint="--rates") from None
    if len(rate_list) < 2 or any(not r > 0 for r in rate_list):
        raise click.BadParameter("two or more positive rates", param_hint="--rates")
    nbytes = parse_size(size)
    if nbytes < 4 or workers < 1 or not 1 <= steady <= calls or rebalance_every < 1:
        raise click.BadParameter("--size of a value at least, --workers and --rebalance-every positive, "
                                 "--steady in 1..--calls")
    cfg = sb.Config(workers=workers, elements_total=nbytes // 4, calls=calls, steady=steady, rates=rate_list,
                    rebalance_every=rebalance_every)

    def show(row):
        if as_json:
            click.echo(json.dumps(row))
            return
        extra = f"  {row['speedup_over_even']:.2f}x the even split" if "speedup_over_even" in row else ""
        click.echo(f"{row['mode']:<10} workers={row['workers']} bytes={row['bytes']} rates={row['rates_mbit']}  "
                   f"{row['seconds_per_allreduce'] * 1e3:9.2f} ms  weights={row['final_weights']}{extra}")

    if scale is not None:
        try:
            add_at, drain_at = (int(v) for v in scale.split(":"))
        except ValueError:
            raise click.BadParameter(f"{scale!r} is not ADD_AT:DRAIN_AT", param_hint="--scale") from None
        if not 0 < add_at < drain_at < calls:
            raise click.BadParameter("0 < ADD_AT < DRAIN_AT < --calls", param_hint="--scale")
        try:
            row = sb.run_scale(cfg, "s" + uuid.uuid4().hex[:6], add_at, drain_at)
        except sb.BenchError as e:
            raise click.ClickException(str(e)) from None
        if as_json:
            click.echo(json.dumps(row))
        else:
            click.echo("  ".join(f"{phase}: {'-' if t is None else f'{t * 1e3:.1f} ms'}"
                                 for phase, t in row["seconds_by_phase"].items()))
        if plot_path:
            sb.plot([row], plot_path)
        return
    try:
        rows = sb.run(cfg, "s" + uuid.uuid4().hex[:6], on_row=show)
    except sb.BenchError as e:
        raise click.ClickException(str(e)) from None
    _write_plot(sb.plot, rows, plot_path, as_json)


@bench.command("xdp")
@click.option("--elements", "elements_list", default=f"64,256,512,{proto.NATIVE_MAX_ELEMENTS}", show_default=True,
              help="packet sizes (int32 values a packet) to compile and time")
@click.option("--strategies", default="sync,quorum:48:50ms,ssp:2,async,wbsp", show_default=True)
@click.option("--packets", default=4096, show_default=True, help="timed packets per configuration")
@click.option("--precision", "precisions", default="32", show_default=True,
              help="bits a contribution value, e.g. 8,32: narrow ones with room for the result, an 8-bit "
                   "packet holding two values a lane (docs/protocol.md, \"Precision\")")
@click.option("--exponents", "exponents_list", default="1", show_default=True,
              help="exponents the members' chunks take, e.g. 1,2: above 1 the program aligns every "
                   "contribution at another exponent than its round's (workers' chunks differ so)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per configuration")
def bench_xdp(elements_list, strategies, packets, precisions, exponents_list, as_json):
    """Time the production XDP program through BPF_PROG_TEST_RUN, next to numpy's int32 add."""
    from aggd.dataplane.xdp.loader import XdpDataPlane
    from aggd.bench.xdp import bench_strategy, harness_ns, numpy_add

    bits_list = _bits_list(precisions)
    exponents = _int_list(exponents_list)
    if any(not 1 <= n <= 32 for n in exponents):
        raise click.BadParameter("each must be 1 to 32", param_hint="--exponents")
    rows = []
    for elements in _int_list(elements_list):
        dp = XdpDataPlane(None, elements=elements, total_slots=4)
        try:
            timed = [bench_strategy(dp, s, elements, packets, bits, n) for n in exponents for bits in bits_list
                     for s in strategies.split(",")]
        finally:
            dp.close()
        floor = harness_ns(elements, packets)
        rows += [row | {"harness_ns": floor} for row in timed]
    rows.append(numpy_add())
    limit = rows[-1]["elements_per_s_per_core"]
    for row in rows:
        row["fraction_of_numpy"] = row["elements_per_s_per_core"] / limit
        if as_json:
            click.echo(json.dumps(row))
        else:
            harness = f"  (test-run harness {row['harness_ns']:.0f} ns/pkt)" if "harness_ns" in row else ""
            bits = f" {row['precision']:>2}-bit" if "precision" in row else " " * 7
            if row.get("exponents", 1) > 1:
                bits += f" {row['exponents']} exponents"
            click.echo(f"{row['strategy']:<16}{bits} {row.get('values_per_packet', row['elements_per_packet']):>9} "
                       f"values/pkt {row['ns_per_packet']:>12.1f} ns/pkt {row['elements_per_s_per_core']:>10.3g} values/s/core "
                       f"({row['fraction_of_numpy']:.0%} of numpy){harness}")


@bench.command("kernels")
@click.option("--values", "size", default="16M", show_default=True, help="values in the tensor, e.g. 1M, 16M")
@click.option("--precision", "precisions", default="32,16,8", show_default=True, help="bits a contribution value")
@click.option("--dtype", type=click.Choice(["float32", "float64"]), default="float32", show_default=True)
@click.option("--world", default=4, show_default=True, help="members the job is quantised for")
@click.option("--elements", default=proto.NATIVE_MAX_ELEMENTS, show_default=True,
              help="int32 values a packet (a narrow packet holds values_per_packet of its precision)")
@click.option("--ring", default=2048, show_default=True, help="packets in the fill's ring (a member's window)")
@click.option("--batch", default=64, show_default=True, help="results a scatter call reads (a receive batch)")
@click.option("--repeats", type=click.IntRange(1), default=5, show_default=True, help="runs of each; the best is kept")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per kernel and precision")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None, help="write a bar chart")
def bench_kernels(size, precisions, dtype, world, elements, ring, batch, repeats, as_json, png_path):
    """Time the client's numba kernels alone on one core (finiteness check, fill, scatter): ns a value."""
    from aggd.bench import client_kernels

    bits_list = _bits_list(precisions)
    values = parse_size(size)
    if not 1 <= world <= proto.MAX_MEMBERS:
        raise click.BadParameter(f"must be 1 to {proto.MAX_MEMBERS}", param_hint="--world")
    if not 1 <= elements <= proto.MAX_ELEMENTS or ring < 1 or batch < 1:
        raise click.BadParameter(f"--elements must be 1 to {proto.MAX_ELEMENTS}, --ring and --batch at least 1")
    try:
        rows = client_kernels.run(values, bits_list, dtype, world, elements, ring, batch, repeats)
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None
    for r in rows:
        if as_json:
            click.echo(json.dumps(r))
        else:
            bits = "" if r["precision"] is None else f"{r['precision']:>2}-bit"
            click.echo(f"{r['kernel']:<11}{bits:>7} {r['ns_per_value']:8.3f} ns a value")
    _write_plot(client_kernels.plot, rows, png_path, as_json)


@bench.command("transport")
@click.option("--mtu", "mtus", default="1500,9000", show_default=True, help="MTUs of the veth, comma-separated")
@click.option("--bytes", "size", default="1G", show_default=True, help="payload bytes out and back a run")
@click.option("--window", type=click.IntRange(1, 4096), default=512, show_default=True, help="frames in flight")
@click.option("--reps", type=click.IntRange(1), default=2, show_default=True, help="runs of each system, in turn")
@click.option("--systems", default="udp,xsk", show_default=True,
              help="udp (GSO out, GRO in) and/or xsk (AF_XDP, copy mode), comma-separated")
@click.option("--path", "paths", default="veth", show_default=True,
              help="veth (one veth to the peer) and/or bridge (through a bridge, as the lab), comma-separated")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per run")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None, help="write a bar chart")
def bench_transport(mtus, size, window, reps, systems, paths, as_json, png_path):
    """A worker's packet path alone, UDP sockets against AF_XDP, through a veth to a native XDP
    program that turns each frame round: rate and host CPU a GB."""
    from aggd.bench import transport

    mtu_list = _int_list(mtus, "--mtu")
    bad = [m for m in mtu_list if not 576 <= m <= 9000]
    if bad:
        raise click.BadParameter(f"an MTU must be 576 to 9000 (native XDP on a veth), not {bad[0]}", param_hint="--mtu")
    chosen = _words(systems)
    if not chosen or any(s not in transport.SYSTEMS for s in chosen):
        raise click.BadParameter(f"use {', '.join(transport.SYSTEMS)}", param_hint="--systems")
    path_list = _words(paths)
    if not path_list or any(p not in ("veth", "bridge") for p in path_list):
        raise click.BadParameter("use veth and/or bridge", param_hint="--path")

    def show(r):
        if as_json:
            click.echo(json.dumps(r))
        else:
            click.echo(f"{r['system']:<4} {r['path']:<6} mtu={r['mtu']:<5} {r['gbps']:7.2f} Gbit/s  "
                       f"{r['host_cpu_seconds_per_gb']:.3f} host CPU s/GB  resends={r['resends']}")

    rows = transport.run(tuple(mtu_list), parse_size(size), window, reps, tuple(chosen), tuple(path_list),
                         on_row=show)
    _write_plot(transport.plot, rows, png_path, as_json)


@bench.command("swap")
@click.option("--workers", default=4, show_default=True)
@click.option("--swaps", default=10, show_default=True, help="strategy swaps to time")
@click.option("--steps", default=400, show_default=True, help="steps each worker runs")
@click.option("--delay", default=0.003, show_default=True, help="seconds of compute a step")
@click.option("--json", "as_json", is_flag=True)
def bench_swap(workers, swaps, steps, delay, as_json):
    """Time from a hot-swap request to the first round released under the new strategy, with
    workers training in a lab (median and max)."""
    import time

    from aggd.core import strategy as strat
    from aggd.core.hotswap import swap_on
    from aggd.lab.namespaces import Lab
    from aggd.lab.runner import LabJob, StrategyRun, xdp_aggregator

    cycle = ["quorum:%d:200ms" % max(1, workers - 1), "ssp:2", "async", "wbsp", "sync"]
    name = "s" + uuid.uuid4().hex[:6]
    requests = []
    with Lab(name, workers + 1) as lab, xdp_aggregator(lab) as dp:
        job = LabJob(job=1, workers=list(range(workers)), slots=16)
        dp.install_job(job.config(lab))
        table = strat.StrategyTable(strat.SYNC)
        run = StrategyRun(lab, job, workers, steps=steps, delay=delay, jitter=1.0).start()
        while run.running() and (dp.max_round(1) or 0) < 10:  # workers import and get going
            time.sleep(0.01)
        for i in range(swaps):
            if not run.running():
                break
            t0 = time.monotonic()
            try:
                version, first = swap_on(dp, 1, table, strat.parse(cycle[i % len(cycle)]), workers)
            except strat.StrategyError:  # the table is full until older versions retire
                time.sleep(0.05)
                continue
            requests.append((version, first, cycle[i % len(cycle)], t0))
            time.sleep(0.3)
        records, releases, errors = run.finish(timeout=600)
    if errors:
        raise click.ClickException(f"workers failed: {errors}")
    lat = []
    for version, first, text, t0 in requests:
        ts = [r["t"] for r in releases if r["version"] == version]
        if ts:
            lat.append(min(ts) - t0)
    if not lat:
        raise click.ClickException("no round ran under a swapped strategy: raise --steps")
    lat.sort()
    row = {"bench": "swap", "workers": workers, "swaps": len(requests), "observed": len(lat),
           "median_s": lat[len(lat) // 2], "max_s": lat[-1], "min_s": lat[0],
           "margin_rounds": __import__("aggd.core.hotswap", fromlist=["SWAP_MARGIN"]).SWAP_MARGIN}
    click.echo(json.dumps(row) if as_json else
               f"swap -> first round under the new strategy: median {row['median_s'] * 1e3:.1f} ms, "
               f"max {row['max_s'] * 1e3:.1f} ms over {row['observed']} swaps ({workers} workers)")


@bench.command("memory")
@click.option("--jobs", default=256, show_default=True, help="idle jobs to create (and delete)")
@click.option("--slots", type=int, default=None, help="slots of each idle job (default: the daemon's "
              "[jobs] default_slots, 1024)")
@click.option("--active", default="1024,4096,16384", show_default=True,
              help="active-slot counts to measure, in one user-space job of the largest")
@click.option("--big-slots", default=16384, show_default=True,
              help="slots of the job created while status is timed ([jobs] max_slots)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per measurement")
def bench_memory(jobs, slots, active, big_slots, as_json):
    """The real daemon's resident memory with no job, with idle jobs, after deleting them, and per
    active user-space slot; and status latency while a job of --big-slots slots is created."""
    from aggd.bench import memory

    counts = tuple(_int_list(active))
    if jobs < 0 or any(k < 1 for k in counts) or big_slots < 1 or (slots is not None and slots < 1):
        raise click.BadParameter("counts must be positive")
    mib = 1 / 2**20

    def show(row):
        if as_json:
            click.echo(json.dumps(row))
            return
        case = row["case"]
        text = f"{case:<20} rss {row.get('rss_bytes', 0) * mib:8.1f} MiB"
        if case == "idle_jobs":
            text += (f"  +{row['rss_over_no_jobs_bytes'] * mib:.1f} MiB for {row['jobs']} jobs of {row['slots']} "
                     f"slots: {row['rss_per_idle_job_bytes'] / 1024:.1f} KiB/job; create median "
                     f"{row['create_median_s'] * 1e3:.1f} ms, max {row['create_max_s'] * 1e3:.1f} ms")
        elif case == "active_slots":
            text += (f"  {row['active_slots']} active slots: {row['rss_per_active_slot_bytes']:.0f} B/slot "
                     f"({row['anon_per_active_slot_bytes']:.0f} anon, {row['file_per_active_slot_bytes']:.0f} file)")
        elif case == "empty_job":
            text += f"  a job of {row['slots']} slots, none used: {row['rss_over_previous_bytes'] * mib:+.1f} MiB"
        elif case == "create_big_job":
            text = (f"{case:<20} {row['slots']} slots in {row['create_s'] * 1e3:.0f} ms; status answered "
                    f"{row['status_answers']} times, slowest {row['status_max_s'] * 1e3:.0f} ms")
        elif "rss_over_no_jobs_bytes" in row:
            text += f"  ({row['rss_over_no_jobs_bytes'] * mib:+.1f} MiB over no jobs)"
        click.echo(text)

    memory.run(jobs=jobs, slots=slots, active=counts, big_slots=big_slots,
               lab_name="m" + uuid.uuid4().hex[:6], on_row=show)


from aggd.cli.commands.stragglers import stragglers  # noqa: E402  (aggctl bench stragglers: aggd/commands/stragglers.py)
bench.add_command(stragglers)
