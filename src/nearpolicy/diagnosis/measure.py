"""Sample responses from one rollout candidate, recompute the trainer's log-probs of the sampled tokens, and
summarise the mismatch. The trainer (pi) is the fp32 policy; the engine (mu) is the candidate; every ratio is
r = pi / mu on tokens sampled from mu, so the KL estimators are of KL(mu || pi) in nats per token."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nearpolicy.batching import collate
from nearpolicy.diagnosis.candidates import RolloutCandidate
from nearpolicy.engines.factory import EngineInputs, EngineRequest, kind_of
from nearpolicy.engines.factory import build_engine as build_factory_engine
from nearpolicy.engines.gguf.export import round_to_precision, tensor_precision
from nearpolicy.model.load import pad_token_id, stop_token_ids
from nearpolicy.ops.diagnostics import (k3_standard_error, logprob_diff_quantiles, mismatch_by_position,
                                        mismatch_metrics, sequence_ess, sequence_mismatch_metrics)
from nearpolicy.types import GenerationRequest, SamplingParams
from nearpolicy.model.policy import recompute_logprobs, trainer_compute


@dataclass
class DiagnoseContext:
    """What every candidate is measured against: the trainer's policy and the prompts."""

    model: torch.nn.Module  # the trainer's fp32 policy (pi); never modified
    tokenizer: object
    template_gguf: Path | None
    prompts: list[list[int]]
    group_size: int
    sampling: SamplingParams
    workdir: Path
    seed: int = 0
    threads: int = 2
    max_context: int = 1024
    micro_batch_size: int = 8
    position_bucket: int = 8
    max_parallel: int = 64  # engine.max_parallel_sequences
    vllm_kv_cache_gib: float = 1.0  # engine.vllm_kv_cache_gib
    trainer_precision: str = "fp32"  # algorithm.trainer_precision: the trainer's log-probs as the update computes them


@dataclass
class CandidateResult:
    """The mismatch of one candidate: flat float metrics, the per-position profile and timings."""

    candidate: str
    weights: str
    metrics: dict[str, float]
    by_position: dict[str, list[float]] = field(default_factory=dict)

    def row(self) -> dict[str, float | str]:
        return {"candidate": self.candidate, "weights": self.weights, **self.metrics}


def engine_state_dict(ctx: DiagnoseContext, candidate: RolloutCandidate) -> dict[str, torch.Tensor]:
    """The weights the candidate's engine receives: the trainer's; with `weights_only`, each 2-D weight rounded to
    the GGUF type the candidate would store it at (quantize, dequantize; row permutations commute with it)."""
    state = {k: v.detach() for k, v in ctx.model.state_dict().items()}
    if not candidate.weights_only:
        return state
    rounded = {}
    for name, value in state.items():
        if value.ndim >= 2:
            precision = tensor_precision(name, ctx.model.config, candidate.precision, candidate.tensor_precision)
            value = torch.from_numpy(round_to_precision(value.float().numpy(), precision))
        rounded[name] = value
    return rounded


def build_engine(ctx: DiagnoseContext, candidate: RolloutCandidate):
    """Start the candidate's engine on the trainer's weights through the engine factory (engines/factory.py): kinds
    that load a GGUF get one written to ctx.workdir (run in this process, as the measurement always has; with
    `weights_only`, the rounded weights at f32), the others the state dict (vLLM writes an HF folder and starts in its
    own environment)."""
    state = engine_state_dict(ctx, candidate)
    precision, overrides = candidate.precision, candidate.tensor_precision
    inputs = EngineInputs(model=ctx.model, state_dict=state, workdir=ctx.workdir, probe_prompt=ctx.prompts[0])
    if kind_of(candidate.engine).loads == "gguf":
        from nearpolicy.engines.gguf.export import export_gguf

        ctx.workdir.mkdir(parents=True, exist_ok=True)
        inputs.gguf = ctx.workdir / "candidate.gguf"
        if candidate.weights_only:
            precision, overrides = "f32", ()
        export_gguf(state, ctx.model.config, inputs.gguf, precision, ctx.template_gguf, tokenizer=ctx.tokenizer,
                    tensor_precision=overrides)
    else:
        inputs.stop_ids = stop_token_ids(ctx.model, ctx.tokenizer, ctx.template_gguf, ctx.workdir)
    request = EngineRequest(candidate.engine, precision, ctx.max_context, ctx.max_parallel, ctx.threads, overrides,
                            candidate.kv_cache, candidate.flash_attention, seed=ctx.seed,
                            kv_cache_gib=ctx.vllm_kv_cache_gib, isolated=False)
    return build_factory_engine(request, inputs)


def sample_batch(ctx: DiagnoseContext, engine, sampling: SamplingParams, on_samples=lambda n: None):
    """Sample group_size responses per prompt (seeded per prompt, so `on_samples` can drive a progress bar);
    returns (TokenBatch, seconds spent sampling)."""
    t0 = time.perf_counter()
    rollouts = []
    for i, prompt in enumerate(ctx.prompts):
        rollouts += engine.generate([GenerationRequest(i, tuple(prompt), ctx.group_size)], sampling, ctx.seed + i)
        on_samples(ctx.group_size)
    seconds = time.perf_counter() - t0
    return collate(rollouts, pad_token_id(ctx.tokenizer), ctx.model.get_output_embeddings().weight.shape[0]), seconds


def measure_candidate(ctx: DiagnoseContext, candidate: RolloutCandidate, on_samples=lambda n: None) -> CandidateResult:
    """Sample len(prompts) x group_size responses from the candidate, recompute the trainer's log-probs and
    return the mismatch metrics."""
    sampling = candidate.sampling_params(ctx.sampling)
    engine = build_engine(ctx, candidate)
    try:
        batch, seconds = sample_batch(ctx, engine, sampling, on_samples)
    finally:
        engine.close()
    with trainer_compute(ctx.trainer_precision):
        trainer = recompute_logprobs(ctx.model, batch, sampling, ctx.micro_batch_size)[0]
    defined = batch.mask & batch.has_rollout
    result = summarise(candidate, trainer, batch.rollout_logprobs, defined, ctx.position_bucket, seconds)
    aligned = aligned_logprobs(ctx, candidate, batch, sampling)
    if aligned is not None:
        m = mismatch_metrics(aligned, batch.rollout_logprobs, defined)
        q = logprob_diff_quantiles(aligned, batch.rollout_logprobs, defined)
        result.metrics |= {"aligned_k3": float(m["k3"]), "aligned_k1": float(m["k1"]),
                           "aligned_k3_se": float(k3_standard_error(aligned, batch.rollout_logprobs, defined)),
                           "aligned_abs_logprob_diff_p99": float(q["p99"]),
                           "aligned_abs_logprob_diff_max": float(q["max"])}
    return result


def aligned_logprobs(ctx: DiagnoseContext, candidate: RolloutCandidate, batch, sampling: SamplingParams):
    """The precision-aligned trainer's log-probs [B, T] (float32, no grad) of the batch's tokens against a llama.cpp
    candidate (model/aligned.py: its weight types, activation rounding and KV cache), or None where alignment does not
    apply (other engines, weights_only, flash attention, an architecture model/aligned.py does not emulate, a K-quant).
    ctx.model is restored afterwards."""
    from nearpolicy.engines.gguf.export import TENSOR_PRECISIONS
    from nearpolicy.model.aligned import ALIGNED_ARCHITECTURES, align_model

    if (not kind_of(candidate.engine).alignable or candidate.weights_only or candidate.flash_attention
            or ctx.model.config.model_type not in ALIGNED_ARCHITECTURES
            or candidate.precision not in TENSOR_PRECISIONS):  # a K-quant's per-tensor mix is llama.cpp's choice
        return None

    with align_model(ctx.model, candidate.precision, candidate.tensor_precision, candidate.kv_cache):
        return recompute_logprobs(ctx.model, batch, sampling, ctx.micro_batch_size)[0]


def summarise(candidate: RolloutCandidate, trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
              defined: torch.Tensor, bucket: int, seconds: float = float("nan")) -> CandidateResult:
    """Flat metrics of one candidate from [B, T] trainer / engine log-probs on the sampled tokens: per token, and per
    sequence (seq_*: the trainer's mismatch/seq_* metrics, docs/math.md sec. 22)."""
    m = mismatch_metrics(trainer_logprobs, rollout_logprobs, defined)
    q = logprob_diff_quantiles(trainer_logprobs, rollout_logprobs, defined)
    metrics = {k: float(m[k]) for k in ("k1", "k3", "chi2", "ess", "prob_corr", "frac_ratio_outside_0.5_2")}
    metrics |= {f"abs_logprob_diff_{k}": float(v) for k, v in q.items()}
    metrics["k3_se"] = float(k3_standard_error(trainer_logprobs, rollout_logprobs, defined))
    metrics["seq_ess"] = float(sequence_ess(trainer_logprobs, rollout_logprobs, defined))
    metrics |= {k: float(v) for k, v in sequence_mismatch_metrics(trainer_logprobs, rollout_logprobs, defined).items()}
    metrics["tokens"] = float(m["tokens"])
    metrics["sequences"] = float(defined.any(-1).sum())
    metrics["mean_response_tokens"] = metrics["tokens"] / max(metrics["sequences"], 1.0)
    metrics["sampling_seconds"] = seconds
    metrics["tokens_per_s"] = metrics["tokens"] / seconds if seconds > 0 else float("nan")
    profile = mismatch_by_position(trainer_logprobs, rollout_logprobs, defined, bucket)
    return CandidateResult(candidate.name, candidate.weights_description(), metrics,
                           {k: v.tolist() for k, v in profile.items()})
