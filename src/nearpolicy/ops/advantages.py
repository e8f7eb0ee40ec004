"""Advantage estimators for outcome rewards. One signature: (rewards [N] float, group_ids [N] int) ->
advantages [N] float, one scalar per sequence (broadcast over its tokens by the loss).

Normalisation is per group id (never batch-wide). Unscorable rewards (NaN) get advantage 0 and are left out
of their group's statistics; singleton and constant groups give 0 (invariant 6)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nearpolicy.registry import Registry

AdvantageFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")

STD_FLOOR = 1e-6


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


@ADVANTAGES.register("grpo", summary="(R - group mean) / group std; std below a floor is not divided by",
                     source="DeepSeekMath arXiv:2402.03300 eq. 3 (outcome supervision)")
def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    mean, std, size = _group_stats(rewards, group_ids)
    centred = rewards.double() - mean
    adv = torch.where(std > STD_FLOOR, centred / std.clamp_min(STD_FLOOR), centred)
    return _finish(adv, rewards, size)


@ADVANTAGES.register("dr_grpo", summary="R - group mean (no std scaling)", source="Dr. GRPO arXiv:2503.20783 sec. 3.1")
def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    mean, _, size = _group_stats(rewards, group_ids)
    return _finish(rewards.double() - mean, rewards, size)


@ADVANTAGES.register("rloo", summary="R minus the mean of the other members of the group",
                     source="RLOO arXiv:2402.14740 eq. 6")
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    mean, _, size = _group_stats(rewards, group_ids)
    adv = size / (size - 1).clamp_min(1) * (rewards.double() - mean)
    return _finish(adv, rewards, size)


@ADVANTAGES.register("reinforce", summary="the reward itself, no baseline", source="Williams 1992")
def reinforce_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    del group_ids
    return torch.where(torch.isfinite(rewards), rewards, torch.zeros_like(rewards))
