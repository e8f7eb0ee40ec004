"""Every registered correction, policy loss, advantage estimator and KL estimator through the real Trainer, in
process, with a known mismatch: the engine is the hf engine on the trainer's own weights (fp32) behind
engines/fake.OffsetEngine, which adds a chosen, seeded offset to each rollout log-prob. The mismatch the trainer
measures must be that offset; the corrections must weigh, mask or reject by it; every loss must give a finite loss
and gradient. The reward depends on the response (length parity), so groups have non-zero advantages.

A few real-CLI, real-llama.cpp runs of the same families stay as end-to-end smokes (test_cli_objectives.py)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from nearpolicy.config.schema import load_config
from nearpolicy.engines.fake import OffsetEngine
from nearpolicy.ops.advantages import ADVANTAGES
from nearpolicy.ops.correction_presets import CORRECTIONS
from nearpolicy.ops.kl import KL_ESTIMATORS
from nearpolicy.ops.losses import POLICY_LOSSES
from nearpolicy.tasks.base import Problem
from test_objectives_advantages import _loop_reference


class LengthParityTask:
    """The run's task, scored by the response's length parity (1 for an even number of characters): a reward the
    tiny random model earns about half the time. Module-level, so the scoring process can unpickle it."""

    def __init__(self, task):
        self.task = task

    def score(self, response: str, problem: Problem) -> float:
        return float(len(response) % 2 == 0)

    def __getattr__(self, name):
        if name == "task":  # during unpickling, before __init__'s attributes exist
            raise AttributeError(name)
        return getattr(self.task, name)


def _run(model_dir: Path, out: Path, name: str, *sets: str, shift: float = -0.3, noise: float = 0.0, steps: int = 2,
         per_sequence: bool = False):
    """`steps` train steps of a Trainer on the tiny model whose engine reports log-probs offset by shift + noise z;
    returns (metrics per step, the offsets of each step's tokens: one array, or one per sequence with
    `per_sequence`)."""
    from nearpolicy.training import assemble as setup
    from nearpolicy.training.trainer import open_trainer

    engines = []

    def build(cfg, run_dir, log):
        session = setup.build_session(cfg, run_dir, log)
        session.task = LengthParityTask(session.task)
        engines.append(_Recording(setup.build_engine(cfg, session), shift=shift, noise=noise, seed=3))
        return session, setup.build_rollouts(cfg, session, engines[0], log)

    cfg = load_config(None, [f"model.path='{model_dir}'", f"run.output_dir='{out}'", f"run.name={name}",
                             f"run.steps={steps}", "run.threads=1", "algorithm.prompts_per_step=2",
                             "algorithm.group_size=4", "algorithm.micro_batch_size=4", "sampling.max_new_tokens=6",
                             "task.eval_size=2", "task.train_size=50", "logging.eval_every=100",
                             "logging.checkpoint_every=100", "logging.tensorboard=false", "logging.progress=false",
                             "model.max_context=256", "engine.kind=hf", *sets])
    trainer = open_trainer(cfg, log=lambda _: None, build=build)
    rows, offsets = [], []
    try:
        for _ in range(steps):
            rows.append(trainer.train_step())
            offsets.append(list(engines[0].applied) if per_sequence else np.concatenate(engines[0].applied))
            trainer.state.step += 1
    finally:
        trainer.close()
    return rows, offsets


class _Recording(OffsetEngine):
    """OffsetEngine that keeps the offsets of its last generate call."""

    def generate(self, requests, sampling, seed):
        out = super().generate(requests, sampling, seed)
        self.applied = [self.offsets(r.group_id, r.sample_index, len(r.rollout_logprobs)) for r in out]
        return out


def _assert_measured_mismatch_is_the_offset(row: dict, offsets: np.ndarray) -> None:
    """The trainer's k1 is the token mean of log mu - log pi_old = the mean offset; its max |delta log p| the
    largest offset; k3 and the normalised ESS those of r = exp(-offset) (hf fp32 engine vs trainer: about 1e-6
    nats apart)."""
    assert row["mismatch/tokens"] == len(offsets)
    assert row["mismatch/k1"] == pytest.approx(float(offsets.mean()), abs=2e-4)
    assert row["mismatch/max_abs_logprob_diff"] == pytest.approx(float(np.abs(offsets).max()), abs=2e-4)
    w = np.exp(-offsets)  # r = pi_old / mu = exp(-offset)
    assert row["mismatch/k3"] == pytest.approx(float(np.mean(w - 1 + offsets)), abs=2e-4)
    assert row["mismatch/ess"] == pytest.approx(float(w.sum() ** 2 / (len(w) * (w * w).sum())), abs=2e-4)


def _assert_finite_update(row: dict) -> None:
    assert math.isfinite(row["actor/loss"]) and math.isfinite(row["actor/grad_norm"])
    assert row["actor/skipped_minibatches"] == 0


# companions some entries need (the rest run with the defaults: grpo, ppo_clip, tis)
PRESET_NEEDS = {"bypass_pg_is": ["algorithm.loss=reinforce"], "bypass_pg_geo_rs": ["algorithm.loss=reinforce"],
                "bypass_pg_geo_rs_token_tis": ["algorithm.loss=reinforce"]}
LOSS_NEEDS = {"pnpo": ["correction.preset=off"]}


@pytest.mark.parametrize("preset", CORRECTIONS.names())
def test_every_correction_preset_trains_on_a_known_mismatch(tiny_model_dir, tmp_path, preset):
    rows, offsets = _run(tiny_model_dir, tmp_path, preset, f"correction.preset={preset}", *PRESET_NEEDS.get(preset, []),
                         noise=0.3)
    for row, offs in zip(rows, offsets):
        _assert_measured_mismatch_is_the_offset(row, offs)
        _assert_finite_update(row)


@pytest.mark.parametrize("loss", POLICY_LOSSES.names())
def test_every_policy_loss_trains_on_a_known_mismatch(tiny_model_dir, tmp_path, loss):
    rows, offsets = _run(tiny_model_dir, tmp_path, loss, f"algorithm.loss={loss}", *LOSS_NEEDS.get(loss, []), noise=0.3)
    for row, offs in zip(rows, offsets):
        _assert_measured_mismatch_is_the_offset(row, offs)
        _assert_finite_update(row)
    assert any(row["actor/grad_norm"] > 0 for row in rows)  # mixed rewards: some group moves the policy


def record_advantages(monkeypatch) -> list[tuple[list[tuple[int, int, int, float]], object, torch.Tensor]]:
    """Wrap training/trainer.step_advantages: each step appends ((group id, sample index, completion length, reward)
    per rollout in batch order, the AdvantageResult, the advantages it returned)."""
    from nearpolicy.training import trainer

    seen, real = [], trainer.step_advantages

    def recording(cfg, session, rollouts, batch, sampling, problems=None, rejected=None):
        out = real(cfg, session, rollouts, batch, sampling, problems, rejected)
        seen.append(([(r.group_id, r.sample_index, len(r.completion_ids), r.reward) for r in rollouts], out[1], out[2]))
        return out

    monkeypatch.setattr(trainer, "step_advantages", recording)
    return seen


def _reference_advantages(name: str, rewards: list[float]) -> tuple[list[float], list[bool]]:
    """One group's advantages and keep-mask by hand (plain Python; MC-GRPO: test_objectives_advantages' loop)."""
    n, mean = len(rewards), statistics.fmean(rewards)
    if name == "reinforce":
        return list(rewards), [True] * n
    if name in ("mc_grpo", "mc_grpo_mad", "mc_grpo_released"):
        scale = "none" if name == "mc_grpo" else "mad"
        adv, keep = _loop_reference(torch.tensor(rewards, dtype=torch.float64), torch.zeros(n, dtype=torch.long), scale,
                                    name == "mc_grpo_released")
        return adv.tolist(), keep.tolist()
    if name == "grpo":
        std = statistics.stdev(rewards)
        return [(r - mean) / std if std > 1e-6 else r - mean for r in rewards], [True] * n
    if name == "dr_grpo":
        return [r - mean for r in rewards], [True] * n
    assert name == "rloo", f"no reference for {name}: add one"
    return [n / (n - 1) * (r - mean) for r in rewards], [True] * n


@pytest.mark.parametrize("advantage", ADVANTAGES.names())
def test_every_advantage_estimator_trains(tiny_model_dir, tmp_path, advantage, monkeypatch):
    """The advantages the real Trainer trains on are the estimator's, computed here by hand from the rewards."""
    seen = record_advantages(monkeypatch)
    rows, offsets = _run(tiny_model_dir, tmp_path, advantage, f"algorithm.advantage={advantage}")
    for row, offs in zip(rows, offsets):
        _assert_measured_mismatch_is_the_offset(row, offs)
        _assert_finite_update(row)
    nonzero = 0
    for samples, result, advantages in seen:
        for group in sorted({g for g, *_ in samples}):
            rows_of = [k for k, (g, *_) in enumerate(samples) if g == group]
            want, keep = _reference_advantages(advantage, [samples[k][3] for k in rows_of])
            assert [float(advantages[k]) for k in rows_of] == pytest.approx(want, rel=1e-5, abs=1e-6)
            assert [bool(result.keep[k]) for k in rows_of] == keep
            nonzero += any(a != 0 for a in want)
    assert nonzero > 0  # mixed rewards: the comparison is not over zeros only


@pytest.mark.parametrize("estimator", KL_ESTIMATORS.names())
def test_every_kl_estimator_is_zero_at_the_reference_and_trains(tiny_model_dir, tmp_path, estimator):
    rows, _ = _run(tiny_model_dir, tmp_path, estimator.replace("+", "plus"), "algorithm.kl_coef=0.1",
                   f"algorithm.kl_estimator='{estimator}'")
    assert rows[0]["actor/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # step 1: the policy is the reference
    assert all(_assert_finite_update(row) is None for row in rows)


def test_token_tis_weighs_every_token_by_the_known_ratio(tiny_model_dir, tmp_path):
    """Offset -0.3 on every token: rho = pi_old / mu = exp(0.3) = 1.3499 < cap 2, so each token's weight is rho."""
    rows, offsets = _run(tiny_model_dir, tmp_path, "tis", "correction.preset=tis", shift=-0.3)
    for row in rows:
        assert row["correction/weight_mean"] == pytest.approx(math.exp(0.3), rel=1e-3)
        assert row["correction/frac_high"] == 0.0


def test_token_mis_masks_every_token_outside_its_bounds(tiny_model_dir, tmp_path):
    """Offset -1: rho = e = 2.718 > 2, so token MIS masks every token; offset -0.5 (rho 1.65) keeps them all."""
    rows, _ = _run(tiny_model_dir, tmp_path, "mis", "correction.preset=token_mis", shift=-1.0, steps=1)
    assert rows[0]["correction/rejected_frac"] == pytest.approx(1.0)
    assert rows[0]["actor/grad_norm"] == 0.0  # nothing left to learn from
    rows, _ = _run(tiny_model_dir, tmp_path, "mis2", "correction.preset=token_mis", shift=-0.5, steps=1)
    assert rows[0]["correction/rejected_frac"] == 0.0


def test_self_normalised_is_has_unit_mean_weight(tiny_model_dir, tmp_path):
    rows, _ = _run(tiny_model_dir, tmp_path, "snis", "correction.preset=tis_snis", noise=0.5)
    assert all(row["correction/weight_mean"] == pytest.approx(1.0, rel=1e-4) for row in rows)
    assert all(row["correction/sn_factor"] > 0 for row in rows)


def test_dlc_center_and_ais_mix_follow_the_known_mismatch(tiny_model_dir, tmp_path):
    """log rho = old - rollout = -offset per token (the hf fp32 engine and the trainer agree to ~1e-6 nats): the DLC
    centre is its mean, and the AIS lambda (docs/math.md sec. 14) is computed here from the centred log-ratios."""
    rows, offsets = _run(tiny_model_dir, tmp_path, "dlc", "correction.preset=token_is", "correction.center=log_mean",
                         "correction.adaptive_mix=ais", noise=0.3)
    for row, offs in zip(rows, offsets):
        log_rho = -offs
        center = log_rho.mean()
        assert row["correction/dlc_center"] == pytest.approx(center, abs=1e-5)
        w = np.exp(log_rho - center)
        reliability = w.sum() ** 2 / (len(w) * (w * w).sum())
        severity = np.mean(w - 1 - (log_rho - center))
        amplification = max(np.mean(w * w) - 1, 0.0)
        lam = severity / (severity + 1e-3) * reliability / (1 + amplification)
        assert (row["ais/reliability"], row["ais/severity"], row["ais/amplification"]) == pytest.approx(
            (reliability, severity, amplification), rel=1e-3, abs=1e-6)
        assert row["ais/lambda"] == pytest.approx(lam, rel=1e-3)
        assert 0.5 < lam < 1  # noise 0.3: a real, not a degenerate, mix
