"""Policy-loss registry, aggregation modes and the KL penalty against per-token loop references (float64)."""

import math

import pytest
import torch

from nearpolicy.ops.kl import KL_ESTIMATORS
from nearpolicy.ops.losses import (POLICY_LOSSES, PolicyLossInput, PolicyLossParams, kl_penalty_tokens, policy_loss,
                                   required_aggregation)
from nearpolicy.ops.masked import AGGREGATIONS, aggregate, aggregation_denominator

torch.set_default_dtype(torch.float64)  # for module-level constants; tests: conftest._default_dtype
DEFAULT_DTYPE = torch.float64
LOSSES = POLICY_LOSSES.names()
VALID = [(name, mode) for name in LOSSES for mode in AGGREGATIONS if required_aggregation(name) in (None, mode)]
P = PolicyLossParams(clip_low=0.2, clip_high=0.28, dual_clip=3.0)


def _case(seed=0, B=5, T=7, token_adv=False):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 3
    old = lp + 0.4 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g) if token_adv else torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0] = False  # an empty sequence
    weights = torch.rand(B, T, generator=g) * 2
    return lp, old, adv, mask, weights


def _clip(x, lo, hi):
    return min(max(x, lo), hi)


def _ref_token(name, lp, old, adv, mask, w, p, i, t):
    """Per-token loss of `name` at (i, t) by plain Python."""
    a = float(adv[i, t]) if adv.dim() == 2 else float(adv[i])
    r = math.exp(lp[i, t] - old[i, t])
    if name == "ppo_clip":
        loss = max(-a * r, -a * _clip(r, 1 - p.clip_low, 1 + p.clip_high))
        if a < 0 and p.dual_clip is not None:
            loss = min(loss, -a * p.dual_clip)
    elif name == "gspo":
        idx = [k for k in range(lp.shape[1]) if mask[i, k]]
        s = math.exp(sum(lp[i, k] - old[i, k] for k in idx) / len(idx))
        loss = max(-a * s, -a * _clip(s, 1 - p.clip_low, 1 + p.clip_high))
    elif name == "cispo":
        loss = -_clip(r, 1 - p.clip_low, 1 + p.clip_high) * a * float(lp[i, t])
    elif name == "reinforce":
        loss = -a * float(lp[i, t])
    elif name == "importance_sampling":
        loss = -r * a
    elif name in ("pnpo", "pnpo_prefix_grad"):
        idx = [k for k in range(t + 1) if mask[i, k]]
        s = math.exp(sum(lp[i, k] - old[i, k] for k in idx) / len(idx))
        loss = max(-a * s, -a * _clip(s, 1 - p.clip_low, 1 + p.clip_high))
    else:
        raise AssertionError(name)
    return loss * float(w[i, t])


def _ref_loss(name, lp, old, adv, mask, w, p, mode, const=None):
    B, T = lp.shape
    rows = [[_ref_token(name, lp, old, adv, mask, w, p, i, t) for t in range(T) if mask[i, t]] for i in range(B)]
    n_tok = sum(len(r) for r in rows)
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        return sum(map(sum, rows)) / n_tok
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / len(nonempty)
    return sum(map(sum, rows)) / (len(nonempty) * const)


@pytest.mark.parametrize("name,mode", VALID)
@pytest.mark.parametrize("token_adv", [False, True])
def test_every_loss_and_mode_matches_loop_reference(name, mode, token_adv):
    lp, old, adv, mask, w = _case(1, token_adv=token_adv)
    denom = aggregation_denominator(mask, mode, constant=40.0)
    loss, _ = policy_loss(name, PolicyLossInput(lp, old, adv, mask, mask.sum(), w), P, mode, denom)
    assert loss.item() == pytest.approx(_ref_loss(name, lp, old, adv, mask, w, P, mode, 40.0), rel=1e-12, abs=1e-14)


def test_aggregation_hand_computed():
    loss_tok = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]]).bool()
    expected = {"token-mean": 6 / 3, "seq-mean-token-mean": (1.5 + 3) / 2, "seq-mean-token-sum": 6 / 2,
                "seq-mean-token-sum-norm": 6 / (2 * 10)}
    for mode, value in expected.items():
        denom = aggregation_denominator(mask, mode, constant=10)
        assert aggregate(loss_tok, mask, mode, denom).item() == pytest.approx(value, rel=1e-15)
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(loss_tok, mask, "sum", 1)
    with pytest.raises(ValueError, match="constant"):
        aggregation_denominator(mask, "seq-mean-token-sum-norm")


@pytest.mark.parametrize("name,mode", VALID)
def test_micro_batch_split_and_padding_leave_loss_and_gradient_unchanged(name, mode):
    lp, old, adv, mask, w = _case(2, B=6)
    lp.requires_grad_(True)
    denom = aggregation_denominator(mask, mode, constant=30.0)
    full, _ = policy_loss(name, PolicyLossInput(lp, old, adv, mask, mask.sum(), w), P, mode, denom)
    (g_full,) = torch.autograd.grad(full, lp)
    total = 0
    pad = lambda x, v: torch.cat([x, torch.full((x.shape[0], 3), v, dtype=x.dtype)], dim=1)  # noqa: E731
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        inp = PolicyLossInput(pad(lp[rows], 7.0), pad(old[rows], -7.0), adv[rows], pad(mask[rows], False), mask.sum(),
                              pad(w[rows], 5.0))
        total = total + policy_loss(name, inp, P, mode, denom)[0]
    (g_split,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(full.item(), rel=1e-12)
    assert torch.allclose(g_split, g_full, atol=1e-14, rtol=0)


@pytest.mark.parametrize("name", LOSSES)
def test_nan_and_inf_at_masked_positions_change_neither_loss_nor_gradient(name):
    lp, old, adv, mask, w = _case(3, token_adv=True)
    lp.requires_grad_(True)
    inp = PolicyLossInput(lp, old, adv, mask, mask.sum(), w, ref_logprobs=old - 0.1)
    params = PolicyLossParams(kl_coef=0.1)
    loss, _ = policy_loss(name, inp, params, "seq-mean-token-mean", 4)
    (grad,) = torch.autograd.grad(loss, lp)
    bad = lp.detach().clone().masked_fill(~mask, float("nan")).requires_grad_(True)
    poison = lambda x, v: x.masked_fill(~mask, v)  # noqa: E731
    inp2 = PolicyLossInput(bad, poison(old, float("inf")), poison(adv, float("-inf")), mask, mask.sum(),
                           poison(w, float("nan")), ref_logprobs=poison(old - 0.1, float("nan")))
    loss2, metrics = policy_loss(name, inp2, params, "seq-mean-token-mean", 4)
    (grad2,) = torch.autograd.grad(loss2, bad)
    assert loss2.item() == loss.item()
    assert torch.equal(grad2, grad)
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", [n for n in LOSSES if n not in ("cispo", "pnpo")])  # stop-gradient forms: see below
def test_gradcheck(name):
    lp, old, adv, mask, w = _case(4, B=3, T=4)
    mask[0, 0] = True
    lp.requires_grad_(True)
    if name == "gspo":  # GSPO-token equals the sequence gradient only for weights constant along the sequence
        w = w[:, :1].expand_as(w)
    inp = lambda x: PolicyLossInput(x, old, adv, mask, mask.sum(), w, ref_logprobs=old)  # noqa: E731
    f = lambda x: policy_loss(name, inp(x), PolicyLossParams(0.2, 0.28, 3.0, kl_coef=0.05), "seq-mean-token-mean", 3)[0]  # noqa: E731
    assert torch.autograd.gradcheck(f, (lp,))


def test_cispo_gradient_is_the_detached_clipped_weight_times_the_score():
    """CISPO's weight is stop-gradient, so finite differences (gradcheck) do not apply; check the formula."""
    lp, old, adv, mask, w = _case(4)
    lp.requires_grad_(True)
    loss, _ = policy_loss("cispo", PolicyLossInput(lp, old, adv, mask, mask.sum(), w), P)
    (grad,) = torch.autograd.grad(loss, lp)
    kept = torch.exp(lp.detach() - old).clamp(0.8, 1.28)
    expected = torch.where(mask, -kept * adv[:, None] * w / mask.sum(), 0.0)
    assert torch.allclose(grad, expected, atol=1e-15, rtol=0)


def test_pnpo_gradient_is_prefix_ratio_times_the_token_score():
    lp, old, adv, mask, w = _case(4)
    lp.requires_grad_(True)
    wide = PolicyLossParams(clip_low=0.999, clip_high=1e6, dual_clip=None)
    loss, _ = policy_loss("pnpo", PolicyLossInput(lp, old, adv, mask, mask.sum(), w), wide)
    (grad,) = torch.autograd.grad(loss, lp)
    d = torch.where(mask, lp.detach() - old, 0.0)
    prefix = torch.exp(torch.cumsum(d, -1) / torch.cumsum(mask.double(), -1).clamp_min(1))
    expected = torch.where(mask, -adv[:, None] * prefix * w / mask.sum(), 0.0)
    assert torch.allclose(grad, expected, atol=1e-15, rtol=0)


def test_on_policy_every_ratio_loss_has_the_plain_policy_gradient():
    """With old = logprobs.detach() (r = 1): PPO, GSPO, CISPO, PNPO, IS and REINFORCE all give -A grad lp
    (GSPO per sequence: -A grad lp / (n_i N_seqs))."""
    lp, _, adv, mask, _ = _case(5)
    lp.requires_grad_(True)
    per_token = torch.where(mask, -adv[:, None].expand_as(lp) / mask.sum(), torch.zeros_like(lp))
    n_i, n_seq = mask.sum(-1, keepdim=True).clamp_min(1), mask.any(-1).sum()
    per_seq = torch.where(mask, -adv[:, None].expand_as(lp) / (n_i * n_seq), torch.zeros_like(lp))
    for name in [n for n in LOSSES if n != "pnpo_prefix_grad"]:
        mode = required_aggregation(name) or "token-mean"
        expected = per_token if mode == "token-mean" else per_seq
        loss, metrics = policy_loss(name, PolicyLossInput(lp, lp.detach(), adv, mask, mask.sum()), P, mode,
                                    aggregation_denominator(mask, mode))
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.allclose(grad, expected, atol=1e-15, rtol=0), name
        assert metrics["pg_clipfrac"].item() == 0 and metrics["ppo_kl"].item() == 0


def test_pnpo_prefix_grad_on_policy_gradient_is_the_harmonic_tail():
    lp, _, adv, mask, _ = _case(5)
    lp.requires_grad_(True)
    loss, _ = policy_loss("pnpo_prefix_grad", PolicyLossInput(lp, lp.detach(), adv, mask, mask.sum()), P)
    (grad,) = torch.autograd.grad(loss, lp)
    B, T = lp.shape
    for i in range(B):
        counts = [sum(bool(mask[i, j]) for j in range(t + 1)) for t in range(T)]
        for k in range(T):
            tail = sum(1 / counts[t] for t in range(k, T) if mask[i, t]) if mask[i, k] else 0.0
            assert grad[i, k].item() == pytest.approx(-float(adv[i]) * tail / mask.sum().item(), rel=1e-12, abs=1e-16)


def test_gspo_token_form_has_the_sequence_level_gradient():
    lp, old, adv, mask, _ = _case(6)
    lp.requires_grad_(True)
    wide = PolicyLossParams(clip_low=0.99, clip_high=100.0, dual_clip=None)
    loss, _ = policy_loss("gspo", PolicyLossInput(lp, old, adv, mask, mask.sum()), wide, "seq-mean-token-mean",
                          aggregation_denominator(mask, "seq-mean-token-mean"))
    (g_tok,) = torch.autograd.grad(loss, lp)
    n = mask.sum(-1).clamp_min(1)
    s = torch.exp(torch.where(mask, lp - old, 0.0).sum(-1) / n)
    seq_loss = torch.where(mask.any(-1), -adv * s, 0.0).sum() / mask.any(-1).sum()
    (g_seq,) = torch.autograd.grad(seq_loss, lp)
    assert torch.allclose(g_tok, g_seq, atol=1e-14, rtol=0)
    assert loss.item() == pytest.approx(seq_loss.item(), rel=1e-12)


def test_clip_higher_is_asymmetric_and_clip_fractions_hand_computed():
    old = torch.zeros(1, 4)
    lp = torch.log(torch.tensor([[0.7, 0.85, 1.25, 1.35]]))  # ratios
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = policy_loss("ppo_clip", PolicyLossInput(lp, old, adv, mask, 4), PolicyLossParams(0.2, 0.28))
    # A > 0: min(r, clip(r)) -> 0.7 (unclipped below), 0.85, 1.25, 1.28 (clipped above)
    assert loss.item() == pytest.approx(-(0.7 + 0.85 + 1.25 + 1.28) / 4, rel=1e-14)
    assert m["pg_clipfrac"].item() == pytest.approx(1 / 4)
    loss_c, m_c = policy_loss("cispo", PolicyLossInput(lp, old, adv, mask, 4), PolicyLossParams(0.2, 0.28))
    weights = torch.tensor([0.8, 0.85, 1.25, 1.28])
    assert loss_c.item() == pytest.approx(-(weights * lp[0]).sum().item() / 4, rel=1e-14)
    assert m_c["pg_clipfrac"].item() == pytest.approx(2 / 4)


def test_dual_clip_bounds_negative_advantage_loss():
    lp, old = torch.tensor([[math.log(5.0)]]), torch.zeros(1, 1)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, m = policy_loss("ppo_clip", PolicyLossInput(lp, old, torch.tensor([-2.0]), mask, 1), P)
    assert loss.item() == pytest.approx(2.0 * 3.0, rel=1e-14)  # -A c, not -A r = 10
    assert m["pg_clipfrac_lower"].item() == 1.0


@pytest.mark.parametrize("estimator", KL_ESTIMATORS.names())
def test_kl_penalty_matches_loop_and_vanishes_at_reference(estimator):
    lp, ref, _, mask, _ = _case(7)
    old = lp - 0.3 * torch.sin(lp)  # pi / pi_old = exp(0.3 sin lp)
    kl = kl_penalty_tokens(lp, ref, mask, estimator, old)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            d, r = float(lp[i, t] - ref[i, t]), math.exp(float(lp[i, t] - old[i, t]))
            k3 = math.exp(-d) + d - 1
            value = {"k1": d, "k2": 0.5 * d * d, "k3": k3, "k1+": d, "k3+": k3, "k2_is": r * 0.5 * d * d,
                     "k3_is": r * k3}[estimator] if mask[i, t] else 0.0
            assert kl[i, t].item() == pytest.approx(value, rel=1e-12, abs=1e-15)
    assert torch.equal(kl_penalty_tokens(lp, lp.clone(), mask, estimator, old), torch.zeros_like(lp))
    with pytest.raises(KeyError, match="k3_is"):
        kl_penalty_tokens(lp, ref, mask, "k4")


def test_kl_coefficient_adds_penalty_in_the_same_aggregation():
    lp, old, adv, mask, w = _case(8)
    ref = old - 0.3
    base, _ = policy_loss("ppo_clip", PolicyLossInput(lp, old, adv, mask, mask.sum(), w), P, "seq-mean-token-mean", 4)
    params = PolicyLossParams(0.2, 0.28, 3.0, kl_coef=0.04, kl_estimator="k3")
    with_kl, m = policy_loss("ppo_clip", PolicyLossInput(lp, old, adv, mask, mask.sum(), w, ref), params, "seq-mean-token-mean", 4)
    kl = kl_penalty_tokens(lp, ref, mask, "k3")
    expected = base + 0.04 * aggregate(kl, mask, "seq-mean-token-mean", 4)
    assert with_kl.item() == pytest.approx(expected.item(), rel=1e-13)
    assert m["kl_ref"].item() == pytest.approx((kl.sum() / mask.sum()).item(), rel=1e-13)


def test_registry_and_params_errors():
    lp, old, adv, mask, w = _case(9)
    inp = PolicyLossInput(lp, old, adv, mask, mask.sum(), w)
    with pytest.raises(KeyError, match="cispo"):
        POLICY_LOSSES.get("nope")
    with pytest.raises(ValueError, match="dual_clip"):
        PolicyLossParams(dual_clip=1.0)
    with pytest.raises(ValueError, match="k3"):
        PolicyLossParams(kl_estimator="k4")
    with pytest.raises(ValueError, match="denominator"):
        policy_loss("gspo", inp, P, "seq-mean-token-mean")
    with pytest.raises(ValueError, match="already registered"):
        POLICY_LOSSES.register("gspo", summary="", source="")(lambda i, p: None)


@pytest.mark.parametrize("name,mode", VALID)
def test_empty_micro_batch_gives_zero_loss_that_still_carries_a_graph(name, mode):
    lp, old, adv, _, w = _case(10, B=2)
    lp.requires_grad_(True)
    empty = torch.zeros_like(lp, dtype=torch.bool)
    loss, metrics = policy_loss(name, PolicyLossInput(lp, old, adv, empty, 0, w, ref_logprobs=old), PolicyLossParams(kl_coef=0.1),
                                mode, 0)
    assert loss.item() == 0.0 and loss.requires_grad
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.equal(grad, torch.zeros_like(lp)) and all(v.item() == 0 for v in metrics.values())


@pytest.mark.parametrize("copies", [2, 4, 8])
def test_dr_grpo_sum_norm_divides_by_sequences_times_constant(copies):
    """Dr. GRPO (verl PR #5417): identical 30-token sequences with per-token loss 1 (on-policy PPO, A = -1) and
    constant 64 give 30 / 64 = 0.46875 for any number of copies (the constant-only form gave 0.9375, 1.875, 3.75)."""
    lp = torch.full((copies, 40), -1.0)
    mask = torch.zeros(copies, 40, dtype=torch.bool)
    mask[:, :30] = True
    inp = PolicyLossInput(lp, lp.clone(), -torch.ones(copies), mask, mask.sum())
    mode = "seq-mean-token-sum-norm"
    loss, _ = policy_loss("ppo_clip", inp, P, mode, aggregation_denominator(mask, mode, constant=64))
    assert loss.item() == pytest.approx(0.46875, rel=1e-12, abs=0)


@pytest.mark.parametrize("name,mode", VALID)
def test_duplicating_the_batch_leaves_loss_and_gradient_unchanged(name, mode):
    """Invariant 14: every sequence twice (with its empty rows) gives the same loss, and the summed gradient of
    the two copies of a token equals the token's gradient in the original batch."""
    lp, old, adv, mask, w = _case(11)
    ref = old - 0.2
    params = PolicyLossParams(0.2, 0.28, 3.0, kl_coef=0.1)
    twice = lambda x: torch.cat([x, x]).detach().requires_grad_(x.requires_grad)  # noqa: E731
    lp.requires_grad_(True)
    lp2 = twice(lp)
    losses, grads = [], []
    for x, o, a, m, ww, rf in ((lp, old, adv, mask, w, ref), (lp2, *map(twice, (old, adv, mask, w, ref)))):
        inp = PolicyLossInput(x, o, a, m, m.sum(), ww, rf)
        loss, _ = policy_loss(name, inp, params, mode, aggregation_denominator(m, mode, constant=40.0))
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, x)[0])
    assert losses[1].item() == pytest.approx(losses[0].item(), rel=1e-12, abs=1e-15)
    B = lp.shape[0]
    assert torch.allclose(grads[1][:B] + grads[1][B:], grads[0], rtol=1e-12, atol=1e-15)


def test_gspo_weighs_each_sequence_equally_and_refuses_other_modes():
    """Sequences of 2 and 6 tokens, same ratio (on-policy, 1), A = 1: gradient mass -0.5 and -0.5 per sequence
    (token-mean would give -2/8 = -0.25 and -6/8 = -0.75, TRL #3823); any other mode is refused."""
    lp = torch.full((2, 6), -0.7, requires_grad=True)
    mask = torch.tensor([[True] * 2 + [False] * 4, [True] * 6])
    inp = PolicyLossInput(lp, lp.detach(), torch.ones(2), mask, mask.sum())
    loss, _ = policy_loss("gspo", inp, P, "seq-mean-token-mean", aggregation_denominator(mask, "seq-mean-token-mean"))
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(grad.sum(-1), torch.tensor([-0.5, -0.5]), rtol=1e-12, atol=1e-15)
    for mode in AGGREGATIONS:
        if mode != "seq-mean-token-mean":
            with pytest.raises(ValueError, match="sequence-level"):
                policy_loss("gspo", inp, P, mode, aggregation_denominator(mask, mode, constant=6))
