"""The orchestrator: one function per phase (collect, score, advantages, update, diagnostics, publish, evaluate,
log) over a Session (policy, task, optimizer) and a RolloutSource (rollouts/: where the samples come from, inline
or from engine replicas), both assembled by training/assemble.py and handed in. `open_trainer` checks the run folder and
assembles them."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from nearpolicy.batching import TokenBatch, collate
from nearpolicy.config.schema import Config
from nearpolicy.engines.base import EngineDied
from nearpolicy.training.allocator import peak_memory
from nearpolicy.training.guards import BadStepGuard, check_finite_weights
from nearpolicy.ops.advantages import compute_advantages
from nearpolicy.ops.corrections import mismatch_log_ratio
from nearpolicy.ops.losses import PolicyLossParams
from nearpolicy.training.phases import (accuracy_figure, advantage_signal, apply_data_policy, distill_advantages,
                                        eval_metrics, eval_samples, mismatch_diagnostics, progress_postfix, score_texts,
                                        step_metrics, turn_credit_advantages)
from nearpolicy.model.ewma import build_proximal_policy, restore_proximal
from nearpolicy.rollouts.base import RolloutSource
from nearpolicy.runs.lock import lock_run_folder, release_run_folder
from nearpolicy.runs.start_checks import check_run_folder, last_eval_accuracy, note_engine_precision, set_aside_restarted_metrics
from nearpolicy.runs.folder import MetricsSink, resume_checkpoint, save_checkpoint, write_json
from nearpolicy.runs.samples import SampleLog
from nearpolicy.training.assemble import Session, assemble, policy_engine, sampling_params
from nearpolicy.signals import StopRequested
from nearpolicy.tasks import Problem
from nearpolicy.tasks.identity import data_identity
from nearpolicy.tasks.scoring import BoundedScorer
from nearpolicy.runs.trackers import check_trackers, open_trackers
from nearpolicy.types import Rollout
from nearpolicy.ops.schedule import learning_rate
from nearpolicy.training.mipu import weight_sync
from nearpolicy.training.update import Recomputed, UpdateResult, UpdateSettings, policy_update, recompute


@dataclass
class TrainState:
    step: int = 0
    data_position: int = 0
    version: int = 0
    scorer_errors: int = 0
    scheduler: dict | None = None  # the rollout source's restart state (async rollouts: the scheduler's)


def update_settings(cfg: Config) -> UpdateSettings:
    a, c = cfg.algorithm, cfg.correction
    params = PolicyLossParams(a.clip_low, a.clip_high, a.dual_clip, kl_coef=a.kl_coef, kl_estimator=a.kl_estimator,
                              entropy_coef=a.entropy_coef)
    longest = cfg.episode.max_tokens if cfg.episode.enabled else cfg.sampling.max_new_tokens  # a response's most tokens
    constant = a.aggregation_constant or float(longest)
    return UpdateSettings(a.minibatches, a.micro_batch_size, a.max_grad_norm, a.loss, params, a.aggregation, constant,
                          c.spec(), c.center, c.adaptive_mix, c.proximal, a.epochs, a.observation_loss_coef,
                          baseline_after_rejection=a.baseline_samples == "accepted" and c.spec().rejects,
                          trainer_precision=a.trainer_precision)


def set_learning_rate(optimizer: torch.optim.Optimizer, cfg: Config, step: int) -> float:
    """Set every parameter group to training step `step`'s learning rate (algorithm.lr_schedule of algorithm.lr, or of
    lora.lr under [lora]) and return it."""
    a = cfg.algorithm
    peak = cfg.lora.lr if cfg.lora.enabled else a.lr
    lr = learning_rate(step, cfg.run.steps, peak, a.lr_schedule, a.warmup_steps, a.min_lr_ratio)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def open_trainer(cfg: Config, *, resume: bool = False, log=print,
                 build: Callable[[Config, Path, Callable], tuple[Session, RolloutSource]] = assemble) -> Trainer:
    """Check the run folder (runs.start_checks.check_run_folder: a run there needs --resume; a resume needs the same config
    and data, and steps left) and the trackers (runs.trackers.check_trackers), assemble the session and rollout source
    with `build` (training.assemble.assemble), and return the Trainer. A run that fails to assemble leaves no folder
    behind."""
    run_dir = cfg.run.output_dir / cfg.run.name
    created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # run_dir and run.output_dir, if new
    lock_run_folder(run_dir)  # another process's live run in this folder: refused (runs/lock.py)
    try:
        folder = check_run_folder(cfg, resume)  # a run already there, a changed config or data: refused before loading
        check_trackers(cfg.logging)  # a missing wandb / tensorboard, online wandb without credentials: also before
        if folder.restart:
            set_aside_restarted_metrics(run_dir)
            log(f"starting over: {folder.said}")
        torch.manual_seed(cfg.run.seed)
        session, rollouts = build(cfg, run_dir, log)
        try:
            return Trainer(cfg, session, rollouts, resume=resume, log=log, data=folder.data)
        except BaseException:
            rollouts.close()  # its engine processes must not outlive a Trainer that never started
            raise
    except BaseException:
        if created:  # a run that never started leaves no folder (nor an empty run.output_dir) behind
            release_run_folder(run_dir)
            shutil.rmtree(created[-1], ignore_errors=True)
        raise


def step_advantages(cfg: Config, session: Session, rollouts: list[Rollout], batch: TokenBatch, sampling,
                    problems: dict[int, Problem] | None = None, rejected: torch.Tensor | None = None):
    """(rewards [N] float32, NaN = unscorable; the advantage result of algorithm.advantage, whose keep-mask also
    drops unscorable samples from the loss unless a teacher scores them; the advantages, [N], or [N, T] with on-policy
    distillation or turn-level credit (algorithm.turn_credit other than outcome: episodes, `problems` by group id give
    TRACE's gold answers); the distillation / turn-credit metrics, data/* and advantage/nonzero_frac), after
    algorithm.data_policy (phases.apply_data_policy: its keep in the keep-mask, its weights in the advantages).
    `batch`: the rollouts' token batch; rejected [N] bool (update.rejected_samples): samples left out of their group's
    baseline (advantage 0, as an unscorable one; they stay in the loss mask, where the correction zeroes their
    tokens)."""
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    group_ids = torch.tensor([r.group_id for r in rollouts])
    baseline = rewards if rejected is None else torch.where(rejected, torch.full_like(rewards, float("nan")), rewards)
    adv = compute_advantages(cfg.algorithm.advantage, baseline, group_ids)
    if cfg.algorithm.turn_credit != "outcome":
        answers = [problems[r.group_id].answer for r in rollouts] if problems else [""] * len(rollouts)
        advantages, keep, metrics = turn_credit_advantages(cfg, session.ref_model, session.tokenizer, batch,
                                                           batch.observation_mask, batch.turn_index, baseline,
                                                           group_ids, answers)
        adv = replace(adv, keep=keep if rejected is None else keep | (rejected & torch.isfinite(rewards)))
    elif session.teacher is None:  # an unscorable sample leaves the loss's numerator and its denominator
        adv = replace(adv, keep=adv.keep & torch.isfinite(rewards))
        advantages, metrics = adv.advantages.float(), {}
    else:
        advantages, metrics = distill_advantages(cfg, session.teacher, batch, adv.advantages.float(), sampling)
    adv, advantages, data_metrics = apply_data_policy(cfg, adv, advantages, baseline, group_ids, batch)
    return rewards, adv, advantages, metrics | data_metrics | advantage_signal(advantages, adv.keep, batch.mask)


def kl_reference(cfg: Config, session: Session):
    """The frozen reference for the KL term, None without one (TRACE's reference only scores gold answers)."""
    return session.ref_model if cfg.algorithm.kl_coef > 0 else None


class _Timer(dict):
    """time/<phase> seconds of one step: `with timer("rollout"): ...`."""

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self[f"time/{phase}"] = self.get(f"time/{phase}", 0.0) + time.perf_counter() - t0


class Trainer:
    """One run over a Session and a RolloutSource (see open_trainer): `fit` runs the steps, evaluates, logs and
    checkpoints; `train_step` is one step's phases."""

    def __init__(self, cfg: Config, session: Session, rollouts: RolloutSource, *, resume: bool = False, log=print,
                 data: dict | None = None):
        self.cfg, self.s, self.rollouts, self.log = cfg, session, rollouts, log
        self.run_dir = cfg.run.output_dir / cfg.run.name
        self.data = data if data is not None else data_identity(cfg.task.kind, cfg.task.path, cfg.task.name)
        self.sampling = sampling_params(cfg)
        self.settings = update_settings(cfg)
        self.state = TrainState()
        self.guard = BadStepGuard(cfg.run.max_bad_steps)
        self.saved: Path | None = None  # the checkpoint this process wrote or resumed from last
        self.postfix: dict[str, str] = {}  # the progress bar's figures after the last step
        self.ewma = build_proximal_policy(cfg.correction.proximal, session.model, cfg.correction.ewma_decay)
        self.sync = weight_sync(cfg, session.model, session.optimizer, rollouts, self.sampling, self.ewma)  # MIPU
        if resume:
            self._resume()
        rollouts.start(self.state.version, self.state.data_position, self.state.scheduler)
        write_json(self.run_dir / "config.json", cfg.model_dump(mode="json"))
        plan = {"data": self.data, "resumed_at_step": self.state.step,
                "working_dir": str(Path.cwd())}  # where config.json's relative paths are read (start_checks.PATH_KEYS)
        write_json(self.run_dir / "plan.json", session.plan | plan)
        self.metrics = MetricsSink(self.run_dir, open_trackers(self.run_dir, cfg.logging, cfg.model_dump(mode="json")))
        self.samples = SampleLog(self.run_dir, resumed_at=self.state.step)  # eval responses and rewards
        self.scorer = BoundedScorer(session.task, cfg.task.reward_timeout_s)  # last: nothing after it can fail

    # -- phases ----------------------------------------------------------------------------------
    def score(self, rollouts: list[Rollout], problems: dict[int, Problem]) -> dict[str, float]:
        """Set each rollout's reward (NaN = unscorable: left out of the group statistics, advantage 0; a timeout
        scores 0). Returns the step's counts reward/unscorable and reward/timeouts."""
        results = score_texts(self.scorer, self.s.tokenizer, [r.response_ids() for r in rollouts],
                              [problems[r.group_id] for r in rollouts], f"step {self.state.step + 1}", self.log)
        for r, result in zip(rollouts, results):
            r.reward = result.reward
        unscorable = sum(result.status == "error" for result in results)
        self.state.scorer_errors += unscorable
        return {"reward/unscorable": float(unscorable),
                "reward/timeouts": float(sum(result.status == "timeout" for result in results))}

    def update(self, batch, advantages: torch.Tensor, keep: torch.Tensor | None, old: Recomputed,
               timer: _Timer) -> UpdateResult:
        """epochs x minibatches optimizer steps at this step's learning rate (ops/schedule.py)."""
        lr = set_learning_rate(self.s.optimizer, self.cfg, self.state.step)
        self.sync.snapshot()  # MIPU: what a rejected candidate returns to (nothing otherwise)
        with timer("update"):
            update = policy_update(self.s.model, self.s.optimizer, batch, old.old_logprobs, advantages, self.sampling,
                                   self.settings, sample_keep=keep, ref_model=kl_reference(self.cfg, self.s),
                                   ewma_logprobs=old.ewma_logprobs, version=self.state.version, distill=self.s.distill,
                                   on_step=None if self.ewma is None else lambda: self.ewma.update(self.s.model))
        update.entropy = old.entropy if update.entropy is None else update.entropy
        update.metrics["actor/lr"] = lr
        return update

    def publish(self, batch, advantages, keep, update: UpdateResult) -> dict[str, float]:
        check_finite_weights(self.s.model, self.state.step + 1)  # never export (or later save) NaN / inf weights
        self.state.version += 1  # mipu.enabled: the candidate is kept only if the engine's policy improves (mipu/*)
        return self.sync.publish(self.state.version, batch, advantages, keep, update.old_logprobs)

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out problems with the in-process engine at the newest weights, or the
        trainer's fp32 policy (logging.eval_policy), as the rollout source evaluates (RolloutSource.evaluate)."""
        started = time.perf_counter()
        try:
            engine = self.rollouts.eval_engine() if self.cfg.logging.eval_policy == "engine" else policy_engine(self.s)
        except EngineDied as died:  # replicas: refreshing the eval engine to the newest weights
            died.at = died.at or f"step {self.state.step}"
            died.phase = f"{died.phase} before the eval"
            raise
        problems = self.s.task.eval_problems()
        score = lambda ids, label: score_texts(self.scorer, self.s.tokenizer, ids, problems,  # noqa: E731
                                               f"eval at step {self.state.step}{label}", self.log)
        completions, results, extra = self.rollouts.evaluate(engine, problems, score)
        self.samples.write(eval_samples(self.state.step, self.s.tokenizer, problems, completions, results))
        self.samples.write_outcomes(self.state.step, [r.reward for r in results])  # every problem's, for the arena
        return eval_metrics(results, completions) | extra | {"time/eval": time.perf_counter() - started}

    def train_step(self) -> dict[str, float]:
        timer = _Timer(**{"time/recompute": 0.0})
        with timer("rollout"):
            got = self.rollouts.collect(self.state.step, self.state.version, self.state.data_position)
        with timer("score"):
            score_metrics = self.score(got.rollouts, got.problems)
        batch = collate(got.rollouts, self.s.pad_id, self.s.vocab_size, self.cfg.algorithm.shared_prompt)
        with timer("recompute"):
            old = recompute(self.s.model, batch, self.sampling, self.settings, self.ewma, self.state.version)
        rewards, adv, advantages, distill_metrics = step_advantages(self.cfg, self.s, got.rollouts, batch, self.sampling,
                                                                    got.problems, old.rejected)
        update = self.update(batch, advantages, adv.keep, old, timer)
        with timer("diagnostics"):
            _, defined = mismatch_log_ratio(update.old_logprobs, batch.rollout_logprobs, batch.mask, batch.has_rollout)
            mismatch = mismatch_diagnostics(update, batch, defined) if self.cfg.logging.diagnostics else {}
        source_metrics = got.metrics | self.rollouts.step_metrics(update.old_logprobs, batch.rollout_logprobs, defined,
                                                                  batch.versions, self.state.version)
        self.state.data_position = got.next_position  # only a completed step counts
        with timer("sync"):
            synced = self.publish(batch, advantages, adv.keep, update)
        return step_metrics(rewards, got.rollouts, batch, update, timer) | score_metrics | mismatch | synced | {
            "reward/scorer_errors": float(self.state.scorer_errors), **distill_metrics, **source_metrics,
            "policy/version": float(self.state.version)}

    # -- loop ------------------------------------------------------------------------------------
    def fit(self, stop=None, progress: bool = True) -> Path:
        """Run to cfg.run.steps. `stop` (signals.GracefulStop) ends the run after the step in progress, checkpointing
        it, with StopRequested. Raises NonFiniteError after run.max_bad_steps consecutive non-finite steps.
        `progress=False` hides the bar whatever logging.progress says (the Ray driver draws its own)."""
        cfg = self.cfg
        bar = tqdm(total=cfg.run.steps, initial=self.state.step, desc=cfg.run.name,
                   disable=not (progress and cfg.logging.progress), dynamic_ncols=True, postfix=self.postfix or None)
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
            bar.set_postfix(phase="eval")
            first = self.evaluate()  # its time/eval is counted in `summary`'s training time
            self.metrics.write(0, first)
            self.postfix = accuracy_figure(first["eval/accuracy"])
            bar.set_postfix(self.postfix)
            self.log(f"step 0 eval accuracy {first['eval/accuracy']:.3f}")
        while self.state.step < cfg.run.steps:
            if stop is not None and stop.signum is not None:
                raise StopRequested(stop.signum, self.state.step, self._checkpoint_on_stop())
            t0 = time.perf_counter()
            metrics = self.train_step()
            self.state.step = step = self.state.step + 1
            bar.update(1)  # the bar counts trained steps, so step N's eval line appears beside N
            metrics |= self.guard.observe(step, metrics, self.log)
            if step % cfg.logging.eval_every == 0 or step == cfg.run.steps:
                bar.set_postfix(self.postfix | {"phase": "eval"})
                metrics |= self.evaluate()
                self.log(f"step {step} eval accuracy {metrics['eval/accuracy']:.3f}")
            metrics |= {"time/step": time.perf_counter() - t0, **peak_memory()}
            self.metrics.write(step, metrics)
            self.postfix = progress_postfix(metrics, self.postfix)
            if step % cfg.logging.checkpoint_every == 0 or step == cfg.run.steps:
                bar.set_postfix(self.postfix | {"phase": "checkpoint"})
                self.checkpoint()
            self.guard.check(step)
            bar.set_postfix(self.postfix)
        self.close()
        return self.run_dir

    def close(self) -> None:
        """Close the metric trackers, stop the rollout source's engines and the scoring process; safe to call
        twice."""
        self.metrics.close()
        self.scorer.close()
        self.rollouts.close()

    def checkpoint(self) -> Path:
        st = self.state
        state = {"data_position": st.data_position, "version": st.version, "scorer_errors": st.scorer_errors,
                 "engine_precision": self.cfg.engine.precision, **self.guard.state(), **self.sync.state()}
        source_state = self.rollouts.state_dict()
        if source_state is not None:
            state["scheduler"] = source_state
        extra = None if self.ewma is None else self.ewma.state_tensors()
        kept, model = self.cfg.logging, self.s.checkpointed  # the last may keep weights only; [lora]: the adapter
        self.saved = save_checkpoint(self.run_dir, st.step, model, self.s.optimizer, state, kept.keep_checkpoints,
                                     extra=extra, weights_only=kept.final_weights_only and st.step == self.cfg.run.steps)
        return self.saved

    def _checkpoint_on_stop(self) -> Path | None:
        """The checkpoint of the last completed step (written now unless it already exists); None at step 0."""
        if self.state.step == 0:
            return None
        if self.saved is not None and self.saved.name == f"step_{self.state.step:06d}":
            return self.saved
        return self.checkpoint()

    def _resume(self) -> None:
        """Continue from the newest loadable checkpoint (runs.folder.resume_checkpoint); with none, start over. The rollout
        source pushes the restored weights to its engines when it starts."""
        found = resume_checkpoint(self.run_dir, self.s.checkpointed, self.s.optimizer, lambda path, extra:
                                  restore_proximal(self.ewma, extra, self.s.model, self.log, where=path), self.log)
        if found is None:
            return
        path, saved = found
        self.state = TrainState(step=saved["step"], data_position=saved["data_position"], version=saved["version"],
                                scorer_errors=saved.get("scorer_errors", 0), scheduler=saved.get("scheduler"))
        self.guard.restore(saved)
        self.sync.restore(saved)
        self.saved = path
        self.postfix = accuracy_figure(last_eval_accuracy(self.run_dir, self.state.step))
        note_engine_precision(saved, self.cfg.engine.precision, self.log)
        self.log(f"resumed from {path} at step {self.state.step}")
