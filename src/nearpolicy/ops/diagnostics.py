"""Mismatch diagnostics between the engine (mu, samples drawn from it) and the trainer (pi). All inputs
[B, T]; `defined` marks valid tokens that have an engine log-prob. Returns detached scalar tensors.

With log r = logprobs_pi - logprobs_mu on tokens sampled from mu (Schulman 2020, "Approximating KL
divergence"): k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r, each averaged over tokens, estimate
KL(mu || pi) in nats. Normalised ESS = (sum w)^2 / (n sum w^2) with w = r (in (0, 1]); chi2 = mean(w^2) - 1."""

from __future__ import annotations

import torch

from nearpolicy.ops.masked import SAFETY_BOUND, masked_max, masked_mean, select


def mismatch_metrics(pi_logprobs: torch.Tensor, mu_logprobs: torch.Tensor, defined: torch.Tensor) -> dict[str, torch.Tensor]:
    """Token-level KL(mu || pi) estimators, ESS, chi-square, max |delta log p|, probability correlation and
    the fraction of ratios outside [0.5, 2]. Computed in float64. An empty `defined` mask gives zeros
    (ESS 1, correlation 1)."""
    defined = defined.bool()
    log_r = (select(pi_logprobs.double(), defined) - select(mu_logprobs.double(), defined)).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    w = log_r.exp()
    n = defined.sum()
    sum_w = select(w, defined).sum()
    sum_w2 = select(w * w, defined).sum()
    ess = torch.where(n > 0, sum_w**2 / (n * sum_w2).clamp_min(1e-300), torch.ones((), dtype=w.dtype))
    return {
        "k1": masked_mean(-log_r, defined),
        "k2": masked_mean(0.5 * log_r**2, defined),
        "k3": masked_mean(w - 1 - log_r, defined),
        "chi2": masked_mean(w * w, defined) - torch.where(n > 0, 1.0, 0.0),
        "ess": ess,
        "max_abs_logprob_diff": masked_max(log_r.abs(), defined),
        "mean_abs_logprob_diff": masked_mean(log_r.abs(), defined),
        "prob_corr": probability_correlation(pi_logprobs, mu_logprobs, defined),
        "frac_ratio_outside_0.5_2": masked_mean(((w < 0.5) | (w > 2.0)).double(), defined),
        "tokens": n.double(),
    }


def probability_correlation(a_logprobs: torch.Tensor, b_logprobs: torch.Tensor, defined: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of exp(a) and exp(b) over defined tokens; 1 when either side has no variance
    and the two are identical, 0 when fewer than 2 tokens."""
    defined = defined.bool()
    a = a_logprobs.double()[defined].exp()
    b = b_logprobs.double()[defined].exp()
    if a.numel() < 2:
        return torch.zeros((), dtype=torch.float64)
    da, db = a - a.mean(), b - b.mean()
    denom = (da.square().sum() * db.square().sum()).sqrt()
    if denom <= 0:
        return torch.ones((), dtype=torch.float64) if torch.equal(a, b) else torch.zeros((), dtype=torch.float64)
    return (da * db).sum() / denom


def sequence_stats(values: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean and max of a per-token quantity [B, T] over valid tokens."""
    return {"mean": masked_mean(values, mask), "max": masked_max(values, mask)}
