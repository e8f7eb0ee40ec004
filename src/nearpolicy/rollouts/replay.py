"""POPO's prioritized group replay as a rollout source (popo.enabled; ops/popo.py, docs/math.md sec. 25).

`GroupReplay` wraps the run's synchronous single-turn source (`inner`, training/assemble.py builds both). Each
collect it scores the inner source's fresh groups (`score`: the task's reward, bounded as the trainer's), and every
group without a learning signal (constant or fewer than two scorable rewards: ops/popo.group_spread) gives its slot to
a stored effective group, the eligible ones (age <= max_age versions) taken by priority s_g * decay^age
(ops/popo.replay_priority / top_priority). A replayed group comes back exactly as it was sampled: its prompt, token
ids, the engine's log-probs (mu, of the weights that sampled it) and each token's version, under its own group id
(its data position, whose problem `problem` gives again); the trainer scores it again and recomputes pi_old at the
current weights, so its tokens count as stale in every staleness measure and the decoupled correction weights them by
pi_old / mu. A group is replayed once: it leaves the buffer when it is taken. After the selection the step's fresh
effective groups enter the buffer (newest first, so ties of priority go to the newest), groups older than max_age
leave it, and beyond `buffer_groups` the lowest priorities go. The data position is the inner source's: replay
consumes no problems.

Metrics: popo/constant_groups (fresh groups without signal), popo/replayed_groups, popo/buffer_groups (after the
step's insertions) at collect; after the update popo/replayed_tokens, popo/replayed_age_mean (versions) and
popo/replayed_log_weight_mean / _abs_mean (log pi_old / mu over the stale tokens, nats; NaN when none). The buffer
rides in `state_dict` (the checkpoint's restart state), so a resumed run replays what the uninterrupted one would."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from nearpolicy.ops.popo import group_spread, replay_priority, replayed_token_stats, top_priority
from nearpolicy.rollouts.base import RolloutSource, SourceWrapper, StepSamples
from nearpolicy.tasks import Problem
from nearpolicy.types import Rollout

ROLLOUT_FIELDS = ("sample_index", "prompt_ids", "completion_ids", "rollout_logprobs", "versions", "finish_reason")


@dataclass(frozen=True)
class ReplaySettings:
    """[popo]'s plain settings: buffer_groups (most stored groups), max_age (versions), recency_decay (lambda)."""

    buffer_groups: int
    max_age: int
    recency_decay: float


@dataclass(frozen=True)
class StoredGroup:
    """An effective group as sampled: its group id (data position), the version that sampled it, its reward spread
    s_g and its rollouts (reward left NaN: the trainer scores a replayed group again)."""

    group_id: int
    version: int
    spread: float
    rollouts: tuple[Rollout, ...]

    def state(self) -> dict:
        return {"group_id": self.group_id, "version": self.version, "spread": self.spread,
                "rollouts": [{name: getattr(r, name) for name in ROLLOUT_FIELDS} for r in self.rollouts]}

    @classmethod
    def from_state(cls, state: dict) -> "StoredGroup":
        rollouts = tuple(Rollout(group_id=state["group_id"], **{name: r[name] for name in ROLLOUT_FIELDS})
                         for r in state["rollouts"])
        return cls(int(state["group_id"]), int(state["version"]), float(state["spread"]), rollouts)


def _fresh_copy(r: Rollout) -> Rollout:
    """The rollout as sampled, its lists copied, no reward or extras (what the buffer keeps and a replay returns)."""
    return replace(r, prompt_ids=list(r.prompt_ids), completion_ids=list(r.completion_ids),
                   rollout_logprobs=list(r.rollout_logprobs), versions=list(r.versions), reward=float("nan"),
                   extras={})


class GroupReplay(SourceWrapper):
    """RolloutSource: `inner`'s groups, those without a learning signal replaced by stored effective groups (module
    docstring). score(rollouts, problems) -> a reward per rollout (NaN = unscorable); problem(group_id) -> its
    problem; close_score() stops the scorer."""

    def __init__(self, inner: RolloutSource, score: Callable[[list[Rollout], dict[int, Problem]], list[float]],
                 problem: Callable[[int], Problem], settings: ReplaySettings,
                 close_score: Callable[[], None] = lambda: None):
        self.inner, self.score, self.problem, self.settings = inner, score, problem, settings
        self.close_score = close_score
        self.buffer: list[StoredGroup] = []  # newest first

    def start(self, version: int, data_position: int, state: dict | None) -> None:
        state = state or {}
        self.inner.start(version, data_position, state.get("inner"))
        self.buffer = [StoredGroup.from_state(g) for g in state.get("buffer", [])]

    def collect(self, step: int, version: int, data_position: int) -> StepSamples:
        got = self.inner.collect(step, version, data_position)
        rewards = torch.tensor(self.score(got.rollouts, got.problems), dtype=torch.float64)
        groups: dict[int, list[Rollout]] = {}
        for r in got.rollouts:
            groups.setdefault(r.group_id, []).append(r)
        spread = group_spread(rewards, torch.tensor([r.group_id for r in got.rollouts], dtype=torch.long))
        signal = {int(g): (float(s), bool(e)) for g, s, e in zip(spread.ids, spread.spread, spread.effective)}
        constant = [gid for gid in groups if not signal[gid][1]]
        self.buffer = [g for g in self.buffer if version - g.version <= self.settings.max_age]
        taken = self._take(len(constant), version)
        swaps = dict(zip(constant, taken))
        rollouts, problems = [], dict(got.problems)
        for gid, members in groups.items():
            if gid in swaps:
                stored = swaps[gid]
                rollouts += [_fresh_copy(r) for r in stored.rollouts]
                problems.pop(gid)
                problems[stored.group_id] = self.problem(stored.group_id)
            else:
                rollouts += members
        fresh = [StoredGroup(gid, version, signal[gid][0], tuple(_fresh_copy(r) for r in members))
                 for gid, members in groups.items() if signal[gid][1]]
        self.buffer = self._trim(fresh + self.buffer, version)
        metrics = {"popo/constant_groups": float(len(constant)), "popo/replayed_groups": float(len(taken)),
                   "popo/buffer_groups": float(len(self.buffer))}
        return StepSamples(rollouts, problems, got.next_position, got.metrics | metrics)

    def _priorities(self, groups: list[StoredGroup], version: int) -> torch.Tensor:
        spread = torch.tensor([g.spread for g in groups], dtype=torch.float64)
        age = torch.tensor([version - g.version for g in groups], dtype=torch.long)
        return replay_priority(spread, age, self.settings.recency_decay)

    def _take(self, k: int, version: int) -> list[StoredGroup]:
        """The k stored groups of highest priority at `version` (fewer if the buffer holds fewer), removed."""
        if not k or not self.buffer:
            return []
        eligible = torch.ones(len(self.buffer), dtype=torch.bool)  # the expired ones have already left
        picked = top_priority(self._priorities(self.buffer, version), eligible, k).tolist()
        taken, gone = [self.buffer[i] for i in picked], set(picked)
        self.buffer = [g for i, g in enumerate(self.buffer) if i not in gone]
        return taken

    def _trim(self, groups: list[StoredGroup], version: int) -> list[StoredGroup]:
        """`groups` less the lowest priorities beyond buffer_groups, in their order."""
        if len(groups) <= self.settings.buffer_groups:
            return groups
        eligible = torch.ones(len(groups), dtype=torch.bool)
        kept = set(top_priority(self._priorities(groups, version), eligible, self.settings.buffer_groups).tolist())
        return [g for i, g in enumerate(groups) if i in kept]

    def step_metrics(self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, defined: torch.Tensor,
                     versions: torch.Tensor, version: int) -> dict[str, float]:
        metrics = self.inner.step_metrics(old_logprobs, rollout_logprobs, defined, versions, version)
        stats = replayed_token_stats(old_logprobs, rollout_logprobs, defined, versions, version)
        return metrics | {f"popo/replayed_{key}": float(value) for key, value in stats.items()}

    def state_dict(self) -> dict | None:
        return {"inner": self.inner.state_dict(), "buffer": [g.state() for g in self.buffer]}

    def close(self) -> None:
        try:
            self.close_score()
        finally:
            self.inner.close()
