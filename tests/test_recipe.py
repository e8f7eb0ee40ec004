"""The recipe keys of issue 19 item 4: learning-rate schedule with warmup (ops/schedule.py), the entropy bonus
(algorithm.entropy_coef) and PPO epochs (algorithm.epochs), on the ops and through the real Trainer."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from nearpolicy.ops.losses import PolicyLossInput, PolicyLossParams, policy_loss
from nearpolicy.ops.logprobs import token_logprobs_and_entropy
from nearpolicy.ops.schedule import learning_rate
from nearpolicy.training.update import policy_update
from test_trainer_families import _run
from test_update import SAMPLING, _settings, model_and_batch  # noqa: F401 - the fixture


def test_warmup_is_linear_and_reaches_the_peak_on_its_last_step():
    rates = [learning_rate(s, 10, 1e-3, "constant", warmup_steps=4) for s in range(10)]
    assert rates[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3], rel=1e-12)
    assert rates[4:] == pytest.approx([1e-3] * 6, rel=1e-12)


@pytest.mark.parametrize("schedule, middle", [("linear", 0.55), ("cosine", 0.55)])
def test_decay_runs_from_the_peak_to_the_floor(schedule, middle):
    # 2 warmup steps, then steps 2..12 (11 steps, p = 0, 0.1, ..., 1); floor 0.1
    rates = [learning_rate(s, 13, 2.0, schedule, warmup_steps=2, min_lr_ratio=0.1) for s in range(13)]
    assert rates[2] == pytest.approx(2.0, rel=1e-12)
    assert rates[-1] == pytest.approx(0.2, rel=1e-12)
    assert rates[7] == pytest.approx(2.0 * middle, rel=1e-12)  # p = 0.5: both are half way for this floor
    if schedule == "cosine":  # p = 0.2: 0.1 + 0.9 (1 + cos(0.2 pi)) / 2
        assert rates[4] == pytest.approx(2.0 * (0.1 + 0.45 * (1 + math.cos(0.2 * math.pi))), rel=1e-12)
    else:
        assert rates[4] == pytest.approx(2.0 * (0.1 + 0.9 * 0.8), rel=1e-12)
    assert all(a >= b for a, b in zip(rates[2:], rates[3:]))


def test_schedule_refuses_bad_arguments():
    with pytest.raises(ValueError, match="unknown lr schedule 'step'"):
        learning_rate(0, 10, 1.0, "step")
    with pytest.raises(ValueError, match="outside the run's"):
        learning_rate(10, 10, 1.0)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        learning_rate(0, 10, 1.0, "cosine", min_lr_ratio=1.5)


def test_entropy_bonus_gradient_is_the_analytic_one():
    """Advantages 0 leave only -c H: dH/dz_i = -p_i (log p_i + H), so d(loss)/dz_i = c p_i (log p_i + H) / n."""
    torch.manual_seed(0)
    logits = torch.randn(1, 3, 11, requires_grad=True)
    ids = torch.tensor([[1, 4, 7]])
    mask = torch.tensor([[True, True, False]])
    logprobs, entropy = token_logprobs_and_entropy(logits, ids, 1.0, entropy_grad=True)
    coef = 0.3
    inp = PolicyLossInput(logprobs, logprobs.detach(), torch.zeros(1), mask, 2, None, None, entropy)
    loss, metrics = policy_loss("ppo_clip", inp, PolicyLossParams(entropy_coef=coef))
    loss.backward()
    logp = torch.log_softmax(logits.detach(), -1)
    p, h = logp.exp(), -(logp.exp() * logp).sum(-1, keepdim=True)
    expected = coef * p * (logp + h) / 2 * mask[..., None]
    torch.testing.assert_close(logits.grad, expected, rtol=1e-5, atol=1e-7)
    assert float(metrics["entropy_bonus"]) == pytest.approx(coef * float(h[0, :2].mean()), rel=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_the_logged_entropy_bonus_is_the_term_in_the_loss(mode):
    """actor/entropy_bonus is what the loss subtracts, aggregated like it (it was c x the token mean in every mode:
    0.0120 logged against 0.0150 in the loss for seq-mean-token-mean here)."""
    from nearpolicy.ops.masked import aggregation_denominator

    entropy = torch.tensor([[1.0, 1.0, 1.0, 1.0], [2.0, 0.0, 0.0, 0.0], [float("nan"), 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, True], [True, False, False, False], [False, False, False, False]])
    lp = torch.full((3, 4), -1.0, requires_grad=True)
    coef, denom = 0.01, aggregation_denominator(mask, mode, 4.0)
    inp = PolicyLossInput(lp, lp.detach(), torch.tensor([0.5, -0.5, 1.0]), mask, 5, None, None, entropy)
    with_bonus, metrics = policy_loss("ppo_clip", inp, PolicyLossParams(entropy_coef=coef), mode, denom)
    without, _ = policy_loss("ppo_clip", inp, PolicyLossParams(), mode, denom)
    # by hand: 5 tokens of entropy (1, 1, 1, 1, 2), sums per sequence 4 and 2, means 1 and 2, 2 non-empty sequences
    want = {"token-mean": 6 / 5, "seq-mean-token-mean": (1 + 2) / 2, "seq-mean-token-sum": (4 + 2) / 2,
            "seq-mean-token-sum-norm": (4 + 2) / (2 * 4.0)}[mode]
    assert float(metrics["entropy_bonus"]) == pytest.approx(coef * want, rel=1e-6)
    assert (without - with_bonus).item() == pytest.approx(coef * want, rel=1e-5)


def test_entropy_bonus_needs_the_entropy():
    lp = torch.zeros(1, 2, requires_grad=True)
    inp = PolicyLossInput(lp, lp.detach(), torch.ones(1), torch.ones(1, 2, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match="entropy_coef > 0 needs the token entropy"):
        policy_loss("ppo_clip", inp, PolicyLossParams(entropy_coef=0.1))


def test_epochs_run_every_minibatch_once_per_epoch(model_and_batch):  # noqa: F811
    from dataclasses import replace

    from nearpolicy.model.policy import recompute_logprobs

    model, batch = model_and_batch
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    settings = replace(_settings(2, 3), epochs=3)
    old = recompute_logprobs(model, batch, SAMPLING, 3)[0]
    steps = []
    result = policy_update(model, optimizer, batch, old, torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0]), SAMPLING,
                           settings, on_step=lambda: steps.append(1))
    assert len(steps) == 6  # 3 epochs x 2 mini-batches
    assert result.metrics["actor/skipped_minibatches"] == 0.0
    with pytest.raises(ValueError, match="one epoch"):
        policy_update(model, optimizer, batch, None, torch.zeros(6), SAMPLING, settings)


def test_trainer_applies_the_schedule_epochs_and_entropy_bonus(tiny_model_dir, tmp_path):
    rows, _ = _run(tiny_model_dir, tmp_path, "recipe", "algorithm.lr=1e-3", "algorithm.lr_schedule=cosine",
                   "algorithm.warmup_steps=1", "algorithm.min_lr_ratio=0.1", "algorithm.epochs=2",
                   "algorithm.minibatches=2", "algorithm.entropy_coef=0.01", steps=3)
    assert [r["actor/lr"] for r in rows] == pytest.approx([1e-3, 1e-3, 1e-4], rel=1e-12)
    for r in rows:  # the bonus is 0.01 x the entropy of the moving policy: same order as the step's entropy
        assert 0.002 * r["entropy"] < r["actor/entropy_bonus"] < 0.05 * r["entropy"]


def test_warmup_must_end_before_the_run_does():
    from nearpolicy.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"algorithm\.warmup_steps \(5\) must be below run\.steps \(5\)"):
        load_config(None, ["run.steps=5", "algorithm.warmup_steps=5"])
    assert load_config(None, ["run.steps=5", "algorithm.warmup_steps=4"]).algorithm.warmup_steps == 4


def test_a_resume_may_not_stretch_a_decaying_schedule(tmp_path):
    import json

    from nearpolicy.config.schema import load_config
    from nearpolicy.runs.start_checks import check_same_config
    from nearpolicy.runs.folder import RunExistsError

    saved = tmp_path / "config.json"
    cosine = ["algorithm.lr_schedule=cosine", "run.steps=10"]
    saved.write_text(json.dumps(load_config(None, cosine).model_dump(mode="json")))
    with pytest.raises(RunExistsError, match=r"run\.steps 10 -> 20: with algorithm\.lr_schedule = 'cosine'"):
        check_same_config(saved, load_config(None, ["algorithm.lr_schedule=cosine", "run.steps=20"]))
    with pytest.raises(RunExistsError, match=r"run\.steps 10 -> 9: .*cannot be shortened \(resume with run\.steps = 10"):
        check_same_config(saved, load_config(None, ["algorithm.lr_schedule=cosine", "run.steps=9"]))
    check_same_config(saved, load_config(None, cosine))  # unchanged: accepted
    with pytest.raises(RunExistsError, match=r"differs from .* in: algorithm\.lr_schedule"):  # the real change first
        check_same_config(saved, load_config(None, ["algorithm.lr_schedule=linear", "run.steps=9"]))
    saved.write_text(json.dumps(load_config(None, ["run.steps=10"]).model_dump(mode="json")))
    check_same_config(saved, load_config(None, ["run.steps=20"]))  # constant rate: extending is fine
