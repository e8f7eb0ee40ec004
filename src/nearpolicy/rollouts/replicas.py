"""The trainer's side of asynchronous rollouts (`rollout.engines >= 1`): engine replicas sample with bounded
staleness while the trainer updates; each step takes a batch of complete groups, each update publishes a
versioned GGUF that interrupts and refreshes the replicas. With `rollout.engines = 0` (the default) none of this
runs and the engine samples inline, synchronously."""

from __future__ import annotations

from pathlib import Path

import torch

from nearpolicy.config import Config
from nearpolicy.ops.diagnostics import mismatch_metrics
from nearpolicy.rollouts.pool import LocalPool, RayPool
from nearpolicy.rollouts.scheduler import RolloutScheduler, staleness_metrics
from nearpolicy.rollouts.service import RolloutService, groups_to_rollouts
from nearpolicy.setup import Session, engine_spec, export_engine_gguf
from nearpolicy.tasks import Problem
from nearpolicy.types import Rollout, SamplingParams


class AsyncRollouts:
    def __init__(self, cfg: Config, session: Session, sampling: SamplingParams, version: int, data_position: int,
                 scheduler_state: dict | None, log=print):
        r, a = cfg.rollout, cfg.algorithm
        self.session, self.cfg, self.log = session, cfg, log
        self.folder = session.engine_dir / "published"
        self.sched = RolloutScheduler(a.group_size, a.prompts_per_step, r.staleness, sampling.max_new_tokens,
                                      partial=r.partial, overprovision=r.overprovision, next_group_id=data_position)
        self.sched.version = version
        if scheduler_state is not None:
            self.sched.load_state_dict(scheduler_state)
        self._prompts: dict[int, tuple[int, ...]] = {}
        path = self._export(version)
        e = cfg.engine
        spec = engine_spec(cfg, path, version, threads=r.engine_threads)
        pool = LocalPool(spec, r.engines) if r.backend == "local" else RayPool(spec, r.engines, r.ray_address)
        self.service = RolloutService(self.sched, pool, self.prompt_of, sampling, cfg.run.seed,
                                      e.max_parallel_sequences, str(path), log)
        self.latest = path
        log(f"async rollouts: {r.engines} {r.backend} engine replica(s), staleness {r.staleness}, "
            f"partial rollouts {'on' if r.partial else 'off'}, over-provision {r.overprovision} group(s)")

    def prompt_of(self, group_id: int) -> tuple[int, ...]:
        if group_id not in self._prompts:
            self._prompts[group_id] = tuple(self.session.prompt_ids(self.session.task.train_problem(group_id)))
        return self._prompts[group_id]

    @property
    def next_group_id(self) -> int:
        return self.sched.next_group_id

    def collect(self, version: int, fresh_only: bool) -> tuple[list[Rollout], dict[int, Problem], dict[str, float]]:
        """One training batch of complete groups with the staleness metrics of its tokens."""
        groups = self.service.next_batch(fresh_only)
        rollouts = groups_to_rollouts(groups, self.prompt_of)
        by_group = {g.group_id: self.session.task.train_problem(g.group_id) for g in groups}
        for gid in by_group:
            self._prompts.pop(gid, None)
        return rollouts, by_group, staleness_metrics(groups, version) | {"staleness/fresh_only": float(fresh_only)}

    def publish(self, version: int) -> Path:
        """Export the trainer's weights as version `version` and hand them to the replicas."""
        path = self._export(version)
        self.service.publish(str(path), version)
        self.latest = path
        for old in self.folder.glob("policy-v*.gguf"):  # replicas that still load an older one hold it open
            if old != path and int(old.stem.split("-v")[1]) < version - 2:
                old.unlink(missing_ok=True)
        return path

    def _export(self, version: int) -> Path:
        path = export_engine_gguf(self.session.model, self.folder, self.cfg.engine, self.session.template_gguf,
                                  self.session.tokenizer)
        versioned = path.with_name(f"policy-v{version}.gguf")
        path.replace(versioned)
        return versioned

    def metrics(self) -> dict[str, float]:
        return self.service.take_counters()

    def state_dict(self) -> dict:
        return self.sched.state_dict()

    def close(self) -> None:
        self.service.close()


def lag_ess(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, defined: torch.Tensor,
            versions: torch.Tensor, version: int) -> float:
    """Normalised ESS of exp(old_logprobs - rollout_logprobs) over the stale tokens (version < `version`) of a
    batch ([B, T] inputs): the lag weights DLC watches. 1.0 when no token is stale."""
    stale = defined & (versions < version)
    return float(mismatch_metrics(old_logprobs, rollout_logprobs, stale)["ess"])
