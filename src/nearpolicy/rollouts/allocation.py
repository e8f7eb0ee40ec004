"""XRPO's rollout allocator as a rollout source ([xrpo] allocate; ops/xrpo.py, docs/math.md sec. 26).

`RolloutAllocation` wraps the run's synchronous single-turn source (`inner`, rollouts/inline.InlineRollouts; built by
training/xrpo.xrpo_rollouts). Each collect takes the inner source's problems of the step and samples them in two
rounds with its engine and sampling transform:

1. first_round samples of each prompt (seed SeedSequence([seed, step]), as the inner source's own collect), scored by
   `score` (the task's reward, bounded as the trainer's; the trainer scores every sample again with its own scorer);
2. the rest of the step's budget, prompts x (group_size - first_round) samples, given one at a time by
   ops/xrpo.allocate_rollouts (Student-t half-width reduction of each prompt's mean reward + the exploration bonus at
   T = step + 1, the step being collected, so the bonus is live from the first step), sampled with seed
   SeedSequence([seed, step, 1]); a prompt's extra samples go out in requests of at most max_parallel (an engine
   decodes one request in one batch).

Each prompt's rounds come back as ONE group (its data position as group id, sample indices 0, 1, ... over both
rounds), so groups differ in size and the step still holds prompts x group_size samples. Seeding (settings.seeding,
reconstructed: the paper's exact form was not read here): a prompt whose first round scored all 0 (every finite reward
0) and that got at least two extra samples (one stays in its prompt's group, where a correct one gives signal) gets
them drawn from a seeded prompt, the task's prompt with a solved problem of the run in context (the newest exemplar of
another question whose seeded prompt fits max_prompt_tokens; `seeded_prompt` builds its ids). Those samples keep the
seeded prompt as their prompt ids and form their own group, id SEEDED_GROUP_OFFSET + data position, mapped to the same
problem: the trainer's log-probs are then computed in the context that sampled them (the importance ratios stay those
of an ordinary sample), and they are compared only with each other. Exemplars: the first full-reward (>= 1)
first-round response of each problem, newest first, one per question, at most settings.exemplars; they ride in
`state_dict`, so a resumed run seeds as the uninterrupted one would.

Metrics at collect: xrpo/group_size_min, xrpo/group_size_max (the step's groups as the trainer gets them, seeded ones
included), xrpo/extra_max (most extra samples one prompt got), xrpo/constant_prompts (first rounds of reward std 0),
xrpo/seeded_groups, xrpo/seeded_samples, xrpo/unseeded_zero_prompts (all-0 prompts with extra samples but no exemplar
that fits), xrpo/exemplars (kept after the step)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from nearpolicy.ops.xrpo import allocate_rollouts, prompt_reward_stats
from nearpolicy.rollouts.base import SourceWrapper, StepSamples
from nearpolicy.rollouts.inline import InlineRollouts
from nearpolicy.tasks import Problem
from nearpolicy.types import GenerationRequest, Rollout

SEEDED_GROUP_OFFSET = 1 << 48  # seeded groups' ids: above any data position, non-negative (engines seed by ids)
FULL_REWARD = 1.0  # a first-round response at or above this reward solved its problem (an exemplar)


@dataclass(frozen=True)
class AllocationSettings:
    """[xrpo]'s plain settings: first_round (>= 2 samples per prompt before the allocation), group_size (the step's
    mean samples per prompt: the budget is prompts x (group_size - first_round)), alpha and exploration (the
    allocator's), seeding (on/off), max_parallel (most samples of one engine request), max_prompt_tokens (the longest
    seeded prompt that still leaves room for a response), exemplars (most solved problems kept)."""

    first_round: int
    group_size: int
    alpha: float
    exploration: float
    seeding: bool
    max_parallel: int
    max_prompt_tokens: int
    exemplars: int = 16

    def __post_init__(self) -> None:
        if not 2 <= self.first_round < self.group_size:
            raise ValueError(f"need 2 <= first_round < group_size, got {self.first_round}, {self.group_size}")
        if self.max_parallel < 1 or self.exemplars < 1:
            raise ValueError(f"max_parallel and exemplars must be >= 1, got {self.max_parallel}, {self.exemplars}")


@dataclass(frozen=True)
class Exemplar:
    """A problem the run solved: its question and a full-reward response text (what a seeded prompt puts in
    context as a user / assistant turn)."""

    question: str
    response: str


@dataclass(frozen=True)
class _Request:
    """One engine request of a round: the group its samples join, their first sample index, the prompt and count."""

    group_id: int
    first_index: int
    prompt_ids: tuple[int, ...]
    n: int


class RolloutAllocation(SourceWrapper):
    """RolloutSource: `inner`'s problems, sampled in two rounds with the extra samples allocated by XRPO (module
    docstring). score(rollouts, problems) -> a reward per rollout (NaN = unscorable); response_text(ids) -> the text
    a reward reads; seeded_prompt(problem, exemplar) -> the seeded prompt's ids; close_score() stops the scorer."""

    def __init__(self, inner: InlineRollouts, score: Callable[[list[Rollout], dict[int, Problem]], list[float]],
                 response_text: Callable[[list[int]], str], seeded_prompt: Callable[[Problem, Exemplar], list[int]],
                 settings: AllocationSettings, close_score: Callable[[], None] = lambda: None):
        self.inner, self.score, self.response_text, self.seeded_prompt = inner, score, response_text, seeded_prompt
        self.settings, self.close_score = settings, close_score
        self.exemplars: list[Exemplar] = []  # newest first
        self.generate_s = 0.0  # seconds in the engine's generate calls of the collect in progress

    def start(self, version: int, data_position: int, state: dict | None) -> None:
        state = state or {}
        self.inner.start(version, data_position, state.get("inner"))
        self.exemplars = [Exemplar(**e) for e in state.get("exemplars", [])]

    def collect(self, step: int, version: int, data_position: int) -> StepSamples:
        s, inner = self.settings, self.inner
        problems = inner.step_problems(data_position)
        self.generate_s = 0.0
        first = self._sample([_Request(gid, 0, tuple(inner.prompt_ids(p)), s.first_round)
                              for gid, p in problems.items()], [inner.seed, step])
        rewards = torch.tensor(self.score(first, problems), dtype=torch.float64)
        ids, std, _ = prompt_reward_stats(rewards, torch.tensor([r.group_id for r in first], dtype=torch.long))
        n = torch.full((ids.numel(),), s.first_round, dtype=torch.long)
        budget = len(problems) * (s.group_size - s.first_round)
        extra = dict(zip(ids.tolist(), allocate_rollouts(std, n, budget, step + 1, s.alpha, s.exploration).tolist()))
        self._remember(first, rewards, problems)
        all_zero = {gid for gid in problems if _all_zero(rewards, first, gid)}
        requests, seeded, missed = [], {}, 0
        for gid, problem in problems.items():
            target, prompt, index = gid, tuple(inner.prompt_ids(problem)), s.first_round
            if s.seeding and gid in all_zero and extra[gid] >= 2:  # a seeded group of one would get advantage 0
                found = self._seeded(problem)
                missed += found is None
                if found is not None:
                    target, prompt, index = SEEDED_GROUP_OFFSET + gid, tuple(found), 0
                    seeded[target] = problem
            for start in range(0, extra[gid], s.max_parallel):
                requests.append(_Request(target, index + start, prompt, min(s.max_parallel, extra[gid] - start)))
        second = self._sample(requests, [inner.seed, step, 1])
        rollouts = _in_groups(first + second, list(problems), seeded)
        sizes = [sum(r.group_id == g for r in rollouts) for g in [*problems, *seeded]]
        metrics = {"xrpo/group_size_min": float(min(sizes)), "xrpo/group_size_max": float(max(sizes)),
                   "xrpo/extra_max": float(max(extra.values())), "xrpo/constant_prompts": float((std == 0).sum()),
                   "xrpo/seeded_groups": float(len(seeded)),
                   "xrpo/seeded_samples": float(sum(r.group_id in seeded for r in rollouts)),
                   "xrpo/unseeded_zero_prompts": float(missed), "xrpo/exemplars": float(len(self.exemplars))}
        return StepSamples(rollouts, problems | seeded, data_position + len(problems),
                           inner.decode_metrics(self.generate_s) | metrics)

    def _sample(self, requests: list[_Request], entropy: list[int]) -> list[Rollout]:
        """The requests' samples from the inner engine, each moved to its group with its sample indices (the engine
        gets each request under its position in `requests` as a temporary group id)."""
        if not requests:
            return []
        seed = int(np.random.SeedSequence(entropy).generate_state(1)[0])
        asked = [GenerationRequest(i, r.prompt_ids, r.n) for i, r in enumerate(requests)]
        t0 = time.perf_counter()
        out = self.inner.engine.generate(asked, self.inner.sampling, seed)
        self.generate_s += time.perf_counter() - t0  # the roofline share's wall time: the engine's, not the scorer's
        return [replace(r, group_id=requests[r.group_id].group_id,
                        sample_index=requests[r.group_id].first_index + r.sample_index) for r in out]

    def _remember(self, rollouts: list[Rollout], rewards: torch.Tensor, problems: dict[int, Problem]) -> None:
        """Keep the first full-reward response of each solved problem as an exemplar, newest first."""
        added: set[str] = set()
        for r, reward in zip(rollouts, rewards.tolist()):
            question = problems[r.group_id].question
            if not reward >= FULL_REWARD or question in added:  # NaN (unscorable) is no solution either
                continue
            text = self.response_text(r.response_ids())
            if text.strip():  # a chat turn needs content
                added.add(question)
                self.exemplars = [Exemplar(question, text)] + [e for e in self.exemplars if e.question != question]
        self.exemplars = self.exemplars[: self.settings.exemplars]

    def _seeded(self, problem: Problem) -> list[int] | None:
        """The ids of `problem`'s prompt seeded with the newest exemplar of another question that fits
        max_prompt_tokens; None when there is none."""
        for exemplar in self.exemplars:
            if exemplar.question != problem.question:
                ids = self.seeded_prompt(problem, exemplar)
                if len(ids) <= self.settings.max_prompt_tokens:
                    return ids
        return None

    def step_metrics(self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, defined: torch.Tensor,
                     versions: torch.Tensor, version: int) -> dict[str, float]:
        return self.inner.step_metrics(old_logprobs, rollout_logprobs, defined, versions, version)

    def state_dict(self) -> dict | None:
        return {"inner": self.inner.state_dict(),
                "exemplars": [{"question": e.question, "response": e.response} for e in self.exemplars]}

    def close(self) -> None:
        try:
            self.close_score()
        finally:
            self.inner.close()


def _all_zero(rewards: torch.Tensor, rollouts: list[Rollout], group_id: int) -> bool:
    """Whether group `group_id`'s finite first-round rewards are all 0 (and there is at least one)."""
    mine = rewards[torch.tensor([r.group_id == group_id for r in rollouts])]
    mine = mine[torch.isfinite(mine)]
    return bool(mine.numel()) and bool((mine == 0).all())


def _in_groups(rollouts: list[Rollout], order: list[int], seeded: dict[int, Problem]) -> list[Rollout]:
    """`rollouts` ordered by group (each prompt's group, then its seeded group), by sample index within a group."""
    rank = {gid: 2 * i for i, gid in enumerate(order)} | {gid: 2 * order.index(gid - SEEDED_GROUP_OFFSET) + 1
                                                           for gid in seeded}
    return sorted(rollouts, key=lambda r: (rank[r.group_id], r.sample_index))
