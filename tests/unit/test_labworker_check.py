"""The lab worker's result check works block by block (so 8 workers can check 256 MiB results);
it must judge exactly as the whole-array computation would."""
import numpy as np
import pytest

from aggd.lab import worker as lw
from aggd_client.quant import chunk_exponents, error_bound, output_rounding

WORLD, ELEMENTS = 3, 832
SIZE = lw._block(ELEMENTS) * 2 + 1000  # three blocks, the last one short and ending mid-chunk


def _whole(seed, pattern):
    xs = [lw.tensor(seed, r, SIZE, "float32", 0, pattern, ELEMENTS).astype(np.float64) for r in range(WORLD)]
    n_chunks = -(-SIZE // ELEMENTS)
    exps = None
    for x in xs:
        padded = np.zeros(n_chunks * ELEMENTS)
        padded[:SIZE] = np.abs(x)
        e = chunk_exponents(padded.reshape(n_chunks, ELEMENTS).max(axis=1), WORLD)
        exps = e if exps is None else np.minimum(exps, e)
    return np.sum(xs, axis=0), np.repeat(error_bound(WORLD, exps), ELEMENTS)[:SIZE]


@pytest.mark.parametrize("pattern", lw.PATTERNS)
def test_blockwise_check_matches_the_whole_array_computation(pattern):
    exact, bound = _whole(7, pattern)
    e2, b2 = lw.expected(7, WORLD, SIZE, "float32", 0, ELEMENTS, pattern)
    np.testing.assert_array_equal(exact, e2)
    np.testing.assert_array_equal(bound, b2)
    out = exact.astype(np.float32)
    rec = lw.check(out, 7, WORLD, SIZE, "float32", 0, ELEMENTS, pattern)
    err = np.abs(out.astype(np.float64) - exact)
    full = bound + output_rounding(out)
    assert rec == {"max_abs_error": float(err.max()), "error_bound": float(full.max()),
                   "within_bound": True, "max_abs_value": float(np.abs(exact).max())}


def test_an_error_in_the_last_block_is_found():
    exact, bound = _whole(3, "random")
    out = exact.astype(np.float32)
    out[SIZE - 5] += np.float32(1.0)
    rec = lw.check(out, 3, WORLD, SIZE, "float32", 0, ELEMENTS)
    assert not rec["within_bound"] and rec["max_abs_error"] >= 0.99


def test_the_float_sum_bound_for_gloo():
    xs = [lw.tensor(5, r, SIZE, "float32", 1, "random", ELEMENTS).astype(np.float64) for r in range(WORLD)]
    exact = np.sum(xs, axis=0)
    rec = lw.check(exact.astype(np.float32), 5, WORLD, SIZE, "float32", 1, ELEMENTS, float_sum=True)
    bound = WORLD * float(np.finfo(np.float32).eps) * np.sum(np.abs(xs), axis=0)
    assert rec["within_bound"]
    assert rec["error_bound"] == float((bound + output_rounding(exact.astype(np.float32))).max())


def test_tensor_blocks_are_the_tensor():
    t = lw.tensor(1, 2, SIZE, "float32", 0, "random", ELEMENTS)
    b = lw._block(ELEMENTS)
    np.testing.assert_array_equal(t[b:2 * b], lw.tensor_block(1, 2, SIZE, "float32", 0, "random", ELEMENTS, 1))
    assert t.dtype == np.float32 and np.all(np.isfinite(t))


def test_partial_check_takes_each_chunk_as_the_sum_of_as_many_members_as_it_counts():
    """``--check partial`` (async's running sums): each chunk the sum of some n_contrib members."""
    xs = [lw.tensor(5, r, SIZE, "float32", 0, "random", ELEMENTS).astype(np.float64) for r in range(WORLD)]
    n_chunks = -(-SIZE // ELEMENTS)
    counts = np.array([1 + k % WORLD for k in range(n_chunks)])
    out = np.empty(SIZE)
    for k in range(n_chunks):    # chunk k: members k .. k + count - 1 (mod WORLD)
        sl = slice(k * ELEMENTS, (k + 1) * ELEMENTS)
        out[sl] = sum(xs[(k + j) % WORLD][sl] for j in range(counts[k]))
    out = out.astype(np.float32)
    assert lw.check_partial(out, counts, 5, WORLD, SIZE, "float32", 0, ELEMENTS)["within_bound"]
    assert not lw.check(out, 5, WORLD, SIZE, "float32", 0, ELEMENTS)["within_bound"]
    wrong = counts.copy()
    wrong[-1] = 1 + wrong[-1] % WORLD     # the last chunk counted as another number of members
    assert not lw.check_partial(out, wrong, 5, WORLD, SIZE, "float32", 0, ELEMENTS)["within_bound"]


@pytest.mark.parametrize("world", [4, 8])
def test_near_workers_chunks_are_a_step_apart_at_most_where_random_ones_are_further(world):
    """``--pattern near``: a chunk's own exponents mostly at most a step apart (data-parallel
    gradients lie between the two patterns: docs/benchmarks.md)."""
    def spread(pattern):
        e = np.stack([chunk_exponents(np.abs(lw.tensor(2, r, 64 * ELEMENTS, "float32", 0, pattern, ELEMENTS))
                                      .reshape(64, ELEMENTS).max(axis=1), world) for r in range(world)])
        return e.max(axis=0) - e.min(axis=0)
    assert (spread("near") <= 1).mean() > 0.9
    assert (spread("random") >= 2).mean() > 0.8
