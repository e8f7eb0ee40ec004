"""The sampling transform, engine side, in numpy float64 (same definition as ops/logprobs.py).

log pi(y) = log_softmax(s masked to the kept set)[y], s = logits / T; kept set = top-k (s >= k-th largest)
intersected with top-p (exclusive cumulative probability, sorted descending, < p)."""

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


def sample_rows(logits: np.ndarray, sampling: SamplingParams, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Sample one token per row. logits [N, V] -> (ids [N] int64, log-probs [N] float64, nats)."""
    if sampling.top_k == 0 and sampling.top_p >= 1.0:
        s = logits.astype(np.float64) / sampling.temperature
        m = s.max(axis=1, keepdims=True)
        logp = s - (m + np.log(np.exp(s - m).sum(axis=1, keepdims=True)))
    else:
        logp = np.stack([transformed_log_softmax(row, sampling) for row in logits])
    ids = np.argmax(logp + rng.gumbel(size=logp.shape), axis=1)
    return ids, logp[np.arange(len(ids)), ids]
