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
    random numbers, which cost more than the model's decode step at V = 49152 (bench/, docs/benchmarks.md)."""
    if logit_noise:
        logits = perturb_logits(logits, logit_noise, rng)
    if sampling.top_k == 0 and sampling.top_p >= 1.0:
        s = np.asarray(logits, np.float64) / sampling.temperature  # float64 throughout, as score() computes it
        m = s.max(axis=1, keepdims=True)
        cdf = np.cumsum(np.exp(s - m), axis=1)
        total = cdf[:, -1]
        log_z = m[:, 0] + np.log(total)
        u = rng.random(len(s)) * total
        ids = np.array([np.searchsorted(row, x, side="right") for row, x in zip(cdf, u)], np.int64)
        ids = np.minimum(ids, s.shape[1] - 1)
        return ids, s[np.arange(len(ids)), ids] - log_z
    logp = np.stack([transformed_log_softmax(row, sampling) for row in logits])
    cdf = np.cumsum(np.exp(logp), axis=1)
    u = rng.random(len(logp)) * cdf[:, -1]
    ids = np.minimum([np.searchsorted(row, x, side="right") for row, x in zip(cdf, u)], logp.shape[1] - 1)
    ids = np.asarray(ids, np.int64)
    return ids, logp[np.arange(len(ids)), ids]
