"""``aggctl demo`` (what ``make demo`` runs): real training through aggd with a straggler.

A lab of namespaces (a bridge, the aggregator, N workers), an aggd daemon attached to it with its
straggler policy on, and N workers training a small MLP on scikit-learn's digits, each on its own
shard. One worker turns 3x slower for the middle of the run: the daemon sees it in the data
plane's per-member lag counters, switches the job to a quorum that does not wait for it, and back
to sync once it is even again. A live line per worker shows its round, its replica's test accuracy
and the strategy in force. Then the same training under plain sync, and the time each took to
reach the target accuracy.
"""
from __future__ import annotations

import sys
import threading
import time
import uuid

import click


class Board:
    """One line per worker plus one for the daemon, redrawn in place on a terminal (or printed
    every few rounds when stdout is not one)."""

    def __init__(self, workers: int, rounds: int, slow_rank: int, title: str):
        self.n, self.rounds, self.slow_rank = workers, rounds, slow_rank
        self.tty = sys.stdout.isatty()
        self.rows = [f"worker {r}: starting" for r in range(workers)]
        self.daemon = "daemon: -"
        self.lock = threading.Lock()
        self.drawn = False
        self.last_draw = 0.0
        self.last_print_round = -1
        click.echo(click.style(title, bold=True))

    def worker(self, rank: int, rec: dict) -> None:
        if "accuracy" not in rec:
            return
        slow = rec.get("slow", 1.0)
        bar_w = 24
        done = int(bar_w * min(1.0, rec["round"] / self.rounds))
        text = (f"worker {rank} [{'#' * done}{'.' * (bar_w - done)}] round {rec['round']:>4}/{self.rounds}  "
                f"accuracy {rec['accuracy']:.3f}  strategy {rec['strategy']:<9}"
                f"  compute {'%gx SLOW' % slow if slow != 1.0 else '1x'}")
        with self.lock:
            self.rows[rank] = text
            if not self.tty and rank == 0 and rec["round"] // 50 != self.last_print_round // 50:
                self.last_print_round = rec["round"]
                for row in self.rows:
                    click.echo("  " + row)
        self.draw()

    def set_daemon(self, text: str, key=None) -> None:
        """``key``: what must change for a line to be printed when stdout is not a terminal."""
        with self.lock:
            self.daemon = text
            changed = key != getattr(self, "_key", None)
            self._key = key
        if changed and not self.tty:
            click.echo("  " + text)
        self.draw()

    def draw(self, force: bool = False) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        with self.lock:
            if not force and now - self.last_draw < 0.1:
                return
            self.last_draw = now
            lines = self.rows + [self.daemon]
            out = ("\x1b[%dA" % len(lines) if self.drawn else "") + "".join(
                "\r\x1b[2K" + line[:160] + "\n" for line in lines)
            self.drawn = True
        sys.stdout.write(out)
        sys.stdout.flush()


def _watch(daemon, job: dict, board: Board, stop: threading.Event) -> None:
    """Show what the daemon's detector and policy say about the job, as they change."""
    while not stop.wait(0.25):
        if "name" not in job:
            continue
        try:
            w = daemon.call("workers", job=job["name"])
        except Exception:
            return
        p = w.get("policy") or {}
        slow = ", ".join(f"rank {x['rank']} {x['slowdown']:.1f}x" for x in w["workers"] if x.get("straggler"))
        last = p.get("last_decision")
        text = f"daemon: stragglers: {slow or 'none'}; strategy {p.get('in_force', '-')}"
        if last:
            text += f"; last switch -> {last['strategy']} from round {last['from_round']}"
        board.set_daemon(text, (slow.count("rank"), p.get("in_force")))


def _train(lab, daemon, strategy, scenario, params, title):
    from aggd.training.labtrain import run

    board = Board(params.workers, params.rounds, params.workers - 1, title)
    job, stop = {}, threading.Event()
    watcher = threading.Thread(target=_watch, args=(daemon, job, board, stop), daemon=True)
    watcher.start()
    try:
        res = run(lab, daemon, strategy, scenario, params, on_record=board.worker, on_job=job.update)
    finally:
        stop.set()
        watcher.join(2)
        board.draw(force=True)
    return res


#: The slow worker's phase, as fractions of the run: from before the model reaches the target (at
#: the default 95% about round 110 of an even run) to where the run has room left for the daemon to
#: see every member even again (30 rounds, and the slow member catching up) and switch back.
SLOW_FROM, SLOW_UNTIL = 0.1, 0.4


@click.command()
@click.option("--workers", default=4, show_default=True)
@click.option("--rounds", default=400, show_default=True, help="allreduce rounds of training")
@click.option("--compute-ms", default=20.0, show_default=True, help="simulated compute a step")
@click.option("--slow", default=3.0, show_default=True, help="how much slower the last worker turns")
@click.option("--target", default=0.95, show_default=True, help="target test accuracy")
@click.option("--no-baseline", is_flag=True, help="skip the sync run")
@click.option("--name", help="the lab's name (its namespaces are NAME-agg, NAME-w0, ...; default: demo and "
                             "4 random hex digits)")
def demo(workers, rounds, compute_ms, slow, target, no_baseline, name):
    """Train a model with N workers through aggd while one turns slow for a while: the daemon
    switches strategy and back; then the same under sync, and the time to target accuracy of both."""
    from aggd.lab.namespaces import Lab
    from aggd.training.labtrain import RunParams, Scenario, lab_daemon

    if workers < 2:
        raise click.BadParameter("a straggler needs at least 2 workers", param_hint="--workers")
    params = RunParams(workers=workers, rounds=rounds, compute_ms=compute_ms, target=target)
    start, end = SLOW_FROM, SLOW_UNTIL
    scenario = Scenario("phase", slow, start, end)
    name = name or "demo" + uuid.uuid4().hex[:4]
    try:
        lab = Lab(name, workers)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--name or --workers") from None
    click.echo(f"lab {name}: a bridge, the aggregator and {workers} worker namespaces; aggd's XDP data plane on "
               f"agg0 with its straggler policy on.\nEach worker trains a {64}-{params.hidden}-10 MLP on its "
               f"shard of scikit-learn's digits ({compute_ms:g} ms of compute a step); worker {workers - 1} "
               f"turns {slow:g}x slower for rounds {int(start * rounds)}..{int(end * rounds)}.\n")
    with lab, lab_daemon(lab) as daemon:
        dyn = _train(lab, daemon, "dynamic", scenario, params,
                     "1) dynamic: the daemon picks the strategy from what it measures")
        for d in dyn.decisions:
            click.echo(f"   the daemon switched {d['from']} -> {d['strategy']} from round {d['from_round']}: "
                       f"{d['reason']}")
        if not dyn.decisions:
            click.echo("   the daemon made no switch")
        base = None
        if not no_baseline:
            click.echo("")
            base = _train(lab, daemon, "sync", scenario, params, "2) sync throughout, same straggler")
    click.echo("")

    def ttt(r):
        return "not reached" if r.time_to_target_s is None else f"{r.time_to_target_s:5.2f} s"

    click.echo(click.style(f"time to {target:.0%} test accuracy", bold=True))
    click.echo(f"  dynamic: {ttt(dyn)}   (final accuracy {dyn.final_accuracy:.3f}, {dyn.seconds:.1f} s for "
               f"{rounds} rounds)")
    if base is not None:
        click.echo(f"  sync:    {ttt(base)}   (final accuracy {base.final_accuracy:.3f}, {base.seconds:.1f} s for "
                   f"{rounds} rounds)")
        if dyn.time_to_target_s and base.time_to_target_s:
            gain = 1 - dyn.time_to_target_s / base.time_to_target_s
            click.echo(f"  the dynamic policy reached it {abs(gain):.0%} {'sooner' if gain >= 0 else 'later'} "
                       f"than sync ({base.time_to_target_s / dyn.time_to_target_s:.2f}x)")
