"""Policy losses. Shapes: logprobs, old_logprobs, mask, weights [B, T]; advantages [B] (one per sequence)
or [B, T]. PPO ratio r = exp(logprobs - old_logprobs). `weights` is the detached mismatch correction
(ops/corrections.py). Aggregation is token-mean with an explicit denominator: the valid-token count of the
whole gradient-accumulation group, so splitting into micro-batches leaves the loss unchanged (invariant 7)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nearpolicy.ops.masked import clamped_exp, masked_sum, select


@dataclass(frozen=True)
class PolicyLossInput:
    logprobs: torch.Tensor  # [B, T] float32, with grad: log pi_theta
    old_logprobs: torch.Tensor  # [B, T] float32, detached: log pi_old at the sampling weights
    advantages: torch.Tensor  # [B] or [B, T]
    mask: torch.Tensor  # [B, T] bool, True = valid response token
    token_denominator: torch.Tensor | float  # valid tokens in the whole accumulation group (>= 1)
    weights: torch.Tensor | None = None  # [B, T] detached mismatch weight, None = 1


def _broadcast_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == 1 else advantages


def ppo_clip_loss(
    inp: PolicyLossInput, clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = 3.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip with optional dual clip, token-mean aggregated.

    L_t = max(-A r, -A clip(r, 1-clip_low, 1+clip_high)); for A < 0 also min(L_t, -A c) (dual clip, c > 1);
    L_t *= w_t (detached); loss = sum_valid L_t / token_denominator.
    Returns (loss scalar with grad, metrics of detached scalars normalised by the same denominator, so that
    summing them over micro-batches gives the accumulation-group mean).

    Source: Schulman et al. arXiv:1707.06347 eq. 7; dual clip Ye et al. arXiv:1912.09729 eq. 5.
    Raises ValueError if dual_clip <= 1.
    """
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    mask = inp.mask.bool()
    logprobs = select(inp.logprobs, mask)
    old = select(inp.old_logprobs.detach(), mask)
    adv = select(_broadcast_advantages(inp.advantages, logprobs).detach().to(logprobs.dtype), mask)
    log_ratio = logprobs - old
    ratio = clamped_exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss_tok = torch.maximum(unclipped, clipped)
    lower_clipped = torch.zeros_like(mask)
    if dual_clip is not None:
        dual = -adv * dual_clip
        lower_clipped = (adv < 0) & (loss_tok > dual)
        loss_tok = torch.where(adv < 0, torch.minimum(loss_tok, dual), loss_tok)
    if inp.weights is not None:
        loss_tok = loss_tok * select(inp.weights.detach().to(loss_tok.dtype), mask, fill=1.0)
    denom = torch.as_tensor(inp.token_denominator, dtype=loss_tok.dtype).clamp_min(1)
    loss = masked_sum(loss_tok, mask) / denom
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_sum((clipped > unclipped).to(loss_tok.dtype), mask) / denom,
            "pg_clipfrac_lower": masked_sum(lower_clipped.to(loss_tok.dtype), mask) / denom,
            "ppo_kl": masked_sum(-log_ratio, mask) / denom,
        }
    return loss, metrics
