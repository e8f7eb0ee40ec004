"""Mismatch diagnostics between the engine (mu, samples drawn from it) and the trainer (pi). All inputs
[B, T]; `defined` marks valid tokens that have an engine log-prob. Returns detached scalar tensors.

With log r = logprobs_pi - logprobs_mu on tokens sampled from mu (Schulman 2020, "Approximating KL
divergence"): k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r, each averaged over tokens, estimate
KL(mu || pi) in nats. Normalised ESS = (sum w)^2 / (n sum w^2) with w = r (in (0, 1]; `normalized_ess`, the one
ESS of the library: token, lag, sequence and AIS reliability all call it); chi2 = mean(w^2) - 1. Per sequence
(`sequence_mismatch_metrics`, verl's rollout_corr family): log-perplexities, their difference d = log PPL_pi -
log PPL_mu = mean log mu - mean log pi, the perplexity ratio exp(d) and chi2 of the sequence weight prod_t w."""

from __future__ import annotations

import math

import torch

from nearpolicy.ops.masked import SAFETY_BOUND, clamped_exp, masked_max, masked_mean, masked_min, select


def normalized_ess(log_weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The one normalised effective sample size: (sum w)^2 / (n sum w^2) of w = exp(log_weights) over the n
    positions where `mask` holds (any shape, the same for both), in (0, 1]; 1 when n = 0. Computed in float64 on
    the weights divided by the largest, so sequence log-weights (sums over many tokens) do not overflow; the
    caller clamps token log-weights (+-20) where its definition does. Detached float64 scalar."""
    mask = mask.bool()
    lw = select(log_weights.detach().double(), mask, fill=-math.inf).flatten()
    n = mask.sum()
    peak = lw.max() if lw.numel() else lw.new_zeros(())
    w = (lw - torch.where(torch.isfinite(peak), peak, 0.0)).exp()  # largest weight exactly 1: no overflow, and
    ess = w.sum() ** 2 / (n.clamp_min(1) * (w * w).sum().clamp_min(1e-300))  # equal weights give exactly 1
    return torch.where(n > 0, ess, torch.ones((), dtype=torch.float64))


def mismatch_metrics(pi_logprobs: torch.Tensor, mu_logprobs: torch.Tensor, defined: torch.Tensor) -> dict[str, torch.Tensor]:
    """Token-level KL(mu || pi) estimators, ESS, chi-square, max |delta log p|, probability correlation and
    the fraction of ratios outside [0.5, 2]. Computed in float64. An empty `defined` mask gives zeros
    (ESS 1, correlation 1)."""
    defined = defined.bool()
    log_r = (select(pi_logprobs.double(), defined) - select(mu_logprobs.double(), defined)).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    w = log_r.exp()
    n = defined.sum()
    return {
        "k1": masked_mean(-log_r, defined),
        "k2": masked_mean(0.5 * log_r**2, defined),
        "k3": masked_mean(w - 1 - log_r, defined),
        "chi2": masked_mean(w * w, defined) - torch.where(n > 0, 1.0, 0.0),
        "ess": normalized_ess(log_r, defined),
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
    log_r = select(old_logprobs.double(), stale) - select(rollout_logprobs.double(), stale)
    return normalized_ess(log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND), stale)


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
    return normalized_ess(log_w, defined.any(-1))


def sequence_mismatch_metrics(pi_logprobs: torch.Tensor, mu_logprobs: torch.Tensor,
                              defined: torch.Tensor) -> dict[str, torch.Tensor]:
    """verl's per-sequence perplexity family (rollout_corr metrics of `compute_offpolicy_metrics`, verl
    trainer/ppo/rollout_corr_helper.py), docs/math.md sec. 22. pi_logprobs: the trainer's (`old_logprobs`),
    mu_logprobs: the engine's (`rollout_logprobs`, NaN where undefined: never read), both [B, T] float (nats);
    `defined` [B, T] bool. Per sequence i with n_i > 0 defined tokens, log PPL_i = -mean_t log p (nats / token) and

        d_i = log PPL_pi,i - log PPL_mu,i = mean_t log mu - mean_t log pi      (> 0: the trainer is more surprised)

    Returns detached float64 scalars, means over the non-empty sequences (each one vote, whatever its length):
    seq_{training,rollout}_ppl = mean exp(log PPL_i), seq_{training,rollout}_log_ppl = mean log PPL_i,
    seq_log_ppl_diff = mean d_i, seq_log_ppl_abs_diff = mean |d_i|, seq_log_ppl_diff_{max,min}, seq_ppl_ratio =
    mean exp(d_i) (d_i clamped to +-20), seq_chi2 = mean exp(2 clamp(sum_t log pi/mu, +-20)) - 1; seq_count (non-empty
    sequences) and seq_empty_count (rows without a defined token: left out of every mean). With no non-empty
    sequence the log quantities are 0 and the perplexities and ratio 1."""
    defined = defined.bool()
    tokens = defined.sum(-1)
    rows = tokens > 0
    pi = select(pi_logprobs.detach().double(), defined)
    mu = select(mu_logprobs.detach().double(), defined)
    per_token = tokens.clamp_min(1).double()
    training_log_ppl, rollout_log_ppl = -pi.sum(-1) / per_token, -mu.sum(-1) / per_token  # [B]
    diff = training_log_ppl - rollout_log_ppl
    seq_log_ratio = (pi - mu).sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    mean = lambda values: masked_mean(values, rows)  # noqa: E731
    any_row = rows.any()
    one = lambda value: torch.where(any_row, value, torch.ones((), dtype=torch.float64))  # noqa: E731
    return {
        "seq_training_ppl": one(mean(training_log_ppl.exp())), "seq_rollout_ppl": one(mean(rollout_log_ppl.exp())),
        "seq_training_log_ppl": mean(training_log_ppl), "seq_rollout_log_ppl": mean(rollout_log_ppl),
        "seq_log_ppl_diff": mean(diff), "seq_log_ppl_abs_diff": mean(diff.abs()),
        "seq_log_ppl_diff_max": masked_max(diff, rows), "seq_log_ppl_diff_min": masked_min(diff, rows),
        "seq_ppl_ratio": one(mean(clamped_exp(diff))),
        "seq_chi2": mean((2 * seq_log_ratio).exp()) - any_row.double(),
        "seq_count": rows.sum().double(), "seq_empty_count": (~rows).sum().double(),
    }


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


def mismatch_by_turn(pi_logprobs: torch.Tensor, mu_logprobs: torch.Tensor, defined: torch.Tensor,
                     turn_index: torch.Tensor) -> dict[int, dict[str, torch.Tensor]]:
    """Token-mean k3 = mean(r - 1 - log r) (r = pi / mu, nats / token) and the token count per turn of a
    multi-turn episode batch: {turn k: {"k3", "tokens"}} over the turns with a defined token. Inputs [B, T];
    turn_index [B, T] int64 (-1 at padding); `defined` [B, T] bool (the model's tokens with an engine log-prob, so
    tool and template tokens are left out). Float64 scalars; values at undefined positions (NaN, inf) are never
    read. The estimator is the module's k3 (Schulman 2020), taken over each turn's tokens."""
    defined = defined.bool()
    log_r = (select(pi_logprobs.double(), defined) - select(mu_logprobs.double(), defined)).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    out = {}
    for k in torch.unique(turn_index[defined]).tolist():
        cell = defined & (turn_index == k)
        out[int(k)] = {"k3": masked_mean(log_r.exp() - 1 - log_r, cell), "tokens": cell.sum().double()}
    return out
