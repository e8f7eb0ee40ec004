"""POPO's prioritized group replay: which groups carry a learning signal, how a stored group is ranked, which stored
groups fill the slots of the groups that carry none, and what the update sees of the replayed tokens.

Source: Mao, Qu, Wang, Zou, Ji, "RLVR without Ineffective Samples: Group Prioritized Off-Policy Optimization for LLM
Reasoning", arXiv:2606.01281. Reconstructed from the abstract: it names the two components ("prioritized group
replay", which replaces ineffective on-policy groups with effective off-policy groups through "a recency-based replay
mechanism that jointly considers sample quality and the degree of off-policiness", and "decoupled importance
sampling ... under consistent trust-region constraints") but not their equations. The forms below are ours
(docs/math.md sec. 25); rollouts/replay.py applies them to a step's groups and the decoupled loss (ops/corrections.py,
mode "decoupled") corrects the replayed tokens.

Notation. A group g is the G responses to one prompt; R_g its finite (scorable) rewards, n_g = |R_g|; v the trainer's
version (optimizer updates done) when the step's samples are collected; v_g the version that sampled g. Then

    effective_g = n_g >= 2 and max R_g > min R_g          (some GRPO advantage of the group is nonzero)
    s_g         = sqrt(mean_{r in R_g} (r - mean R_g)^2)   (quality: the population reward std; 0 when n_g < 2)
    a_g         = v - v_g                                  (age, versions since sampling: the off-policiness)
    p_g         = s_g * lambda^a_g,  lambda in (0, 1]      (priority: quality discounted by recency)

A stored group is eligible while a_g <= max_age; the k slots are filled by the k eligible groups of highest p_g,
ties to the earlier entry in the order given (rollouts/replay.py lists its buffer newest first). For binary
rewards s_g = sqrt(q (1 - q)) with q the group's accuracy: half-right groups rank first, a group of one right
answer in 4 has s = 0.433.

Log-probs of the replayed tokens (named as everywhere): `rollout_logprobs` = mu, the engine's at v_g (kept from the
sampling step); `old_logprobs` = pi_old, the trainer's recomputed at the current version v (the proximal policy); the
decoupled weight is pi_old / mu, so log w = old_logprobs - rollout_logprobs, nonzero for a replayed token once the
policy has moved. All inputs and outputs are tensors; nothing here calls `.item()`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nearpolicy.registry import Registry

REPLAY_RULES: Registry = Registry("group replay rule")


@dataclass(frozen=True)
class GroupSpread:
    """Per group, in ascending group id: ids [G] int64, spread s_g [G] float64, effective [G] bool (module doc)."""

    ids: torch.Tensor
    spread: torch.Tensor
    effective: torch.Tensor


def group_spread(rewards: torch.Tensor, group_ids: torch.Tensor) -> GroupSpread:
    """Each group's reward spread s_g and whether it is effective (module doc). rewards [N] float (NaN = unscorable:
    left out), group_ids [N] int64. A group of fewer than two scorable rewards is not effective and has s_g = 0."""
    finite = torch.isfinite(rewards)
    r = torch.where(finite, rewards, torch.zeros_like(rewards)).double()
    ids, inverse = torch.unique(group_ids, return_inverse=True)
    n = ids.numel()
    count = torch.zeros(n, dtype=torch.float64).index_add_(0, inverse, finite.double())
    mean = torch.zeros(n, dtype=torch.float64).index_add_(0, inverse, r) / count.clamp_min(1)
    dev = torch.where(finite, r - mean[inverse], torch.zeros_like(r))
    spread = (torch.zeros(n, dtype=torch.float64).index_add_(0, inverse, dev * dev) / count.clamp_min(1)).sqrt()
    inf = torch.full((n,), float("inf"), dtype=torch.float64)
    high = (-inf).scatter_reduce(0, inverse, torch.where(finite, r, -torch.inf), "amax")
    low = inf.scatter_reduce(0, inverse, torch.where(finite, r, torch.inf), "amin")
    effective = (count >= 2) & (high > low)
    return GroupSpread(ids, torch.where(count >= 2, spread, torch.zeros_like(spread)), effective)


@REPLAY_RULES.register("popo", summary="replay effective groups in place of constant-reward ones, ranked by reward "
                                       "std x decay^age; decoupled IS on the stale tokens (reconstruction)",
                       source="POPO, Mao et al., arXiv:2606.01281 (reconstructed from the abstract; docs/math.md "
                              "sec. 25)")
def replay_priority(spread: torch.Tensor, age: torch.Tensor, decay: float) -> torch.Tensor:
    """p_g = s_g * decay^a_g [M] float64: spread [M] (s_g), age [M] int64 (versions since sampling, >= 0), decay in
    (0, 1] (1 = recency ignored). Raises ValueError for a decay outside (0, 1]."""
    if not 0 < decay <= 1:
        raise ValueError(f"recency decay must be in (0, 1], got {decay}")
    return spread.double() * torch.tensor(decay, dtype=torch.float64) ** age.double()


def top_priority(priority: torch.Tensor, eligible: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [min(k, #eligible)] int64 of the k eligible entries of highest priority, highest first; ties go to the
    lower index. priority [M] float, eligible [M] bool, k >= 0."""
    order = torch.sort(-priority.double(), stable=True).indices
    return order[eligible[order]][:max(k, 0)]


def replayed_token_stats(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, defined: torch.Tensor,
                         versions: torch.Tensor, version: int) -> dict[str, torch.Tensor]:
    """What the update saw of the stale tokens (those sampled before `version`: replayed ones, in a synchronous run):
    tokens (count), age_mean (mean of version - v_t, versions), log_weight_mean and log_weight_abs_mean (mean of
    log(pi_old / mu) = old - rollout and of its absolute value, nats, over those with an engine log-prob); NaN means
    with no stale token. old_logprobs / rollout_logprobs [B, T] float, defined [B, T] bool (tokens with an engine
    log-prob, in the loss mask), versions [B, T] int64 (-1 at padding). 0-dim float64 tensors."""
    stale = (versions >= 0) & (versions < version)
    age = (version - versions).double()
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    count = stale.sum()
    weighted = stale & defined
    log_w = torch.where(weighted, (old_logprobs - rollout_logprobs).double(), torch.zeros_like(age))
    n_w = weighted.sum()
    return {"tokens": count.double(),
            "age_mean": torch.where(count > 0, (age * stale).sum() / count.clamp_min(1), nan),
            "log_weight_mean": torch.where(n_w > 0, log_w.sum() / n_w.clamp_min(1), nan),
            "log_weight_abs_mean": torch.where(n_w > 0, log_w.abs().sum() / n_w.clamp_min(1), nan)}
