"""One policy update on a rollout batch: mini-batches, micro-batch gradient accumulation, clipping.

The loss of a mini-batch is normalised by the valid tokens of the whole mini-batch (the accumulation group),
so the gradient does not depend on the micro-batch size (invariant 7)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nearpolicy.batching import TokenBatch
from nearpolicy.ops.corrections import TokenCorrection, token_correction_weights
from nearpolicy.ops.losses import PolicyLossInput, ppo_clip_loss
from nearpolicy.policy import sequence_logprobs
from nearpolicy.types import SamplingParams


@dataclass(frozen=True)
class UpdateSettings:
    minibatches: int
    micro_batch_size: int
    max_grad_norm: float
    clip_low: float
    clip_high: float
    dual_clip: float | None
    correction: TokenCorrection


@torch.no_grad()
def recompute_logprobs(model: torch.nn.Module, batch: TokenBatch, sampling: SamplingParams, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """old_logprobs [B, T] and entropy [B, T] at the current (sampling) weights, in micro-batches."""
    parts = [sequence_logprobs(model, batch.select(slice(i, i + micro)), sampling) for i in range(0, len(batch), micro)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def policy_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: TokenBatch,
                  old_logprobs: torch.Tensor | None, advantages: torch.Tensor, sampling: SamplingParams,
                  settings: UpdateSettings) -> tuple[dict[str, float], torch.Tensor, torch.Tensor | None]:
    """Run `minibatches` optimizer steps over the batch. advantages [B].

    `old_logprobs=None` fuses the recompute into the update (only with one mini-batch: the weights have not
    moved before each micro-batch's forward, so old_logprobs = logprobs.detach() exactly, invariant 8).
    Returns (step metrics as floats, old_logprobs [B, T], entropy [B, T] or None when not fused).
    A mini-batch whose gradient is not finite is skipped (optimizer not stepped) and counted."""
    n = len(batch)
    size = n // settings.minibatches
    fused = old_logprobs is None
    if fused and settings.minibatches != 1:
        raise ValueError("old_logprobs can only be fused into the update with a single mini-batch")
    if fused:
        old_logprobs = torch.zeros(batch.mask.shape)
        entropy = torch.zeros(batch.mask.shape)
    totals: dict[str, float] = {}
    skipped = 0
    for start in range(0, n, size):
        rows = slice(start, start + size)
        mini, mini_old, mini_adv = batch.select(rows), old_logprobs[rows], advantages[rows]
        denom = mini.mask.sum().clamp_min(1)
        optimizer.zero_grad(set_to_none=True)
        sums: dict[str, torch.Tensor] = {}
        for m0 in range(0, len(mini), settings.micro_batch_size):
            part = slice(m0, m0 + settings.micro_batch_size)
            micro = mini.select(part)
            logprobs, micro_entropy = sequence_logprobs(model, micro, sampling)
            if fused:
                mini_old[part] = logprobs.detach()
                entropy[start:start + size][part] = micro_entropy
            weights, corr_metrics = token_correction_weights(
                mini_old[part], micro.rollout_logprobs, micro.mask, micro.has_rollout, settings.correction
            )
            loss, metrics = ppo_clip_loss(
                PolicyLossInput(logprobs, mini_old[part], mini_adv[part], micro.mask, denom, weights),
                settings.clip_low, settings.clip_high, settings.dual_clip,
            )
            loss.backward()
            share = micro.mask.sum() / denom
            for key, value in {"loss": loss.detach(), **metrics}.items():
                sums[key] = sums.get(key, 0) + value
            for key, value in corr_metrics.items():
                sums[key] = sums.get(key, 0) + value * share
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
        if torch.isfinite(grad_norm) and torch.isfinite(sums["loss"]):
            optimizer.step()
        else:
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
        for key, value in {**sums, "grad_norm": grad_norm}.items():
            totals[key] = totals.get(key, 0.0) + float(value) / settings.minibatches
    totals["skipped_minibatches"] = float(skipped)
    metrics = {f"actor/{k}" if "/" not in k else k: v for k, v in totals.items()}
    return metrics, old_logprobs, entropy if fused else None
