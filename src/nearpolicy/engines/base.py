"""The rollout-engine contract.

An engine takes generation requests (prompt ids, group size n) and returns, per sampled sequence, the prompt
ids, the completion ids exactly as sampled, the per-token engine log-prob of each sampled id under the
sampling transform (see ops/logprobs.py), the finish reason and the policy version of each token.
`update_weights` loads new policy weights and bumps the version; `score` returns the engine's log-probs of
given completions (teacher forcing) under a sampling transform, used for sync verification and diagnostics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from nearpolicy.types import GenerationRequest, Rollout, SamplingParams

ENGINE_KINDS = ("llamacpp", "hf", "vllm")
"""config engine.kind: llamacpp (engines/llamacpp.py, GGUF weights), hf (engines/hf.py, transformers) or vllm
(engines/vllm_engine.py, vLLM in its own environment and process)."""

LLAMA_MAX_SEQ = 256
"""llama.cpp's compile-time limit on sequences per context (LLAMA_MAX_SEQ in src/llama-cparams.h)."""


@runtime_checkable
class RolloutEngine(Protocol):
    version: int

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams, seed: int) -> list[Rollout]:
        """Sample `request.n` completions per request; rollouts ordered by (request, sample index)."""
        ...

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy (argmax) completions for evaluation; no log-probs (greedy has no sampling distribution)."""
        ...

    def score(self, prompt_ids: list[int], completion_ids: list[int], sampling: SamplingParams) -> list[float]:
        """Engine log-probs [T] of `completion_ids` after `prompt_ids` under the sampling transform."""
        ...

    def is_stop_token(self, token: int) -> bool:
        """True for every id that ends a response (the engine's end-of-generation set)."""
        ...

    def update_weights(self, source: Path | dict, version: int) -> None:
        """Load new policy weights (a GGUF path or a state dict, by engine) and set the policy version."""
        ...

    def close(self) -> None: ...


class EngineError(RuntimeError):
    """The engine failed (bad model file, decode failure, out of context)."""
