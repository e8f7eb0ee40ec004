"""Every correction's gradient at fixed weights is a weighted sum of the same per-token gradients.

At the weights that are measured, the trainer's log-probs lp [B, T] are one tensor for every correction; a loss
built by training/update.policy_update from (lp, its proximal, the engine's log-probs, the advantages, the
correction's weights) is then a function of lp (and the entropy, with an entropy bonus) alone, so its gradient is
J^T c with J the per-token gradients d lp / d theta and c = dL / d lp [B, T] (e = dL / d entropy). `coefficients`
runs the library's own correction and loss on a leaf copy of lp and returns c: two corrections with the same c
have the same gradient, and the model's backward runs once per distinct c (measure.same_gradient). The proximal, the DLC
centre, the AIS mix and the self-normalisation mean are decided as policy_update decides them for one mini-batch
holding the whole batch at its first optimizer step (tests/test_gradbias.py checks the gradient against
policy_update's own)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nearpolicy.batching import TokenBatch
from nearpolicy.ops.corrections import mismatch_correction
from nearpolicy.ops.losses import PolicyLossInput, policy_loss
from nearpolicy.ops.masked import aggregation_denominator
from nearpolicy.ops.proximal import proximal_logprobs
from nearpolicy.training.update import UpdateSettings, batch_correction


@dataclass(frozen=True)
class Coefficients:
    """dL / d lp [B, T] float32 (`logprobs`) and dL / d entropy [B, T] or None (`entropy`) of one correction's loss
    on a batch; `weights` [B, T] and `keep` [B, T] bool: its CorrectionResult's weights and kept tokens."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    weights: torch.Tensor
    keep: torch.Tensor


def unsupported(settings: UpdateSettings) -> str | None:
    """Why `settings` cannot be measured this way (None: it can): the EWMA proximal needs a second policy, ECHO's
    observation loss a term outside lp."""
    if settings.proximal == "ewma":
        return "correction.proximal = 'ewma' (the EWMA policy's log-probs are not measured)"
    if settings.observation_loss_coef > 0:
        return "algorithm.observation_loss_coef > 0 (ECHO's observation loss is not a function of the log-probs)"
    return None


def coefficients(batch: TokenBatch, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                 sample_keep: torch.Tensor | None, settings: UpdateSettings, version: int,
                 ref_logprobs: torch.Tensor | None = None, entropy: torch.Tensor | None = None) -> Coefficients:
    """The per-token coefficients of `settings`' loss on `batch` at the weights that gave `old_logprobs` [B, T]
    (the trainer's log-probs, also the current ones here). advantages [B] or [B, T]; sample_keep [B] bool or None;
    version: the trainer's policy version (A-3PO's staleness); ref_logprobs [B, T] for a KL penalty; entropy
    [B, T] the token entropy (needed when entropy_coef > 0). Raises ValueError for `unsupported` settings."""
    why = unsupported(settings)
    if why is not None:
        raise ValueError(f"gradbias cannot measure {why}")
    loss_mask = batch.mask & (sample_keep[:, None] if sample_keep is not None else True)
    tokens = loss_mask.sum().clamp_min(1)
    denom = aggregation_denominator(loss_mask, settings.aggregation, settings.aggregation_constant)
    first = proximal_logprobs(settings.proximal, "decoupled", old_logprobs, old_logprobs, batch.rollout_logprobs,
                              batch.has_rollout, batch.versions, version)
    center, spec, _, normalizer = batch_correction(batch, first, settings, loss_mask)
    lp = old_logprobs.detach().clone().requires_grad_(True)
    bonus = settings.loss_params.entropy_coef > 0
    if bonus and entropy is None:
        raise ValueError("entropy_coef > 0 needs the token entropy")
    ent = entropy.detach().clone().requires_grad_(True) if bonus else None
    prox = proximal_logprobs(settings.proximal, spec.mode, lp, old_logprobs, batch.rollout_logprobs, batch.has_rollout,
                             batch.versions, version, None, center)
    result = mismatch_correction(spec, lp, prox, batch.rollout_logprobs + center, loss_mask, batch.has_rollout,
                                 normalizer)
    loss, _ = policy_loss(settings.loss, PolicyLossInput(lp, prox, advantages, loss_mask, tokens, result.weights,
                                                         ref_logprobs, ent),
                          settings.loss_params, settings.aggregation, denom)
    leaves = [lp] + ([ent] if ent is not None else [])
    grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else [None] * len(leaves)
    c = torch.zeros_like(lp) if grads[0] is None else grads[0].detach()
    e = None if ent is None else (torch.zeros_like(ent) if grads[1] is None else grads[1].detach())
    return Coefficients(c, e, result.weights.detach(), result.keep)


def token_effect(arm: Coefficients, baseline: Coefficients, defined: torch.Tensor) -> tuple[float, float]:
    """(fraction of the defined tokens [B, T] bool whose coefficient the correction changed against `baseline`
    (no correction): relative change > 1e-6, rejections included; the normalised ESS (sum m)^2 / (n sum m^2) of the
    multipliers m = c / c_baseline over the defined tokens with a nonzero baseline coefficient, 1 when unchanged)."""
    base, c = baseline.logprobs, arm.logprobs
    changed = defined & ((c - base).abs() > 1e-6 * base.abs().clamp_min(1e-30))
    n_defined = int(defined.sum())
    live = defined & (base != 0)
    m = (c[live] / base[live]).double()
    ess = float(m.sum() ** 2 / (m.numel() * (m * m).sum())) if m.numel() and float((m * m).sum()) > 0 else float("nan")
    return (float(changed.sum()) / n_defined if n_defined else float("nan")), ess
