"""Two small PyTorch models on the digits (``aggd.training.data.load_digits``) for DDP through aggd.

* ``cnn``: two 3x3 convolutions (1 -> 32 -> 64 channels) on the 8x8 image, a 2x2 max-pool, two
  more (64 -> 64 -> 64) on the 4x4 map and three fully connected layers (1024 -> 224 -> 128 -> 10):
  about 350,000 parameters in 14 tensors, two thirds of them in ``fc1``.
* ``transformer``: the image read as a sequence of its 8 rows (8 pixels a token), a linear token
  embedding and a learned position embedding (width 128), two pre-norm encoder layers (4 heads,
  feed-forward 512, no dropout), mean pooling and a linear head: about 400,000 parameters.

Both are deterministic functions of the seed (``build(name, seed)``), so every rank of a run, and a
gloo run and an aggd run, start from the same parameters. DDP buckets: torch 2.13 puts every
gradient in one bucket for the first step and then rebuilds the buckets in the order gradients
become ready, with a first bucket of at most 1 MiB and the others of at most ``bucket_cap_mb``
(25 by default). Both models are larger than 1 MiB and far smaller than 26 MiB, so with the default
cap every later step has exactly two buckets of unequal sizes; a small cap (0.02 MiB) gives many
(a bucket holds whole tensors: 6 for the 14 tensors of the cnn, 9 for the transformer;
tests/train/test_torch_models.py counts them).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

MODELS = ("cnn", "transformer")


class DigitsCNN(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.conv3 = nn.Conv2d(64, 64, 3, padding=1)
        self.conv4 = nn.Conv2d(64, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 4 * 4, 224)
        self.fc2 = nn.Linear(224, 128)
        self.fc3 = nn.Linear(128, classes)
        for m in self.modules():  # He initialisation: PyTorch's default leaves this depth barely trainable by SGD
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, 1, 8, 8)
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        x = torch.max_pool2d(x, 2)
        x = torch.relu(self.conv4(torch.relu(self.conv3(x))))
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x.flatten(1))))))


class RowTransformer(nn.Module):
    """Sequence classification: 8 tokens (the image's rows) of 8 values each."""

    def __init__(self, classes: int = 10, width: int = 128, layers: int = 2, heads: int = 4, ff: int = 512):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.pos = nn.Parameter(torch.randn(8, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.reshape(-1, 8, 8)) + self.pos
        h = self.encoder(h)
        return self.head(self.norm(h).mean(dim=1))


def build(name: str, seed: int = 0, classes: int = 10) -> nn.Module:
    """The model ``name`` (``cnn`` or ``transformer``) initialised from ``seed``."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, not {name!r}")
    torch.manual_seed(seed)
    return DigitsCNN(classes) if name == "cnn" else RowTransformer(classes)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flat_params(model: nn.Module) -> np.ndarray:
    """Every parameter, in ``model.parameters()`` order, as one float32 vector."""
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()]).numpy().copy()


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        out = model(torch.from_numpy(np.ascontiguousarray(x)))
    return float((out.argmax(dim=1).numpy() == y).mean())
