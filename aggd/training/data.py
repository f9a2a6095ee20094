"""The digits data set scikit-learn ships (1797 8x8 images, no download), split and sharded.

Every worker loads the same split (a fixed seed) and takes its own shard of the training set:
rank ``r`` of ``world`` gets every ``world``-th example of a seeded permutation, so shards are
disjoint, cover the training set and hold the classes in about equal parts. ``Batches`` draws
mini-batches from a shard, reshuffled each epoch with a per-rank seed.
"""
from __future__ import annotations

import gzip
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Dataset:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def features(self) -> int:
        return self.x_train.shape[1]

    @property
    def classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def _digits_file() -> Path | None:
    """scikit-learn's own copy of the digits (``sklearn/datasets/data/digits.csv.gz``), found
    without importing scikit-learn (which takes a second or more, per worker)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    return path if path.exists() else None


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(1797 x 64 pixel values 0..16, labels 0..9), as ``sklearn.datasets.load_digits`` gives them."""
    path = _digits_file()
    if path is not None:
        with gzip.open(path, "rt") as f:
            raw = np.loadtxt(f, delimiter=",", dtype=np.float64)
        return raw[:, :-1], raw[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as _load  # another layout: the documented way
    d = _load()
    return d.data, d.target


def load_digits(test_fraction: float = 0.25, seed: int = 0) -> Dataset:
    """Digits scaled to [0, 1], split into train and test by a seeded, class-stratified shuffle."""
    data, target = digits_arrays()
    x = (data / 16.0).astype(np.float32)
    y = target.astype(np.int64)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), bool)
    for c in np.unique(y):  # stratified: every class in the same proportion on both sides
        idx = rng.permutation(np.flatnonzero(y == c))
        test[idx[:int(round(len(idx) * test_fraction))]] = True
    return Dataset(x[~test], y[~test], x[test], y[test])


def shard(n: int, rank: int, world: int, seed: int = 0) -> np.ndarray:
    """Indices of rank ``rank``'s shard of ``n`` examples (disjoint, together all of them)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
    return np.random.default_rng([seed, 1]).permutation(n)[rank::world]


class Batches:
    """Endless mini-batches of ``batch`` examples from one shard, reshuffled every epoch."""

    def __init__(self, data: Dataset, rank: int, world: int, batch: int, seed: int = 0):
        self.x, self.y = data.x_train, data.y_train
        self.idx = shard(len(self.y), rank, world, seed)
        self.batch = min(int(batch), len(self.idx))
        self.rng = np.random.default_rng([seed, 2, rank])
        self.epoch, self._order, self._pos = 0, self.rng.permutation(self.idx), 0

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        if self._pos + self.batch > len(self._order):
            self.epoch += 1
            self._order, self._pos = self.rng.permutation(self.idx), 0
        sel = self._order[self._pos:self._pos + self.batch]
        self._pos += self.batch
        return self.x[sel], self.y[sel]
