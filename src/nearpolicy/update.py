"""One policy update on a rollout batch: mini-batches, micro-batch gradient accumulation, clipping.

The loss of a mini-batch is aggregated over the whole mini-batch (the accumulation group): its denominator is
computed from the mini-batch's loss mask once, so the gradient does not depend on the micro-batch size
(invariant 7). Batch statistics of the mismatch (DLC centre, AIS lambda) are computed once over the whole batch
before micro-batching."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from nearpolicy.batching import TokenBatch
from nearpolicy.ops.corrections import CorrectionSpec, correct, correction_log_ratio, mismatch_correction, mismatch_log_ratio
from nearpolicy.ops.losses import PolicyLossInput, PolicyLossParams, policy_loss
from nearpolicy.ops.masked import aggregation_denominator
from nearpolicy.ops.proximal import ais_lambda, discrepancy_center
from nearpolicy.policy import sequence_logprobs
from nearpolicy.proximal_policy import a3po_behaviour_proximal
from nearpolicy.types import SamplingParams


@dataclass(frozen=True)
class UpdateSettings:
    minibatches: int
    micro_batch_size: int
    max_grad_norm: float
    loss: str
    loss_params: PolicyLossParams
    aggregation: str
    aggregation_constant: float | None
    correction: CorrectionSpec
    center: str = "none"  # DLC discrepancy centring: none, log_mean, weight_mean
    adaptive_mix: str = "none"  # none or ais
    proximal: str = "old"  # old, ewma (proximal_logprobs given to policy_update) or a3po (proximal_policy.py)

    @property
    def needs_batch_statistics(self) -> bool:
        return self.center != "none" or self.adaptive_mix != "none" or self.correction.self_normalize != "off"


@dataclass
class UpdateResult:
    """What `policy_update` returns. metrics: step metrics as floats; old_logprobs [B, T] float32: the trainer at
    the sampling weights; logprobs [B, T] float32, detached: the trainer when each row's mini-batch was trained
    (equal to old_logprobs on the first mini-batch, invariant 8); entropy [B, T] or None when not fused."""

    metrics: dict[str, float]
    old_logprobs: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor | None


@torch.no_grad()
def recompute_logprobs(model: torch.nn.Module, batch: TokenBatch, sampling: SamplingParams, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """old_logprobs [B, T] and entropy [B, T] at the current (sampling) weights, in micro-batches."""
    parts = [sequence_logprobs(model, batch.select(slice(i, i + micro)), sampling) for i in range(0, len(batch), micro)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def batch_correction(batch: TokenBatch, old_logprobs: torch.Tensor, settings: UpdateSettings,
                     mask: torch.Tensor | None = None) -> tuple[torch.Tensor, CorrectionSpec, dict[str, float], torch.Tensor | None]:
    """Apply the batch-level parts of the correction: returns (rollout log-probs shifted by the DLC centre,
    the spec with the AIS lambda as its mix, metrics, the self-normalisation mean or None). old_logprobs [B, T]:
    the loss's proximal log-probs at the start of the update (in bypass mode also the current log-probs, exact
    on the first mini-batch); mask [B, T]: the loss mask (default batch.mask)."""
    rollout, spec, metrics = batch.rollout_logprobs, settings.correction, {}
    mask = batch.mask if mask is None else mask
    if not settings.needs_batch_statistics:
        return rollout, spec, metrics, None
    log_rho, defined = mismatch_log_ratio(old_logprobs, rollout, batch.mask, batch.has_rollout)
    center = discrepancy_center(log_rho, defined, settings.center)
    metrics["correction/dlc_center"] = float(center)
    rollout = rollout + center  # log(pi_old / mu) - c: the centring, as a shift of the engine's log-probs
    if settings.adaptive_mix == "ais":
        lam, ais = ais_lambda(log_rho - center, defined)
        spec = replace(spec, mix=float(lam))
        metrics |= {k: float(v) for k, v in ais.items()}
    normalizer = None
    if spec.self_normalize != "off":
        lr, dfn = correction_log_ratio(spec.mode, old_logprobs, old_logprobs, rollout, mask, batch.has_rollout)
        normalizer = correct(spec, lr, dfn, mask).metrics["correction/sn_factor"]  # reported by each micro-batch
    return rollout, spec, metrics, normalizer


def policy_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: TokenBatch,
                  old_logprobs: torch.Tensor | None, advantages: torch.Tensor, sampling: SamplingParams,
                  settings: UpdateSettings, sample_keep: torch.Tensor | None = None,
                  ref_model: torch.nn.Module | None = None, proximal_logprobs: torch.Tensor | None = None,
                  version: int = 0, on_step: Callable[[], None] | None = None) -> UpdateResult:
    """Run `minibatches` optimizer steps over the batch. advantages [B]; sample_keep [B] bool (False = left out
    of the gradient, e.g. MC-GRPO's pivot); ref_model gives ref_logprobs for the KL penalty.
    Proximal policy (proximal_policy.py): proximal_logprobs [B, T] replace old_logprobs in the loss (PPO-EWMA);
    settings.proximal = "a3po" interpolates per token from batch.versions and the trainer's `version`; on_step is
    called after every optimizer step (the EWMA update).

    `old_logprobs=None` fuses the recompute into the update (only with one mini-batch and no batch statistics:
    the weights have not moved before each micro-batch's forward, so old_logprobs = logprobs.detach() exactly,
    invariant 8). Returns an UpdateResult; its logprobs - old_logprobs is the policy lag accumulated by earlier
    mini-batches of this update. A mini-batch whose gradient is not finite is skipped (optimizer not stepped) and counted."""
    n = len(batch)
    size = n // settings.minibatches
    fused = old_logprobs is None
    if fused and (settings.minibatches != 1 or settings.needs_batch_statistics):
        raise ValueError("old_logprobs can only be fused into the update with a single mini-batch and no batch statistics")
    entropy = None
    current = torch.zeros(batch.mask.shape)
    if fused:
        old_logprobs, entropy = torch.zeros(batch.mask.shape), torch.zeros(batch.mask.shape)
        rollout, spec, totals = batch.rollout_logprobs, settings.correction, {}
    loss_mask = batch.mask & (sample_keep[:, None] if sample_keep is not None else True)
    normalizer = None
    if not fused:
        start_prox = _proximal(settings, old_logprobs, old_logprobs, batch, version, proximal_logprobs)
        rollout, spec, totals, normalizer = batch_correction(batch, start_prox, settings, loss_mask)
    skipped = 0
    for start in range(0, n, size):
        rows = slice(start, start + size)
        mini_mask = loss_mask[rows]
        tokens = mini_mask.sum().clamp_min(1)
        denom = aggregation_denominator(mini_mask, settings.aggregation, settings.aggregation_constant)
        optimizer.zero_grad(set_to_none=True)
        sums: dict[str, torch.Tensor] = {}
        for m0 in range(start, start + size, settings.micro_batch_size):
            part = slice(m0, min(m0 + settings.micro_batch_size, start + size))
            micro = batch.select(part)
            logprobs, micro_entropy = sequence_logprobs(model, micro, sampling)
            current[part] = logprobs.detach()
            if fused:
                old_logprobs[part], entropy[part] = logprobs.detach(), micro_entropy
            prox = _proximal(settings, logprobs, old_logprobs[part], micro, version,
                             None if proximal_logprobs is None else proximal_logprobs[part])
            result, proximal = mismatch_correction(spec, logprobs, prox, rollout[part], loss_mask[part],
                                                   micro.has_rollout, normalizer)
            ref = None
            if ref_model is not None:
                with torch.no_grad():
                    ref = sequence_logprobs(ref_model, micro, sampling)[0]
            loss, metrics = policy_loss(
                settings.loss,
                PolicyLossInput(logprobs, proximal, advantages[part], loss_mask[part], tokens, result.weights, ref),
                settings.loss_params, settings.aggregation, denom,
            )
            loss.backward()
            share = loss_mask[part].sum() / tokens
            for key, value in {"loss": loss.detach(), **metrics}.items():
                sums[key] = sums.get(key, 0) + value
            for key, value in result.metrics.items():
                sums[key] = sums.get(key, 0) + value * share
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
        if torch.isfinite(grad_norm) and torch.isfinite(sums["loss"]):
            optimizer.step()
            if on_step is not None:
                on_step()
        else:
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
        for key, value in {**sums, "grad_norm": grad_norm}.items():
            totals[key] = totals.get(key, 0.0) + float(value) / settings.minibatches
    totals["skipped_minibatches"] = float(skipped)
    metrics = {f"actor/{k}" if "/" not in k else k: v for k, v in totals.items()}
    return UpdateResult(metrics, old_logprobs, current, entropy)


def _proximal(settings: UpdateSettings, logprobs: torch.Tensor, old_logprobs: torch.Tensor, batch: TokenBatch,
              version: int, given: torch.Tensor | None) -> torch.Tensor:
    """The loss's proximal log-probs [B, T] (detached) for settings.proximal: given (ewma), A-3PO, or old."""
    if given is not None:
        return given.detach()
    if settings.proximal == "a3po":
        return a3po_behaviour_proximal(logprobs, old_logprobs, batch.rollout_logprobs, batch.has_rollout,
                                       batch.versions, version)
    return old_logprobs.detach()
