"""Cost of the engine-side sampler (engines/sampling.sample_rows, no top-k / top-p): the two-level float32 inverse
CDF against the single-level float64 one it replaced (kept here as the reference), paired draws on the same logits,
one thread, N = 32 rows (the main job's batch), V = 49152 (SmolLM2). Prints the medians and the paired ratio, and
checks both draw the same ids with log-probs within 1e-6 nats.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sampling_cost.py [--rows 32] [--repeats 40]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from nearpolicy.engines.sampling import sample_rows
from nearpolicy.types import SamplingParams


def single_level_float64(logits: np.ndarray, temperature: float, rng: np.random.Generator):
    """The previous sampler: float64 exp and cumsum over the whole vocabulary."""
    s = np.asarray(logits, np.float64) / temperature
    m = s.max(axis=1, keepdims=True)
    cdf = np.cumsum(np.exp(s - m), axis=1)
    total = cdf[:, -1]
    u = rng.random(len(s)) * total
    ids = np.minimum([np.searchsorted(row, x, side="right") for row, x in zip(cdf, u)], s.shape[1] - 1)
    ids = np.asarray(ids, np.int64)
    return ids, s[np.arange(len(ids)), ids] - (m[:, 0] + np.log(total))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    logits = (np.random.default_rng(0).standard_normal((args.rows, args.vocab)) * 3).astype(np.float32)
    old, new = [], []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        ref = single_level_float64(logits, 1.0, np.random.default_rng(i))
        t1 = time.perf_counter()
        got = sample_rows(logits, SamplingParams(), np.random.default_rng(i))
        t2 = time.perf_counter()
        old.append(t1 - t0)
        new.append(t2 - t1)
        assert (ref[0] == got[0]).all() and np.abs(ref[1] - got[1]).max() < 1e-6
    ratio = np.median(np.array(new) / np.array(old))
    print(f"rows {args.rows}, vocab {args.vocab}: single-level float64 {np.median(old) * 1e3:.2f} ms, "
          f"two-level {np.median(new) * 1e3:.2f} ms, paired ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
