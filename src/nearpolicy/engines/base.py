"""The rollout-engine contract.

An engine takes generation requests (prompt ids, group size n) and returns, per sampled sequence, the prompt
ids, the completion ids exactly as sampled, the per-token engine log-prob of each sampled id under the
sampling transform (see ops/logprobs.py), the finish reason and the policy version of each token.
`update_weights` loads new policy weights and bumps the version; `score` returns the engine's log-probs of
given completions (teacher forcing) under a sampling transform, used for sync verification and diagnostics.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from nearpolicy.engines.roofline import DecodeShape, DecodeStep
from nearpolicy.types import GenerationRequest, Rollout, SamplingParams

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

    def update_weights(self, source: "Path | RewrittenGGUF | dict | LoraAdapter", version: int) -> None:
        """Load new policy weights (a GGUF path or RewrittenGGUF, or a state dict, by engine; or, under [lora], a
        LoraAdapter that replaces the adapter on the engine's unchanged base) and set the policy version."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RewrittenGGUF:
    """A llama.cpp update_weights source: every tensor of the GGUF at `path`, the file whose (st_dev, st_ino) is
    `file_id`, was rewritten in place (engines/gguf/inplace.py). An engine mapping that very file keeps its model
    and drops its caches; any other reloads from `path`."""

    path: str
    file_id: tuple[int, int]


@dataclass(frozen=True)
class LoraAdapter:
    """An update_weights source under [lora] (docs/lora.md): the engine keeps its base weights and takes this adapter
    in place of the one it holds (every KV cache dropped). `gguf`: a GGUF LoRA adapter file (llama.cpp;
    engines/gguf/lora_adapter.py); `tensors`: HF base weight name -> (lora_A [r, in], lora_B [out, r]) float32 (an
    engine in this process, e.g. hf); `peft_dir`: a PEFT adapter folder (adapter_config.json +
    adapter_model.safetensors, as peft's save_pretrained writes it; vLLM), its own folder per sync; `scale`: alpha / r,
    the factor of B A. An engine refuses a LoraAdapter without the field it reads with TypeError."""

    gguf: str | None = None
    tensors: dict | None = None
    scale: float = 1.0
    peft_dir: str | None = None


def file_id(path: Path | str) -> tuple[int, int]:
    """(st_dev, st_ino) of `path`: which file a path names (an atomic rewrite makes a new one). Raises OSError."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


@dataclass(frozen=True)
class DecodeCounts:
    """How full an engine's sampling decode calls were: `calls` decode calls after the prefill (each one token for
    every live sequence), `sequences` the live sequences summed over them, `slots` the engine's
    max_parallel_sequences summed over them (what they could have held). Counts add over calls and replicas.
    An engine that also records each call's shape for the roofline (engines/roofline.py; the llama.cpp engine) gives
    `steps`, one DecodeStep per call (its live sequences and their KV positions attended in all), and `shape`, its
    model as the roofline sees it; `roofline_steps` says whether every counted call has one."""

    calls: int = 0
    sequences: int = 0
    slots: int = 0
    steps: tuple[DecodeStep, ...] = ()
    shape: DecodeShape | None = None

    def __add__(self, other: "DecodeCounts") -> "DecodeCounts":
        return DecodeCounts(self.calls + other.calls, self.sequences + other.sequences, self.slots + other.slots,
                            self.steps + other.steps, self.shape or other.shape)

    def metrics(self) -> dict[str, float]:
        """rollout/decode_calls; with at least one call, rollout/decode_batch_mean (live sequences per call) and
        rollout/decode_occupancy (live sequences / slots, in [0, 1])."""
        if self.calls == 0:
            return {"rollout/decode_calls": 0.0}
        return {"rollout/decode_calls": float(self.calls), "rollout/decode_batch_mean": self.sequences / self.calls,
                "rollout/decode_occupancy": self.sequences / max(self.slots, 1)}

    def roofline_steps(self) -> tuple[DecodeShape, tuple[DecodeStep, ...]] | None:
        """(shape, steps) when the roofline of these calls is known: a shape and one step per counted call; None for
        an engine that counts calls only (hf), never a guess."""
        if self.shape is None or len(self.steps) != self.calls:
            return None
        return self.shape, self.steps


def take_decode_counts(engine) -> DecodeCounts | None:
    """The DecodeCounts of `engine`'s generate calls since the last take (the engine's count restarts at zero), or
    None for an engine that does not count them (vllm, the fake engines: their step has no rollout/decode_*)."""
    take = getattr(engine, "take_decode_counts", None)
    return None if take is None else take()


class EngineError(RuntimeError):
    """The engine failed (bad model file, decode failure, out of context)."""


class EngineDied(EngineError):
    """The engine's process ended during a call. `signal_name` is e.g. "SIGSEGV" (or "exit code N"), `phase` what
    the engine was doing, `log_tail` the last lines of its log; `at` ("step 3") is set by the caller that knows."""

    def __init__(self, engine: str, signal_name: str, phase: str, log_tail: list[str], at: str | None = None):
        super().__init__(engine, signal_name, phase, log_tail, at)
        self.engine, self.signal_name, self.phase, self.log_tail, self.at = engine, signal_name, phase, log_tail, at

    def __str__(self) -> str:
        where = f"{self.phase} of {self.at}" if self.at else self.phase
        text = f"engine {self.engine} died with {self.signal_name} during {where}"
        if self.signal_name == "SIGKILL":
            text += " (SIGKILL without a stop request is usually the kernel's out-of-memory killer)"
        if self.log_tail:
            text += "; last lines of its log:\n    " + "\n    ".join(self.log_tail)
        return text
