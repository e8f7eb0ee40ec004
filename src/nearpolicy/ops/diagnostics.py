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
def sequence_mismatch_metrics(
    pi_logprobs: torch.Tensor, mu_logprobs: torch.Tensor, defined: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Sequence-level mismatch diagnostics (float64 scalars, detached), over sequences with >= 1 defined token
    (all zeros, ratio metrics 1, when there is none). pi = trainer (old_logprobs in decoupled mode), mu = engine.
    Per sequence i with n_i defined tokens: log_ppl_pi = -mean_t lp_pi, log_ppl_mu = -mean_t lp_mu,
      log_ppl_diff_i = mean_t lp_mu - mean_t lp_pi = log_ppl_pi - log_ppl_mu  (nats/token),
      ppl_ratio_i = exp(log_ppl_diff_i) = ppl_pi / ppl_mu = 1 / geometric-mean ratio,
      chi2_seq = mean_i exp(2 clamp(sum_t log r, +-20)) - 1, log r = lp_pi - lp_mu.
    Returns log_ppl_diff (mean, abs mean, max, min), ppl_ratio (mean), training_ppl / rollout_ppl (mean of
    per-sequence exp(log ppl)), chi2_seq, seqs. Source: verl compute_offpolicy_metrics (docs/math.md sec. 16)."""
    defined = defined.bool()
    pi = select(pi_logprobs.detach().double(), defined)
    mu = select(mu_logprobs.detach().double(), defined)
    n = defined.sum(-1).double()
    seq = n > 0
    mean_pi, mean_mu = pi.sum(-1) / n.clamp_min(1), mu.sum(-1) / n.clamp_min(1)
    diff = mean_mu - mean_pi
    log_r_sum = (pi - mu).sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    one = torch.ones((), dtype=torch.float64)
    count = seq.sum()
    m = lambda x: torch.where(seq, x, torch.zeros_like(x)).sum() / count.clamp_min(1)  # noqa: E731
    return {
        "log_ppl_diff": m(diff),
        "log_ppl_diff_abs": m(diff.abs()),
        "log_ppl_diff_max": torch.where(count > 0, select(diff, seq, fill=-torch.inf).max(), 0 * one),
        "log_ppl_diff_min": torch.where(count > 0, select(diff, seq, fill=torch.inf).min(), 0 * one),
        "ppl_ratio": torch.where(count > 0, m(diff.exp()), one),
        "training_ppl": torch.where(count > 0, m((-mean_pi).exp()), one),
        "rollout_ppl": torch.where(count > 0, m((-mean_mu).exp()), one),
        "chi2_seq": torch.where(count > 0, m((2 * log_r_sum).exp()) - 1, 0 * one),
        "seqs": count.double(),
    }


def fraction(indicator: torch.Tensor, mask: torch.Tensor, denominator: torch.Tensor | float | None = None) -> torch.Tensor:
    """Fraction of valid positions where a bool indicator [B, T] holds (clip / mask / rejection fractions);
    `denominator` overrides the count (a global token count, so micro-batch results add up)."""
    return masked_mean(indicator.double(), mask, denominator=denominator)


def mismatch_decomposition(logprobs: torch.Tensor, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                           defined: torch.Tensor) -> dict[str, torch.Tensor]:
    """Split log(pi_theta / mu) = log(pi_old / mu) + log(pi_theta / pi_old) into the numerical discrepancy
    (old_logprobs - rollout_logprobs: trainer vs engine at the same weights) and the policy lag (logprobs -
    old_logprobs: weights moved since sampling), with k3 KL and normalised ESS of each and of the total.
    All inputs [B, T] float (logprobs detached, the trainer when the token's mini-batch was trained);
    `defined` [B, T] bool. Returns float64 scalars: {discrepancy,lag,total}_{k3,ess}. docs/math.md sec. 17."""
    parts = {"discrepancy": (old_logprobs, rollout_logprobs), "lag": (logprobs, old_logprobs),
             "total": (logprobs, rollout_logprobs)}
    out = {}
    for name, (pi, mu) in parts.items():
        m = mismatch_metrics(pi, mu, defined)
        out[f"{name}_k3"], out[f"{name}_ess"] = m["k3"], m["ess"]
    return out


def lag_ess(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, defined: torch.Tensor,
            versions: torch.Tensor, version: int) -> torch.Tensor:
    """Normalised ESS (float64 scalar, in (0, 1]) of exp(old_logprobs - rollout_logprobs) over the stale tokens
    (versions [B, T] < `version`) of a batch ([B, T] inputs): the lag weights DLC watches (docs/math.md sec. 19).
    1 when no token is stale."""
    stale = defined.bool() & (versions < version)
    return mismatch_metrics(old_logprobs, rollout_logprobs, stale)["ess"]


def logprob_diff_quantiles(pi_logprobs: torch.Tensor, mu_logprobs: torch.Tensor, defined: torch.Tensor,
                           quantiles: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[str, torch.Tensor]:
    """Quantiles and max of |log pi - log mu| (nats) over defined tokens of [B, T] inputs, float64 scalars
    ("p50", "p90", "p99", "max"); zeros when no token is defined."""
    diff = (pi_logprobs.double() - mu_logprobs.double())[defined.bool()].abs()
    if diff.numel() == 0:
        diff = torch.zeros(1, dtype=torch.float64)
    q = torch.quantile(diff, torch.tensor(quantiles, dtype=torch.float64))
    return {f"p{round(100 * k):d}": v for k, v in zip(quantiles, q)} | {"max": diff.max()}


def mismatch_by_position(pi_logprobs: torch.Tensor, mu_logprobs: torch.Tensor, defined: torch.Tensor,
                         bucket: int) -> dict[str, torch.Tensor]:
    """How the mismatch grows with position in the response: token-mean k3 = mean(r - 1 - log r) and mean
    |log r| (r = pi / mu) per bucket of `bucket` response positions ([0, bucket), [bucket, 2 bucket), ...).
    Inputs [B, T]; returns float64 [K] tensors "start", "k3", "mean_abs_logprob_diff", "tokens" over buckets
    that hold at least one defined token."""
    defined = defined.bool()
    log_r = (select(pi_logprobs.double(), defined) - select(mu_logprobs.double(), defined)).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    starts, k3, mad, counts = [], [], [], []
    for start in range(0, defined.shape[1], bucket):
        cols = slice(start, start + bucket)
        n = defined[:, cols].sum()
        if n == 0:
            continue
        starts.append(float(start))
        k3.append(masked_mean(log_r[:, cols].exp() - 1 - log_r[:, cols], defined[:, cols]))
        mad.append(masked_mean(log_r[:, cols].abs(), defined[:, cols]))
        counts.append(n.double())
    as_tensor = lambda xs: torch.stack(xs) if xs else torch.zeros(0, dtype=torch.float64)  # noqa: E731
    return {"start": torch.tensor(starts, dtype=torch.float64), "k3": as_tensor(k3),
            "mean_abs_logprob_diff": as_tensor(mad), "tokens": as_tensor(counts)}


def sequence_ess(pi_logprobs: torch.Tensor, mu_logprobs: torch.Tensor, defined: torch.Tensor) -> torch.Tensor:
    """Normalised ESS (sum w)^2 / (n sum w^2) of the sequence weights w_i = prod_t pi / mu over sequences with a
    defined token (inputs [B, T]); computed with log-sum-exp so long sequences do not overflow. 1 when fewer
    than one such sequence."""
    defined = defined.bool()
    log_w = (select(pi_logprobs.double(), defined) - select(mu_logprobs.double(), defined)).sum(-1)
    log_w = log_w[defined.any(-1)]
    if log_w.numel() == 0:
        return torch.ones((), dtype=torch.float64)
    return (2 * torch.logsumexp(log_w, 0) - torch.logsumexp(2 * log_w, 0)).exp() / log_w.numel()


def k3_standard_error(pi_logprobs: torch.Tensor, mu_logprobs: torch.Tensor, defined: torch.Tensor) -> torch.Tensor:
    """Standard error (nats / token, float64) of the token-mean k3 over [B, T] inputs, with sequences as clusters
    (tokens of one response are not independent): with S_i the sum of k3 terms and n_i the tokens of sequence i,
    k3 = sum S / sum n and se = sqrt(m / (m - 1) * sum_i (S_i - k3 n_i)^2) / sum n over the m sequences with a
    defined token (the ratio-estimator variance). 0 with fewer than two such sequences."""
    defined = defined.bool()
    log_r = (select(pi_logprobs.double(), defined) - select(mu_logprobs.double(), defined)).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    terms = select(log_r.exp() - 1 - log_r, defined)
    rows = defined.any(-1)
    sums, counts = terms.sum(-1)[rows], defined.sum(-1)[rows].double()
    m = sums.numel()
    if m < 2:
        return torch.zeros((), dtype=torch.float64)
    k3 = sums.sum() / counts.sum()
    return (m / (m - 1) * ((sums - k3 * counts) ** 2).sum()).sqrt() / counts.sum()
