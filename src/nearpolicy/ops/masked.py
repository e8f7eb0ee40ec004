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


def masked_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Min over valid positions (scalar); +inf-free: an empty mask gives 0."""
    if not mask.bool().any():
        return values.new_zeros(())
    return select(values, mask, fill=float("inf")).min()


def clamped_exp(log_ratio: torch.Tensor, bound: float = SAFETY_BOUND) -> torch.Tensor:
    """exp of a log-ratio clamped to [-bound, bound] nats."""
    return torch.exp(log_ratio.clamp(-bound, bound))


AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(loss_tok: torch.Tensor, mask: torch.Tensor, mode: str, denominator: torch.Tensor | float) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar; masked positions are never read (selection, not product).

    `denominator` is a global count of the whole gradient-accumulation group, so summing the results of a
    micro-batch split gives the full-batch value (invariant 7):
      token-mean               sum_{i,t} m L / denominator          (denominator = valid tokens)
      seq-mean-token-mean      sum_i [sum_t m L / sum_t m] / denominator   (denominator = sequences with >= 1
                               valid token; an empty sequence contributes 0)
      seq-mean-token-sum       sum_i sum_t m L / denominator       (denominator = non-empty sequences)
      seq-mean-token-sum-norm  sum_{i,t} m L / denominator          (denominator = non-empty sequences x a constant
                               C, e.g. the max response length: Dr. GRPO, arXiv:2503.20783; TRL dr_grpo; verl
                               PR #5417)
    Every denominator grows with the batch, so duplicating every sequence leaves the loss unchanged
    (invariant 14). The denominator is clamped to >= 1. Source: verl core_algos.agg_loss. Raises ValueError for
    an unknown mode.
    """
    denom = torch.as_tensor(denominator, dtype=loss_tok.dtype, device=loss_tok.device).clamp_min(1)
    if mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        return masked_sum(loss_tok, mask) / denom
    if mode == "seq-mean-token-mean":
        per_seq = masked_sum(loss_tok, mask, dim=-1) / mask.bool().sum(-1).clamp_min(1).to(loss_tok.dtype)
        return per_seq.sum() / denom
    raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")


def aggregation_denominator(mask: torch.Tensor, mode: str, constant: float | None = None) -> torch.Tensor:
    """The global denominator `aggregate` expects for `mode`, from the mask [B, T] bool of the WHOLE accumulation
    group: valid tokens (token-mean), non-empty sequences (seq-mean-*), or non-empty sequences x `constant`
    (seq-mean-token-sum-norm; `constant` > 0 in tokens, required; verl PR #5417). Returns a scalar tensor (a
    count, float64 for seq-mean-token-sum-norm). Raises ValueError for an unknown mode or a missing constant."""
    if mode == "token-mean":
        return mask.bool().sum()
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return mask.bool().any(-1).sum()
    if mode == "seq-mean-token-sum-norm":
        if constant is None:
            raise ValueError("seq-mean-token-sum-norm needs a constant denominator")
        return mask.bool().any(-1).sum().double() * float(constant)
    raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")
