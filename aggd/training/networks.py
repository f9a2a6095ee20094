"""A small multi-layer perceptron in numpy whose parameters live in one flat float32 vector.

One flat vector is what an allreduce takes: the whole model (or its gradient) goes through aggd as
one tensor, with no packing step. Layers are views into it. Forward and backward are plain numpy
(softmax cross-entropy on ReLU hidden layers), a few microseconds a batch for the digits model.
"""
from __future__ import annotations

import numpy as np


class MLP:
    """``MLP((64, 64, 10), seed)``: ReLU hidden layers, softmax output, He-initialised weights.

    ``params`` is the flat float32 vector; ``weights[i]`` and ``biases[i]`` are views into it, so
    assigning into ``params`` (``mlp.params[:] = averaged``) changes the model in place.
    """

    def __init__(self, sizes: tuple[int, ...] = (64, 64, 10), seed: int = 0):
        if len(sizes) < 2 or any(int(s) < 1 for s in sizes):
            raise ValueError(f"sizes must be at least two positive layer widths, got {sizes}")
        self.sizes = tuple(int(s) for s in sizes)
        shapes = []
        for fan_in, fan_out in zip(self.sizes[:-1], self.sizes[1:]):
            shapes += [(fan_in, fan_out), (fan_out,)]
        self.n_params = sum(int(np.prod(s)) for s in shapes)
        self.params = np.zeros(self.n_params, np.float32)
        self._views = []
        off = 0
        for s in shapes:
            n = int(np.prod(s))
            self._views.append(self.params[off:off + n].reshape(s))
            off += n
        rng = np.random.default_rng(seed)
        for w in self.weights:
            w[...] = rng.standard_normal(w.shape) * np.sqrt(2.0 / w.shape[0])

    @property
    def weights(self) -> list[np.ndarray]:
        return self._views[0::2]

    @property
    def biases(self) -> list[np.ndarray]:
        return self._views[1::2]

    def logits(self, x: np.ndarray) -> np.ndarray:
        h = np.asarray(x, np.float32)
        n = len(self.weights)
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            h = h @ w + b
            if i < n - 1:
                np.maximum(h, 0, out=h)
        return h

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.logits(x).argmax(axis=1)

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        return float((self.predict(x) == y).mean())

    def loss_and_grad(self, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
        """Mean cross-entropy over the batch and its gradient, flat like ``params``."""
        x = np.asarray(x, np.float32)
        acts = [x]
        h = x
        n = len(self.weights)
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            h = h @ w + b
            if i < n - 1:
                h = np.maximum(h, 0)
            acts.append(h)
        z = acts[-1] - acts[-1].max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        m = len(y)
        loss = float(-np.log(p[np.arange(m), y] + 1e-12).mean())
        grad = np.zeros_like(self.params)
        gviews, off = [], 0
        for v in self._views:
            gviews.append(grad[off:off + v.size].reshape(v.shape))
            off += v.size
        d = p
        d[np.arange(m), y] -= 1.0
        d /= m
        for i in range(n - 1, -1, -1):
            gviews[2 * i][...] = acts[i].T @ d
            gviews[2 * i + 1][...] = d.sum(axis=0)
            if i:
                d = (d @ self.weights[i].T) * (acts[i] > 0)
        return loss, grad
