"""The helpers of a training step that need no Trainer state: scoring response texts, distillation advantages,
turn-credit advantages of multi-turn episodes, the data policy, mismatch diagnostics, the metrics of a step and of an
evaluation (floats for the sinks), and an eval's samples."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from nearpolicy.batching import TokenBatch
from nearpolicy.config.schema import Config
from nearpolicy.ops.advantages import AdvantageResult
from nearpolicy.ops.data_policies import DATA_POLICIES, DataPolicyParams, data_policy_metrics
from nearpolicy.ops.diagnostics import mismatch_decomposition, mismatch_metrics, sequence_mismatch_metrics
from nearpolicy.ops.distill import opd_advantages
from nearpolicy.ops.turn_credit import TurnCreditParams, compute_turn_credit
from nearpolicy.ops.xrpo import novelty_sharpened_advantages, sequence_scores
from nearpolicy.model.policy import recompute_logprobs
from nearpolicy.runs.samples import SAMPLES_PER_EVAL
from nearpolicy.tasks import Problem
from nearpolicy.tasks.scoring import BoundedScorer, ScoreResult
from nearpolicy.types import Rollout, SamplingParams
from nearpolicy.model.turn_values import gold_answer_ids, turn_values
from nearpolicy.training.update import UpdateResult


def score_texts(scorer: BoundedScorer, tokenizer, completions: list[list[int]], problems: list[Problem], phase: str,
                log=print) -> list[ScoreResult]:
    """Score each response text only (never the prompt), in one batch, each call within task.reward_timeout_s:
    NaN when the scorer raises or returns no number in [0, 1] (unscorable), 0 on a timeout. `phase` names the
    step or eval in the warning that failed calls get."""
    texts = [response_text(tokenizer, c) for c in completions]
    results = scorer.score(list(zip(texts, problems)))
    for status in ("error", "timeout"):
        failed = [r for r in results if r.status == status]
        if failed:
            log(f"warning: {phase}: {len(failed)} of {len(results)} reward call(s) "
                f"{'unscorable' if status == 'error' else 'timed out'}, e.g. {failed[0].message}")
    return results


def response_text(tokenizer, completion: list[int]) -> str:
    """The text a reward sees: the completion ids decoded without special tokens."""
    return tokenizer.decode(completion, skip_special_tokens=True)


def eval_samples(step: int, tokenizer, problems: list[Problem], completions: list[list[int]],
                 results: list[ScoreResult], count: int = SAMPLES_PER_EVAL) -> list[dict]:
    """The rows of samples.jsonl (runs/samples.py) for the first `count` eval problems: prompt, reference answer, the
    response text exactly as the reward saw it, its reward and status."""
    rows = []
    for index, (problem, completion, result) in enumerate(list(zip(problems, completions, results))[:count]):
        rows.append({"step": step, "index": index, "prompt": problem.question, "answer": problem.answer,
                     "response": response_text(tokenizer, completion), "reward": result.reward,
                     "status": result.status} | ({"message": result.message} if result.message else {}))
    return rows


def distill_advantages(cfg: Config, teacher: torch.nn.Module, batch: TokenBatch, task_advantages: torch.Tensor,
                       sampling: SamplingParams) -> tuple[torch.Tensor, dict[str, float]]:
    """Token advantages [B, T]: on-policy distillation from the engine's log-probs of its own samples and the
    teacher's, both under the same sampling transform (so the reverse KL compares like with like when T != 1
    or top-k / top-p are on), plus distill.reward_weight x the task advantage [B]. With distill.divergence =
    "forward" the teacher acts through the update's forward-KL term instead (training/distillation.py): its
    advantage part is 0, and distill/teacher_kl (the reverse KL's k1 on the sampled tokens; after an R-OPD switch,
    the initial policy's, not the student's) stays as a diagnostic."""
    d = cfg.distill
    teacher_logprobs = recompute_logprobs(teacher, batch, sampling, cfg.algorithm.micro_batch_size)[0]
    defined = batch.mask & batch.has_rollout
    token_adv, metrics = opd_advantages(batch.rollout_logprobs, teacher_logprobs, defined, d.coef, d.discount)
    token_adv = torch.zeros_like(token_adv) if d.divergence == "forward" else token_adv
    total = token_adv + d.reward_weight * task_advantages[:, None]
    return total.float(), {"distill/teacher_kl": float(metrics["teacher_kl"])}


def turn_credit_advantages(cfg: Config, ref_model: torch.nn.Module | None, tokenizer, batch: TokenBatch,
                           observation_mask: torch.Tensor, turn_index: torch.Tensor, rewards: torch.Tensor,
                           group_ids: torch.Tensor, answers: list[str]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(token advantages [B, T] float32, keep [B] bool, metrics as floats) of algorithm.turn_credit over the
    episodes of `batch` (docs/turn_credit.md). observation_mask [B, T] bool (tool and template tokens), turn_index
    [B, T] int64 (-1 at padding); model tokens = batch.mask & ~observation_mask. For "trace", the frozen
    `ref_model` scores each row's gold answer (`answers`, formatted by algorithm.trace_answer_format) at every
    boundary (turn_values). keep drops unscorable rewards, as the trainer does for the [B] estimators. Raises
    ValueError for "trace" without a ref_model, and what compute_turn_credit raises."""
    a = cfg.algorithm
    values = None
    if a.turn_credit == "trace":
        if ref_model is None:
            raise ValueError("algorithm.turn_credit = 'trace' needs the frozen reference model (training/assemble.py loads it)")
        gold = [gold_answer_ids(tokenizer, answer, a.trace_answer_format) for answer in answers]
        values = turn_values(ref_model, batch, observation_mask, gold, a.micro_batch_size)
    result = compute_turn_credit(a.turn_credit, rewards, group_ids, turn_index, batch.mask & ~observation_mask,
                                 values, TurnCreditParams(trace_weight=a.trace_weight))
    keep = result.keep & torch.isfinite(rewards)
    return result.advantages, keep, {key: float(value) for key, value in result.metrics.items()}


def advantage_signal(advantages: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """advantage/nonzero_frac: the fraction of the kept samples (keep [N] bool) with a nonzero advantage at a response
    token (advantages [N] or [N, T]; mask [N, T] bool); 0 when none is kept. At 0 the policy-gradient term of the step
    trains on nothing (every group constant, a singleton or unscorable: training/guards.py warns)."""
    adv = advantages[:, None].expand(mask.shape) if advantages.dim() == 1 else advantages
    live = ((adv != 0) & mask.bool()).any(-1) & keep.bool()
    return {"advantage/nonzero_frac": float(live.sum()) / max(int(keep.sum()), 1)}


def apply_data_policy(cfg: Config, adv: AdvantageResult, advantages: torch.Tensor, rewards: torch.Tensor,
                      group_ids: torch.Tensor, batch: TokenBatch | None = None
                      ) -> tuple[AdvantageResult, torch.Tensor, dict[str, float]]:
    """algorithm.data_policy on a step's samples (ops/data_policies.py; docs/math.md sec. 23): (the advantage result
    with the policy's keep ANDed into its keep-mask, so the loss denominators count the kept samples only; the
    advantages [N] or [N, T] float32, each kept sample's times its weight (the multiplier of its policy-gradient term,
    every registered loss being homogeneous of degree 1 in A), a dropped sample's 0; the data/* metrics as floats).
    rewards [N]: those the estimator saw (NaN = unscorable or rejected); group_ids [N]. "uniform" changes nothing.
    With [xrpo] novelty the advantages are sharpened first (novelty_sharpening, from `batch`'s engine log-probs; the
    data policy's weight then multiplies the sharpened advantage); raises ValueError there without the batch."""
    a = cfg.algorithm
    metrics = {}
    if cfg.xrpo.sharpening:
        if batch is None:
            raise ValueError("xrpo.novelty sharpens with the engine's log-probs: apply_data_policy needs the step's batch")
        advantages, metrics = novelty_sharpening(cfg, advantages, adv.keep, batch, group_ids)
    result = DATA_POLICIES.get(a.data_policy)(rewards, group_ids, DataPolicyParams(a.data_policy_top_k))
    w, keep = result.weights.to(advantages.dtype), result.keep
    w, keep = (w[:, None], keep[:, None]) if advantages.dim() == 2 else (w, keep)
    scaled = torch.where(keep, advantages * w, torch.zeros_like(advantages))  # selection: a NaN never meets a 0 weight
    metrics |= {f"data/{key}": float(value) for key, value in data_policy_metrics(result, group_ids).items()}
    return replace(adv, keep=adv.keep & result.keep), scaled, metrics


def novelty_sharpening(cfg: Config, advantages: torch.Tensor, keep: torch.Tensor, batch: TokenBatch,
                       group_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """XRPO's novelty sharpening of a step's advantages [N] float32 (ops/xrpo.novelty_sharpened_advantages with
    xrpo.novelty_lambda and novelty_kappa; docs/math.md sec. 26): each response's score is the mean of the engine's
    log-probs (batch.rollout_logprobs [N, T], nats; the sampling policy's, no gradient) over its tokens with one
    (batch.mask & batch.has_rollout), its group by group_ids [N]. Returns (the sharpened advantages [N] float32,
    xrpo/sharpened_frac: the share of the kept samples (keep [N] bool) whose advantage grew, xrpo/bonus_mean: their
    mean gain, 0 when none). Raises ValueError for per-token advantages [N, T] (distillation, turn credit)."""
    if advantages.dim() != 1:
        raise ValueError("xrpo.novelty sharpens sequence advantages [N]; per-token advantages (distillation, turn "
                         "credit) are not sharpened")
    x = cfg.xrpo
    scores = sequence_scores(batch.rollout_logprobs, batch.mask & batch.has_rollout)
    sharpened = novelty_sharpened_advantages(advantages, scores, group_ids, x.novelty_lambda, x.novelty_kappa)
    gain = torch.where(keep, sharpened.double() - advantages.double(), torch.zeros_like(scores))
    grew = gain > 0
    return sharpened, {"xrpo/sharpened_frac": float(grew.sum()) / max(int(keep.sum()), 1),
                       "xrpo/bonus_mean": float(gain[grew].mean()) if grew.any() else 0.0}


def mismatch_diagnostics(update: UpdateResult, batch: TokenBatch, defined: torch.Tensor) -> dict[str, float]:
    """mismatch/*: trainer (old_logprobs) vs engine (rollout_logprobs) over the defined tokens [B, T], per token and
    per sequence (mismatch/seq_*: verl's rollout_corr perplexity family, docs/math.md sec. 22), and its
    decomposition into numerical discrepancy and policy lag (docs/math.md sec. 17)."""
    out = mismatch_metrics(update.old_logprobs, batch.rollout_logprobs, defined)
    out |= sequence_mismatch_metrics(update.old_logprobs, batch.rollout_logprobs, defined)
    out |= mismatch_decomposition(update.logprobs, update.old_logprobs, batch.rollout_logprobs, defined)
    return {f"mismatch/{k}": float(v) for k, v in out.items()}


def reward_stats(rewards: torch.Tensor) -> dict[str, float]:
    """reward/mean and reward/std over the scorable (finite) rewards [N]; NaN when none is scorable."""
    scorable = rewards[torch.isfinite(rewards)]
    mean = float(scorable.mean()) if scorable.numel() else float("nan")
    return {"reward/mean": mean, "reward/std": float(scorable.std()) if scorable.numel() > 1 else 0.0}


def step_metrics(rewards: torch.Tensor, rollouts: list[Rollout], batch: TokenBatch, update: UpdateResult,
                 times: dict[str, float]) -> dict[str, float]:
    """Rewards, response lengths (mean, max, p50 and p90 with linear interpolation), entropy, the update's metrics,
    phase times and throughputs of one step."""
    lengths = batch.mask.sum(1).float()
    return {
        **reward_stats(rewards),
        "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
        "response/length_p50": float(lengths.quantile(0.5)), "response/length_p90": float(lengths.quantile(0.9)),
        "response/frac_truncated": float(np.mean([r.finish_reason == "length" for r in rollouts])),
        "entropy": float(update.entropy[batch.mask].mean()),
        **update.metrics, **times,
        "throughput/rollout_tokens_per_s": float(batch.mask.sum()) / max(times["time/rollout"], 1e-9),
        "throughput/train_tokens_per_s": float(batch.attention_mask.sum()) / max(times["time/update"], 1e-9),
    }


def eval_metrics(results: list[ScoreResult], completions: list[list[int]]) -> dict[str, float]:
    """eval/accuracy over the scorable answers (a timeout counts as wrong), eval/unscorable, eval/response_length."""
    scores = np.array([r.reward for r in results], dtype=float)
    scorable = scores[np.isfinite(scores)]
    return {"eval/accuracy": float(scorable.mean()) if scorable.size else float("nan"),
            "eval/unscorable": float(scores.size - scorable.size),
            "eval/response_length": float(np.mean([len(c) for c in completions]))}


def accuracy_figure(accuracy: float | None) -> dict[str, str]:
    """The progress bar's eval figure `acc=` ({} without an accuracy): after an eval, at step 0 and at a resume."""
    return {} if accuracy is None else {"acc": f"{accuracy:.2f}"}


def progress_postfix(metrics: dict[str, float], before: dict[str, str] | None = None) -> dict[str, str]:
    """The progress bar's figures after a step: reward, k3 mismatch, and the latest eval accuracy (kept from
    `before`, the previous figures, on steps without an eval)."""
    figures = dict(reward=f"{metrics['reward/mean']:.2f}", k3=f"{metrics.get('mismatch/k3', float('nan')):.1e}")
    if metrics.get("eval/accuracy") is not None:
        figures |= accuracy_figure(metrics["eval/accuracy"])
    elif before and "acc" in before:
        figures["acc"] = before["acc"]
    return figures
