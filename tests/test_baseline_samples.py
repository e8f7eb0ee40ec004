"""algorithm.baseline_samples: a sample the correction rejects whole (seq_mis, geo_mis, k3_rs, a veto) is left out of
its group's baseline ("accepted", the default) or kept in it ("all"); verl #6375 / #6452. Hand-computed values for
step_advantages and update.rejected_samples, then the real Trainer on an engine whose mismatch is known."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from nearpolicy.batching import collate
from nearpolicy.config.schema import load_config
from nearpolicy.engines.fake import OffsetEngine
from nearpolicy.ops.correction_presets import correction_spec
from nearpolicy.ops.losses import PolicyLossParams
from nearpolicy.training.trainer import step_advantages, update_settings
from nearpolicy.training.update import UpdateSettings, rejected_samples
from nearpolicy.types import Rollout

from test_trainer_families import _run, record_advantages


def _rollouts(rewards: list[float], groups: list[int]) -> list[Rollout]:
    out = [Rollout(g, i, [5, 6], [7, 8, 9], [-1.0, -1.0, -1.0], [0, 0, 0], "length") for i, g in enumerate(groups)]
    for r, reward in zip(out, rewards):
        r.reward = reward
    return out


@pytest.mark.parametrize("mode", ["accepted", "all"])
def test_a_rejected_sample_sets_its_siblings_baseline_only_with_all(mode):
    # one group of three, rewards 0, 0.5, 1, the third rejected. accepted: GRPO over (0, 0.5): mean 0.25, unbiased std
    # 0.5 / sqrt(2) -> -+1 / sqrt(2); all: mean 0.5, std 0.5 -> -1, 0 (and the rejected one's own +1, which the
    # correction then zeroes)
    cfg = load_config(None, [f"algorithm.baseline_samples={mode}", "algorithm.group_size=3"])
    rollouts = _rollouts([0.0, 0.5, 1.0], [0, 0, 0])
    batch = collate(rollouts, 2, 16, shared_prompt=False)
    rejected = torch.tensor([False, False, True]) if mode == "accepted" else None
    _, adv, advantages, metrics = step_advantages(cfg, SimpleNamespace(teacher=None), rollouts, batch, None, None,
                                                  rejected)
    want = [-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0] if mode == "accepted" else [-1.0, 0.0, 1.0]
    assert advantages.tolist() == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert adv.keep.tolist() == [True, True, True]  # the loss mask is unchanged: the correction drops its tokens
    assert metrics["advantage/nonzero_frac"] == 2 / 3  # accepted: the rejected one; all: the mean reward 0.5


def test_rejected_samples_are_the_rows_whose_every_token_the_correction_drops():
    # seq_mis: reject a sequence when prod rho = exp(sum (old - rollout)) is outside [0, 2]
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0], [-2.0, 0.0, 0.0]])
    rollout = old - torch.tensor([[0.1, 0.1, 0.1], [0.3, 0.3, 0.2], [0.0, 0.0, 0.0], [0.8, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, True], [False, False, False], [True, False, False]])
    batch = SimpleNamespace(mask=mask, rollout_logprobs=torch.where(mask, rollout, torch.nan), has_rollout=mask,
                            versions=torch.zeros(4, 3, dtype=torch.long))
    settings = UpdateSettings(1, 4, 1.0, "ppo_clip", PolicyLossParams(), "token-mean", None, correction_spec("seq_mis"),
                              baseline_after_rejection=True)
    # log prod rho: 0.3 (kept), 0.8 > log 2 = 0.693 (rejected), an empty row (never rejected), 0.8 (rejected)
    assert rejected_samples(batch, old, settings).tolist() == [False, True, False, True]
    tis = UpdateSettings(1, 4, 1.0, "ppo_clip", PolicyLossParams(), "token-mean", None, correction_spec("tis"))
    assert rejected_samples(batch, old, tis).tolist() == [False] * 4  # truncation rejects nothing


def test_the_baseline_option_only_unfuses_the_recompute_when_the_correction_can_reject():
    def settings(*sets):
        return update_settings(load_config(None, list(sets)))

    assert settings("correction.preset=seq_mis").baseline_after_rejection
    assert not settings("correction.preset=seq_mis").fusable  # old_logprobs come before the advantages
    assert not settings("correction.preset=seq_mis", "algorithm.baseline_samples=all").baseline_after_rejection
    assert settings("correction.preset=tis").fusable and not settings("correction.preset=tis").baseline_after_rejection


def _grpo(rewards: list[float]) -> list[float]:
    """GRPO over one group's rewards, by hand: (r - mean) / unbiased std, not divided at std <= 1e-6, 0 alone."""
    if len(rewards) < 2:
        return [0.0] * len(rewards)
    mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
    return [(r - mean) / std if std > 1e-6 else r - mean for r in rewards]


@pytest.mark.parametrize("mode", ["accepted", "all"])
def test_the_trainer_leaves_rejected_samples_out_of_the_baseline(tiny_model_dir, tmp_path, monkeypatch, mode):
    """The real Trainer, seq_mis, engine log-probs offset by -0.1 + 0.3 z nats (known): a sample is rejected iff
    -sum offsets > log 2; its group's GRPO advantages, computed here from the rewards, leave it out ("accepted")."""
    seen = record_advantages(monkeypatch)
    _run(tiny_model_dir, tmp_path, mode, "correction.preset=seq_mis", f"algorithm.baseline_samples={mode}",
         shift=-0.1, noise=0.3)
    offsets = OffsetEngine(None, shift=-0.1, noise=0.3, seed=3).offsets  # the engine _run wraps
    moved, decisions = 0, []
    for samples, _, advantages in seen:
        rejected = {(g, i): -offsets(g, i, n).sum() > math.log(2) for g, i, n, _ in samples}
        decisions += rejected.values()
        for group in {g for g, *_ in samples}:
            members = [(i, reward, rejected[group, i]) for g, i, _, reward in samples if g == group]
            with_all = dict(zip([i for i, _, _ in members], _grpo([r for _, r, _ in members])))
            kept = [(i, r) for i, r, out in members if not out]
            with_accepted = dict.fromkeys(with_all, 0.0) | dict(zip([i for i, _ in kept], _grpo([r for _, r in kept])))
            want = with_accepted if mode == "accepted" else with_all
            got = {i: float(advantages[k]) for k, (g, i, _, _) in enumerate(samples) if g == group}
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (group, rejected)
            moved += any(abs(with_all[i] - with_accepted[i]) > 1e-3 for i, _, out in members if not out)
    assert moved > 0  # not vacuous: some accepted sample's advantage differs between the two behaviours
    assert any(decisions) and not all(decisions)
