"""Tool-use episodes on the asynchronous engine replicas (`episode.enabled` with `rollout.engines >= 1`).

Each replica runs its episode segments itself (rollouts/worker.EngineWorker.run_episodes: its own EpisodeRunner and
ToolClient, tools in the replica's process; why there, see rollouts/worker.py): a segment is an episode's turns at
one policy version with the tool observations between them. A weight update interrupts it, mid-turn or between
turns; with rollout.partial the sample keeps every token (the model's with their log-probs and versions, the
observations', the turn index, the tool counters) and continues at the new version, else it restarts from its
prompt. The scheduler counts every token's version as for single responses, so the staleness bound holds for every
trained token. The trainer's process keeps a runner only for the greedy eval (on the refreshed in-process engine)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from nearpolicy.engines.base import RolloutEngine
from nearpolicy.engines.llamacpp import EngineSpec
from nearpolicy.rollouts.episodes import EpisodeRunner, EpisodeSetup, EpisodeSourceParts, episode_metrics
from nearpolicy.rollouts.replicas import ReplicaRollouts, ReplicaSettings
from nearpolicy.rollouts.scheduler import GroupState
from nearpolicy.tasks import Problem, Task
from nearpolicy.types import Rollout, SamplingParams


class EpisodeReplicaRollouts(EpisodeSourceParts, ReplicaRollouts):
    """ReplicaRollouts (start, publish, eval_engine, state_dict as there) whose samples are episodes of `setup`, run
    on the replicas; `prompt_ids` templates an episode's prompt, `plain_prompt_ids` the no-tool eval's; `runner`
    (the trainer process's, with its own ToolClient, closed with the source) runs the greedy eval only
    (`eval_without_tool`: also single greedy turns of the plain prompt, `plain_tokens` new tokens)."""

    def __init__(self, settings: ReplicaSettings, engine: RolloutEngine, export: Callable[[Path], Path], folder: Path,
                 spec_for: Callable[[Path, int], EngineSpec], task: Task, prompt_ids: Callable[[Problem], list[int]],
                 plain_prompt_ids: Callable[[Problem], list[int]], sampling: SamplingParams, setup: EpisodeSetup,
                 runner: EpisodeRunner, log=print, eval_without_tool: bool = True, plain_tokens: int = 64):
        super().__init__(settings, engine, export, folder, spec_for, task, prompt_ids, sampling, log, episodes=setup)
        self._init_episode_parts(runner, plain_prompt_ids, eval_without_tool, plain_tokens)

    def to_rollouts(self, groups: list[GroupState]) -> tuple[list[Rollout], dict[str, float]]:
        """Each sample's finished episode as its Rollout (model mask, turn index, versions verbatim) and the
        episode/* and turn{k}/* metrics of the batch. Raises ValueError for a sample that holds no episode."""
        episodes = [s.episode for g in groups for s in g.samples]
        if any(e is None or not e.done for e in episodes):
            raise ValueError("a complete group of an episode run holds a sample without a finished episode")
        return self._trained_rollouts(episodes), episode_metrics(episodes)
