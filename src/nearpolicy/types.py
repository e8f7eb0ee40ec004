"""The names used everywhere: sampling parameters, generation requests and rollouts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "interrupted"]


@dataclass(frozen=True)
class SamplingParams:
    """How the engine turns logits into a token. The returned log-prob is log softmax of the transformed
    logits (logits / temperature, then top-k, then top-p renormalised over the kept set). `ignore_eos`: an
    end-of-generation token does not end the response; it is sampled and kept like any other token, so every response
    runs to its token limit (finish "length") while the distribution, and so every log-prob, stays the same (equal
    work per response for benchmarks: bench/run_all.py's equal-length arm; vLLM's own ignore_eos means the same).

    Raises ValueError for temperature <= 0 (greedy has no sampling distribution; use `greedy=True` on an
    engine's `evaluate` instead), top_p outside (0, 1], top_k < 0 or max_new_tokens < 1."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    max_new_tokens: int = 64  # the default of config sampling.max_new_tokens
    ignore_eos: bool = False  # the default of config sampling.ignore_eos

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature <= 0:
            raise ValueError(
                f"temperature must be > 0, got {self.temperature}: temperature 0 (greedy) has no sampling "
                "distribution and log-probs would need a division by zero; use a small temperature instead"
            )
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must satisfy 0 < top_p <= 1, got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables top-k), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to be sampled `n` times (a GRPO group). `prompt_ids` are token ids, already templated.
    `max_new_tokens` (optional) lowers the sampling's limit for this request (a partial rollout's remainder)."""

    group_id: int
    prompt_ids: tuple[int, ...]
    n: int = 1
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError(f"group {self.group_id}: empty prompt")
        if self.n < 1:
            raise ValueError(f"group {self.group_id}: n must be >= 1, got {self.n}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"group {self.group_id}: max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def token_limit(self, sampling_limit: int) -> int:
        return min(sampling_limit, self.max_new_tokens or sampling_limit)

    def kv_cells(self, sampling_limit: int) -> int:
        """KV cells one of its sequences may fill: the prompt and the token limit."""
        return len(self.prompt_ids) + self.token_limit(sampling_limit)


@dataclass
class Rollout:
    """One sampled response.

    completion_ids   [T] ids exactly as sampled (never re-tokenised), the stop token included when finish='stop'
    rollout_logprobs [T] engine log-prob (nats) of each sampled id under the sampling transform; None = missing
    versions         [T] policy version of the weights that generated each token
    model_mask       [T] True where the model sampled the token, False where the environment inserted it (a tool
                     result and its chat-template framing in a multi-turn episode); None = every token is the model's
    turn_index       [T] 0-based turn of each token (the observation after turn k's tool call carries k); None = one
                     turn

    Raises ValueError when the per-token lists differ in length or an inserted token has an engine log-prob (the
    engine did not sample it: its log-prob must be None, invariant 5).
    """

    group_id: int
    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    rollout_logprobs: list[float | None]
    versions: list[int]
    finish_reason: FinishReason
    reward: float = float("nan")
    extras: dict = field(default_factory=dict)
    model_mask: list[bool] | None = None
    turn_index: list[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.rollout_logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"rollout of group {self.group_id}: {n} completion ids but {len(self.rollout_logprobs)} "
                f"log-probs and {len(self.versions)} versions"
            )
        for name in ("model_mask", "turn_index"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"rollout of group {self.group_id}: {n} completion ids but {len(values)} {name} entries")
        if self.model_mask is not None:
            logged = [t for t, (own, lp) in enumerate(zip(self.model_mask, self.rollout_logprobs))
                      if not own and lp is not None]
            if logged:
                raise ValueError(f"rollout of group {self.group_id}: inserted (tool / template) tokens at {logged[:5]} "
                                 "carry an engine log-prob; the engine did not sample them (use None)")
        if self.turn_index is not None and any(b < a for a, b in zip(self.turn_index, self.turn_index[1:])):
            raise ValueError(f"rollout of group {self.group_id}: turn_index must not decrease along the completion")

    def response_ids(self) -> list[int]:
        """The ids the reward reads: the whole completion, or in a multi-turn episode the last turn's own (model)
        tokens, so a tool's result is never scored as the model's answer."""
        if self.turn_index is None or not self.completion_ids:
            return list(self.completion_ids)
        last, own = self.turn_index[-1], self.model_mask or [True] * len(self.completion_ids)
        return [t for t, k, m in zip(self.completion_ids, self.turn_index, own) if k == last and m]
