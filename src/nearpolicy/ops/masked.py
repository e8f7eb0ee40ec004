"""Masked reductions. Masking is by selection (`torch.where`), never by multiplication, so NaN or inf
at masked positions changes neither values nor gradients (invariant 4)."""

from __future__ import annotations

import torch

SAFETY_BOUND = 20.0  # log-ratios are clamped to +-20 nats before exp (verl's guard)


def select(values: torch.Tensor, mask: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """`values` where `mask` is true, `fill` elsewhere. Apply to inputs first so no NaN reaches a grad."""
    return torch.where(mask.bool(), values, torch.full_like(values, fill))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` over valid positions. values, mask: same shape [B, T]."""
    picked = select(values, mask)
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, dim: int | None = None, denominator: torch.Tensor | float | None = None
) -> torch.Tensor:
    """Mean over valid positions; `denominator` overrides the count (e.g. a global token count).

    An empty mask gives 0 (the count is clamped to at least 1)."""
    total = masked_sum(values, mask, dim)
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    if denominator is not None:
        count = torch.as_tensor(denominator, dtype=total.dtype, device=total.device)
    return total / torch.as_tensor(count, dtype=total.dtype).clamp_min(1)


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max over valid positions (scalar); -inf-free: an empty mask gives 0."""
    if not mask.bool().any():
        return values.new_zeros(())
    return select(values, mask, fill=float("-inf")).max()


def clamped_exp(log_ratio: torch.Tensor, bound: float = SAFETY_BOUND) -> torch.Tensor:
    """exp of a log-ratio clamped to [-bound, bound] nats."""
    return torch.exp(log_ratio.clamp(-bound, bound))
