"""The orchestrator: one function per phase (rollout, score, recompute, update, sync, evaluate, log).
Synchronous GRPO: the engine samples with the trainer's current weights (exported at the rollout precision),
so every difference between rollout_logprobs and old_logprobs is numerical mismatch, not policy lag."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nearpolicy.batching import collate
from nearpolicy.config import Config
from nearpolicy.engines.process import EngineDied, ProcessEngine
from nearpolicy.guards import BadStepGuard, check_finite_weights, check_task_prompts
from nearpolicy.ops.advantages import compute_advantages
from nearpolicy.ops.corrections import mismatch_log_ratio
from nearpolicy.ops.distill import opd_advantages
from nearpolicy.ops.losses import PolicyLossParams
from nearpolicy.ops.diagnostics import mismatch_decomposition, mismatch_metrics
from nearpolicy.proximal_policy import build_proximal_policy, restore_proximal
from nearpolicy.runs import MetricsSink, list_checkpoints, load_checkpoint, save_checkpoint, write_json
from nearpolicy.setup import Session, build_session
from nearpolicy.signals import StopRequested
from nearpolicy.tasks import Problem
from nearpolicy.tasks.identity import data_changes, data_identity
from nearpolicy.tasks.scoring import BoundedScorer, ScoreResult
from nearpolicy.types import GenerationRequest, Rollout, SamplingParams
from nearpolicy.policy import recompute_logprobs
from nearpolicy.update import UpdateSettings, policy_update


class RunExistsError(RuntimeError):
    """The run folder already holds a run and --resume was not given."""


@dataclass
class TrainState:
    step: int = 0
    data_position: int = 0
    version: int = 0
    scorer_errors: int = 0
    scheduler: dict | None = None  # async rollouts: the scheduler's restart state


def _update_settings(cfg: Config) -> UpdateSettings:
    a, c = cfg.algorithm, cfg.correction
    params = PolicyLossParams(a.clip_low, a.clip_high, a.dual_clip, kl_coef=a.kl_coef, kl_estimator=a.kl_estimator)
    constant = a.aggregation_constant or float(cfg.sampling.max_new_tokens)
    return UpdateSettings(a.minibatches, a.micro_batch_size, a.max_grad_norm, a.loss, params, a.aggregation, constant,
                          c.spec(), c.center, c.adaptive_mix, c.proximal)


class Trainer:
    def __init__(self, cfg: Config, *, resume: bool = False, log=print):
        self.cfg, self.log = cfg, log
        self.run_dir = cfg.run.output_dir / cfg.run.name
        existing = list_checkpoints(self.run_dir) or (self.run_dir / "metrics.jsonl").exists()
        if existing and not resume:
            raise RunExistsError(f"{self.run_dir} already holds a run; pass --resume to continue it or set run.name")
        self.data = data_identity(cfg.task.kind, cfg.task.path, cfg.task.name)
        if resume:  # refuse a changed config or changed data before the minutes of loading
            _check_same_config(self.run_dir / "config.json", cfg)
            _check_same_data(self.run_dir / "plan.json", self.data)
        created = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.run.seed)
        try:
            self.s: Session = build_session(cfg, self.run_dir, log)
        except BaseException:
            if created:  # a run that never started leaves no folder to block the retry
                shutil.rmtree(self.run_dir, ignore_errors=True)
            raise
        self.scorer = BoundedScorer(self.s.task, cfg.task.reward_timeout_s)
        self.sampling = SamplingParams(cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.top_k,
                                       cfg.sampling.max_new_tokens)
        self.settings = _update_settings(cfg)
        check_task_prompts(self.s.task, self.s.prompt_ids, cfg.model.max_context, cfg.sampling.max_new_tokens)
        self.state = TrainState()
        self.guard = BadStepGuard(cfg.run.max_bad_steps)
        self.saved: Path | None = None  # the checkpoint this process wrote or resumed from last
        self.postfix: dict[str, str] = {}  # the progress bar's figures after the last step
        self.ewma = build_proximal_policy(cfg.correction.proximal, self.s.model, cfg.correction.ewma_decay)
        if resume:
            self._resume()
        self.resync_pending = False  # DLC: the next batch must come from the newest weights
        self.inline_version = self.state.version  # the weights the in-process engine (evaluation) holds
        self.async_rollouts = None
        if cfg.rollout.engines:
            from nearpolicy.rollouts.replicas import AsyncRollouts

            self.async_rollouts = AsyncRollouts(cfg, self.s, self.sampling, self.state.version, self.state.data_position,
                                                self.state.scheduler, log)
        write_json(self.run_dir / "config.json", cfg.model_dump(mode="json"))
        write_json(self.run_dir / "plan.json", self.s.plan | {"data": self.data, "resumed_at_step": self.state.step})
        self.metrics = MetricsSink(self.run_dir, cfg.logging.tensorboard)

    # -- phases ----------------------------------------------------------------------------------
    def rollout(self, problems: list[Problem]) -> list[Rollout]:
        g = self.cfg.algorithm.group_size
        base = self.state.data_position
        requests = [GenerationRequest(base + i, tuple(self.s.prompt_ids(p)), g) for i, p in enumerate(problems)]
        seed = int(np.random.SeedSequence([self.cfg.run.seed, self.state.step]).generate_state(1)[0])
        return self.s.engine.generate(requests, self.sampling, seed)

    def _reward(self, completions: list[list[int]], problems: list[Problem], phase: str) -> list[ScoreResult]:
        """Score each response text only (never the prompt), in one batch, each call within task.reward_timeout_s:
        NaN when the scorer raises or returns no number in [0, 1] (unscorable), 0 on a timeout. `phase` names the
        step or eval in the warning that failed calls get."""
        texts = [self.s.tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        results = self.scorer.score(list(zip(texts, problems)))
        for status in ("error", "timeout"):
            failed = [r for r in results if r.status == status]
            if failed:
                self.log(f"warning: {phase}: {len(failed)} of {len(results)} reward call(s) "
                         f"{'unscorable' if status == 'error' else 'timed out'}, e.g. {failed[0].message}")
        return results

    def score(self, rollouts: list[Rollout], problems: dict[int, Problem]) -> dict[str, float]:
        """Set each rollout's reward (NaN = unscorable: left out of the group statistics, advantage 0; a timeout
        scores 0). Returns the step's counts reward/unscorable and reward/timeouts."""
        results = self._reward([r.completion_ids for r in rollouts], [problems[r.group_id] for r in rollouts],
                               f"step {self.state.step + 1}")
        for r, result in zip(rollouts, results):
            r.reward = result.reward
        unscorable = sum(result.status == "error" for result in results)
        self.state.scorer_errors += unscorable
        return {"reward/unscorable": float(unscorable),
                "reward/timeouts": float(sum(result.status == "timeout" for result in results))}

    def distill_advantages(self, batch, task_advantages: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Token advantages [B, T]: on-policy distillation from the engine's log-probs of its own samples and the
        teacher's, both under the same sampling transform (so the reverse KL compares like with like when T != 1
        or top-k / top-p are on), plus distill.reward_weight x the task advantage."""
        d = self.cfg.distill
        teacher = recompute_logprobs(self.s.teacher, batch, self.sampling, self.cfg.algorithm.micro_batch_size)[0]
        defined = batch.mask & batch.has_rollout
        token_adv, metrics = opd_advantages(batch.rollout_logprobs, teacher, defined, d.coef, d.discount)
        total = token_adv + d.reward_weight * task_advantages[:, None]
        return total.float(), {"distill/teacher_kl": float(metrics["teacher_kl"])}

    def sync(self) -> None:
        check_finite_weights(self.s.model, self.state.step + 1)  # never export (or later save) NaN / inf weights
        self.state.version += 1
        if self.async_rollouts is not None:
            self.async_rollouts.publish(self.state.version)
        else:
            self.s.sync_engine(self.state.version)
            self.inline_version = self.state.version

    def evaluate(self) -> dict[str, float]:
        if self.inline_version != self.state.version:  # async: the replicas got every update, this engine did not
            self.s.engine.update_weights(self.async_rollouts.latest, self.state.version)
            self.inline_version = self.state.version
        problems = self.s.task.eval_problems()
        prompts = [self.s.prompt_ids(p) for p in problems]
        completions = self.s.engine.greedy(prompts, self.cfg.sampling.max_new_tokens)
        results = self._reward(completions, problems, f"eval at step {self.state.step}")
        scores = np.array([r.reward for r in results], dtype=float)
        scorable = scores[np.isfinite(scores)]  # accuracy over the scorable answers; a timeout counts as wrong
        return {"eval/accuracy": float(scorable.mean()) if scorable.size else float("nan"),
                "eval/unscorable": float(scores.size - scorable.size),
                "eval/response_length": float(np.mean([len(c) for c in completions]))}

    def collect(self) -> tuple[list[Rollout], dict[int, Problem], dict[str, float]]:
        """The step's rollouts and their problems: sampled inline now, or taken from the async replicas."""
        if self.async_rollouts is not None:
            return self.async_rollouts.collect(self.state.version, self.resync_pending)
        n = self.cfg.algorithm.prompts_per_step
        problems = [self.s.task.train_problem(self.state.data_position + i) for i in range(n)]
        by_group = {self.state.data_position + i: p for i, p in enumerate(problems)}
        return self.rollout(problems), by_group, {}

    def _resync_check(self, batch, old_logprobs: torch.Tensor, defined: torch.Tensor) -> dict[str, float]:
        from nearpolicy.rollouts.replicas import lag_ess

        ess = lag_ess(old_logprobs, batch.rollout_logprobs, defined, batch.versions, self.state.version)
        self.resync_pending = ess < self.cfg.rollout.resync_ess
        fresh = defined & (batch.versions == self.state.version)  # numerical discrepancy only
        split = {"fresh": fresh, "stale": defined & ~fresh}  # stale: discrepancy + version lag
        return {"staleness/lag_ess": ess, "staleness/resync": float(self.resync_pending),
                **{f"mismatch/{k}_k3": float(mismatch_metrics(old_logprobs, batch.rollout_logprobs, m)["k3"])
                   for k, m in split.items()}}

    def train_step(self) -> dict[str, float]:
        cfg, t = self.cfg, {}
        t0 = time.perf_counter()
        rollouts, by_group, async_metrics = self.collect()
        t["time/rollout"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        score_metrics = self.score(rollouts, by_group)
        t["time/score"] = time.perf_counter() - t0
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)  # NaN = unscorable
        groups = torch.tensor([r.group_id for r in rollouts])
        adv = compute_advantages(cfg.algorithm.advantage, rewards, groups)
        advantages = adv.advantages.float()
        batch = collate(rollouts, self.s.pad_id, self.s.vocab_size)
        distill_metrics = {}
        if self.s.teacher is not None:
            advantages, distill_metrics = self.distill_advantages(batch, advantages)
        old_logprobs = entropy = None
        t["time/recompute"] = 0.0
        if cfg.algorithm.minibatches > 1 or self.settings.needs_batch_statistics:  # else fused into the update
            t0 = time.perf_counter()
            old_logprobs, entropy = recompute_logprobs(self.s.model, batch, self.sampling, cfg.algorithm.micro_batch_size)
            t["time/recompute"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        prox = None if self.ewma is None else self.ewma.logprobs(batch, self.sampling, cfg.algorithm.micro_batch_size)
        update = policy_update(self.s.model, self.s.optimizer, batch, old_logprobs, advantages, self.sampling,
                               self.settings, sample_keep=adv.keep, ref_model=self.s.ref_model, ewma_logprobs=prox,
                               version=self.state.version,
                               on_step=None if self.ewma is None else lambda: self.ewma.update(self.s.model))
        old_logprobs = update.old_logprobs
        entropy = entropy if update.entropy is None else update.entropy
        t["time/update"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, defined = mismatch_log_ratio(old_logprobs, batch.rollout_logprobs, batch.mask, batch.has_rollout)
        mismatch = {}
        if cfg.logging.diagnostics:
            mismatch = mismatch_metrics(old_logprobs, batch.rollout_logprobs, defined)
            mismatch |= mismatch_decomposition(update.logprobs, old_logprobs, batch.rollout_logprobs, defined)
            mismatch = {k: float(v) for k, v in mismatch.items()}
        t["time/diagnostics"] = time.perf_counter() - t0
        if self.async_rollouts is not None:
            async_metrics |= self._resync_check(batch, old_logprobs, defined)
        self.state.data_position = (self.async_rollouts.next_group_id if self.async_rollouts is not None
                                    else self.state.data_position + len(by_group))  # only a completed step counts
        t0 = time.perf_counter()
        self.sync()
        t["time/sync"] = time.perf_counter() - t0
        if self.async_rollouts is not None:
            async_metrics |= self.async_rollouts.metrics()
        n_tokens = float(batch.mask.sum())
        lengths = batch.mask.sum(1).float()
        out = {
            **_reward_stats(rewards), **score_metrics, "reward/scorer_errors": float(self.state.scorer_errors),
            "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
            "response/frac_truncated": float(np.mean([r.finish_reason == "length" for r in rollouts])),
            "entropy": float(entropy[batch.mask].mean()),
            **{f"mismatch/{k}": float(v) for k, v in mismatch.items()},
            **update.metrics, **t, **distill_metrics, **async_metrics,
            "throughput/rollout_tokens_per_s": n_tokens / max(t["time/rollout"], 1e-9),
            "throughput/train_tokens_per_s": float(batch.attention_mask.sum()) / max(t["time/update"], 1e-9),
            "policy/version": float(self.state.version),
        }
        return out

    # -- loop ------------------------------------------------------------------------------------
    def fit(self, stop=None, progress: bool = True) -> Path:
        """Run to cfg.run.steps. `stop` (signals.GracefulStop) ends the run after the step in progress, checkpointing
        it, with StopRequested. Raises NonFiniteError after run.max_bad_steps consecutive non-finite steps.
        `progress=False` hides the bar whatever logging.progress says (the Ray driver draws its own)."""
        cfg = self.cfg
        from tqdm import tqdm

        bar = tqdm(total=cfg.run.steps, initial=self.state.step, desc=cfg.run.name,
                   disable=not (progress and cfg.logging.progress), dynamic_ncols=True)
        try:
            return self._fit(stop, bar)
        finally:
            bar.close()  # before any stop or error message, so that message gets its own line

    def _fit(self, stop, bar) -> Path:
        try:
            return self._steps(stop, bar)
        except EngineDied as died:  # name the step: the eval of step k, or the rollout / sync of step k + 1
            died.at = died.at or f"step {self.state.step + (died.phase != 'eval')}"
            raise

    def _steps(self, stop, bar) -> Path:
        cfg = self.cfg
        if self.state.step == 0:
            self.log(f"step 0: greedy eval on {len(self.s.task.eval_problems())} held-out problems...")
            first = self.evaluate()
            self.metrics.write(0, first)
            self.log(f"step 0 eval accuracy {first['eval/accuracy']:.3f}")
        while self.state.step < cfg.run.steps:
            if stop is not None and stop.signum is not None:
                raise StopRequested(stop.signum, self.state.step, self._checkpoint_on_stop())
            t0 = time.perf_counter()
            metrics = self.train_step()
            self.state.step += 1
            step = self.state.step
            metrics |= self.guard.observe(step, metrics, self.log)
            if step % cfg.logging.eval_every == 0 or step == cfg.run.steps:
                t1 = time.perf_counter()
                metrics |= self.evaluate()
                metrics["time/eval"] = time.perf_counter() - t1
            metrics["time/step"] = time.perf_counter() - t0
            self.metrics.write(step, metrics)
            if step % cfg.logging.checkpoint_every == 0 or step == cfg.run.steps:
                self.checkpoint()
            self.guard.check(step)
            self.postfix = dict(reward=f"{metrics['reward/mean']:.2f}", k3=f"{metrics.get('mismatch/k3', float('nan')):.1e}",
                                acc=f"{metrics.get('eval/accuracy', float('nan')):.2f}")
            bar.update(1)
            bar.set_postfix(self.postfix)
        self.metrics.close()
        self.close()
        return self.run_dir

    def close(self) -> None:
        """Stop the engine replicas (async rollouts), the engine's process and the scoring process; safe to call
        twice."""
        self.scorer.close()
        if self.async_rollouts is not None:
            self.async_rollouts.close()
            self.async_rollouts = None
        if isinstance(self.s.engine, ProcessEngine):
            self.s.engine.close()

    def checkpoint(self) -> Path:
        st = self.state
        state = {"data_position": st.data_position, "version": st.version, "scorer_errors": st.scorer_errors,
                 "engine_precision": self.cfg.engine.precision, **self.guard.state()}
        if self.async_rollouts is not None:
            state["scheduler"] = self.async_rollouts.state_dict()
        extra = None if self.ewma is None else self.ewma.state_tensors()
        self.saved = save_checkpoint(self.run_dir, st.step, self.s.model, self.s.optimizer, state,
                                     self.cfg.logging.keep_checkpoints, extra=extra)
        return self.saved

    def _checkpoint_on_stop(self) -> Path | None:
        """The checkpoint of the last completed step (written now unless it already exists); None at step 0."""
        if self.state.step == 0:
            return None
        if self.saved is not None and self.saved.name == f"step_{self.state.step:06d}":
            return self.saved
        return self.checkpoint()

    def _resume(self) -> None:
        """Continue from the newest loadable checkpoint (a damaged one is reported and skipped); with none,
        start over, keeping the earlier metrics as metrics.before-resume.jsonl."""
        checkpoints = list_checkpoints(self.run_dir)
        initial = {k: v.clone() for k, v in self.s.model.state_dict().items()} if checkpoints else {}
        for path in reversed(checkpoints):
            try:
                saved = load_checkpoint(path, self.s.model, self.s.optimizer)
                restore_proximal(self.ewma, path, self.s.model, self.log)
            except Exception as err:  # noqa: BLE001 - any damage (safetensors header, json, shapes) skips it
                self.log(f"warning: checkpoint {path} is not loadable ({type(err).__name__}: {err}); trying an older one")
                self.s.model.load_state_dict(initial)  # a partial load must not leak into the next attempt
                continue
            self.state = TrainState(step=saved["step"], data_position=saved["data_position"], version=saved["version"],
                                    scorer_errors=saved.get("scorer_errors", 0), scheduler=saved.get("scheduler"))
            self.guard.restore(saved)
            self.saved = path
            _truncate_metrics(self.run_dir / "metrics.jsonl", self.state.step)
            self.s.sync_engine(self.state.version)
            self.log(f"resumed from {path} at step {self.state.step}")
            return
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.exists():
            metrics.replace(self.run_dir / "metrics.before-resume.jsonl")
        self.log(f"no loadable checkpoint in {self.run_dir}: starting from step 0")


# may change on --resume (placement, not training, settings); everything else must match
# engine.precision and engine.extra_buffers too: the way out after an engine crash (docs/reliability.md)
RESUMABLE_KEYS = {"run.steps", "logging", "rollout.ray_address", "rollout.trainer_resources", "engine.precision",
                  "engine.extra_buffers"}


def _check_same_config(saved_path: Path, cfg: Config) -> None:
    """Refuse a --resume whose config differs from the run's (except run.steps and logging.*). A key the saved
    config lacks (added to the schema since) counts as its default."""
    if not saved_path.exists():
        return
    saved = json.loads(saved_path.read_text())
    now, default = cfg.model_dump(mode="json"), Config().model_dump(mode="json")
    changed = [f"{section}.{key}" for section, fields in now.items() for key, value in fields.items()
               if saved.get(section, {}).get(key, default[section][key]) != value
               and section not in RESUMABLE_KEYS and f"{section}.{key}" not in RESUMABLE_KEYS]
    if changed:
        raise RunExistsError(f"--resume with a config that differs from {saved_path} in: {', '.join(changed)} "
                             "(only run.steps, logging.*, rollout.ray_address, rollout.trainer_resources, engine.precision and "
                             "engine.extra_buffers may change; use a new run.name)")


def _check_same_data(plan_path: Path, now: dict) -> None:
    """Refuse a --resume whose data differs from the identity the run recorded in plan.json (runs from before
    the record are not checked)."""
    saved = json.loads(plan_path.read_text()).get("data") if plan_path.exists() else None
    change = data_changes(saved, now) if saved is not None else None
    if change:
        raise RunExistsError(f"--resume on changed data: {change}; the run's order and held-out split come from "
                             "the data it started with (restore it, or use a new run.name)")


def _reward_stats(rewards: torch.Tensor) -> dict[str, float]:
    """reward/mean and reward/std over the scorable (finite) rewards [N]; NaN when none is scorable."""
    scorable = rewards[torch.isfinite(rewards)]
    mean = float(scorable.mean()) if scorable.numel() else float("nan")
    return {"reward/mean": mean, "reward/std": float(scorable.std()) if scorable.numel() > 1 else 0.0}


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines written after the checkpoint (they will be produced again) and unreadable lines (a
    write cut short by a kill)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)
