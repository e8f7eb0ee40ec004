"""How the trainer's fp32 weights are rounded onto the engine's quantization grid at each weight sync.

"nearest" is gguf-py's quantizer (what llama.cpp's own `quantize` does): a weight moves to the next grid point
only once training has moved it more than half a step, so a coarse engine erases small updates (docs/results.md
sec. 3: after 30 steps 59.6 % of the q4_1 block weights round back to their step-0 value).

"stochastic" is stochastic rounding (Gupta et al. 2015, "Deep Learning with Limited Numerical Precision",
arXiv:1502.02551, sec. 3, eq. 2): a weight a fraction f of a grid step above grid point q is exported as q + 1
with probability f, else q, so the exported weight is unbiased (E = the master weight) and an update smaller
than a step reaches the engine with probability proportional to its size instead of never. Realised by
dithering: x' = x + (u - 1/2) d with u ~ U[0, 1) per weight, then gguf-py's round-to-nearest, keeping each
block's extremes (hence its scale d and minimum m, which gguf-py derives from them) unchanged.

The noise is a function of the weight itself (seeded by the run seed and a CRC of the tensor's bytes), so the
GGUF exporter and the precision-aligned trainer forward (model/aligned.py), which round the same tensor independently,
get the same draw, a resumed run gets the draws it would have had, and a weight that did not change is not
re-drawn.
"""

from __future__ import annotations

import zlib

import numpy as np

ROUNDINGS = ("nearest", "stochastic")
STOCHASTIC_TYPES = ("q8_0", "q4_1")  # block types whose scale comes from the block's extremes alone
FLOAT_TYPES = ("f32", "f16", "bf16")  # no grid to dither: always nearest
_BLOCK = 32


def check_rounding(rounding: str, precisions: set[str] | tuple[str, ...]) -> None:
    """Raise ValueError when `rounding` is unknown or "stochastic" is asked for a tensor type it does not cover
    (`precisions`: the GGUF types the export uses, e.g. {"q4_1", "q8_0"})."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown export rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}")
    unsupported = sorted(set(precisions) - set(STOCHASTIC_TYPES) - set(FLOAT_TYPES))
    if rounding == "stochastic" and unsupported:
        raise ValueError(f"stochastic export rounding covers {', '.join(STOCHASTIC_TYPES)} (and leaves float types "
                         f"as they are); this export also uses {', '.join(unsupported)} (engine.precision / engine.tensor_precision)")


def dither(weight: np.ndarray, precision: str, seed: int) -> np.ndarray:
    """The array to hand gguf-py's round-to-nearest quantizer so that it rounds `weight` stochastically to its
    `precision` grid (module docstring). weight: float32 [..., in] with in a multiple of 32 (the GGUF block);
    returns a new float32 array of the same shape; the dequantized result lies on the grid nearest rounding of
    `weight` would use (same per-block d and m). Rows are dithered independently, so permuting rows before
    quantizing (the exporter's q/k permutation) commutes with it. Float types come back unchanged (a copy). Raises ValueError
    (a type outside STOCHASTIC_TYPES, a row length that is not a multiple of 32)."""
    x = np.ascontiguousarray(weight, dtype=np.float32)
    if precision in FLOAT_TYPES:
        return x.copy()
    if precision not in STOCHASTIC_TYPES:
        raise ValueError(f"stochastic rounding covers {', '.join(STOCHASTIC_TYPES)}, not {precision!r}")
    if x.shape[-1] % _BLOCK:
        raise ValueError(f"rows of {x.shape[-1]} values are not whole {_BLOCK}-value blocks")
    blocks = x.reshape(-1, _BLOCK)
    u = _uniform(x, seed).reshape(blocks.shape)
    if precision == "q8_0":  # gguf-py Q8_0: d = max|x| / 127, q = roundf(x / d)
        magnitude = np.abs(blocks)
        top = _block_reduce(magnitude, np.maximum)
        lo, hi, step = -top, top, top / np.float32(127)
        keep = magnitude == top
    else:  # Q4_1: d = (max - min) / 15, m = min, q = trunc((x - m) / d + 1/2)
        lo, hi = _block_reduce(blocks, np.minimum), _block_reduce(blocks, np.maximum)
        step = (hi - lo) / np.float32(15)
        keep = (blocks == lo) | (blocks == hi)
    moved = np.clip(blocks + (u - np.float32(0.5)) * step, lo, hi)
    moved[keep] = blocks[keep]
    return moved.reshape(x.shape)


def rounding_input(weight: np.ndarray, precision: str, rounding: str, seed: int) -> np.ndarray:
    """What gguf-py's round-to-nearest quantizer is handed for `weight` (float32 [..., in], the trainer's layout)
    at `precision` under `rounding`: the dithered array for "stochastic" on a STOCHASTIC_TYPES tensor, else
    `weight` itself. The GGUF exporter and the aligned forward both call this, so they round alike."""
    return dither(weight, precision, seed) if rounding == "stochastic" and precision in STOCHASTIC_TYPES else weight


def _block_reduce(blocks: np.ndarray, op: np.ufunc) -> np.ndarray:
    """op over each row of [n, 32] as a halving tree ([n, 1]): numpy's axis-1 reductions of 32 values are ~3x slower."""
    out = op(blocks[:, :16], blocks[:, 16:])
    while out.shape[1] > 1:
        half = out.shape[1] // 2
        out = op(out[:, :half], out[:, half:])
    return out


def _uniform(x: np.ndarray, seed: int) -> np.ndarray:
    """U[0, 1) float32 [x.size], a function of the run seed and x's bytes."""
    entropy = [int(seed), zlib.crc32(memoryview(x).cast("B"))]
    return np.random.default_rng(np.random.SeedSequence(entropy)).random(x.size, dtype=np.float32)
