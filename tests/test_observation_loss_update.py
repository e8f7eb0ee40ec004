"""ECHO's observation loss through policy_update (training/update.py, ops/observation_loss.py; arXiv:2605.24517): with
algorithm.observation_loss_coef > 0 the loss of a mini-batch is the policy loss plus coef x the token-mean
cross-entropy of its tool-observation tokens under the raw (T = 1) distribution, the same for any micro-batch split;
with 0 the update is the plain one."""

from __future__ import annotations

import copy

import pytest
import torch

from nearpolicy.batching import collate
from nearpolicy.ops.corrections import CorrectionSpec
from nearpolicy.ops.losses import PolicyLossParams
from nearpolicy.model.policy import recompute_logprobs
from nearpolicy.types import Rollout, SamplingParams
from nearpolicy.training.update import UpdateSettings, policy_update

SAMPLING = SamplingParams(0.8, 1.0, 20, 8)  # not the identity transform: the raw log-probs differ from the loss's


@pytest.fixture(scope="module")
def model_and_batch(tiny_model_dir):
    from nearpolicy.model.load import load_policy

    model = load_policy(str(tiny_model_dir))[0]
    g = torch.Generator().manual_seed(3)
    rollouts = []
    for i in range(4):
        prompt = torch.randint(3, 49152, (4,), generator=g).tolist()
        ids = torch.randint(3, 49152, (7,), generator=g).tolist()
        model_mask = [True, True, False, False, False, True, True] if i % 2 == 0 else [True] * 7
        lps = [-10.0 if m else None for m in model_mask]
        rollouts.append(Rollout(i // 2, i % 2, prompt, ids, lps, [0] * 7, "stop", model_mask=model_mask,
                                turn_index=[0, 0, 0, 0, 0, 1, 1] if i % 2 == 0 else [0] * 7))
    return model, collate(rollouts, 2, 49152)


def _update(model, batch, coef: float, micro: int):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    grads = {}
    optimizer.step = lambda: grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
    old = recompute_logprobs(model, batch, SAMPLING, 4)[0]
    settings = UpdateSettings(1, micro, 1e9, "ppo_clip", PolicyLossParams(0.2, 0.28, 3.0), "token-mean", None,
                              CorrectionSpec(), observation_loss_coef=coef)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    return policy_update(model, optimizer, batch, old, advantages, SAMPLING, settings).metrics, grads


def _observation_cross_entropy(model, batch) -> float:
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
        at = torch.gather(logits, 1, batch.logit_positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        logp = torch.gather(torch.log_softmax(at, -1), -1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    return float(-logp[batch.observation_mask].mean())


def test_the_loss_adds_coef_times_the_observation_cross_entropy(model_and_batch):
    model, batch = model_and_batch
    assert int(batch.observation_mask.sum()) == 6 and not bool((batch.mask & batch.observation_mask).any())
    plain, plain_grads = _update(model, batch, 0.0, 4)
    echo, echo_grads = _update(model, batch, 0.3, 4)
    expected = _observation_cross_entropy(model, batch)
    assert expected > 5  # a random tiny model: about log V
    assert "actor/observation_loss" not in plain
    assert echo["actor/observation_loss"] == pytest.approx(expected, rel=1e-5)
    assert echo["actor/loss"] - plain["actor/loss"] == pytest.approx(0.3 * expected, rel=1e-4)
    embed = "model.embed_tokens.weight"
    assert float((echo_grads[embed] - plain_grads[embed]).norm()) > 1e-3 * float(plain_grads[embed].norm())


def test_micro_batches_sum_to_the_mini_batch_token_mean(model_and_batch):
    model, batch = model_and_batch
    whole, whole_grads = _update(model, batch, 0.3, 4)
    split, split_grads = _update(model, batch, 0.3, 1)
    assert split["actor/observation_loss"] == pytest.approx(whole["actor/observation_loss"], rel=1e-5)
    assert split["actor/loss"] == pytest.approx(whole["actor/loss"], rel=1e-5)
    for name, g in whole_grads.items():
        assert float((split_grads[name] - g).norm()) <= 1e-5 * float(g.norm()) + 1e-12, name
