"""XRPO (eXplore-eXploit GRPO, Bamba et al., arXiv:2510.06672): its two pure-math pieces (docs/math.md sec. 26).

1. Novelty-aware advantage sharpening (exploitation). Log-probs: `logprobs` are the sampling policy's per-token
   log-probs of the response (nats; the trainer's old_logprobs or the engine's rollout_logprobs), detached. The
   sequence score is their mean over the response, s_i = (1/|y_i|) sum_t log pi(y_i,t | x, y_i,<t); the novelty
   eta_i = exp(s_i - mean_g s) compares it with its group's mean (log-ratio clamped to +-20 nats); a response with a
   positive advantage gains A_i+ = A_i + min(max(lambda (1 - eta_i), 0), kappa A_i): the less likely a correct
   response is than its group's average, the larger the gain, at most kappa A_i. Advantages <= 0 are unchanged.
2. The rollout allocator (exploration). For a prompt q with n_q >= 2 scored rollouts of sample std s_q, the
   uncertainty of its mean reward is the Student-t half-width h_q(n) = t_{1-alpha/2, n-1} s_q / sqrt(n); one more
   rollout is worth its expected reduction h_q(n_q) - h_q(n_q + 1) (s_q held at its estimate) plus an exploration
   bonus lambda sqrt(ln(1 + T) / n_q) at training step T. A budget of extra rollouts is given one at a time to the
   prompt of highest priority, which is then recomputed at n_q + 1 (greedy).

The forms come from a third-party reimplementation's summary of the paper (grpo-composer) and a review's quotation of
the half-width; the paper's own text was not read here, so treat constants and group-mean conventions as a
reconstruction (docs/math.md sec. 26). Wired by [xrpo] (config/xrpo.py): the sharpening in the advantage phase
(training/phases.novelty_sharpening), the allocator and the in-context seeding in rollouts/allocation.py."""

from __future__ import annotations

import math

import torch

from nearpolicy.ops.masked import SAFETY_BOUND
from nearpolicy.registry import Registry

ADVANTAGE_TRANSFORMS: Registry = Registry("advantage transform")
ROLLOUT_ALLOCATORS: Registry = Registry("rollout allocator")


def sequence_scores(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Length-normalised sequence log-likelihood s_i [B] float64 (nats per token): the mean of logprobs [B, T] over
    the valid tokens of mask [B, T] bool; NaN for a row without a valid token (it gets no sharpening)."""
    mask = mask.bool()
    total = torch.where(mask, logprobs.detach().double(), torch.zeros_like(logprobs, dtype=torch.float64)).sum(-1)
    count = mask.sum(-1)
    return torch.where(count > 0, total / count.clamp_min(1), torch.full_like(total, float("nan")))


@ADVANTAGE_TRANSFORMS.register("xrpo_novelty", summary="A > 0 gains min(max(lambda (1 - exp(s - group mean s)), 0), "
                               "kappa A), s = mean token log-prob: rare correct responses weigh more",
                               source="XRPO arXiv:2510.06672 (novelty-guided advantage sharpening; form from a "
                                      "third-party summary, docs/math.md sec. 26)")
def novelty_sharpened_advantages(advantages: torch.Tensor, scores: torch.Tensor, group_ids: torch.Tensor,
                                 novelty_lambda: float, kappa: float) -> torch.Tensor:
    """A_i+ = A_i + min(max(lambda (1 - eta_i), 0), kappa A_i) where A_i > 0, else A_i; eta_i = exp(s_i - sbar_g).

    advantages [N] float (any estimator's), scores [N] float (sequence_scores; NaN = unavailable, left out of its
    group's mean and not sharpened), group_ids [N] int -> [N] in the advantages' dtype. sbar_g is the mean score of
    the group's members with a finite score, so a singleton gets eta = 1 and no gain. Raises ValueError for a
    negative lambda or kappa."""
    if novelty_lambda < 0 or kappa < 0:
        raise ValueError(f"novelty_lambda and kappa must be >= 0, got {novelty_lambda}, {kappa}")
    s = scores.double()
    finite = torch.isfinite(s)
    s0 = torch.where(finite, s, torch.zeros_like(s))
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, finite.double())
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, s0)
    mean = (total / count.clamp_min(1))[inverse]
    eta = torch.exp((s0 - mean).clamp(-SAFETY_BOUND, SAFETY_BOUND))
    a = advantages.double()
    gain = torch.minimum((novelty_lambda * (1 - eta)).clamp_min(0), kappa * a)
    return torch.where((a > 0) & finite, a + gain, a).to(advantages.dtype)


def t_quantile(p: float, df: int) -> float:
    """Student-t quantile t_{p, df} for 0.5 <= p < 1 and an integer df >= 1, by bisection on the exact finite-series
    CDF of Abramowitz & Stegun 26.7.3-4 (P(|T| <= t) in theta = atan(t / sqrt(df))). Raises ValueError outside."""
    if not 0.5 <= p < 1 or df < 1:
        raise ValueError(f"need 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    target = 2 * p - 1

    def two_sided(t: float) -> float:
        theta = math.atan(t / math.sqrt(df))
        c, s = math.cos(theta), math.sin(theta)
        term = total = c if df % 2 else 1.0
        for k in range(3 if df % 2 else 2, df - 1, 2):
            term *= c * c * (k - 1) / k
            total += term
        if df % 2 == 0:
            return s * total
        return 2 / math.pi * (theta + (s * total if df > 1 else 0.0))

    lo, hi = 0.0, 1.0
    while two_sided(hi) < target:
        lo, hi = hi, 2 * hi
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if two_sided(mid) < target else (lo, mid)
    return (lo + hi) / 2


def half_width(std: float, n: int, alpha: float) -> float:
    """h(n) = t_{1-alpha/2, n-1} std / sqrt(n): the half-width of the Student-t confidence interval of a mean
    reward from n >= 2 rollouts of sample std `std` (reward units). Raises ValueError for n < 2."""
    if n < 2:
        raise ValueError(f"a confidence half-width needs n >= 2 rollouts, got {n}")
    return t_quantile(1 - alpha / 2, n - 1) * std / math.sqrt(n)


@ROLLOUT_ALLOCATORS.register("xrpo", summary="priority = t-interval half-width reduction of one more rollout + "
                             "lambda sqrt(ln(1 + T) / n); a budget goes greedily to the top priority",
                             source="XRPO arXiv:2510.06672 (hierarchical rollout planning; form from a third-party "
                                    "summary, docs/math.md sec. 26)")
def allocation_priority(std: torch.Tensor, n: torch.Tensor, step: int, alpha: float,
                        explore_lambda: float) -> torch.Tensor:
    """Pi_q = h_q(n_q) - h_q(n_q + 1) + explore_lambda sqrt(ln(1 + step) / n_q) [Q] float64: std [Q] float (sample
    std of prompt q's rewards), n [Q] int (its rollouts so far, each >= 2), step >= 0. Raises ValueError for
    n < 2, alpha outside (0, 1) or a negative step or lambda."""
    if not 0 < alpha < 1 or step < 0 or explore_lambda < 0:
        raise ValueError(f"need 0 < alpha < 1, step >= 0, explore_lambda >= 0; got {alpha}, {step}, {explore_lambda}")
    out = [half_width(s, k, alpha) - half_width(s, k + 1, alpha) + explore_lambda * math.sqrt(math.log1p(step) / k)
           for s, k in zip(std.double().tolist(), n.long().tolist())]
    return torch.tensor(out, dtype=torch.float64)


def allocate_rollouts(std: torch.Tensor, n: torch.Tensor, budget: int, step: int, alpha: float = 0.05,
                      explore_lambda: float = 0.0) -> torch.Tensor:
    """Extra rollouts per prompt [Q] int64 summing to `budget` >= 0: each unit goes to the prompt of highest
    allocation_priority (ties to the lowest index), whose priority is then recomputed at n_q + 1 with its std
    unchanged. std [Q], n [Q] as allocation_priority. Raises ValueError for a negative budget."""
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    counts = n.long().clone()
    priority = allocation_priority(std, counts, step, alpha, explore_lambda)
    for _ in range(budget):
        q = int(torch.argmax(priority))  # first maximum on ties
        counts[q] += 1
        priority[q] = allocation_priority(std[q : q + 1], counts[q : q + 1], step, alpha, explore_lambda)[0]
    return counts - n.long()


def prompt_reward_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]:
    """Per group, in ascending group id: (ids [G] int64, sample std [G] float64 (unbiased; 0 for one member),
    scorable count [G] int64) over the finite rewards [N] of group_ids [N] -- the allocator's inputs."""
    finite = torch.isfinite(rewards)
    ids, inverse = torch.unique(group_ids, return_inverse=True)
    r = torch.where(finite, rewards.double(), torch.zeros_like(rewards, dtype=torch.float64))
    count = torch.zeros(ids.numel(), dtype=torch.float64).index_add_(0, inverse, finite.double())
    mean = torch.zeros(ids.numel(), dtype=torch.float64).index_add_(0, inverse, r) / count.clamp_min(1)
    dev = torch.where(finite, r - mean[inverse], torch.zeros_like(r))
    sq = torch.zeros(ids.numel(), dtype=torch.float64).index_add_(0, inverse, dev * dev)
    return ids.long(), (sq / (count - 1).clamp_min(1)).sqrt(), count.long()
