"""``aggctl bench train``'s summary over seeds (aggd.training.torchbench.steps_to_target): the median
steps to the target accuracy per system and precision, and a narrow precision's ratio to 32 bits."""
from __future__ import annotations

from aggd.training.torchbench import steps_to_target


def rows(system, bits, counts):
    return [{"model": "cnn", "system": system, "precision": bits, "seed": seed, "eval_every": 2,
             "steps_to_target": n} for seed, n in enumerate(counts)]


def test_medians_over_seeds_and_the_ratio_to_32_bits_of_the_same_system():
    out = steps_to_target(rows("aggd-xdp", 32, [20, 22, 18]) + rows("aggd-xdp", 8, [22, 24, 20])
                          + rows("aggd-user", 8, [30, 18, 20]) + rows("gloo", 32, [20, 20, 22]))
    by = {(r["system"], r["precision"]): r for r in out}
    assert by["aggd-xdp", 32]["median"] == 20 and by["aggd-xdp", 32]["vs_32_bits"] == 1.0
    assert by["aggd-xdp", 8]["steps_to_target"] == [22, 24, 20] and by["aggd-xdp", 8]["median"] == 22
    assert by["aggd-xdp", 8]["vs_32_bits"] == 1.1 and by["aggd-xdp", 8]["seeds"] == [0, 1, 2]
    assert by["aggd-user", 8]["median"] == 20 and by["aggd-user", 8]["vs_32_bits"] is None  # no 32-bit row
    assert by["gloo", 32]["eval_every"] == 2


def test_a_seed_that_never_reached_the_target_leaves_no_median():
    out = steps_to_target(rows("aggd-xdp", 32, [20, 20]) + rows("aggd-xdp", 8, [20, None]))
    narrow = next(r for r in out if r["precision"] == 8)
    assert narrow["median"] is None and narrow["vs_32_bits"] is None and narrow["steps_to_target"] == [20, None]
