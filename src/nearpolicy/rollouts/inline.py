"""Synchronous rollouts: each step the in-process engine samples the step's groups with the trainer's current
weights (exported at the rollout precision), so every difference between rollout_logprobs and old_logprobs is
numerical mismatch, not policy lag. With an engine that records its decode calls' shapes (llama.cpp), each step also
reports the rollout's share of its roofline bound (engines/roofline.py), from rates measured once at `start`."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from nearpolicy.engines.base import RolloutEngine, take_decode_counts
from nearpolicy.engines.roofline import MachineRates, measure_rates, roofline_metrics
from nearpolicy.rollouts.base import StepSamples, greedy_single_turn
from nearpolicy.tasks import Problem, Task
from nearpolicy.types import GenerationRequest, SamplingParams


class InlineRollouts:
    """`engine` samples group_size completions of prompts_per_step problems per step; `weights()` gives what
    `engine.update_weights` loads (a freshly exported GGUF path, or a state dict); `prompt_ids` templates a
    problem. Seeds: SeedSequence([seed, step]), so a resumed run samples what the uninterrupted one did."""

    def __init__(self, engine: RolloutEngine, weights: Callable[[], object], task: Task,
                 prompt_ids: Callable[[Problem], list[int]], sampling: SamplingParams, group_size: int,
                 prompts_per_step: int, seed: int):
        self.engine, self.weights, self.task, self.prompt_ids = engine, weights, task, prompt_ids
        self.sampling, self.group_size, self.prompts_per_step, self.seed = sampling, group_size, prompts_per_step, seed
        self.rates: MachineRates | None = None  # the roofline's rates, measured at `start` for an engine with shapes

    def start(self, version: int, data_position: int, state: dict | None) -> None:
        """Publish resumed weights; drop the decode counts of calls made before the run (a startup probe), and for an
        engine whose counts carry a DecodeShape measure the roofline's two rates (engines/roofline.measure_rates,
        about 1 s on the trainer's torch threads, = run.threads)."""
        counts = take_decode_counts(self.engine)
        if counts is not None and counts.shape is not None and self.rates is None:
            self.rates = measure_rates()
        if self.engine.version != version:  # resumed weights
            self.publish(version)

    def step_problems(self, data_position: int) -> dict[int, Problem]:
        """The step's prompts_per_step training problems by group id (= data position)."""
        return {data_position + i: self.task.train_problem(data_position + i) for i in range(self.prompts_per_step)}

    def collect(self, step: int, version: int, data_position: int) -> StepSamples:
        problems = self.step_problems(data_position)
        requests = [GenerationRequest(gid, tuple(self.prompt_ids(p)), self.group_size) for gid, p in problems.items()]
        seed = int(np.random.SeedSequence([self.seed, step]).generate_state(1)[0])
        t0 = time.perf_counter()
        rollouts = self.engine.generate(requests, self.sampling, seed)
        seconds = time.perf_counter() - t0
        return StepSamples(rollouts, problems, data_position + len(problems), self.decode_metrics(seconds))

    def decode_metrics(self, seconds: float | None = None) -> dict[str, float]:
        """rollout/decode_calls, decode_batch_mean (live sequences per call) and decode_occupancy (of the engine's
        max_parallel_sequences) of the engine's generate calls since the last read: this collect's, the greedy eval
        is not counted (engines/base.DecodeCounts); {} for an engine that does not count them (hf, vllm). With the
        calls' shapes and measured rates, the roofline metrics too (engines/roofline.roofline_metrics: roofline_s, and
        roofline_share of `seconds`, generate's wall time; no share without it: an episode's collect also runs
        tools); absent otherwise, never estimated."""
        counts = take_decode_counts(self.engine)
        if counts is None:
            return {}
        known = counts.roofline_steps()
        if known is None or self.rates is None:
            return counts.metrics()
        measured = None if seconds is None else max(seconds, 1e-9)
        return counts.metrics() | roofline_metrics(*known, self.rates, measured)

    def step_metrics(self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, defined: torch.Tensor,
                     versions: torch.Tensor, version: int) -> dict[str, float]:
        return {}

    def publish(self, version: int) -> None:
        self.engine.update_weights(self.weights(), version)

    def eval_engine(self) -> RolloutEngine:
        return self.engine

    def evaluate(self, engine: RolloutEngine, problems: list[Problem], score: Callable) -> tuple[list, list, dict]:
        return greedy_single_turn(engine, [self.prompt_ids(p) for p in problems], self.sampling.max_new_tokens, score)

    def state_dict(self) -> dict | None:
        return None

    def close(self) -> None:
        self.engine.close()
