"""The update on the tiny model: on-policy ratio exactly 1, micro-batching does not change the gradient
(invariants 7, 8)."""

from __future__ import annotations

import copy

import pytest
import torch

from nearpolicy.batching import collate
from nearpolicy.ops.corrections import CorrectionSpec
from nearpolicy.ops.losses import PolicyLossParams
from nearpolicy.types import Rollout, SamplingParams
from nearpolicy.model.policy import recompute_logprobs
from nearpolicy.training.update import UpdateSettings, policy_update

SAMPLING = SamplingParams(0.9, 1.0, 0, 8)


@pytest.fixture(scope="module")
def model_and_batch(tiny_model_dir):
    from nearpolicy.model.load import load_policy

    model, _ = load_policy(str(tiny_model_dir))
    g = torch.Generator().manual_seed(0)
    rollouts = []
    for i in range(6):  # uneven prompt and completion lengths: real padding
        prompt = torch.randint(3, 49152, (3 + i % 3,), generator=g).tolist()
        completion = torch.randint(3, 49152, (2 + (5 * i) % 7,), generator=g).tolist()
        rollouts.append(Rollout(i // 2, i % 2, prompt, completion, [-10.0] * len(completion), [0] * len(completion), "length"))
    return model, collate(rollouts, pad_id=2, vocab_size=49152)


def _settings(minibatches, micro):
    return UpdateSettings(minibatches, micro, 1e9, "ppo_clip", PolicyLossParams(0.2, 0.28, 3.0), "token-mean", None,
                          CorrectionSpec())


def _grads_after_update(model, batch, micro, fused):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: weights stay, gradients are inspected
    captured = {}
    optimizer.step = lambda: captured.update({n: p.grad.clone() for n, p in model.named_parameters()})
    old = None if fused else recompute_logprobs(model, batch, SAMPLING, micro)[0]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    result = policy_update(model, optimizer, batch, old, adv, SAMPLING, _settings(1, micro))
    metrics, old_out = result.metrics, result.old_logprobs
    return captured, metrics, old_out


@pytest.mark.parametrize("fused", [True, False])
def test_on_policy_ratio_is_exactly_one_on_the_first_minibatch(model_and_batch, fused):
    model, batch = model_and_batch
    for micro in (1, 4):
        _, metrics, _ = _grads_after_update(model, batch, micro, fused)
        assert metrics["actor/ppo_kl"] == 0.0 and metrics["actor/pg_clipfrac"] == 0.0


def test_gradient_does_not_depend_on_micro_batch_size(model_and_batch):
    model, batch = model_and_batch
    g1, m1, old1 = _grads_after_update(model, batch, 1, True)
    g6, m6, old6 = _grads_after_update(model, batch, 6, True)
    assert m1["actor/loss"] == pytest.approx(m6["actor/loss"], rel=1e-5)
    for name in g1:  # relative L2 error: single near-zero elements carry only float32 reduction-order noise
        assert float((g1[name] - g6[name]).norm() / g1[name].norm().clamp_min(1e-12)) < 1e-4, name
    assert torch.allclose(old1[batch.mask], old6[batch.mask], rtol=0, atol=1e-5)


def test_fused_old_logprobs_need_a_single_minibatch(model_and_batch):
    model, batch = model_and_batch
    with pytest.raises(ValueError, match="single mini-batch"):
        policy_update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, None, torch.zeros(6), SAMPLING,
                      _settings(2, 3))


def test_policy_lag_is_zero_on_the_first_minibatch_and_measured_on_the_second(model_and_batch):
    """logprobs - old_logprobs: exactly 0 on rows trained before any optimizer step, non-zero after one."""
    from nearpolicy.ops.diagnostics import mismatch_decomposition

    model, batch = model_and_batch
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    old = recompute_logprobs(model, batch, SAMPLING, 3)[0]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    result = policy_update(model, optimizer, batch, old, adv, SAMPLING, _settings(2, 3))
    lag = (result.logprobs - result.old_logprobs)[batch.mask]
    rows = batch.mask.nonzero()[:, 0]
    assert torch.equal(lag[rows < 3], torch.zeros_like(lag[rows < 3]))
    assert lag[rows >= 3].abs().max() > 1e-3
    parts = mismatch_decomposition(result.logprobs, result.old_logprobs, result.old_logprobs, batch.mask)
    assert parts["discrepancy_k3"] == 0.0 and parts["discrepancy_ess"] == 1.0
    assert parts["lag_k3"] > 0 and parts["lag_k3"] == parts["total_k3"]


def _rollouts(n):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 49152, (3 + i % 2,), generator=g).tolist()
        completion = torch.randint(3, 49152, (2 + 3 * i,), generator=g).tolist()
        out.append(Rollout(i, 0, prompt, completion, [-10.0] * len(completion), [0] * len(completion), "length"))
    return out


@pytest.mark.parametrize("loss,mode", [("ppo_clip", "token-mean"), ("ppo_clip", "seq-mean-token-mean"),
                                       ("ppo_clip", "seq-mean-token-sum"), ("ppo_clip", "seq-mean-token-sum-norm"),
                                       ("gspo", "seq-mean-token-mean")])
def test_duplicated_minibatch_gives_the_same_loss_and_gradient(model_and_batch, loss, mode):
    """Invariant 14 over the whole update (micro-batches of 3, gradient accumulation): 2 sequences of 2 and 5
    tokens, once and 4 times over, give the same loss and gradient in every mode (Dr. GRPO's sum-norm used to
    give 4 times the loss)."""
    model, _ = model_and_batch
    results = []
    for copies in (1, 4):
        batch = collate(_rollouts(2) * copies, pad_id=2, vocab_size=49152)
        local = copy.deepcopy(model)
        optimizer = torch.optim.SGD(local.parameters(), lr=0.0)
        captured = {}
        optimizer.step = lambda: captured.update({n: p.grad.clone() for n, p in local.named_parameters()})
        settings = UpdateSettings(1, 3, 1e9, loss, PolicyLossParams(0.2, 0.28, 3.0), mode, 8.0, CorrectionSpec())
        result = policy_update(local, optimizer, batch, None, torch.tensor([1.0, -0.5] * copies), SAMPLING, settings)
        results.append((result.metrics["actor/loss"], captured))
    (loss1, g1), (loss4, g4) = results
    assert loss4 == pytest.approx(loss1, rel=1e-5, abs=1e-7)
    for name in g1:  # float32 accumulation over 1 vs 3 micro-batches: compare by relative norm
        assert float((g4[name] - g1[name]).norm() / g1[name].norm()) < 1e-5, name


def test_an_unscorable_sample_leaves_the_loss_denominator(model_and_batch):
    """step_advantages drops an unscorable sample (reward NaN) from the keep-mask, so adding one to a batch leaves
    the gradient of the others unchanged (with advantage 0 alone its tokens would still dilute the token mean)."""
    from types import SimpleNamespace

    from nearpolicy.config.schema import load_config
    from nearpolicy.training.trainer import step_advantages

    model, batch = model_and_batch
    rollouts = [r for r in _rollouts_of(batch)]
    for r, reward in zip(rollouts, [1.0, 0.0, 1.0, float("nan"), 0.0, 1.0]):
        r.reward = reward
    cfg = load_config(None, ["algorithm.group_size=2", "algorithm.prompts_per_step=3", "algorithm.micro_batch_size=2",
                             "algorithm.shared_prompt=false"])
    session = SimpleNamespace(pad_id=2, vocab_size=49152, teacher=None)
    full = collate(rollouts, 2, 49152, shared_prompt=False)
    _, adv, advantages, _ = step_advantages(cfg, session, rollouts, full, SAMPLING)
    assert adv.keep.tolist() == [True, True, True, False, True, True]
    grads = {}
    for name, b, a, keep in (("with", full, advantages, adv.keep),
                             ("without", full.select(torch.tensor([0, 1, 2, 4, 5])), advantages[[0, 1, 2, 4, 5]], None)):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        opt.step = lambda m=m, name=name: grads.update({name: {n: p.grad.clone() for n, p in m.named_parameters()}})
        old = recompute_logprobs(m, b, SAMPLING, 2)[0]
        policy_update(m, opt, b, old, a, SAMPLING, _settings(1, 2), sample_keep=keep)
    for n, g in grads["without"].items():  # float32 sums over other row sets: by relative norm, as above (a leaked
        assert float((grads["with"][n] - g).norm() / g.norm()) < 1e-5, n  # sample would dilute the mean by 5/6)


def _rollouts_of(batch):
    """The Rollouts a test batch was collated from (ids, engine log-probs and versions), rebuilt from the batch."""
    out = []
    for i in range(len(batch)):
        n_prompt, n = int(batch.prompt_lengths[i]), int(batch.completion_lengths[i])
        out.append(Rollout(i // 2, i % 2, batch.input_ids[i, :n_prompt].tolist(), batch.completion_ids[i, :n].tolist(),
                           batch.rollout_logprobs[i, :n].tolist(), [0] * n, "length"))
    return out
