"""Data policies: which rollout groups of a step train, and with what weight, decided after the rewards are scored
and before the update (DataFlex-RL's rollout-selection family), plus the adaptive task-mixture rule.

One signature: (rewards [N] float, NaN = unscorable; group_ids [N] int; DataPolicyParams) -> DataPolicyResult(keep
[N] bool, weights [N] float64, 0 where not kept). A policy reads each group's reward variance over its scorable
members, v_g = mean_i (R_i - mean_g R)^2 (population variance, divided by n: p (1 - p) for 0/1 rewards); a group with
fewer than two scorable members, or with sqrt(v_g) <= STD_FLOOR (1e-6, the GRPO estimator's "constant"), is constant.

How the trainer applies a result (training/phases.apply_data_policy): `keep` is ANDed into the advantage
estimator's keep-mask, which the update ANDs into the loss mask before counting denominators, so a dropped sample
counts in neither the numerator nor the denominator; each sample's advantage is multiplied by its weight. Every
registered policy loss is positively homogeneous of degree 1 in the advantage (L(w A) = w L(A) for w >= 0, the clip
decisions unchanged; tests/test_data_policies.py holds this for each), so that is the per-sample multiplier w_i on
the policy-gradient term, the KL-to-reference, entropy-bonus and ECHO terms left unweighted (as the mismatch weights
leave the KL term). Denominators are unweighted counts of the kept tokens / sequences (docs/math.md sec. 23).

Source: the policy names are DataFlex-RL's (an evaluation platform for RLVR data policies whose finding is that no
data policy beats uniform at paired 95 %); the exact rules are reconstructed here (no paper text or code was
available): drop_zero_variance is DAPO's dynamic-sampling filter (arXiv:2503.14476) without the resampling."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nearpolicy.ops.advantages import STD_FLOOR
from nearpolicy.registry import Registry

VARIANCE_FLOOR = STD_FLOOR ** 2  # v_g at or below this is a constant group
MIXTURE_DECAY = 0.9  # EMA decay of a sub-task's accuracy per step (adaptive mixture)
MIXTURE_FLOOR = 0.1  # share of the fixed mixture kept by the adaptive one: no sub-task starves
MIXTURE_PRIOR = 0.5  # a sub-task's accuracy before its first observation (p (1 - p) at its maximum)


@dataclass(frozen=True)
class DataPolicyParams:
    """Plain scalars of the data policies. top_k: the most groups top_variance_k keeps (>= 1)."""

    top_k: int = 4  # the default of config algorithm.data_policy_top_k (one source)

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")


@dataclass(frozen=True)
class DataPolicyResult:
    """keep [N] bool: the sample's group trains; weights [N] float64: its policy-gradient multiplier (0 where not
    kept). Every member of a group gets the same keep and weight."""

    keep: torch.Tensor
    weights: torch.Tensor


DataPolicyFn = Callable[[torch.Tensor, torch.Tensor, DataPolicyParams], DataPolicyResult]
DATA_POLICIES: Registry[DataPolicyFn] = Registry("data policy")


def group_reward_variance(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inverse [N] int64: each sample's group index, groups in ascending group id; v [G] float64: each group's
    population reward variance over its scorable (finite) members, 0 with fewer than two). rewards [N] float (NaN =
    unscorable: left out), group_ids [N] int."""
    scorable = torch.isfinite(rewards)
    r = torch.where(scorable, rewards, torch.zeros_like(rewards)).double()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, scorable.double())
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, r) / count.clamp_min(1)
    dev = torch.where(scorable, r - mean[inverse], torch.zeros_like(r))
    var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, dev * dev) / count.clamp_min(1)
    return inverse, torch.where(count >= 2, var, torch.zeros_like(var))


def _of_groups(inverse: torch.Tensor, kept: torch.Tensor, weight: torch.Tensor) -> DataPolicyResult:
    """Broadcast per-group keep [G] bool and weight [G] float64 to the samples."""
    keep = kept[inverse]
    return DataPolicyResult(keep, torch.where(keep, weight[inverse], torch.zeros_like(weight[inverse])))


@DATA_POLICIES.register("uniform", summary="every group trains with weight 1 (the default; DataFlex-RL's baseline)",
                        source="DataFlex-RL (uniform baseline)")
def uniform(rewards: torch.Tensor, group_ids: torch.Tensor, params: DataPolicyParams) -> DataPolicyResult:
    del group_ids, params
    return DataPolicyResult(torch.ones_like(rewards, dtype=torch.bool), torch.ones_like(rewards, dtype=torch.float64))


@DATA_POLICIES.register("drop_zero_variance", summary="groups whose rewards are all equal leave the batch (numerator "
                        "and loss denominators); the others weight 1",
                        source="DataFlex-RL (reconstructed); DAPO dynamic sampling arXiv:2503.14476 sec. 3.2")
def drop_zero_variance(rewards: torch.Tensor, group_ids: torch.Tensor, params: DataPolicyParams) -> DataPolicyResult:
    """keep_i = [v_g(i) > VARIANCE_FLOOR], w_i = keep_i."""
    del params
    inverse, var = group_reward_variance(rewards, group_ids)
    live = var > VARIANCE_FLOOR
    return _of_groups(inverse, live, live.double())


@DATA_POLICIES.register("reward_variance", summary="constant groups dropped; each kept group weighted by its reward "
                        "variance, normalised to mean 1 over the kept groups",
                        source="DataFlex-RL (reconstructed)")
def reward_variance(rewards: torch.Tensor, group_ids: torch.Tensor, params: DataPolicyParams) -> DataPolicyResult:
    """keep as drop_zero_variance; w_g = v_g / ((1/K) sum_{kept g'} v_g') over the K kept groups (each group counted
    once, so the weights average 1 over kept groups, and over kept samples when the groups are the same size)."""
    del params
    inverse, var = group_reward_variance(rewards, group_ids)
    live = var > VARIANCE_FLOOR
    mean = var[live].mean() if bool(live.any()) else var.new_ones(())
    return _of_groups(inverse, live, var / mean)


@DATA_POLICIES.register("top_variance_k", summary="keep the algorithm.data_policy_top_k non-constant groups of largest "
                        "reward variance, weight 1",
                        source="DataFlex-RL (reconstructed)")
def top_variance_k(rewards: torch.Tensor, group_ids: torch.Tensor, params: DataPolicyParams) -> DataPolicyResult:
    """The k = params.top_k groups of largest v_g among the non-constant ones (ties to the lower group id), weight 1;
    with k >= the number of non-constant groups this is drop_zero_variance."""
    inverse, var = group_reward_variance(rewards, group_ids)
    order = torch.sort(var, descending=True, stable=True).indices
    chosen = order[:params.top_k]
    kept = torch.zeros_like(var, dtype=torch.bool)
    kept[chosen[var[chosen] > VARIANCE_FLOOR]] = True
    return _of_groups(inverse, kept, kept.double())


def data_policy_metrics(result: DataPolicyResult, group_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """kept_groups (groups with a kept sample), weight_mean (over all N samples of the step, a dropped one counting
    0: the kept fraction for the 0/1 policies), weight_max (0 when nothing is kept); float64 scalars."""
    weights = result.weights
    return {"kept_groups": torch.tensor(float(torch.unique(group_ids[result.keep]).numel()), dtype=torch.float64),
            "weight_mean": weights.mean() if weights.numel() else weights.new_zeros(()),
            "weight_max": weights.max() if weights.numel() else weights.new_zeros(())}


# -- adaptive task mixture (reconstruction; run by task.mixture = 'adaptive': rollouts/mixture.py, math.md sec. 27) ----

def mixture_accuracy_ema(accuracy: torch.Tensor, rewards: torch.Tensor, task_ids: torch.Tensor,
                         decay: float = MIXTURE_DECAY) -> torch.Tensor:
    """The sub-tasks' accuracy EMA after one step. accuracy [K] float64 (start: MIXTURE_PRIOR each); rewards [N] float
    (NaN = unscorable: left out); task_ids [N] int64 in [0, K). p_k <- decay p_k + (1 - decay) rbar_k for each k with a
    scorable sample this step (rbar_k: their mean reward); the others keep p_k. Raises ValueError for decay outside
    [0, 1). Reconstructed (DataFlex-RL's adaptive mixture rule is not public here)."""
    if not 0 <= decay < 1:
        raise ValueError(f"decay must be in [0, 1), got {decay}")
    scorable = torch.isfinite(rewards)
    r = torch.where(scorable, rewards, torch.zeros_like(rewards)).double()
    count = torch.zeros_like(accuracy, dtype=torch.float64).index_add_(0, task_ids, scorable.double())
    mean = torch.zeros_like(count).index_add_(0, task_ids, r) / count.clamp_min(1)
    return torch.where(count > 0, decay * accuracy.double() + (1 - decay) * mean, accuracy.double())


def adaptive_mixture_probs(accuracy: torch.Tensor, weights: torch.Tensor, floor: float = MIXTURE_FLOOR) -> torch.Tensor:
    """Sampling probabilities [K] float64 of the sub-tasks: pi_k = floor wbar_k + (1 - floor) q_k, wbar = weights /
    sum(weights) (the fixed mixture), q_k = wbar_k p_k (1 - p_k) / sum_j wbar_j p_j (1 - p_j) (q = wbar when every
    p (1 - p) is 0). accuracy [K] in [0, 1] (mixture_accuracy_ema), weights [K] > 0. Favours sub-tasks of intermediate
    accuracy; pi_k >= floor wbar_k, so none starves; all p = 0.5 gives the fixed mixture. Raises ValueError for floor
    outside [0, 1] or a weight <= 0. Reconstructed (DataFlex-RL's adaptive mixture rule is not public here)."""
    if not 0 <= floor <= 1:
        raise ValueError(f"floor must be in [0, 1], got {floor}")
    if bool((weights <= 0).any()):
        raise ValueError(f"mixture weights must be > 0, got {weights.tolist()}")
    base = weights.double() / weights.double().sum()
    p = accuracy.double()
    interest = base * p * (1 - p)
    q = interest / interest.sum() if float(interest.sum()) > 0 else base
    return floor * base + (1 - floor) * q
