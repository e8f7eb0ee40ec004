"""A gradient stored as a seeded count-sketch: the flattened parameter gradient g [D] becomes
s [m], s_k = sum_{i: h(i) = k} sign(i) g_i, with h uniform over [0, m) and sign uniform over +-1, drawn once from
`seed` (Charikar, Chen & Farach-Colton 2002; as a Johnson-Lindenstrauss map: Dasgupta, Kumar & Sarlos 2010).
It is linear and unbiased for inner products: E <s(a), s(b)> = <a, b>, with
Var <s(a), s(a)> <= 2 ||a||^4 / m, so a squared norm is distorted by at most sqrt(2 / m) (one standard
deviation): 0.39 % at m = 2^17. One fixed sketch serves every gradient of a measurement, so the bias estimates
of estimate.py are exact for the sketched vectors. dim=None keeps the full gradient (small models, tests)."""

from __future__ import annotations

import math

import numpy as np
import torch

DEFAULT_DIM = 2 ** 17


class GradientSketch:
    """Sketch of the `.grad` of `params` (a fixed list: the model's trainable parameters) into `dim` buckets
    (None: the full flattened gradient, float64). Raises ValueError for dim < 1 or no parameters. Memory: 5 bytes
    per parameter for the hash (675 MB for 135M parameters)."""

    def __init__(self, params: list[torch.nn.Parameter], dim: int | None = DEFAULT_DIM, seed: int = 0):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("no trainable parameters to sketch")
        if dim is not None and dim < 1:
            raise ValueError(f"sketch dimension must be >= 1, got {dim}")
        self.dim, self.seed = dim, seed
        self.parameters = sum(p.numel() for p in self.params)
        self._buckets: list[torch.Tensor] = []
        self._flip: list[torch.Tensor] = []
        if dim is not None:
            gen = torch.Generator().manual_seed(seed)
            for p in self.params:
                self._buckets.append(torch.randint(0, dim, (p.numel(),), generator=gen, dtype=torch.int32))
                self._flip.append(torch.randint(0, 2, (p.numel(),), generator=gen, dtype=torch.bool))

    @property
    def width(self) -> int:
        """Length of a sketch: dim, or the parameter count for the full gradient."""
        return self.parameters if self.dim is None else self.dim

    @property
    def distortion(self) -> float:
        """One standard deviation of a squared norm's relative error, sqrt(2 / dim) (0 for the full gradient)."""
        return 0.0 if self.dim is None else math.sqrt(2 / self.dim)

    def __call__(self, grads: list[torch.Tensor | None] | None = None) -> np.ndarray:
        """The sketch [width] float64 of `grads` (one tensor per parameter, None counts 0; default: the parameters'
        current .grad)."""
        grads = [p.grad for p in self.params] if grads is None else grads
        if len(grads) != len(self.params):
            raise ValueError(f"expected {len(self.params)} gradient tensors, got {len(grads)}")
        if self.dim is None:
            return torch.cat([torch.zeros(p.numel(), dtype=torch.float64) if g is None else g.detach().reshape(-1).double()
                              for p, g in zip(self.params, grads)]).numpy()
        out = torch.zeros(self.dim, dtype=torch.float64)
        for g, bucket, flip in zip(grads, self._buckets, self._flip):
            if g is not None:
                flat = g.detach().reshape(-1).float()
                out.index_add_(0, bucket, torch.where(flip, -flat, flat).double())
        return out.numpy()
