"""Task mixtures: how the datasets of a composite task (task.name = "composite") share a step's prompts, as a
registry (`nearpolicy list`, config task.mixture). Each entry maps the datasets' accuracy EMAs p [K] float64, their
weights w [K] > 0 and the floor eps to the shares pi [K] float64 (summing to 1) the next step's prompts are drawn with.

`fixed` is reasoning-gym's own draw (problem i comes from dataset k with probability w_k / sum w all run;
tasks/reasoning_gym.py): the run keeps its per-index draw and never calls the entry. `adaptive` is the rule of
ops/data_policies.adaptive_mixture_probs, drawn and fed back by rollouts/mixture.py (docs/math.md sec. 27)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nearpolicy.ops.data_policies import adaptive_mixture_probs
from nearpolicy.registry import Registry

__all__ = ["MIXTURES", "SharesFn"]

SharesFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
MIXTURES: Registry[SharesFn] = Registry("task mixture")


@MIXTURES.register("fixed", summary="each dataset of task.name = 'composite' keeps its share weight_k / sum(weight) "
                   "for the whole run (reasoning-gym's per-index draw; the default)",
                   source="reasoning-gym CompositeDataset")
def fixed_shares(accuracy: torch.Tensor, weights: torch.Tensor, floor: float) -> torch.Tensor:
    """wbar = weights / sum(weights), [K] float64, whatever the accuracies."""
    del accuracy, floor
    return weights.double() / weights.double().sum()


@MIXTURES.register("adaptive", summary="each step's prompts drawn per dataset with shares moved toward datasets of "
                   "accuracy near 1/2 (wbar p (1 - p) of an accuracy EMA), floor task.mixture_floor x wbar",
                   source="learnability p(1-p): Rutherford et al. 2024 arXiv:2408.15099, Foster et al. 2025 "
                   "arXiv:2502.12272; per dataset with EMA and floor: reconstructed (DataFlex-RL's adaptive mixture)")
def adaptive_shares(accuracy: torch.Tensor, weights: torch.Tensor, floor: float) -> torch.Tensor:
    """ops/data_policies.adaptive_mixture_probs: pi_k = floor wbar_k + (1 - floor) q_k, q_k proportional to
    wbar_k p_k (1 - p_k); [K] float64. Raises ValueError for a floor outside [0, 1] or a weight <= 0."""
    return adaptive_mixture_probs(accuracy, weights, floor)
