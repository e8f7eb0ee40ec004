"""Rows whose gradient is exactly 0 (advantage 0 everywhere, e.g. GRPO's constant-reward groups) run forward only
in the update (update.inert_rows). The update must be the same as running every row's backward: the same
metrics, logprobs, gradients and weights after AdamW steps, to float32 rounding."""

from __future__ import annotations

import copy

import pytest
import torch

from nearpolicy.batching import collate
from nearpolicy.ops.correction_presets import correction_spec
from nearpolicy.ops.losses import (ADVANTAGE_PROPORTIONAL_LOSSES, POLICY_LOSSES, PolicyLossInput, PolicyLossParams,
                                   policy_loss, required_aggregation)
from nearpolicy.types import Rollout, SamplingParams
from nearpolicy.training.update import UpdateSettings, inert_rows, policy_update

SAMPLING = SamplingParams(0.9, 1.0, 0, 8)
VOCAB, PAD = 49152, 2
GROUPS = [(6, [5, 0, 9, 3]), (10, [2, 7, 7, 1]), (4, [4, 6, 0, 8]), (7, [3, 3, 5, 2])]


def test_every_listed_loss_is_registered():
    assert ADVANTAGE_PROPORTIONAL_LOSSES <= set(POLICY_LOSSES.names())


@pytest.mark.parametrize("loss", sorted(ADVANTAGE_PROPORTIONAL_LOSSES))
def test_a_zero_advantage_row_gets_exactly_zero_gradient(loss):
    """The property the list claims, far from and near the clip range, with mismatch weights."""
    g = torch.Generator().manual_seed(0)
    logprobs = (-3 * torch.rand(6, 9, generator=g, dtype=torch.float64)).requires_grad_(True)
    prox = logprobs.detach() + torch.randn(6, 9, generator=g, dtype=torch.float64)
    advantages = torch.tensor([1.5, 0.0, -0.7, 0.0, 2.0, 0.0], dtype=torch.float64)
    mask = torch.rand(6, 9, generator=g) > 0.2
    weights = torch.rand(6, 9, generator=g, dtype=torch.float64) * 2
    inp = PolicyLossInput(logprobs, prox, advantages, mask, mask.sum(), weights)
    mode = required_aggregation(loss) or "token-mean"
    from nearpolicy.ops.masked import aggregation_denominator

    out, _ = policy_loss(loss, inp, PolicyLossParams(0.2, 0.28, 3.0), mode, aggregation_denominator(mask, mode, None))
    out.backward()
    assert float(logprobs.grad[advantages != 0].abs().sum()) > 0  # a zero gradient everywhere would prove nothing
    assert float(logprobs.grad[advantages == 0].abs().max()) == 0.0


def _settings(loss="ppo_clip", minibatches=1, entropy_coef=0.0, kl_coef=0.0, echo=0.0) -> UpdateSettings:
    params = PolicyLossParams(0.2, 0.28, 3.0, kl_coef=kl_coef, entropy_coef=entropy_coef)
    return UpdateSettings(minibatches, 4, 1e9, loss, params, required_aggregation(loss) or "token-mean", None,
                          correction_spec("tis"), observation_loss_coef=echo)


def test_inert_rows_are_the_zero_advantage_rows_and_only_without_other_terms():
    mask = torch.ones(8, 5, dtype=torch.bool)
    mask[5] = False  # no loss token (e.g. MC-GRPO's pivot): inert whatever its advantage
    advantages = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 0.0, float("nan")])
    assert inert_rows(advantages, mask, _settings(), False).tolist() == [True] * 4 + [False, True, True, False]
    for settings, reference in [(_settings(entropy_coef=0.01), False), (_settings(kl_coef=0.1), True),
                                (_settings(echo=0.5), False)]:
        assert not inert_rows(advantages, mask, settings, reference).any()
    # a mini-batch of inert rows only keeps the backward of its first micro-batch (AdamW's zero-gradient step)
    two = inert_rows(torch.tensor([0.0] * 8), mask, _settings(minibatches=2), False)
    assert two.tolist() == [False] * 4 + [False] * 4
    assert inert_rows(torch.tensor([1.0] + [0.0] * 7), mask, _settings(minibatches=1), False).tolist() == \
        [False] + [True] * 7


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from nearpolicy.model.load import load_policy

    return load_policy(str(tiny_model_dir))[0]


def _batch():
    g = torch.Generator().manual_seed(1)
    rollouts = []
    for group, (n_prompt, lengths) in enumerate(GROUPS):
        prompt = torch.randint(3, VOCAB, (n_prompt,), generator=g).tolist()
        for k, n in enumerate(lengths):
            ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
            rollouts.append(Rollout(group, k, prompt, ids, (-10 + torch.rand(n, generator=g)).tolist(), [0] * n,
                                    "length"))
    return collate(rollouts, PAD, VOCAB)


def _run(model, batch, advantages_per_step, settings, skip: bool, monkeypatch):
    """AdamW steps of policy_update (one batch of advantages per step): metrics and the weights at the end."""
    if not skip:
        monkeypatch.setattr("nearpolicy.training.update.inert_rows", lambda adv, mask, *a: torch.zeros(len(mask), dtype=torch.bool))
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    results = [policy_update(model, optimizer, batch, None, adv, SAMPLING, settings) for adv in advantages_per_step]
    monkeypatch.undo()
    return results, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", ["two constant groups", "every group constant after a step"])
def test_the_update_equals_the_one_that_runs_every_backward(model, case, monkeypatch):
    batch = _batch()
    mixed = torch.randn(len(batch), generator=torch.Generator().manual_seed(3))
    mixed[4:12] = 0.0  # groups 1 and 2: constant rewards
    steps = [mixed] if case == "two constant groups" else [mixed, torch.zeros(len(batch))]
    settings = _settings()
    skipped, weights_skipped = _run(model, batch, steps, settings, True, monkeypatch)
    full, weights_full = _run(model, batch, steps, settings, False, monkeypatch)
    # groups 1 and 2 (8 rows), and group 0's empty completion (no loss token)
    assert skipped[0].metrics["actor/inert_rows"] == pytest.approx(9 / 16)
    assert full[0].metrics["actor/inert_rows"] == 0.0
    if case != "two constant groups":  # all inert: the first micro-batch keeps its backward
        assert skipped[1].metrics["actor/inert_rows"] == pytest.approx(0.75)
    for s, f in zip(skipped, full):
        assert torch.allclose(s.logprobs, f.logprobs, atol=2e-5, rtol=0)
        for key, value in f.metrics.items():
            if key != "actor/inert_rows":
                assert s.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    moved = sum(float((weights_full[n] - p).norm()) for n, p in model.named_parameters())
    assert moved > 0  # the steps did change the weights
    for name, w in weights_full.items():
        assert torch.allclose(weights_skipped[name], w, atol=1e-6, rtol=1e-5), name
