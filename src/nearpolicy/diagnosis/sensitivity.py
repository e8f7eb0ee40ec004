"""Per-layer sensitivity: quantize one unit (a transformer block, or one tensor kind across all blocks) to the
candidate precision while every other tensor stays at the reference precision, and measure the mismatch it adds.

All variants are scored by teacher forcing on the same responses (sampled once from the reference engine), so
the comparison is paired: added_k3(unit) = k3(variant) - k3(reference), token-mean k3 = mean(r - 1 - log r)
with r = pi_trainer / mu_variant over the reference responses' tokens (nats per token)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from nearpolicy.diagnosis.candidates import RolloutCandidate
from nearpolicy.diagnosis.measure import DiagnoseContext, build_engine, sample_batch
from nearpolicy.ops.diagnostics import mismatch_metrics
from nearpolicy.model.policy import recompute_logprobs, trainer_compute


@dataclass(frozen=True)
class ScoredSamples:
    """Reference responses with the trainer's log-probs: prompts / completions per sequence, trainer [B, T]."""

    prompts: list[list[int]]
    completions: list[list[int]]
    trainer_logprobs: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class UnitSensitivity:
    unit: str  # selector: "blk.N" or a tensor kind (embeddings, attention, mlp, output)
    kind: str  # "block" or "tensor kind"
    k3: float  # teacher-forced k3 of the variant (nats / token)
    added_k3: float  # k3 - reference k3
    parameters: int  # weights the unit holds


def reference_samples(ctx: DiagnoseContext, reference: RolloutCandidate) -> ScoredSamples:
    """Sample responses from the reference engine and recompute the trainer's log-probs on them."""
    engine = build_engine(ctx, reference)
    sampling = reference.sampling_params(ctx.sampling)
    try:
        batch, _ = sample_batch(ctx, engine, sampling)
    finally:
        engine.close()
    with trainer_compute(ctx.trainer_precision):  # as measure_candidate scores the candidates
        trainer = recompute_logprobs(ctx.model, batch, sampling, ctx.micro_batch_size)[0]
    completions = [ids[m].tolist() for ids, m in zip(batch.completion_ids, batch.mask)]
    prompts = [p for p in ctx.prompts for _ in range(ctx.group_size)]
    return ScoredSamples(prompts, completions, trainer, batch.mask)


def teacher_forced_k3(ctx: DiagnoseContext, candidate: RolloutCandidate, samples: ScoredSamples) -> float:
    """Token-mean k3 of trainer vs the candidate's engine, scored by teacher forcing on `samples`."""
    engine = build_engine(ctx, candidate)
    sampling = candidate.sampling_params(ctx.sampling)
    engine_logprobs = torch.full_like(samples.trainer_logprobs, float("nan"))
    try:
        for i, (prompt, completion) in enumerate(zip(samples.prompts, samples.completions)):
            engine_logprobs[i, : len(completion)] = torch.tensor(engine.score(prompt, completion, sampling))
    finally:
        engine.close()
    return float(mismatch_metrics(samples.trainer_logprobs, engine_logprobs, samples.mask)["k3"])


def sensitivity_units(model: torch.nn.Module) -> list[tuple[str, str, int]]:
    """(selector, kind, parameter count) for every tensor kind and every block of a llama model."""
    cfg = model.config
    layers = model.model.layers
    attn = sum(p.numel() for layer in layers for p in layer.self_attn.parameters())
    mlp = sum(p.numel() for layer in layers for p in layer.mlp.parameters())
    embed = model.get_input_embeddings().weight.numel()
    units = [("embeddings", "tensor kind", embed), ("attention", "tensor kind", attn), ("mlp", "tensor kind", mlp)]
    if not getattr(cfg, "tie_word_embeddings", False):
        units.append(("output", "tensor kind", model.get_output_embeddings().weight.numel()))
    units += [(f"blk.{i}", "block", sum(p.numel() for p in layer.parameters() if p.ndim >= 2))
              for i, layer in enumerate(layers)]
    return units


def scan(ctx: DiagnoseContext, precision: str, reference: RolloutCandidate,
         samples: ScoredSamples | None = None, progress: bool = True) -> tuple[float, float, list[UnitSensitivity]]:
    """Quantize each unit alone to `precision` on top of `reference` (a llamacpp candidate, e.g. f32). Returns
    (reference k3, k3 with every tensor at `precision`, units sorted by added k3, largest first)."""
    samples = samples or reference_samples(ctx, reference)
    units = sensitivity_units(ctx.model)
    bar = tqdm(total=len(units) + 2, desc=f"sensitivity {precision}", disable=not progress, dynamic_ncols=True)
    base = teacher_forced_k3(ctx, reference, samples)
    bar.update(1)
    full = teacher_forced_k3(ctx, reference.with_overrides((("*", precision),)), samples)
    bar.update(1)
    results = []
    for selector, kind, params in units:
        k3 = teacher_forced_k3(ctx, reference.with_overrides(((selector, precision),)), samples)
        results.append(UnitSensitivity(selector, kind, k3, k3 - base, params))
        bar.update(1)
    bar.close()
    return base, full, sorted(results, key=lambda u: u.added_k3, reverse=True)
