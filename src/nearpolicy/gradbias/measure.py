"""One replicate batch of a source: sample, score, advantages, then every correction's gradient sketch.

`sample_batch` draws the batch exactly as a training step would (the engine's generate on the step's groups, the
task's reward, the config's advantage estimator: training/trainer.step_advantages). `batch_gradients` computes the
per-token coefficients of each correction (coefficients.py), runs the model forward once per micro-batch with
grad, and one backward per distinct coefficient tensor (corrections that leave a batch unchanged share it), over
the rows where some coefficient is nonzero (GRPO's constant-reward groups have none)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nearpolicy.batching import TokenBatch
from nearpolicy.gradbias.coefficients import Coefficients, coefficients, token_effect
from nearpolicy.gradbias.sketch import GradientSketch
from nearpolicy.model.policy import recompute_logprobs, sequence_logprobs
from nearpolicy.ops.diagnostics import mismatch_metrics
from nearpolicy.training.update import UpdateSettings
from nearpolicy.types import Rollout, SamplingParams


@dataclass
class SampledBatch:
    """A replicate's batch: rollouts (rewards set), the token batch, advantages [B] or [B, T], keep [B] bool."""

    rollouts: list[Rollout]
    batch: TokenBatch
    advantages: torch.Tensor
    keep: torch.Tensor


@dataclass
class BatchResult:
    """The sketches [width] float64 by correction name, each correction's (changed fraction, ESS), and the batch's
    facts: k3 KL(mu || pi) of the source against the trainer (nats/token), mean reward, mean response length,
    truncated share, distinct backward passes run."""

    sketches: dict[str, np.ndarray]
    effects: dict[str, tuple[float, float]]
    facts: dict[str, float]


def batch_gradients(model: torch.nn.Module, sketch: GradientSketch, sampled: SampledBatch, sampling: SamplingParams,
                    arms: dict[str, UpdateSettings], version: int, micro: int,
                    ref_model: torch.nn.Module | None = None) -> BatchResult:
    """Every arm's gradient sketch on one batch at the model's current weights (its trainer version `version`).
    The first arm is the baseline the token effects are measured against (no correction: "off"). `micro` rows per
    forward; ref_model: the frozen KL reference (kl_coef > 0)."""
    batch = sampled.batch
    bonus = any(s.loss_params.entropy_coef > 0 for s in arms.values())
    old, entropy = recompute_logprobs(model, batch, sampling, micro)
    ref = None if ref_model is None else recompute_logprobs(ref_model, batch, sampling, micro)[0]
    coeffs = {name: coefficients(batch, old, sampled.advantages, sampled.keep, s, version,
                                 ref if s.loss_params.kl_coef > 0 else None, entropy) for name, s in arms.items()}
    distinct: list[Coefficients] = []
    shared: dict[str, int] = {}
    for name, c in coeffs.items():
        shared[name] = next((i for i, d in enumerate(distinct) if same_gradient(c, d)), len(distinct))
        if shared[name] == len(distinct):
            distinct.append(c)
    grads = _backward(model, batch, sampling, distinct, micro, bonus)
    sketches = [sketch(g) for g in grads]
    defined = batch.mask & batch.has_rollout & sampled.keep[:, None]
    baseline = next(iter(coeffs.values()))
    mismatch = mismatch_metrics(old, batch.rollout_logprobs, defined)
    lengths = batch.mask.sum(1).float()
    facts = {"k3": float(mismatch["k3"]), "reward": float(np.nanmean([r.reward for r in sampled.rollouts])),
             "length": float(lengths.mean()),
             "truncated": float(np.mean([r.finish_reason == "length" for r in sampled.rollouts])),
             "backward_passes": float(len(distinct))}
    return BatchResult({name: sketches[shared[name]] for name in coeffs},
                       {name: token_effect(c, baseline, defined) for name, c in coeffs.items()}, facts)


SAME_GRADIENT_TOLERANCE = 1e-5
"""Two corrections whose coefficients differ by at most this share of the largest one share one backward pass: their
gradients then differ by at most about that share of a gradient's norm, far below the sketch's 0.4 % distortion."""


def same_gradient(a: Coefficients, b: Coefficients) -> bool:
    """True when `a` and `b` give the same gradient to SAME_GRADIENT_TOLERANCE (relative to the largest coefficient)."""
    def close(x, y):
        scale = float(torch.maximum(x.abs().max(), y.abs().max())) if x.numel() else 0.0
        return float((x - y).abs().max()) <= SAME_GRADIENT_TOLERANCE * scale if scale > 0 else True

    if (a.entropy is None) != (b.entropy is None):
        return False
    return close(a.logprobs, b.logprobs) and (a.entropy is None or close(a.entropy, b.entropy))


def _backward(model: torch.nn.Module, batch: TokenBatch, sampling: SamplingParams, coeffs: list[Coefficients],
              micro: int, bonus: bool) -> list[list[torch.Tensor | None]]:
    """J^T c (+ J_entropy^T e) for each coefficient set, one list of per-parameter tensors each: the forward runs
    once per micro-batch of the rows with a nonzero coefficient, the backward once per set (graph retained)."""
    params = [p for p in model.parameters() if p.requires_grad]
    sums: list[list[torch.Tensor | None]] = [[None] * len(params) for _ in coeffs]
    live = torch.zeros(len(batch), dtype=torch.bool)
    for c in coeffs:
        live |= (c.logprobs != 0).any(1)
        if c.entropy is not None:
            live |= (c.entropy != 0).any(1)
    rows = live.nonzero().squeeze(1)
    for start in range(0, len(rows), micro):
        part = rows[start:start + micro]
        logprobs, entropy = sequence_logprobs(model, batch.select(part), sampling, bonus)
        for k, c in enumerate(coeffs):
            outputs, weights = [logprobs], [c.logprobs[part]]
            if bonus and c.entropy is not None:
                outputs, weights = outputs + [entropy], weights + [c.entropy[part]]
            got = torch.autograd.grad(outputs, params, weights, retain_graph=k < len(coeffs) - 1, allow_unused=True)
            sums[k] = [g if s is None else (s if g is None else s.add_(g)) for s, g in zip(sums[k], got)]
        del logprobs, entropy
    return sums
