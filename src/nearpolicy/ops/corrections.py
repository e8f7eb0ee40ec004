"""Token-level mismatch corrections between the engine (behaviour mu) and the trainer at the sampling
weights (pi_old). Weight rho_t = exp(old_logprobs - rollout_logprobs), clamped to +-20 nats in log space,
always detached (invariant 11: pi_old, not the current policy). A token without an engine log-prob gets
rho = 1 exactly (invariant 5).

Actions: "off" (w = 1), "none" (w = rho, plain importance sampling), "truncate" (TIS: w = clip(rho, lower,
upper)), "mask" (MIS / IcePop-style token mask: w = rho inside [lower, upper], 0 outside).
Sources: TIS, Yao et al. 2025 "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training";
token MIS, verl rollout_corr_helper; see docs/math.md sec. 3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from nearpolicy.ops.masked import clamped_exp, masked_sum, select

CorrectionAction = Literal["off", "none", "truncate", "mask"]


@dataclass(frozen=True)
class TokenCorrection:
    action: CorrectionAction = "off"
    lower: float = 0.0
    upper: float = math.inf

    def __post_init__(self) -> None:
        if not (0 <= self.lower < self.upper):
            raise ValueError(f"correction bounds must satisfy 0 <= lower < upper, got [{self.lower}, {self.upper}]")


def mismatch_log_ratio(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, has_rollout: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """log rho = old_logprobs - rollout_logprobs [B, T] (0 where masked or missing) and the mask of tokens
    where it is defined (valid and with an engine log-prob)."""
    defined = mask.bool() & has_rollout.bool()
    log_rho = select(old_logprobs.detach(), defined) - select(rollout_logprobs.detach(), defined)
    return log_rho, defined


def token_correction_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    has_rollout: torch.Tensor,
    correction: TokenCorrection,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached per-token weights [B, T] float32 (1 at masked or missing positions) and metrics
    (fraction of defined tokens clipped high / low or masked)."""
    log_rho, defined = mismatch_log_ratio(old_logprobs, rollout_logprobs, mask, has_rollout)
    rho = clamped_exp(log_rho)
    high, low = rho > correction.upper, rho < correction.lower
    if correction.action == "off":
        weights = torch.ones_like(rho)
    elif correction.action == "none":
        weights = rho
    elif correction.action == "truncate":
        weights = rho.clamp(min=correction.lower, max=correction.upper)
    elif correction.action == "mask":
        weights = torch.where(high | low, torch.zeros_like(rho), rho)
    else:
        raise ValueError(f"unknown correction action {correction.action!r}; valid: off, none, truncate, mask")
    weights = select(weights, defined, fill=1.0).detach()
    n = defined.sum().clamp_min(1)
    metrics = {
        "correction/frac_high": masked_sum(high.float(), defined) / n,
        "correction/frac_low": masked_sum(low.float(), defined) / n,
        "correction/weight_mean": masked_sum(weights, defined) / n,
    }
    return weights, metrics
