"""Pure math: advantages, PPO-clip loss, TIS weights, diagnostics (invariants 4-8, 11)."""

import math

import numpy as np
import pytest
import torch

from nearpolicy.ops.advantages import ADVANTAGES, grpo_advantages, rloo_advantages
from nearpolicy.ops.corrections import CorrectionSpec, mismatch_correction
from nearpolicy.ops.diagnostics import mismatch_metrics
from nearpolicy.ops.losses import PolicyLossInput, PolicyLossParams, policy_loss

torch.set_default_dtype(torch.float64)  # for module-level constants; tests: conftest._default_dtype
DEFAULT_DTYPE = torch.float64


# -- advantages (invariant 6) -------------------------------------------------------------------
def test_grpo_matches_hand_computed_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 3.0])
    groups = torch.tensor([7, 7, 7, 7, 2, 2])
    adv = grpo_advantages(rewards, groups).advantages
    std4 = math.sqrt(((0.5**2) * 4) / 3)  # unbiased std of [1, 0, 0, 1]
    expected = [0.5 / std4, -0.5 / std4, -0.5 / std4, 0.5 / std4, 1 / math.sqrt(2), -1 / math.sqrt(2)]
    assert torch.allclose(adv, torch.tensor(expected), rtol=0, atol=1e-12)


def test_group_normalisation_is_per_group_id_not_positional():
    rewards = torch.tensor([1.0, 5.0, 0.0, 3.0])
    groups = torch.tensor([0, 1, 0, 1])  # interleaved groups
    adv = grpo_advantages(rewards, groups).advantages
    assert torch.allclose(adv, torch.tensor([1, 1, -1, -1]) / math.sqrt(2), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_degenerate_groups_give_finite_zeros(name):
    rewards = torch.tensor([2.0, 2.0, 2.0, 7.0, float("nan"), 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 2, 2, 2])  # constant, singleton, one unscorable member
    out = ADVANTAGES.get(name)(rewards, groups)
    adv = out.advantages
    assert torch.isfinite(adv).all()
    assert adv[4] == 0  # unscorable
    if name != "reinforce":
        assert torch.equal(adv[:4], torch.zeros(4))  # constant and singleton groups


def test_unscorable_member_is_left_out_of_its_group_statistics():
    adv = rloo_advantages(torch.tensor([1.0, float("nan"), 0.0]), torch.tensor([0, 0, 0])).advantages
    assert torch.allclose(adv, torch.tensor([1.0, 0.0, -1.0]), rtol=0, atol=1e-12)


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(KeyError, match="grpo"):
        ADVANTAGES.get("nope")


# -- PPO-clip (the registered loss the trainer calls) ---------------------------------------------
def ppo_clip_loss(inp, clip_low=0.2, clip_high=0.28, dual_clip=3.0):
    return policy_loss("ppo_clip", inp, PolicyLossParams(clip_low, clip_high, dual_clip))


def _loop_reference(lp, old, adv, mask, eps_low, eps_high, c, weights):
    total, n = 0.0, 0
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not mask[i, t]:
                continue
            r = math.exp(lp[i, t] - old[i, t])
            a = float(adv[i])
            loss = max(-a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high))
            if a < 0:
                loss = min(loss, -a * c)
            total += loss * float(weights[i, t])
            n += 1
    return total / n


def _random_case(seed=0, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 3
    old = lp + 0.4 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    weights = torch.rand(B, T, generator=g) * 2
    return lp, old, adv, mask, weights


def test_ppo_clip_matches_per_token_loop_reference():
    lp, old, adv, mask, weights = _random_case()
    loss, _ = ppo_clip_loss(PolicyLossInput(lp, old, adv, mask, mask.sum(), weights), 0.2, 0.28, 3.0)
    ref = _loop_reference(lp, old, adv, mask, 0.2, 0.28, 3.0, weights)
    assert loss.item() == pytest.approx(ref, rel=1e-12)


def test_masked_nan_and_inf_change_neither_loss_nor_gradient():
    lp, old, adv, mask, weights = _random_case(1)
    lp.requires_grad_(True)
    loss, _ = ppo_clip_loss(PolicyLossInput(lp, old, adv, mask, mask.sum(), weights))
    (grad,) = torch.autograd.grad(loss, lp)
    poisoned = lp.detach().clone().masked_fill(~mask, float("nan")).requires_grad_(True)
    bad_old = old.masked_fill(~mask, float("inf"))
    bad_w = weights.masked_fill(~mask, float("nan"))
    loss2, _ = ppo_clip_loss(PolicyLossInput(poisoned, bad_old, adv, mask, mask.sum(), bad_w))
    (grad2,) = torch.autograd.grad(loss2, poisoned)
    assert loss2.item() == loss.item()
    assert torch.equal(grad2, grad)
    assert torch.equal(grad2[~mask], torch.zeros_like(grad2[~mask]))


def test_micro_batch_split_leaves_loss_and_gradient_unchanged():
    lp, old, adv, mask, weights = _random_case(2, B=6)
    lp.requires_grad_(True)
    full, _ = ppo_clip_loss(PolicyLossInput(lp, old, adv, mask, mask.sum(), weights))
    (g_full,) = torch.autograd.grad(full, lp)
    total = 0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        part, _ = ppo_clip_loss(PolicyLossInput(lp[rows], old[rows], adv[rows], mask[rows], mask.sum(), weights[rows]))
        total = total + part
    (g_split,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(full.item(), rel=1e-12)
    assert torch.allclose(g_split, g_full, rtol=0, atol=1e-15)


def test_extra_padding_columns_leave_loss_unchanged():
    lp, old, adv, mask, weights = _random_case(3)
    pad = lambda x, v: torch.cat([x, torch.full((x.shape[0], 4), v, dtype=x.dtype)], dim=1)
    a, _ = ppo_clip_loss(PolicyLossInput(lp, old, adv, mask, mask.sum(), weights))
    b, _ = ppo_clip_loss(PolicyLossInput(pad(lp, 9.0), pad(old, -9.0), adv, pad(mask, False), mask.sum(), pad(weights, 5.0)))
    assert a.item() == b.item()


def test_on_policy_ratio_is_one_and_gradient_is_plain_policy_gradient():
    lp, _, adv, mask, _ = _random_case(4)
    lp.requires_grad_(True)
    loss, metrics = ppo_clip_loss(PolicyLossInput(lp, lp.detach(), adv, mask, mask.sum()))
    (grad,) = torch.autograd.grad(loss, lp)
    expected = torch.where(mask, -adv[:, None].expand_as(lp) / mask.sum(), torch.zeros_like(lp))
    assert torch.allclose(grad, expected, rtol=0, atol=1e-15)
    assert metrics["pg_clipfrac"].item() == 0 and metrics["ppo_kl"].item() == 0


def test_ppo_clip_gradcheck():
    lp, old, adv, mask, weights = _random_case(5, B=3, T=4)
    lp.requires_grad_(True)
    f = lambda x: ppo_clip_loss(PolicyLossInput(x, old, adv, mask, mask.sum(), weights), 0.2, 0.28, 3.0)[0]
    assert torch.autograd.gradcheck(f, (lp,))


def test_dual_clip_must_exceed_one():
    lp, old, adv, mask, _ = _random_case()
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(PolicyLossInput(lp, old, adv, mask, 1), dual_clip=0.5)  # PolicyLossParams refuses it


# -- TIS / corrections (invariants 5, 11), through training/update.py's entry point ------------------------
def token_correction_weights(old, rollout, mask, has, action, lower=0.0, upper=math.inf):
    """Decoupled token-level weights and metrics: mismatch_correction with proximal = old (correction.proximal
    = "old"); the current log-probs are not read in decoupled mode."""
    result = mismatch_correction(CorrectionSpec("token", action, lower, upper), None, old, rollout, mask, has)
    return result.weights, result.metrics


def test_tis_weights_truncate_at_cap_and_missing_logprob_gives_exactly_one():
    old = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.2), 0.0]])
    rollout = torch.tensor([[math.log(0.1), math.log(0.9), math.log(0.4), float("nan")]])
    mask = torch.tensor([[True, True, True, True]])
    has = torch.tensor([[True, True, True, False]])
    w, metrics = token_correction_weights(old, rollout, mask, has, "truncate", 0.0, 2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.5, 1.0]]), rtol=0, atol=1e-12)
    assert metrics["correction/frac_high"].item() == pytest.approx(1 / 3)


def test_correction_weights_are_detached_and_use_old_not_current_logprobs():
    old = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    rollout = torch.tensor([[-1.5, -2.0]])
    w, _ = token_correction_weights(old, rollout, torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 2, dtype=torch.bool),
                                    "none")
    assert not w.requires_grad
    assert torch.allclose(w, torch.tensor([[math.exp(0.5), 1.0]]), rtol=1e-15, atol=0)


def test_all_ratios_one_means_tis_equals_uncorrected_loss():
    lp, old, adv, mask, _ = _random_case(6)
    w, _ = token_correction_weights(old, old.clone(), mask, mask, "truncate", 0.0, 2.0)
    a, _ = ppo_clip_loss(PolicyLossInput(lp, old, adv, mask, mask.sum(), w))
    b, _ = ppo_clip_loss(PolicyLossInput(lp, old, adv, mask, mask.sum()))
    assert a.item() == b.item()


def test_infinite_bounds_are_plain_importance_sampling():
    lp, old, adv, mask, _ = _random_case(7)
    rollout = old + 0.3
    trunc, _ = token_correction_weights(old, rollout, mask, mask, "truncate", 0.0, math.inf)
    plain, _ = token_correction_weights(old, rollout, mask, mask, "none")
    assert torch.equal(trunc, plain)


def test_mask_action_zeroes_out_of_bounds_tokens():
    old = torch.tensor([[0.0, 0.0, 0.0]])
    rollout = torch.tensor([[math.log(4.0), 0.0, -math.log(3.0)]])  # ratios 0.25, 1, 3
    one = torch.ones(1, 3, dtype=torch.bool)
    w, _ = token_correction_weights(old, rollout, one, one, "mask", 0.5, 2.0)
    assert torch.equal(w, torch.tensor([[0.0, 1.0, 0.0]]))


# -- diagnostics ----------------------------------------------------------------------------------
def test_mismatch_metrics_identical_logprobs():
    lp = -torch.rand(3, 5)
    m = mismatch_metrics(lp, lp.clone(), torch.ones(3, 5, dtype=torch.bool))
    assert m["k1"] == 0 and m["k3"] == 0 and m["ess"] == pytest.approx(1.0) and m["max_abs_logprob_diff"] == 0
    assert m["prob_corr"] == pytest.approx(1.0)


def test_mismatch_metrics_hand_computed():
    pi = torch.tensor([[math.log(0.5), math.log(0.2), 0.0]])
    mu = torch.tensor([[math.log(0.25), math.log(0.2), float("nan")]])
    defined = torch.tensor([[True, True, False]])
    m = mismatch_metrics(pi, mu, defined)
    w = np.array([2.0, 1.0])
    assert m["k1"].item() == pytest.approx(np.mean(-np.log(w)))
    assert m["k3"].item() == pytest.approx(np.mean(w - 1 - np.log(w)))
    assert m["ess"].item() == pytest.approx(w.sum() ** 2 / (2 * (w**2).sum()))
    assert m["max_abs_logprob_diff"].item() == pytest.approx(math.log(2))
    assert m["frac_ratio_outside_0.5_2"].item() == 0.0  # 2.0 is inside the closed interval
    assert m["tokens"].item() == 2


@pytest.mark.parametrize("top_k, top_p", [(20, 1.0), (0, 0.9), (5, 0.5)])
def test_the_entropy_gradient_is_finite_and_exact_under_top_k_and_top_p(top_k, top_p):
    """Tokens outside the kept set have log-prob -inf: the entropy's gradient must stay finite there (a NaN would
    skip every optimizer step of an entropy bonus) and equal that of the entropy over the kept set alone."""
    from nearpolicy.ops.logprobs import kept_set, token_logprobs_and_entropy

    logits = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    _, entropy = token_logprobs_and_entropy(logits, ids, 0.7, top_k, top_p, entropy_grad=True)
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()
    keep = kept_set(logits.detach() / 0.7, top_k, top_p).scatter(-1, ids.unsqueeze(-1), True)
    direct = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax((direct / 0.7).masked_fill(~keep, float("-inf")), -1)
    (-(logp.exp() * logp.masked_fill(~keep, 0.0)).sum()).backward()
    assert torch.allclose(logits.grad, direct.grad, rtol=0, atol=1e-12)
    assert float(logits.grad[~keep].abs().max()) == 0.0
