"""The weight sync at the end of a training step, and MIPU's gate on it (docs/math.md sec. 24).

The Trainer hands each step's new weights to the engines through the object `weight_sync` builds once:
`PlainSync` (the default) publishes them as they are; `MipuSync` (mipu.enabled; MIPU, Monotonic Inference Policy
Update, reconstructed from the abstract of arXiv:2606.29526) treats the update as a candidate. The Trainer calls
`snapshot()` before the update (copies of what it trains, the optimizer's parameters: the policy's weights or
[lora]'s adapter; of the AdamW state; of the PPO-EWMA average) and `publish(...)` after it, which:

1. takes mu_old, the engine's log-probs of the batch's sampled tokens at the sampling weights (mipu.reference:
   re-scored by the engine before anything is synchronised, or the rollout log-probs);
2. synchronises the candidate (RolloutSource.publish) and re-scores the batch with the engine (mu_new;
   RolloutEngine.score, teacher forcing, under the step's sampling transform), and the trainer's log-probs at the
   candidate (pi_new, for the trainer-side proxy against old_logprobs);
3. accepts iff ops/mipu.accepts(improvement_proxy(mu_new, mu_old, A), mipu.margin); else, with mipu.max_tries > 1,
   tries theta_old + 2^-j (theta_new - theta_old) for j = 1, 2, ... (the update's AdamW state kept);
4. when no try is accepted, restores the snapshot bit for bit and synchronises the engine back to it.

A rejected step still counts a policy version: the engine holds the restored weights under the new number. Both
classes speak only the RolloutSource and RolloutEngine protocols; the running counts are checkpointed (`state`,
`restore`). Metrics per step: mipu/accepted, tries, step_scale, proxy, proxy_trainer, acceptance_rate, time/mipu."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from nearpolicy.batching import TokenBatch
from nearpolicy.config.schema import Config
from nearpolicy.engines.base import RolloutEngine
from nearpolicy.model.policy import recompute_logprobs, trainer_compute
from nearpolicy.ops.mipu import accepts, improvement_proxy
from nearpolicy.rollouts.base import RolloutSource
from nearpolicy.types import SamplingParams


def engine_logprobs(engine: RolloutEngine, batch: TokenBatch, sampling: SamplingParams) -> torch.Tensor:
    """[B, T] float32: the engine's teacher-forced log-probs (nats; RolloutEngine.score under `sampling`) of each
    row's completion tokens after its prompt, NaN at padding. One score call per row. Raises what score raises."""
    out = torch.full(batch.mask.shape, float("nan"), dtype=torch.float32)
    for i, (p, n) in enumerate(zip(batch.prompt_lengths.tolist(), batch.completion_lengths.tolist())):
        if n:
            scored = engine.score(batch.input_ids[i, :p].tolist(), batch.completion_ids[i, :n].tolist(), sampling)
            out[i, :n] = torch.tensor(scored, dtype=torch.float32)
    return out


class PlainSync:
    """The default weight sync: every update is kept and published as it is; no state."""

    def __init__(self, rollouts: RolloutSource):
        self.rollouts = rollouts

    def snapshot(self) -> None:
        """Nothing to keep."""

    def publish(self, version: int, batch: TokenBatch, advantages: torch.Tensor, keep: torch.Tensor | None,
                old_logprobs: torch.Tensor) -> dict[str, float]:
        self.rollouts.publish(version)
        return {}

    def state(self) -> dict:
        return {}

    def restore(self, saved: dict) -> None:
        """Nothing to restore."""


@dataclass(frozen=True)
class MipuSettings:
    level: str = "token"  # ops/mipu.MIPU_LEVELS
    reference: str = "rescored"  # mu_old: rescored (the engine re-scores the batch) or rollout (its sampling log-probs)
    margin: float = 0.0  # accept iff proxy >= margin (advantage units)
    max_tries: int = 1  # candidates per step (> 1: backtracking by halving)
    micro_batch_size: int = 8  # rows per trainer forward of the trainer-side proxy
    trainer_precision: str = "fp32"  # as the update's log-probs it compares with (algorithm.trainer_precision)


@dataclass
class Snapshot:
    """Copies taken before an update: the optimizer's parameters (in param_groups order), its state dict, the EWMA
    tensors (or None)."""

    params: list[torch.Tensor]
    optimizer: dict
    ewma: dict[str, torch.Tensor] | None


class MipuSync:
    """MIPU's gate on the weight sync (module docstring) over the trainer's `model` and `optimizer`, the rollout
    source whose eval_engine() is the in-process engine (synchronous rollouts), the step's `sampling` transform and
    the PPO-EWMA policy (model/ewma.EwmaPolicy, or None). Keeps the running counts `steps`, `accepted`, `tries`."""

    def __init__(self, settings: MipuSettings, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 rollouts: RolloutSource, sampling: SamplingParams, ewma=None):
        self.settings, self.model, self.optimizer, self.rollouts = settings, model, optimizer, rollouts
        self.sampling, self.ewma = sampling, ewma
        self.steps = self.accepted = self.tries = 0
        self.saved: Snapshot | None = None

    def _params(self) -> list[torch.Tensor]:
        """What the update trains: the optimizer's parameters (the policy's, or [lora]'s adapter)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def snapshot(self) -> None:
        """Copy the trained parameters, the AdamW state and the EWMA average: what a rejected candidate returns to."""
        self.saved = Snapshot([p.detach().clone() for p in self._params()], copy.deepcopy(self.optimizer.state_dict()),
                              None if self.ewma is None else self.ewma.state_tensors())

    def publish(self, version: int, batch: TokenBatch, advantages: torch.Tensor, keep: torch.Tensor | None,
                old_logprobs: torch.Tensor) -> dict[str, float]:
        """Synchronise the candidate at `version`, accept it or restore the snapshot (module docstring); returns the
        step's mipu/* metrics. advantages [B] or [B, T] and keep [B] bool (None = all) as the update used them;
        old_logprobs [B, T]: the trainer at the sampling weights. Raises RuntimeError without a snapshot since the
        last publish, and what the engine's score and the sync raise."""
        if self.saved is None:
            raise RuntimeError("MipuSync.publish needs snapshot() before the update")
        started, s = time.perf_counter(), self.settings
        mask = batch.mask & batch.has_rollout & (True if keep is None else keep.bool()[:, None])
        behaviour = (batch.rollout_logprobs if s.reference == "rollout"
                     else engine_logprobs(self.rollouts.eval_engine(), batch, self.sampling))  # before any sync
        candidate = [p.detach().clone() for p in self._params()] if s.max_tries > 1 else None
        for tries in range(1, s.max_tries + 1):
            if tries > 1:
                self._load_between(candidate, 0.5 ** (tries - 1))
            self.rollouts.publish(version)
            mu_new = engine_logprobs(self.rollouts.eval_engine(), batch, self.sampling)
            proxy = improvement_proxy(mu_new, behaviour, advantages, mask, s.level)
            with torch.no_grad(), trainer_compute(s.trainer_precision):
                pi_new = recompute_logprobs(self.model, batch, self.sampling, s.micro_batch_size)[0]
            trainer_proxy = improvement_proxy(pi_new, old_logprobs, advantages, mask, s.level)
            accepted = bool(accepts(proxy, s.margin))
            if accepted:
                break
        if not accepted:
            self._restore()
            self.rollouts.publish(version)
        self.saved = None
        self.steps, self.accepted, self.tries = self.steps + 1, self.accepted + accepted, self.tries + tries
        return {"mipu/accepted": float(accepted), "mipu/tries": float(tries),
                "mipu/step_scale": 0.5 ** (tries - 1) if accepted else 0.0, "mipu/proxy": float(proxy),
                "mipu/proxy_trainer": float(trainer_proxy), "mipu/acceptance_rate": self.accepted / self.steps,
                "time/mipu": time.perf_counter() - started}

    @torch.no_grad()
    def _load_between(self, candidate: list[torch.Tensor], scale: float) -> None:
        """Parameters theta_old + scale (theta_new - theta_old) (torch.lerp: exact where the two agree)."""
        for p, old, new in zip(self._params(), self.saved.params, candidate):
            p.copy_(torch.lerp(old, new, scale))

    @torch.no_grad()
    def _restore(self) -> None:
        """The snapshot back, bit for bit: trained parameters, AdamW state, EWMA average."""
        for p, old in zip(self._params(), self.saved.params):
            p.copy_(old)
        self.optimizer.load_state_dict(self.saved.optimizer)
        if self.ewma is not None:
            self.ewma.load_state_tensors(self.saved.ewma)

    def state(self) -> dict:
        """The running counts a checkpoint keeps (trainer_state.json)."""
        return {"mipu_steps": self.steps, "mipu_accepted": self.accepted, "mipu_tries": self.tries}

    def restore(self, saved: dict) -> None:
        """The running counts of a checkpoint's `state` (0 in one written without MIPU)."""
        self.steps, self.accepted = saved.get("mipu_steps", 0), saved.get("mipu_accepted", 0)
        self.tries = saved.get("mipu_tries", 0)


def weight_sync(cfg: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rollouts: RolloutSource,
                sampling: SamplingParams, ewma=None) -> PlainSync | MipuSync:
    """The Trainer's weight sync: MipuSync over the trainer's model, optimizer and PPO-EWMA policy with
    mipu.enabled, else PlainSync."""
    m = cfg.mipu
    if not m.enabled:
        return PlainSync(rollouts)
    settings = MipuSettings(m.level, m.reference, m.margin, m.max_tries, cfg.algorithm.micro_batch_size,
                            cfg.algorithm.trainer_precision)
    return MipuSync(settings, model, optimizer, rollouts, sampling, ewma)
