"""One policy update on a rollout batch: mini-batches, micro-batch gradient accumulation, clipping.

The loss of a mini-batch is aggregated over the whole mini-batch (the accumulation group): its denominator is
computed from the mini-batch's loss mask once, so the gradient does not depend on the micro-batch size
(invariant 7). Batch statistics of the mismatch (DLC centre, AIS lambda) are computed once over the whole batch
before micro-batching. The loss's proximal log-probs come from ops/proximal.proximal_logprobs (the one place they
are decided)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from nearpolicy.training.allocator import release_freed_memory
from nearpolicy.batching import TokenBatch
from nearpolicy.ops.corrections import CorrectionSpec, correct, correction_log_ratio, mismatch_correction, mismatch_log_ratio
from nearpolicy.ops.losses import ADVANTAGE_PROPORTIONAL_LOSSES, PolicyLossInput, PolicyLossParams, policy_loss
from nearpolicy.ops.masked import aggregate, aggregation_denominator, masked_sum
from nearpolicy.ops.proximal import ais_lambda, discrepancy_center, proximal_logprobs
from nearpolicy.ops.observation_loss import observation_loss
from nearpolicy.model.policy import (recompute_logprobs, sequence_logprobs, sequence_logprobs_with_raw,
                                     trainer_compute)
from nearpolicy.training.distillation import UpdateDistill, forward_kl_pass
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
    proximal: str = "old"  # old, ewma (ewma_logprobs given to policy_update) or a3po (ops/proximal.py)
    epochs: int = 1  # passes over the batch (PPO epochs); each pass runs the mini-batches in the same order
    observation_loss_coef: float = 0.0  # ECHO: + coef x the observation tokens' cross-entropy (0 = off)
    baseline_after_rejection: bool = False  # old_logprobs come before the advantages (rejected_samples), never fused
    trainer_precision: str = "fp32"  # the forwards' arithmetic (model/policy.trainer_compute); backwards leave autocast

    @property
    def optimizer_steps(self) -> int:
        return self.epochs * self.minibatches

    @property
    def fusable(self) -> bool:
        """True when old_logprobs can be taken from the first forward of the update (weights not yet moved)."""
        return self.optimizer_steps == 1 and not self.needs_batch_statistics and not self.baseline_after_rejection

    @property
    def needs_batch_statistics(self) -> bool:
        return self.center != "none" or self.adaptive_mix != "none" or self.correction.self_normalize != "off"


@dataclass(frozen=True)
class Recomputed:
    """What the trainer computes at the sampling weights before the advantages: old_logprobs and entropy [B, T] float32
    (None when fused into the update), the EWMA proximal's log-probs [B, T] (None without one), and the samples the
    correction rejects whole ([B] bool, rejected_samples; None unless UpdateSettings.baseline_after_rejection)."""

    old_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    ewma_logprobs: torch.Tensor | None = None
    rejected: torch.Tensor | None = None


@dataclass
class UpdateResult:
    """What `policy_update` returns. metrics: step metrics as floats; old_logprobs [B, T] float32: the trainer at
    the sampling weights; logprobs [B, T] float32, detached: the trainer when each row's mini-batch was last trained
    (with one epoch equal to old_logprobs on the first mini-batch, invariant 8; with epochs > 1 the last epoch's, so
    the policy-lag part of the mismatch decomposition includes the earlier epochs' updates); entropy [B, T] or None
    when not fused."""

    metrics: dict[str, float]
    old_logprobs: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor | None


def batch_correction(batch: TokenBatch, proximal: torch.Tensor, settings: UpdateSettings,
                     mask: torch.Tensor | None = None) -> tuple[torch.Tensor, CorrectionSpec, dict[str, float], torch.Tensor | None]:
    """Apply the batch-level parts of the correction: returns (the DLC centre c, a scalar in nats: 0 without
    centring; the spec with the AIS lambda as its mix; metrics; the self-normalisation mean or None). proximal
    [B, T]: the decoupled proximal log-probs at the start of the update (in bypass mode also the current
    log-probs, exact on the first mini-batch); mask [B, T]: the loss mask (default batch.mask)."""
    rollout, spec, metrics = batch.rollout_logprobs, settings.correction, {}
    mask = batch.mask if mask is None else mask
    center = torch.zeros(())
    if not settings.needs_batch_statistics:
        return center, spec, metrics, None
    log_rho, defined = mismatch_log_ratio(proximal, rollout, batch.mask, batch.has_rollout)
    center = discrepancy_center(log_rho, defined, settings.center)
    metrics["correction/dlc_center"] = float(center)
    rollout = rollout + center  # log(pi_prox / mu) - c: the centring, as a shift of the engine's log-probs
    if settings.adaptive_mix == "ais":
        lam, ais = ais_lambda(log_rho - center, defined)
        spec = replace(spec, mix=float(lam))
        metrics |= {k: float(v) for k, v in ais.items()}
    normalizer = None
    if spec.self_normalize != "off":
        lr, dfn = correction_log_ratio(spec.mode, proximal, proximal, rollout, mask, batch.has_rollout)
        normalizer = correct(spec, lr, dfn, mask).metrics["correction/sn_factor"]  # reported by each micro-batch
    return center, spec, metrics, normalizer


def recompute(model: torch.nn.Module, batch: TokenBatch, sampling: SamplingParams, settings: UpdateSettings,
              ewma=None, version: int = 0) -> Recomputed:
    """The log-probs at the sampling weights, before the advantages (the weights have not moved since sampling):
    old_logprobs and entropy (unless settings.fusable: then policy_update computes them in its first forward), the
    EWMA proximal's (`ewma`: a model.ewma.EwmaPolicy, or None), and, with settings.baseline_after_rejection, the
    samples the correction rejects whole (rejected_samples at the trainer's `version`)."""
    old = Recomputed()
    with trainer_compute(settings.trainer_precision):
        if not settings.fusable:
            old = Recomputed(*recompute_logprobs(model, batch, sampling, settings.micro_batch_size))
        if ewma is not None:
            old = replace(old, ewma_logprobs=ewma.logprobs(batch, sampling, settings.micro_batch_size))
    if settings.baseline_after_rejection:
        old = replace(old, rejected=rejected_samples(batch, old.old_logprobs, settings, version, old.ewma_logprobs))
    return old


def rejected_samples(batch: TokenBatch, old_logprobs: torch.Tensor, settings: UpdateSettings, version: int = 0,
                     ewma_logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """[B] bool: the samples settings.correction rejects whole (a sample with response tokens, none of them kept), as
    policy_update's first mini-batch decides: the same proximal, DLC centre and AIS mix (batch_correction), the
    current log-probs equal to old_logprobs [B, T] (the trainer at the sampling weights, float32). In decoupled mode
    with proximal "old" every mini-batch rejects exactly these; in bypass mode and with "a3po" later mini-batches
    decide on the moved policy. For algorithm.baseline_samples = "accepted" (docs/math.md sec. 2); ewma_logprobs
    [B, T] for proximal "ewma". Raises what proximal_logprobs raises."""
    first = proximal_logprobs(settings.proximal, "decoupled", old_logprobs, old_logprobs, batch.rollout_logprobs,
                              batch.has_rollout, batch.versions, version, ewma_logprobs)
    center, spec, _, _ = batch_correction(batch, first, settings)
    prox = proximal_logprobs(settings.proximal, spec.mode, old_logprobs, old_logprobs, batch.rollout_logprobs,
                             batch.has_rollout, batch.versions, version, ewma_logprobs, center)
    result = mismatch_correction(spec, old_logprobs, prox, batch.rollout_logprobs + center, batch.mask,
                                 batch.has_rollout)
    return batch.mask.any(-1) & ~result.keep.any(-1)


def policy_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: TokenBatch,
                  old_logprobs: torch.Tensor | None, advantages: torch.Tensor, sampling: SamplingParams,
                  settings: UpdateSettings, sample_keep: torch.Tensor | None = None,
                  ref_model: torch.nn.Module | None = None, ewma_logprobs: torch.Tensor | None = None,
                  version: int = 0, on_step: Callable[[], None] | None = None,
                  distill: UpdateDistill | None = None) -> UpdateResult:
    """Run `epochs` x `minibatches` optimizer steps over the batch. advantages [B]; sample_keep [B] bool (False = left out
    of the gradient, e.g. MC-GRPO's pivot); ref_model gives ref_logprobs for the KL penalty; distill adds the forward
    KL to its teacher and feeds R-OPD's gradient probe on the first mini-batch (training/distillation.py).
    The loss's proximal log-probs: ops/proximal.proximal_logprobs for settings.proximal and the correction's mode
    (ewma_logprobs [B, T]: the EWMA policy's, for "ewma"; "a3po" interpolates per token from batch.versions and
    the trainer's `version`); on_step is called after every optimizer step (the EWMA update).

    `old_logprobs=None` fuses the recompute into the update (only with one optimizer step and no batch statistics:
    the weights have not moved before each micro-batch's forward, so old_logprobs = logprobs.detach() exactly,
    invariant 8). Returns an UpdateResult; its logprobs - old_logprobs is the policy lag accumulated by earlier
    mini-batches of this update. A mini-batch whose gradient is not finite is skipped (optimizer not stepped) and counted."""
    n = len(batch)
    size, fused, entropy, normalizer = n // settings.minibatches, old_logprobs is None, None, None
    _check_fusable(fused, settings)
    current = torch.zeros(batch.mask.shape)
    if fused:
        old_logprobs, entropy = torch.zeros(batch.mask.shape), torch.zeros(batch.mask.shape)
        center, spec, totals = torch.zeros(()), settings.correction, {}
    loss_mask = batch.mask & (sample_keep[:, None] if sample_keep is not None else True)
    if not fused:  # batch statistics against the decoupled proximal at the start of the update
        first = proximal_logprobs(settings.proximal, "decoupled", old_logprobs, old_logprobs, batch.rollout_logprobs,
                                  batch.has_rollout, batch.versions, version, ewma_logprobs)
        center, spec, totals, normalizer = batch_correction(batch, first, settings, loss_mask)
    rollout, skipped, entropy_grad = batch.rollout_logprobs + center, 0, settings.loss_params.entropy_coef > 0
    inert = inert_rows(advantages, loss_mask, settings, ref_model is not None or bool(distill and distill.forward))
    for index, start in enumerate([first for _ in range(settings.epochs) for first in range(0, n, size)]):
        rows = slice(start, start + size)
        mini_mask = loss_mask[rows]
        tokens = mini_mask.sum().clamp_min(1)
        denom = aggregation_denominator(mini_mask, settings.aggregation, settings.aggregation_constant)
        optimizer.zero_grad(set_to_none=True)
        sums: dict[str, torch.Tensor] = {}
        for m0 in range(start, start + size, settings.micro_batch_size):
            part = slice(m0, min(m0 + settings.micro_batch_size, start + size))
            micro = batch.select(part)
            with trainer_compute(settings.trainer_precision):  # forwards only (the chunked head recomputes in backward)
                logprobs, micro_entropy, echo, fkl = _forward(model, micro, sampling, entropy_grad, settings,
                                                              batch.observation_mask, rows, inert[part], distill)
                ref = None if ref_model is None else _reference_logprobs(ref_model, micro, sampling)
            current[part] = logprobs.detach()
            if fused:
                old_logprobs[part], entropy[part] = logprobs.detach(), micro_entropy.detach()
            prox = proximal_logprobs(settings.proximal, spec.mode, logprobs, old_logprobs[part], micro.rollout_logprobs,
                                     micro.has_rollout, micro.versions, version,
                                     None if ewma_logprobs is None else ewma_logprobs[part], center)
            result = mismatch_correction(spec, logprobs, prox, rollout[part], loss_mask[part], micro.has_rollout,
                                         normalizer)
            loss, metrics = policy_loss(
                settings.loss,
                PolicyLossInput(logprobs, prox, advantages[part], loss_mask[part], tokens, result.weights, ref,
                                micro_entropy if entropy_grad else None),
                settings.loss_params, settings.aggregation, denom,
            )
            loss, metrics = _add_terms(loss, metrics, echo, fkl, settings, distill, loss_mask[part], denom, tokens)
            _backward(loss, distill, first=index == 0)
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
            totals[key] = totals.get(key, 0.0) + float(value) / settings.optimizer_steps
    totals["skipped_minibatches"], totals["inert_rows"] = float(skipped), float(inert.float().mean())
    metrics = {f"actor/{k}" if "/" not in k else k: v for k, v in totals.items()}
    release_freed_memory()  # the heap kept this update's freed blocks for its micro-batches (training/allocator.py)
    return UpdateResult(metrics, old_logprobs, current, entropy)


def _check_fusable(fused: bool, settings: UpdateSettings) -> None:
    if fused and not settings.fusable:
        raise ValueError("old_logprobs can only be fused into the update with a single mini-batch, one epoch and no "
                         "batch statistics")


@torch.no_grad()
def _reference_logprobs(ref_model: torch.nn.Module, micro: TokenBatch, sampling: SamplingParams) -> torch.Tensor:
    return sequence_logprobs(ref_model, micro, sampling)[0]


def inert_rows(advantages: torch.Tensor, loss_mask: torch.Tensor, settings: UpdateSettings,
               has_reference: bool) -> torch.Tensor:
    """[B] bool: rows whose gradient is exactly 0, run forward only (no backward) by the update. A row is inert when
    its advantage is 0 (or it has no loss token) everywhere, the loss is in ops/losses.ADVANTAGE_PROPORTIONAL_LOSSES,
    and no term outside the advantage reaches it: no KL reference, no entropy bonus, no observation loss. GRPO's
    constant-reward groups are such rows: their log-probs are still computed (the mismatch metrics need them), at
    the cost of a forward instead of a forward and a backward. In a mini-batch of inert rows only, the first
    micro-batch keeps its backward, so every parameter gets the zero gradient (AdamW's momentum and weight decay
    still step) exactly as without skipping. advantages [B] or [B, T]; loss_mask [B, T] bool."""
    rows, micro = loss_mask.shape[0], settings.micro_batch_size
    if (has_reference or settings.loss_params.entropy_coef > 0 or settings.observation_loss_coef > 0
            or settings.loss not in ADVANTAGE_PROPORTIONAL_LOSSES):
        return torch.zeros(rows, dtype=torch.bool)
    adv = advantages.unsqueeze(-1).expand_as(loss_mask) if advantages.dim() == 1 else advantages
    inert = ~((adv != 0) & loss_mask).any(1)  # NaN != 0: a NaN advantage keeps its row (and its NaN) in the backward
    size = rows // settings.minibatches
    for start in range(0, rows, size):
        if bool(inert[start:start + size].all()):
            inert[start:start + min(micro, size)] = False
    return inert


def _add_terms(loss: torch.Tensor, metrics: dict, echo: torch.Tensor | None, fkl: torch.Tensor | None,
               settings: UpdateSettings, distill: UpdateDistill | None, mask: torch.Tensor, denom: torch.Tensor,
               tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """A micro-batch's policy loss plus ECHO's observation term (observation_loss_coef x echo, metric
    observation_loss) and the forward-KL term: distill.coef x fkl [b, T] aggregated as the policy loss is (the same
    mask [b, T] and mini-batch denominator, so micro-batches sum to the mini-batch's value), metric
    distill/forward_kl = its sum over the mini-batch's `tokens` (a token mean once the micro-batches are summed)."""
    if echo is not None:
        loss, metrics = loss + settings.observation_loss_coef * echo, {**metrics, "observation_loss": echo.detach()}
    if fkl is not None:
        term, value = aggregate(fkl, mask, settings.aggregation, denom), masked_sum(fkl.detach(), mask) / tokens
        loss, metrics = loss + distill.coef * term, {**metrics, "distill/forward_kl": value}
    return loss, metrics


def _backward(loss: torch.Tensor, distill: UpdateDistill | None, first: bool) -> None:
    """loss.backward(), unless no row of the micro-batch has a graph (every row inert); on the update's `first`
    mini-batch R-OPD's gradient probe (distill.probe) then reads the accumulated gradient."""
    if loss.requires_grad:
        loss.backward()
    if first and distill is not None and distill.probe is not None:
        distill.probe.record()


def _forward(model: torch.nn.Module, micro: TokenBatch, sampling: SamplingParams, entropy_grad: bool,
             settings: UpdateSettings, observation_mask: torch.Tensor | None, rows: slice, inert: torch.Tensor,
             distill: UpdateDistill | None = None):
    """(logprobs [b, T], entropy [b, T], ECHO's observation loss of the micro-batch or None, the forward KL [b, T]
    to distill.teacher at the response tokens (micro.mask) or None: training/distillation.forward_kl_pass, one
    forward for both; config refuses it beside ECHO, and no row is inert with it): with
    settings.observation_loss_coef > 0 and observation tokens in the batch, the raw log-probs of the same forward
    give the cross-entropy of the micro-batch's observation tokens over the mini-batch `rows`' count (so the
    micro-batches' parts sum to the mini-batch's token mean; ops/observation_loss.py, ECHO arXiv:2605.24517).
    The `inert` rows [b] bool (inert_rows) run without grad; their log-probs are detached."""
    if distill is not None and distill.forward:
        logprobs, entropy, fkl = forward_kl_pass(model, micro, sampling, entropy_grad, distill, micro.mask)
        return logprobs, entropy, None, fkl
    if settings.observation_loss_coef <= 0 or observation_mask is None or not bool(observation_mask[rows].any()):
        if not bool(inert.any()):
            return (*sequence_logprobs(model, micro, sampling, entropy_grad), None, None)
        return (*_forward_skipping_inert(model, micro, sampling, inert), None, None)
    logprobs, entropy, raw = sequence_logprobs_with_raw(model, micro, sampling, entropy_grad)
    return logprobs, entropy, observation_loss(raw, micro.observation_mask, observation_mask[rows].sum()), None


def _forward_skipping_inert(model: torch.nn.Module, micro: TokenBatch, sampling: SamplingParams,
                            inert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sequence_logprobs of the micro-batch, the inert rows [b] bool run under no_grad (values equal to float32
    rounding: the two row sets may be packed differently; under trainer_precision bf16, to bf16's, about 1e-3 nats)."""
    active, idle = (~inert).nonzero().squeeze(1), inert.nonzero().squeeze(1)
    parts = [sequence_logprobs(model, micro.select(active), sampling)] if len(active) else []
    with torch.no_grad():
        parts.append(sequence_logprobs(model, micro.select(idle), sampling))
    order = torch.argsort(torch.cat([active, idle]))
    return torch.cat([p[0] for p in parts])[order], torch.cat([p[1] for p in parts])[order]

