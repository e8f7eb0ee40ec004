"""Checks of an engine's sampling distribution that go past the sampled token's log-prob (docs/diagnose.md).

The engine (mu, q) sampled the tokens; the reference (pi, p) is the trainer's model on the same token ids. Three
checks, each a pure function of tensors:

- `topk_bounds`: the engine returned its top-k log-probs at a position (a set S of ids with q_i known); the reference's
  whole distribution p is known. Coarse-graining onto the partition {{i} for i in S} + {S^c} gives, exactly,
      TV(p, q)   >= 1/2 (sum_{i in S} |p_i - q_i| + |q(S) - p(S)|)
      KL(q || p) >= sum_{i in S} q_i log(q_i / p_i) + (1 - q(S)) log((1 - q(S)) / (1 - p(S)))
  (data processing / the log-sum inequality), the best bounds that knowing q on S alone allows: both are attained
  when q's tail outside S is p's tail rescaled. KL(q || p) = KL(mu || pi) is what k1 / k3 estimate.
- `support_replay`: whether each sampled token lies in the kept set of the sampling transform the client claims
  (top-k / top-p of ops/logprobs.kept_set on logits / T) and how far outside it lies: for top-k the gap, in nats of
  scaled logit, below the k-th largest; for top-p the probability mass ranked above the token minus p.
- `temperature_fit_stats` / `fit_temperature`: the maximum-likelihood temperature of the sampled tokens under the
  reference's logits (kept set fixed at the claimed transform), from the log-likelihood, score and Fisher
  information summed at a grid of temperatures; a sampler that draws from the claimed distribution gives the
  claimed temperature within its standard error, whatever log-probs (raw or processed) it reports.

Shapes: n positions (the valid completion tokens of a batch, flattened), V the vocabulary, K the engine's listed
entries per position. Log-probs in nats. Everything is computed without grad; bounds in float64.
"""

from __future__ import annotations

import torch

from nearpolicy.ops.logprobs import kept_set
from nearpolicy.ops.masked import SAFETY_BOUND

# temperature / claimed temperature at which `temperature_fit_stats` evaluates the log-likelihood; 1.0 must be on it
TEMPERATURE_GRID = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 1.75, 2.0)
CHUNK = 128  # positions per vocabulary-wide float64 pass of the temperature fit


def _kl_term(a: torch.Tensor, log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """a log(a / b) elementwise, 0 where a == 0, the log-ratio clamped to +-SAFETY_BOUND (b == 0 counts 20 nats)."""
    ratio = (log_a - log_b).nan_to_num(nan=0.0, posinf=SAFETY_BOUND, neginf=-SAFETY_BOUND)
    return torch.where(a > 0, a * ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND), torch.zeros_like(a))


@torch.no_grad()
def topk_bounds(ref_logprobs: torch.Tensor, engine_ids: torch.Tensor, engine_logprobs: torch.Tensor,
                k: int) -> dict[str, torch.Tensor]:
    """Per-position lower bounds on TV(pi, mu), KL(mu || pi) and KL(pi || mu) from the engine's listed log-probs,
    with the top-k mass and rank agreement.

    ref_logprobs [n, V] float: the reference's log-probs under the same transform the engine's values are of (raw
    log softmax, or the sampling transform); engine_ids [n, K] int64 (-1 where absent), engine_logprobs [n, K]
    float (nats; -inf or NaN where absent or where the engine reports probability 0): distinct ids per row. `k`:
    the top-k the engine was asked for (the listed set may hold the sampled token besides). Returns float64 [n]
    tensors: tv_lower, kl_lower (KL(mu || pi)), kl_reverse_lower (KL(pi || mu)), engine_mass (q(S)), ref_mass (p(S)),
    listed (|S|), top1_agree (the engine's highest listed id is the reference's argmax, 0 / 1) and topk_overlap
    (fraction of the engine's k' = min(k, |S|) highest ids among the reference's k' highest; 1 where k' = 0).
    Formulas in the module docstring; an empty row gives 0 bounds."""
    ref = ref_logprobs.double()
    present = (engine_ids >= 0) & torch.isfinite(engine_logprobs)
    ids = torch.where(present, engine_ids, torch.zeros_like(engine_ids))
    absent = torch.full(ids.shape, -torch.inf, dtype=torch.float64)
    log_q = torch.where(present, engine_logprobs.double(), absent)
    log_p = torch.where(present, ref.gather(1, ids), absent)
    q, p = log_q.exp(), log_p.exp()
    mass_q, mass_p = q.sum(-1).clamp(max=1.0), p.sum(-1).clamp(max=1.0)
    tail_q, tail_p = (1 - mass_q).clamp_min(0), (1 - mass_p).clamp_min(0)
    tv = 0.5 * ((p - q).abs().sum(-1) + (mass_q - mass_p).abs())
    kl = _kl_term(q, log_q, log_p).sum(-1) + _kl_term(tail_q, tail_q.log(), tail_p.log())
    kl_rev = _kl_term(p, log_p, log_q).sum(-1) + _kl_term(tail_p, tail_p.log(), tail_q.log())
    listed = present.sum(-1)
    order = torch.argsort(log_q, dim=-1, descending=True)  # absent entries (-inf) last
    top_ids, top_present = ids.gather(1, order), present.gather(1, order)
    k_eff = listed.clamp(max=k)
    in_top = top_present & (torch.arange(ids.shape[1])[None, :] < k_eff[:, None])
    ref_top = torch.topk(ref, max(1, min(k, ids.shape[1], ref.shape[1])), dim=-1).values  # [n, k]
    threshold = ref_top.gather(1, (k_eff - 1).clamp_min(0)[:, None])  # the reference's k'-th largest log-prob
    overlap = (in_top & (ref.gather(1, top_ids) >= threshold)).sum(-1).double() / k_eff.clamp_min(1)
    top1 = (top_ids[:, 0] == ref.argmax(-1)) & top_present[:, 0]
    return {"tv_lower": tv, "kl_lower": kl, "kl_reverse_lower": kl_rev, "engine_mass": mass_q, "ref_mass": mass_p,
            "listed": listed.double(), "top1_agree": top1.double(),
            "topk_overlap": torch.where(k_eff > 0, overlap, torch.ones_like(overlap))}


@torch.no_grad()
def support_replay(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float, top_k: int,
                   top_p: float) -> dict[str, torch.Tensor]:
    """Whether each sampled token lies inside the kept set of the claimed transform, replayed on the reference's raw
    logits [n, V] (float) for token_ids [n] int64. Returns [n] tensors: `outside` (bool), `topk_gap` (float64, nats
    of scaled logit the token lies below the k-th largest; 0 when inside the top-k or top-k is off) and
    `topp_excess` (float64, probability mass of the top-k-renormalised distribution ranked strictly above the token,
    minus top_p; <= 0 inside the nucleus, 0 when top-p is off). All inside / zero when neither is on."""
    scaled = logits.float() / temperature  # the trainer's own dtype: its kept set is the one replayed
    n, vocab = scaled.shape
    zeros = torch.zeros(n, dtype=torch.float64)
    keep = kept_set(scaled, top_k, top_p)
    if keep is None:
        return {"outside": torch.zeros(n, dtype=torch.bool), "topk_gap": zeros, "topp_excess": zeros}
    picked = scaled.gather(1, token_ids[:, None]).squeeze(1)
    gap = zeros
    in_k = torch.ones_like(scaled, dtype=torch.bool)
    if 0 < top_k < vocab:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1]
        gap = (kth - picked).clamp_min(0).double()
        in_k = scaled >= kth[:, None]
    excess = zeros
    if top_p < 1.0:
        probs = torch.softmax(scaled.masked_fill(~in_k, -torch.inf).double(), dim=-1)
        excess = torch.where(scaled > picked[:, None], probs, torch.zeros_like(probs)).sum(-1) - top_p
    return {"outside": ~keep.gather(1, token_ids[:, None]).squeeze(1), "topk_gap": gap, "topp_excess": excess}


@torch.no_grad()
def temperature_fit_stats(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float, top_k: int = 0,
                          top_p: float = 1.0, grid: tuple[float, ...] = TEMPERATURE_GRID) -> torch.Tensor:
    """Sufficient statistics of the temperature fit: for each grid ratio g (temperature g x T, inverse beta_g =
    1 / (g T)), summed over the n positions, the log-likelihood sum_t [beta z_t(y_t) - logsumexp_kept(beta z_t)],
    its derivative in beta sum_t [z_t(y_t) - E_beta z_t] and the Fisher information sum_t Var_beta z_t, with z the
    raw logits [n, V] of the reference and y = token_ids [n]. The kept set is the claimed transform's (kept_set at
    `temperature`, top_k, top_p) plus the sampled token, the same at every grid point. Returns float64 [G, 3]
    (sums over positions, so micro-batches add up)."""
    out = torch.zeros(len(grid), 3, dtype=torch.float64)
    for rows in torch.split(torch.arange(logits.shape[0]), CHUNK):  # bounded memory: CHUNK x V float64 at a time
        z, ids = logits[rows].double(), token_ids[rows]
        keep = kept_set(logits[rows].float() / temperature, top_k, top_p)
        if keep is not None:
            z = z.masked_fill(~keep.scatter(1, ids[:, None], True), -torch.inf)
        z_y = z.gather(1, ids[:, None]).squeeze(1)
        z0 = torch.where(torch.isfinite(z), z, torch.zeros_like(z))
        for g, ratio in enumerate(grid):
            beta = 1.0 / (ratio * temperature)
            lse = torch.logsumexp(beta * z, dim=-1)
            probs = (beta * z - lse[:, None]).exp()
            mean = (probs * z0).sum(-1)
            var = (probs * (z0 - mean[:, None]).square()).sum(-1)
            out[g] += torch.stack([(beta * z_y - lse).sum(), (z_y - mean).sum(), var.sum()])
    return out


def fit_temperature(stats: torch.Tensor, temperature: float,
                    grid: tuple[float, ...] = TEMPERATURE_GRID) -> dict[str, torch.Tensor]:
    """The maximum-likelihood temperature from `temperature_fit_stats` (summed over every micro-batch): one Newton
    step in beta from the grid point of highest likelihood (the log-likelihood is concave in beta), kept inside the
    grid. Returns float64 scalars: `temperature` (the fit), `se` (its standard error, 1 / sqrt(information) / beta^2),
    `z` (the score test of the claimed temperature: score / sqrt(information) at ratio 1; about N(0, 1) when the
    tokens were drawn at the claimed temperature; positive when the sampler ran colder, negative when hotter) and
    `information` at the fit. Raises ValueError when 1.0 is not on the grid."""
    if 1.0 not in grid:
        raise ValueError("the temperature grid must hold the claimed temperature (ratio 1.0)")
    betas = torch.tensor([1.0 / (g * temperature) for g in grid], dtype=torch.float64)
    best = int(torch.argmax(stats[:, 0]))
    info = stats[best, 2].clamp_min(1e-12)
    beta = (betas[best] + stats[best, 1] / info).clamp(betas.min(), betas.max())
    claim = grid.index(1.0)
    z = stats[claim, 1] / stats[claim, 2].clamp_min(1e-12).sqrt()
    return {"temperature": 1.0 / beta, "se": info.rsqrt() / beta**2, "z": z, "information": info}
