"""The sampling transform, engine side, in numpy float64 (same definition as ops/logprobs.py).

log pi(y) = log_softmax(s masked to the kept set)[y], s = logits / T; kept set = top-k (s >= k-th largest)
intersected with top-p (exclusive cumulative probability, sorted descending, < p).

An injected mismatch of known size (config engine.logit_noise, the correction arena's dose): `sample_rows` with
`logit_noise` = sigma > 0 draws each token from the transform of l + sigma z (z ~ N(0, I) over the vocabulary, fresh
for every row and step, from the engine's seeded generator) and returns the log-prob under that noisy distribution,
so the engine's reported mu is exactly what it sampled from while the trainer's pi uses the clean logits l. For
small sigma at T = 1 without top-k / top-p, E_z KL(mu || pi) = sigma^2 / 2 (1 - sum_i p_i^2) + O(sigma^4)
(docs/arena.md): about sigma^2 / 2 on a flat distribution, less on a peaked one."""

from __future__ import annotations

import numpy as np

from nearpolicy.types import SamplingParams


def transformed_log_softmax(logits: np.ndarray, sampling: SamplingParams) -> np.ndarray:
    """logits [V] float -> log-probs [V] float64, -inf outside the kept set."""
    s = logits.astype(np.float64) / sampling.temperature
    vocab = s.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = np.partition(s, vocab - sampling.top_k)[vocab - sampling.top_k]
        s = np.where(s >= kth, s, -np.inf)
    logp = s - _logsumexp(s)
    if sampling.top_p < 1.0:
        order = np.argsort(-logp, kind="stable")
        sorted_p = np.exp(logp[order])
        exclusive = np.cumsum(sorted_p) - sorted_p
        drop = order[exclusive >= sampling.top_p]
        s = s.copy()
        s[drop] = -np.inf
        logp = s - _logsumexp(s)
    return logp


def _logsumexp(x: np.ndarray) -> float:
    m = np.max(x)
    return float(m + np.log(np.sum(np.exp(x - m))))


def perturb_logits(logits: np.ndarray, std: float, rng: np.random.Generator) -> np.ndarray:
    """logits [N, V] -> logits + std * z [N, V] float64, z ~ N(0, 1) drawn from `rng` (std in logit units, >= 0;
    std = 0 returns the logits as float64 and draws nothing). Raises ValueError for a negative or non-finite std."""
    if not (np.isfinite(std) and std >= 0):
        raise ValueError(f"logit noise std must be a finite number >= 0, got {std!r}")
    base = np.asarray(logits, np.float64)
    return base if std == 0 else base + std * rng.standard_normal(base.shape)


def sample_rows(logits: np.ndarray, sampling: SamplingParams, rng: np.random.Generator,
                logit_noise: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Sample one token per row. logits [N, V] float32 -> (ids [N] int64, log-probs [N] float64, nats).

    logit_noise > 0: sample from the transform of the perturbed logits (perturb_logits, drawn from `rng` before the
    uniforms) and return the log-prob under it (module docstring); 0 draws exactly what it drew before the option.
    Inverse-CDF sampling: one uniform per row against the cumulative probabilities. A Gumbel-max draw needs N x V
    random numbers, which cost more than the model's decode step at V = 49152 (bench/, docs/benchmarks.md).
    Without top-k / top-p the cumulative sums are two-level (`_sample_full_vocabulary`)."""
    if logit_noise:
        logits = perturb_logits(logits, logit_noise, rng)
    if sampling.top_k == 0 and sampling.top_p >= 1.0:
        return _sample_full_vocabulary(logits, sampling.temperature, rng)
    logp = np.stack([transformed_log_softmax(row, sampling) for row in logits])
    cdf = np.cumsum(np.exp(logp), axis=1)
    u = rng.random(len(logp)) * cdf[:, -1]
    ids = np.minimum([np.searchsorted(row, x, side="right") for row, x in zip(cdf, u)], logp.shape[1] - 1)
    ids = np.asarray(ids, np.int64)
    return ids, logp[np.arange(len(ids)), ids]


BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF


def _sample_full_vocabulary(logits: np.ndarray, temperature: float,
                            rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """sample_rows without top-k / top-p: logits [N, V] -> (ids [N] int64, log-probs [N] float64).

    exp in float32 of s - m (s = l / T, m its row max; float32 logits at T = 1 are subtracted in float32, anything
    else in float64, so the rounding is relative to s - m, small where the mass is, not to |s|), sums in float64,
    two-level inverse CDF: u * Z is located among the V / 256 block sums, then inside one block, instead of a
    float64 exp and cumsum over all V: 0.42x the time at N = 32, V = 49152 (bench/sampling_cost.py). The log-prob
    is s_y - m - log Z with s_y in float64: within 2e-7 nats of transformed_log_softmax's at any T
    (tests/test_sampling.py); the same uniform per row, so the same ids but where u * Z falls within that rounding
    of a boundary. Never a token of probability 0: where u * Z lands between a block's float64 cumsum and its
    (pairwise) block sum, the block's last token with mass is drawn."""
    x = np.asarray(logits)
    if temperature == 1.0 and x.dtype == np.float32:
        m = x.max(axis=1, keepdims=True)
        p = np.exp(x - m)  # float32 [N, V], max entry 1
    else:
        m = x.max(axis=1, keepdims=True).astype(np.float64) / temperature  # = max of s (rounding is monotone)
        s = x.astype(np.float64)
        s /= temperature
        s -= m
        p = np.exp(s.astype(np.float32))
    rows, vocab = x.shape
    starts = np.arange(0, vocab, BLOCK)
    whole = vocab - vocab % BLOCK
    sums = p[:, :whole].reshape(rows, -1, BLOCK).sum(axis=2, dtype=np.float64)  # reduceat is 2-5x slower
    if whole < vocab:
        sums = np.concatenate([sums, p[:, whole:].sum(axis=1, dtype=np.float64)[:, None]], axis=1)
    block_cdf = np.cumsum(sums, axis=1)  # [N, ceil(V / 256)]
    total = block_cdf[:, -1]
    u = rng.random(rows) * total  # the one uniform per row the single-level sampler drew
    ids = np.empty(rows, np.int64)
    for r in range(rows):
        b = min(int(np.searchsorted(block_cdf[r], u[r], side="right")), len(starts) - 1)
        lo, hi = starts[b], min(starts[b] + BLOCK, vocab)
        before = block_cdf[r, b - 1] if b else 0.0
        inside = before + np.cumsum(p[r, lo:hi], dtype=np.float64)
        j = int(np.searchsorted(inside, u[r], side="right"))
        if j == hi - lo:  # past the cumsum's end, still below the block sum: rounding; the block has mass (sums > 0)
            j = int(np.flatnonzero(p[r, lo:hi])[-1])
        ids[r] = lo + j
    chosen = x[np.arange(rows), ids].astype(np.float64) / temperature
    return ids, chosen - (m[:, 0].astype(np.float64) + np.log(total))
