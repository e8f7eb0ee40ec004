"""Self-normalised importance sampling: the batch mean the mismatch weights are divided by (docs/math.md sec. 9).

Weights are the detached correction weights of ops/corrections.py (rho = proximal / rollout, after the action).
Sources: verl rollout_corr_helper.py `rollout_is_batch_normalize` (token and sequence forms); slime/Miles
`tis_batch_normalize` (mis.yaml).
"""

from __future__ import annotations

from typing import Literal

import torch

from nearpolicy.ops.masked import select

SelfNormalize = Literal["off", "token", "sequence"]
SELF_NORMALIZE = ("off", "token", "sequence")


def self_normalization_factor(weights: torch.Tensor, keep: torch.Tensor, defined: torch.Tensor, kind: SelfNormalize) -> torch.Tensor:
    """Scalar mean weight of self-normalised IS: weights [B, T] (before rejection), keep / defined [B, T] bool;
    rejected tokens count 0. token: sum_def w / n_def; sequence: mean over sequences with a defined token of
    sum_def w / n_def per sequence (verl rollout_is_batch_normalize, slime tis_batch_normalize). 1 when there
    is nothing to average or the mean is <= 1e-8 (verl skips the division then)."""
    w = select(weights.detach(), keep & defined)
    if kind == "token":
        mean = w.sum() / defined.sum().clamp_min(1)
    else:
        n = defined.sum(-1)
        per_seq = w.sum(-1) / n.clamp_min(1)
        mean = select(per_seq, n > 0).sum() / (n > 0).sum().clamp_min(1)
    return torch.where(mean > 1e-8, mean, torch.ones_like(mean))
