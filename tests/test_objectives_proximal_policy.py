"""The proximal policy selectable in the trainer (model/ewma.py): PPO-EWMA model, its checkpointing, and the
A-3PO staleness interpolation, on the tiny model and on tensors."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from safetensors.torch import load_file

from nearpolicy.batching import collate
from nearpolicy.ops.corrections import CorrectionSpec
from nearpolicy.ops.losses import PolicyLossParams
from nearpolicy.ops.proximal import a3po_behaviour_proximal
from nearpolicy.model.ewma import EwmaPolicy, restore_proximal
from nearpolicy.runs.folder import load_checkpoint, load_extra_tensors, save_checkpoint
from nearpolicy.types import Rollout, SamplingParams
from nearpolicy.model.policy import recompute_logprobs
from nearpolicy.training.update import UpdateSettings, policy_update

SAMPLING = SamplingParams(0.9, 1.0, 0, 8)
ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])


@pytest.fixture(scope="module")
def model_and_batch(tiny_model_dir):
    from nearpolicy.model.load import load_policy

    model, _ = load_policy(str(tiny_model_dir))
    g = torch.Generator().manual_seed(1)
    rollouts = []
    for i in range(6):
        prompt = torch.randint(3, 49152, (3 + i % 3,), generator=g).tolist()
        completion = torch.randint(3, 49152, (2 + (5 * i) % 7,), generator=g).tolist()
        lps = (-10.8 + 0.5 * torch.randn(len(completion), generator=g)).tolist()  # near the tiny model's -log V
        rollouts.append(Rollout(i // 2, i % 2, prompt, completion, lps, [4] * len(completion), "length"))
    return model, collate(rollouts, pad_id=2, vocab_size=49152)


def _settings(minibatches, proximal="old", spec=CorrectionSpec("token", "truncate", 0.0, 2.0)):
    return UpdateSettings(minibatches, 3, 1e9, "ppo_clip", PolicyLossParams(0.2, 0.28, 3.0), "token-mean", None,
                          spec, proximal=proximal)


# -- PPO-EWMA ------------------------------------------------------------------------------------------------
def test_ewma_model_after_k_optimizer_steps_is_the_bias_corrected_average_of_the_snapshots(model_and_batch):
    """Through policy_update (2 mini-batches x 2 updates = 4 steps): the EWMA weights equal
    sum_j beta^(k-j) theta_j / sum_j beta^(k-j) over the k + 1 = 5 snapshots, computed in float64."""
    model, batch = model_and_batch
    model = copy.deepcopy(model)
    beta = 0.8
    ewma = EwmaPolicy(model, beta)
    snapshots = [{n: p.detach().double().clone() for n, p in model.named_parameters()}]

    def step():
        ewma.update(model)
        snapshots.append({n: p.detach().double().clone() for n, p in model.named_parameters()})

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        old = recompute_logprobs(model, batch, SAMPLING, 3)[0]
        policy_update(model, optimizer, batch, old, ADV, SAMPLING, _settings(2, "ewma"), on_step=step,
                      ewma_logprobs=ewma.logprobs(batch, SAMPLING, 3))
    k = len(snapshots) - 1
    assert k == 4
    coeff = [beta ** (k - j) for j in range(k + 1)]
    assert ewma.weight_sum.item() == pytest.approx(sum(coeff), rel=1e-15)
    moved = 0.0
    for name, p in ewma.model.named_parameters():
        ref = sum(c * s[name] for c, s in zip(coeff, snapshots)) / sum(coeff)
        assert torch.allclose(p.double(), ref, rtol=1e-6, atol=1e-7), name
        moved = max(moved, (snapshots[-1][name] - snapshots[0][name]).abs().max().item())
    assert moved > 1e-3  # the policy really moved, so the average is not trivially theta_0


def test_ewma_decay_zero_gives_proximal_equal_to_old_and_the_same_update(model_and_batch):
    model, batch = model_and_batch
    runs = {}
    for proximal in ("old", "ewma"):
        m = copy.deepcopy(model)
        ewma = EwmaPolicy(m, 0.0)
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5)
        policy_update(m, optimizer, batch, None, ADV, SAMPLING, _settings(1), on_step=lambda: ewma.update(m))
        old = recompute_logprobs(m, batch, SAMPLING, 3)[0]  # second update: the policy has moved once
        prox = ewma.logprobs(batch, SAMPLING, 3)
        assert torch.equal(prox, old)
        given = prox if proximal == "ewma" else None
        runs[proximal] = policy_update(m, optimizer, batch, old, ADV, SAMPLING, _settings(2, proximal),
                                       ewma_logprobs=given).metrics
    assert runs["ewma"] == runs["old"]


def test_ewma_proximal_differs_from_old_once_the_policy_moved(model_and_batch):
    model, batch = model_and_batch
    m = copy.deepcopy(model)
    ewma = EwmaPolicy(m, 0.9)
    policy_update(m, torch.optim.SGD(m.parameters(), lr=0.5), batch, None, ADV, SAMPLING, _settings(1),
                  on_step=lambda: ewma.update(m))
    old, prox = recompute_logprobs(m, batch, SAMPLING, 3)[0], ewma.logprobs(batch, SAMPLING, 3)
    assert (old - prox)[batch.mask].abs().max() > 1e-4


def test_ewma_state_survives_a_checkpoint_bit_for_bit_and_old_checkpoints_still_load(model_and_batch, tmp_path):
    model, batch = model_and_batch
    m = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ewma = EwmaPolicy(m, 0.7)
    policy_update(m, optimizer, batch, None, ADV, SAMPLING, _settings(1), on_step=lambda: ewma.update(m))
    path = save_checkpoint(tmp_path, 1, m, optimizer, {"version": 1}, keep=3, extra=ewma.state_tensors())
    fresh_model = copy.deepcopy(model)
    fresh = EwmaPolicy(fresh_model, 0.7)
    load_checkpoint(path, fresh_model, torch.optim.AdamW(fresh_model.parameters(), lr=1e-2))
    restore_proximal(fresh, load_extra_tensors(path), fresh_model, log=lambda _: None)
    assert torch.equal(fresh.weight_sum, ewma.weight_sum) and fresh.weight_sum.item() == 1.7
    saved = dict(ewma.model.named_parameters())
    for name, p in fresh.model.named_parameters():
        assert torch.equal(p, saved[name]), name
    assert torch.equal(fresh.logprobs(batch, SAMPLING, 3), ewma.logprobs(batch, SAMPLING, 3))
    # A checkpoint written without extra tensors (the format before PPO-EWMA) loads; the average restarts.
    legacy = save_checkpoint(tmp_path, 2, m, optimizer, {"version": 2}, keep=3)
    assert load_extra_tensors(legacy) is None and load_extra_tensors(path) is not None
    assert set(load_file(str(path / "extra.safetensors"))) == set(ewma.state_tensors())
    warnings = []
    load_checkpoint(legacy, fresh_model, torch.optim.AdamW(fresh_model.parameters(), lr=1e-2))
    restore_proximal(fresh, load_extra_tensors(legacy), fresh_model, log=warnings.append, where=legacy)
    assert fresh.weight_sum.item() == 1.0 and f"checkpoint {legacy} holds no PPO-EWMA" in warnings[0]
    for (name, p), q in zip(fresh.model.named_parameters(), m.parameters()):
        assert torch.equal(p, q), name


def test_ewma_rejects_a_decay_outside_the_unit_interval(model_and_batch):
    with pytest.raises(ValueError, match="decay"):
        EwmaPolicy(model_and_batch[0], 1.0)


# -- A-3PO ---------------------------------------------------------------------------------------------------
def test_a3po_with_mixed_versions_matches_a_per_token_loop():
    g = torch.Generator().manual_seed(3)
    B, T, version = 3, 5, 6
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = lp + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    rollout = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    versions = torch.tensor([[6, 6, 5, 5, -1], [3, 3, 3, 4, 4], [6, 2, 0, -1, -1]])
    has = (versions >= 0) & (torch.rand(B, T, generator=g) > 0.2)
    has[1, 0] = False  # a stale token without an engine log-prob
    rollout = torch.where(has, rollout, torch.full_like(rollout, math.nan))
    prox = a3po_behaviour_proximal(lp.requires_grad_(True), old, rollout, has, versions, version)
    assert not prox.requires_grad
    for b in range(B):
        for t in range(T):
            v = versions[b, t].item()
            if v < 0 or v >= version or not has[b, t]:
                expected = old[b, t].item()  # fresh, padding, or no engine record: the exact trainer value
            else:
                s = version - v
                alpha = s / (s + 1)  # (v_prox - v) / (v_theta - v), v_prox = version, v_theta = version + 1
                expected = rollout[b, t].item() + alpha * (lp[b, t].item() - rollout[b, t].item())
            assert prox[b, t].item() == pytest.approx(expected, rel=1e-14, abs=1e-14), (b, t)
    assert (prox != old)[has & (versions < version) & (versions >= 0)].all()


def test_a3po_in_the_synchronous_trainer_reduces_to_old_logprobs(model_and_batch):
    """Every token generated by the current version (staleness 0): the A-3PO proximal is old_logprobs, so the
    whole update (metrics and resulting weights) is identical to proximal = old."""
    model, batch = model_and_batch
    assert (batch.versions[batch.mask] == 4).all()
    prox = a3po_behaviour_proximal(batch.rollout_logprobs, batch.rollout_logprobs - 1, batch.rollout_logprobs,
                                   batch.has_rollout, batch.versions, 4)
    assert torch.equal(prox[batch.mask], (batch.rollout_logprobs - 1)[batch.mask])
    out = {}
    for proximal in ("old", "a3po"):
        m = copy.deepcopy(model)
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5)
        old = recompute_logprobs(m, batch, SAMPLING, 3)[0]
        metrics = policy_update(m, optimizer, batch, old, ADV, SAMPLING, _settings(2, proximal), version=4).metrics
        out[proximal] = metrics, [p.detach().clone() for p in m.parameters()]
    assert out["a3po"][0] == out["old"][0]
    assert all(torch.equal(a, b) for a, b in zip(out["a3po"][1], out["old"][1]))
    stale = policy_update(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.0), batch, old, ADV,
                          SAMPLING, _settings(2, "a3po"), version=7).metrics
    assert stale["actor/ppo_kl"] != out["old"][0]["actor/ppo_kl"]  # staleness 3: the interpolation is used


# -- self-normalised IS through the update ---------------------------------------------------------------------
def test_self_normalised_is_loss_does_not_depend_on_the_micro_batch_size(model_and_batch):
    """The self-normalisation mean is a batch statistic computed once, so micro-batching leaves the loss and the
    gradient unchanged (invariant 7)."""
    model, batch = model_and_batch
    spec = CorrectionSpec("token", "truncate", 0.0, 2.0, self_normalize="token")
    out = {}
    for micro in (1, 6):
        m = copy.deepcopy(model)
        optimizer = torch.optim.SGD(m.parameters(), lr=0.0)
        grads = {}
        optimizer.step = lambda m=m, grads=grads: grads.update({n: p.grad.clone() for n, p in m.named_parameters()})
        old = recompute_logprobs(m, batch, SAMPLING, 3)[0]
        settings = UpdateSettings(1, micro, 1e9, "ppo_clip", PolicyLossParams(0.2, 0.28, 3.0), "token-mean", None, spec)
        out[micro] = policy_update(m, optimizer, batch, old, ADV, SAMPLING, settings).metrics, grads
    (m1, g1), (m6, g6) = out[1], out[6]
    assert m1["correction/sn_factor"] == pytest.approx(m6["correction/sn_factor"], rel=1e-5)
    assert abs(m1["correction/sn_factor"] - 1) > 0.05
    assert m1["actor/loss"] == pytest.approx(m6["actor/loss"], rel=1e-5)
    assert m1["correction/weight_mean"] == pytest.approx(1.0, rel=1e-5)  # mean weight over defined tokens is 1
    # per parameter, relative to its norm: float32 rounding of the different GEMM shapes is about 4e-7 (measured);
    # a micro-batch-dependent normalisation would be off by the batch fraction (> 1e-1)
    for name in g1:
        assert float((g1[name] - g6[name]).norm()) <= 1e-5 * float(g6[name].norm()), name


def test_config_rejects_a_non_old_proximal_in_bypass_mode_and_a_decay_of_one():
    from nearpolicy.config.schema import ConfigError, load_config

    cfg = load_config(None, ["correction.proximal='ewma'", "correction.ewma_decay=0.5"])
    assert cfg.correction.proximal == "ewma" and cfg.correction.ewma_decay == 0.5
    with pytest.raises(ConfigError, match="correction.proximal"):
        load_config(None, ["correction.proximal='a3po'", "correction.preset='bypass_ppo_clip'"])
    with pytest.raises(ConfigError, match="ewma_decay"):
        load_config(None, ["correction.ewma_decay=1.0"])
    with pytest.raises(ConfigError, match="proximal"):
        load_config(None, ["correction.proximal='rollout'"])
    assert load_config(None, ["correction.self_normalize='token'"]).correction.spec().self_normalize == "token"
