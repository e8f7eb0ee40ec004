"""The seam between the trainer and wherever a step's samples come from.

A `RolloutSource` hands the trainer complete groups for each step, takes each new version of the weights, reports
its own metrics, keeps what a checkpoint needs to restart it, and owns the in-process engine the trainer
evaluates with. Two implementations: `rollouts.inline.InlineRollouts` (synchronous: the engine samples the step's
groups with the current weights) and `rollouts.replicas.ReplicaRollouts` (asynchronous: engine replicas, local
processes or Ray actors, sample with bounded staleness while the trainer updates). training/assemble.py builds either and the
Trainer only speaks this protocol. A new rollout kind (multi-turn, a remote server) plugs in by implementing it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from nearpolicy.engines.base import RolloutEngine
from nearpolicy.tasks import Problem
from nearpolicy.types import Rollout


@dataclass
class StepSamples:
    """One training step's samples: the rollouts (complete groups), each group's problem by group id (= its data
    position), the source's metrics of this collection, and the data position after these groups (what a
    completed step records)."""

    rollouts: list[Rollout]
    problems: dict[int, Problem]
    next_position: int
    metrics: dict[str, float] = field(default_factory=dict)


def greedy_single_turn(engine: RolloutEngine, prompts: list[list[int]], max_new_tokens: int,
                       score: Callable[[list[list[int]], str], list]) -> tuple[list[list[int]], list, dict[str, float]]:
    """The single-turn sources' `evaluate`: one greedy response per prompt, scored, no extra metrics."""
    completions = engine.greedy(prompts, max_new_tokens)
    return completions, score(completions, ""), {}


class RolloutSource(Protocol):
    def start(self, version: int, data_position: int, state: dict | None) -> None:
        """Begin at policy `version` (the trainer's weights now: pushed to any engine that holds another version)
        and data position, with the `state_dict` a checkpoint kept (None for a fresh run)."""
        ...

    def collect(self, step: int, version: int, data_position: int) -> StepSamples:
        """The samples of step `step` + 1 for the trainer at `version`, starting at `data_position`."""
        ...

    def step_metrics(self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, defined: torch.Tensor,
                     versions: torch.Tensor, version: int) -> dict[str, float]:
        """After the update, before `publish`: the source's metrics of the trained batch ([B, T] trainer old
        log-probs, engine log-probs, defined mask and token versions) and of its own work since the last call."""
        ...

    def publish(self, version: int) -> None:
        """The trainer's current weights are `version`: hand them to the engines."""
        ...

    def eval_engine(self) -> RolloutEngine:
        """The in-process engine, holding the newest published weights (greedy evaluation)."""
        ...

    def evaluate(self, engine: RolloutEngine, problems: list[Problem],
                 score: Callable[[list[list[int]], str], list]) -> tuple[list[list[int]], list, dict[str, float]]:
        """A greedy eval on `problems` with `engine` (eval_engine(), or the trainer's fp32 policy): (completion ids
        per problem, `score(completions, label)`'s results, extra eval/* metrics). Single-turn sources: one greedy
        response of at most sampling.max_new_tokens tokens per prompt (`greedy_single_turn`); episode sources: greedy
        episodes with the tool (and without it)."""
        ...

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps to restart the source (None: nothing)."""
        ...

    def close(self) -> None:
        """Stop every engine the source started; safe to call twice."""
        ...


class SourceWrapper:
    """Base of a RolloutSource around another, `inner` (R-OPD's curriculum, POPO's group replay): publish, eval_engine
    and evaluate pass through to it; the wrapper defines start, collect, step_metrics, state_dict and close."""

    inner: RolloutSource

    def publish(self, version: int) -> None:
        self.inner.publish(version)

    def eval_engine(self) -> RolloutEngine:
        return self.inner.eval_engine()

    def evaluate(self, engine: RolloutEngine, problems: list[Problem],
                 score: Callable[[list[list[int]], str], list]) -> tuple[list[list[int]], list, dict[str, float]]:
        return self.inner.evaluate(engine, problems, score)
