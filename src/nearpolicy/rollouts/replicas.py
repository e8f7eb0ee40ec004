"""Asynchronous rollouts (`rollout.engines >= 1`): engine replicas (local processes or Ray actors) sample with
bounded staleness while the trainer updates; each step takes a batch of complete groups, each update publishes a
versioned GGUF that interrupts and refreshes the replicas. With `rollout.engines = 0` (the default) none of this
runs and rollouts/inline.py samples synchronously. The in-process engine only evaluates here; it is refreshed to
the newest published weights before each evaluation. rollouts/episode_replicas.py runs tool-use episodes on them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from nearpolicy.engines.base import RolloutEngine
from nearpolicy.engines.llamacpp import EngineSpec
from nearpolicy.ops.diagnostics import lag_ess, mismatch_metrics
from nearpolicy.rollouts.base import StepSamples, greedy_single_turn
from nearpolicy.rollouts.episodes import EpisodeSetup
from nearpolicy.rollouts.pool import LocalPool, RayPool
from nearpolicy.rollouts.scheduler import GroupState, RolloutScheduler, staleness_metrics
from nearpolicy.rollouts.service import RolloutService, groups_to_rollouts
from nearpolicy.tasks import Problem, Task
from nearpolicy.types import Rollout, SamplingParams


@dataclass(frozen=True)
class ReplicaSettings:
    """What the replica sources read of the run's settings ([rollout], the group shape, the seed).

    engines: replicas (>= 1); backend: "local" (processes) or "ray" (actors at ray_address); staleness: the most
    versions a trained token may lag; partial: an interrupted sample keeps its tokens; overprovision: groups in
    flight beyond a batch; resync_ess: lag ESS below which the next batch comes from the newest weights only (DLC);
    max_parallel_sequences: sequences a replica decodes together."""

    engines: int
    backend: str
    ray_address: str | None
    staleness: int
    partial: bool
    overprovision: int
    resync_ess: float
    group_size: int
    prompts_per_step: int
    seed: int
    max_parallel_sequences: int


class ReplicaRollouts:
    """`export(folder)` writes the trainer's current weights as a GGUF in `folder` and returns its path;
    `spec_for(path, version)` is the replicas' EngineSpec over it; `engine` is the in-process engine (evaluation);
    with `episodes`, each replica runs tool-use episodes of that setup (a sample's budget: episodes.limits.max_tokens).
    Replicas start in `start` (after a resume has loaded the weights and the scheduler state)."""

    def __init__(self, settings: ReplicaSettings, engine: RolloutEngine, export: Callable[[Path], Path], folder: Path,
                 spec_for: Callable[[Path, int], EngineSpec], task: Task, prompt_ids: Callable[[Problem], list[int]],
                 sampling: SamplingParams, log=print, episodes: EpisodeSetup | None = None):
        self.settings, self.engine, self.export, self.folder, self.spec_for = settings, engine, export, folder, spec_for
        self.task, self.prompt_ids, self.sampling, self.log, self.episodes = task, prompt_ids, sampling, log, episodes
        self._prompts: dict[int, tuple[int, ...]] = {}
        self.fresh_only = False  # DLC: the next batch must come from the newest weights
        self.sched: RolloutScheduler | None = None
        self.service: RolloutService | None = None
        self.latest: Path | None = None
        self.version = 0

    def start(self, version: int, data_position: int, state: dict | None) -> None:
        r = self.settings
        tokens = self.sampling.max_new_tokens if self.episodes is None else self.episodes.limits.max_tokens
        self.sched = RolloutScheduler(r.group_size, r.prompts_per_step, r.staleness, tokens, partial=r.partial,
                                      overprovision=r.overprovision, next_group_id=data_position)
        self.sched.version = version
        if state is not None:
            self.sched.load_state_dict(state)
        path = self._export(version)
        spec = self.spec_for(path, version)
        pool = (LocalPool(spec, r.engines, self.episodes) if r.backend == "local"
                else RayPool(spec, r.engines, r.ray_address, self.episodes))
        self.service = RolloutService(self.sched, pool, self.prompt_of, self.sampling, r.seed,
                                      r.max_parallel_sequences, str(path), self.log)
        self.log(f"async rollouts: {r.engines} {r.backend} engine replica(s), staleness {r.staleness}, "
                 f"partial rollouts {'on' if r.partial else 'off'}, over-provision {r.overprovision} group(s)")

    def prompt_of(self, group_id: int) -> tuple[int, ...]:
        if group_id not in self._prompts:
            self._prompts[group_id] = tuple(self.prompt_ids(self.task.train_problem(group_id)))
        return self._prompts[group_id]

    def collect(self, step: int, version: int, data_position: int) -> StepSamples:
        """One training batch of complete groups with the staleness metrics of its tokens (the data position
        after it: the scheduler's next new group) and rollout/decode_* of the replica calls whose results came back
        since the previous collect (those that filled this batch, and any whose groups wait for a later one)."""
        groups = self.service.next_batch(self.fresh_only)
        rollouts, own = self.to_rollouts(groups)
        problems = {g.group_id: self.task.train_problem(g.group_id) for g in groups}
        for gid in problems:
            self._prompts.pop(gid, None)
        metrics = staleness_metrics(groups, version) | {"staleness/fresh_only": float(self.fresh_only)} | own
        metrics |= self.service.take_decode_metrics()
        return StepSamples(rollouts, problems, self.sched.next_group_id, metrics)

    def to_rollouts(self, groups: list[GroupState]) -> tuple[list[Rollout], dict[str, float]]:
        """The trainer rollouts of a batch's complete groups, in order, and metrics of their own (none here)."""
        return groups_to_rollouts(groups, self.prompt_of), {}

    def step_metrics(self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, defined: torch.Tensor,
                     versions: torch.Tensor, version: int) -> dict[str, float]:
        """DLC's resync check (the lag ESS of the stale tokens below rollout.resync_ess: the next batch comes
        from the newest weights only), the k3 of fresh (numerical discrepancy only) and stale tokens, and the
        service's counters since the last call."""
        ess = float(lag_ess(old_logprobs, rollout_logprobs, defined, versions, version))
        self.fresh_only = ess < self.settings.resync_ess
        fresh = defined & (versions == version)
        split = {"fresh": fresh, "stale": defined & ~fresh}  # stale: discrepancy + version lag
        return {"staleness/lag_ess": ess, "staleness/resync": float(self.fresh_only),
                **{f"mismatch/{k}_k3": float(mismatch_metrics(old_logprobs, rollout_logprobs, m)["k3"])
                   for k, m in split.items()}, **self.service.take_counters()}

    def publish(self, version: int) -> None:
        """Export the trainer's weights as version `version` and hand them to the replicas."""
        path = self._export(version)
        self.service.publish(str(path), version)
        for old in self.folder.glob("policy-v*.gguf"):  # replicas that still load an older one hold it open
            if old != path and int(old.stem.split("-v")[1]) < version - 2:
                old.unlink(missing_ok=True)

    def _export(self, version: int) -> Path:
        path = self.export(self.folder)
        versioned = path.with_name(f"policy-v{version}.gguf")
        path.replace(versioned)
        self.latest, self.version = versioned, version
        return versioned

    def eval_engine(self) -> RolloutEngine:
        if self.engine.version != self.version:  # the replicas got every update, this engine did not
            self.engine.update_weights(self.latest, self.version)
        return self.engine

    def evaluate(self, engine: RolloutEngine, problems: list[Problem], score: Callable) -> tuple[list, list, dict]:
        return greedy_single_turn(engine, [self.prompt_ids(p) for p in problems], self.sampling.max_new_tokens, score)

    def state_dict(self) -> dict | None:
        return self.sched.state_dict()

    def close(self) -> None:
        if self.service is not None:
            self.service.close()
            self.service = None
        self.engine.close()
