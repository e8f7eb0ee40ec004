"""Advantage estimators for outcome rewards. One signature: (rewards [N] float, group_ids [N] int) ->
AdvantageResult(advantages [N] float, one scalar per sequence, broadcast over its tokens by the loss; keep [N]
bool, False for a sample left out of the gradient, e.g. MC-GRPO's pivot, all True for the other estimators).

Normalisation is per group id (never batch-wide). Unscorable rewards (NaN) get advantage 0 and are left out
of their group's statistics; singleton and constant groups give 0 (invariant 6)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nearpolicy.registry import Registry

STD_FLOOR = 1e-6  # a group scale (std, MAD) at or below this is not divided by (invariant 6)
# Estimators whose baseline is the sample's own group: a group of one gives every sample advantage 0, so
# algorithm.group_size = 1 trains on nothing (refused by config/checks.py; tests hold the set to the registry).
GROUP_RELATIVE = frozenset({"grpo", "dr_grpo", "rloo", "mc_grpo", "mc_grpo_mad", "mc_grpo_released"})


@dataclass(frozen=True)
class AdvantageResult:
    """What every registered estimator returns: advantages [N] (dtype of the rewards); keep [N] bool, False for
    samples excluded from the gradient (MC-GRPO's pivot). The caller ANDs `keep` into the response mask *before*
    counting loss denominators, so an excluded sample's tokens count in neither numerator nor denominator."""

    advantages: torch.Tensor
    keep: torch.Tensor


AdvantageFn = Callable[[torch.Tensor, torch.Tensor], AdvantageResult]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence (group mean, group unbiased std, group size) over the scorable members of its group."""
    scorable = torch.isfinite(rewards)
    r = torch.where(scorable, rewards, torch.zeros_like(rewards)).double()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, scorable.double())
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, r)
    mean = total / count.clamp_min(1)
    dev = torch.where(scorable, r - mean[inverse], torch.zeros_like(r))
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, dev * dev)
    std = (sq / (count - 1).clamp_min(1)).sqrt()
    return mean[inverse], std[inverse], count[inverse]


def _finish(adv: torch.Tensor, rewards: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    keep = torch.isfinite(rewards) & (size > 1)
    return torch.where(keep, adv, torch.zeros_like(adv)).to(rewards.dtype)


def _all_kept(adv: torch.Tensor) -> AdvantageResult:
    return AdvantageResult(adv, torch.ones_like(adv, dtype=torch.bool))


@ADVANTAGES.register("grpo", summary="(R - group mean) / group std; std below a floor is not divided by",
                     source="DeepSeekMath arXiv:2402.03300 eq. 3 (outcome supervision)")
def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> AdvantageResult:
    mean, std, size = _group_stats(rewards, group_ids)
    centred = rewards.double() - mean
    adv = torch.where(std > STD_FLOOR, centred / std.clamp_min(STD_FLOOR), centred)
    return _all_kept(_finish(adv, rewards, size))


@ADVANTAGES.register("dr_grpo", summary="R - group mean (no std scaling)", source="Dr. GRPO arXiv:2503.20783 sec. 3.1")
def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> AdvantageResult:
    mean, _, size = _group_stats(rewards, group_ids)
    return _all_kept(_finish(rewards.double() - mean, rewards, size))


@ADVANTAGES.register("rloo", summary="R minus the mean of the other members of the group",
                     source="RLOO arXiv:2402.14740 eq. 6")
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> AdvantageResult:
    mean, _, size = _group_stats(rewards, group_ids)
    adv = size / (size - 1).clamp_min(1) * (rewards.double() - mean)
    return _all_kept(_finish(adv, rewards, size))


@ADVANTAGES.register("reinforce", summary="the reward itself, no baseline", source="Williams 1992")
def reinforce_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> AdvantageResult:
    del group_ids
    return _all_kept(torch.where(torch.isfinite(rewards), rewards, torch.zeros_like(rewards)))


# -- MC-GRPO: median baseline, pivot excluded -----------------------------------------------------
# The pivot (the median sample of each group, which MC-GRPO removes from the gradient) is the `keep` of the
# estimator's AdvantageResult, computed once with the advantages. Its advantage is also exactly 0, so
# forgetting the keep-mask only changes the denominator, never the direction of the gradient.

NONZERO_TOL = 1e-6  # |A| <= this counts as a zero advantage in the released code's rescaling


def _group_order(
    rewards: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort scorable members by (group, reward, original index). Returns (order [N], inverse group index [N],
    start [G] of each group's block in `order`, scorable count [G]). Unscorable members sort to the end of their
    group's block and are not counted."""
    scorable = torch.isfinite(rewards)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    key = torch.where(scorable, rewards.double(), torch.full_like(rewards, float("inf"), dtype=torch.float64))
    by_reward = torch.sort(key, stable=True).indices
    order = by_reward[torch.sort(inverse[by_reward], stable=True).indices]
    size = torch.zeros(n_groups, dtype=torch.long).index_add_(0, inverse, torch.ones_like(inverse))
    start = torch.cumsum(size, 0) - size
    count = torch.zeros(n_groups, dtype=torch.long).index_add_(0, inverse, scorable.long())
    return order, inverse, start, count


def _lower_median(values_sorted: torch.Tensor, start: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Lower median (torch.median convention) of each block values_sorted[start : start + count]; 0 if empty."""
    pos = (start + (count - 1).clamp_min(0) // 2).clamp_max(max(values_sorted.numel() - 1, 0))
    return torch.where(count > 0, values_sorted[pos], torch.zeros_like(values_sorted[pos]))


def mc_grpo_pivot(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group median and pivot of MC-GRPO.

    rewards [N] float (NaN = unscorable), group_ids [N] int -> (median [N] float64, the lower median of the
    member's group over scorable members; keep [N] bool, False only for the pivot: the member at position
    (n - 1) // 2 of the group's scorable members sorted by (reward, batch index), i.e. a member whose reward is
    the lower median, ties broken by batch order; only in groups with >= 2 scorable members).
    Source: MC-GRPO arXiv:2601.22582 (abstract: G+1 samples, median baseline, pivot excluded); the lower-median
    convention matches torch.median in the released code lotusroot-kim/MC-GRPO.
    """
    order, inverse, start, count = _group_order(rewards, group_ids)
    n_groups = count.numel()
    if n_groups == 0:
        return rewards.double(), torch.ones_like(rewards, dtype=torch.bool)
    sorted_r = rewards.double()[order]
    median = _lower_median(sorted_r, start, count)
    pivot_pos = (start + (count - 1).clamp_min(0) // 2)[count >= 2]
    keep = torch.ones_like(rewards, dtype=torch.bool)
    keep[order[pivot_pos]] = False
    return median[inverse], keep


def mc_grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, scale: str = "none", rescale_nonzero: bool = False
) -> AdvantageResult:
    """MC-GRPO advantages and keep-mask.

    A_i = (R_i - med_g) / s_g, s_g = 1 (scale="none") or MAD_g (scale="mad", MAD_g = lower median of
    |R - med_g| over the group's scorable members, pivot included), except that a MAD <= STD_FLOOR (1e-6) is not
    divided by (A_i = R_i - med_g), as grpo does with the std: the MAD of binary rewards is 0 whenever more than
    half a group agrees. rescale_nonzero multiplies the nonzero advantages (|A| > 1e-6) of a group by
    n_g / #nonzero (released code), so |A| <= n_g max|R - med_g| / MAD_g (or without the MAD below the floor).
    Pivot, singleton, constant-group and unscorable members get A = 0. rewards [N] float, group_ids [N] int ->
    AdvantageResult (advantages in the rewards' dtype). Raises ValueError for an unknown `scale`.
    Source: arXiv:2601.22582 (abstract); MAD and rescaling from the released code, whose MAD + 1e-3 divisor
    is replaced by the floor (docs/math.md sec. 6; NeMo-RL #1518 for the same failure with a std).
    """
    if scale not in ("none", "mad"):
        raise ValueError(f"unknown MC-GRPO scale {scale!r}; valid: none, mad")
    median, keep = mc_grpo_pivot(rewards, group_ids)
    scorable = torch.isfinite(rewards)
    centred = torch.where(scorable, rewards.double() - median, torch.zeros_like(median))
    order, inverse, start, count = _group_order(rewards, group_ids)
    if scale == "mad" and count.numel():
        abs_dev = torch.where(scorable, centred.abs(), torch.full_like(centred, float("inf")))
        dev_order, _, dev_start, _ = _group_order(abs_dev, group_ids)
        mad = _lower_median(abs_dev[dev_order], dev_start, count)
        scale_g = mad[inverse]
        centred = torch.where(scale_g > STD_FLOOR, centred / scale_g.clamp_min(STD_FLOOR), centred)
    if rescale_nonzero and count.numel():
        nonzero = scorable & (centred.abs() > NONZERO_TOL)
        n_nonzero = torch.zeros(count.numel(), dtype=torch.float64).index_add_(0, inverse, nonzero.double())
        factor = count.double()[inverse] / n_nonzero[inverse].clamp_min(1)
        centred = torch.where(nonzero, centred * factor, centred)
    size = count.double()[inverse] if count.numel() else torch.zeros_like(centred)
    adv = _finish(torch.where(keep, centred, torch.zeros_like(centred)), rewards, size)
    return AdvantageResult(adv, keep)


@ADVANTAGES.register("mc_grpo", summary="R - group median; the median sample (pivot) is left out of the gradient",
                     source="MC-GRPO arXiv:2601.22582 (abstract); the pivot is the result's keep-mask")
def mc_grpo_median_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> AdvantageResult:
    return mc_grpo_advantages(rewards, group_ids, "none")


@ADVANTAGES.register("mc_grpo_mad", summary="(R - group median) / MAD, no division for MAD <= 1e-6; pivot left out "
                     "of the gradient",
                     source="MC-GRPO arXiv:2601.22582; MAD scaling from the released code lotusroot-kim/MC-GRPO")
def mc_grpo_mad_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> AdvantageResult:
    return mc_grpo_advantages(rewards, group_ids, "mad")


@ADVANTAGES.register("mc_grpo_released", summary="mc_grpo_mad plus nonzero advantages rescaled by n / #nonzero",
                     source="released code lotusroot-kim/MC-GRPO grpo_trainer_gsm.py (mc=True)")
def mc_grpo_released_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> AdvantageResult:
    return mc_grpo_advantages(rewards, group_ids, "mad", rescale_nonzero=True)


def compute_advantages(name: str, rewards: torch.Tensor, group_ids: torch.Tensor) -> AdvantageResult:
    """The registered estimator `name` on rewards [N], group_ids [N]: advantages [N] and the keep-mask [N] bool
    (all True unless the estimator excludes samples from the gradient, as MC-GRPO's pivot). Raises KeyError for
    an unknown name."""
    return ADVANTAGES.get(name)(rewards, group_ids)
