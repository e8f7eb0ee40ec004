"""PPO-EWMA, A-3PO, DLC, AIS, on-policy distillation and the normalised ESS (float64)."""

import math

import pytest
import torch

from nearpolicy.ops.corrections import CorrectionSpec, correct, correction_log_ratio, mismatch_correction
from nearpolicy.ops.diagnostics import fraction, normalized_ess
from nearpolicy.ops.distill import opd_advantages, reverse_kl_tokens
from nearpolicy.ops.losses import PolicyLossInput, PolicyLossParams, policy_loss
from nearpolicy.ops.proximal import (a3po_alpha, a3po_proximal_logprobs, ais_lambda, discrepancy_center, ewma_update,
                                     proximal_logprobs)

torch.set_default_dtype(torch.float64)  # for module-level constants; tests: conftest._default_dtype
DEFAULT_DTYPE = torch.float64


def _case(seed=0, B=5, T=6):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 3
    prox = lp + 0.3 * torch.randn(B, T, generator=g)
    rollout = prox + 0.5 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    return lp, prox, rollout, adv, mask


# -- PPO-EWMA -------------------------------------------------------------------------------------------------
def test_ewma_update_is_the_bias_corrected_weighted_average():
    g = torch.Generator().manual_seed(0)
    thetas = [torch.randn(3, generator=g) for _ in range(5)]
    beta, ewma, w = 0.7, torch.zeros(3), torch.zeros(())
    for theta in thetas:
        ewma, w = ewma_update(ewma, theta, w, beta)
    coeff = [beta ** (4 - k) for k in range(5)]
    expected = sum(c * th for c, th in zip(coeff, thetas)) / sum(coeff)
    assert torch.allclose(ewma, expected, rtol=1e-14, atol=0) and w.item() == pytest.approx(sum(coeff))
    reset, _ = ewma_update(ewma, thetas[0], w, 0.0)
    assert torch.equal(reset, thetas[0])
    with pytest.raises(ValueError, match="decay"):
        ewma_update(ewma, thetas[0], w, 1.0)


def test_ewma_proximal_gives_the_ratio_and_a_detached_weight_against_the_ewma_logprobs():
    """Invariant 11 on the trainer's path (training/update.py): proximal_logprobs("ewma") feeds both the loss's ratio
    exp(lp - ewma) and the mismatch weight exp(ewma - rollout), which is detached even when ewma carries a graph."""
    lp, ewma, rollout, adv, mask = _case(1)
    old = ewma + 0.1  # must not be read for proximal "ewma"
    has = torch.ones_like(mask)
    ewma = ewma.clone().requires_grad_(True)
    lp.requires_grad_(True)
    prox = proximal_logprobs("ewma", "decoupled", lp, old, rollout, has, ewma_logprobs=ewma)
    assert torch.equal(prox, ewma.detach()) and not prox.requires_grad
    w = mismatch_correction(CorrectionSpec("token", "none"), lp, prox, rollout, mask, has).weights
    assert not w.requires_grad
    assert torch.allclose(w, torch.where(mask, (ewma.detach() - rollout).exp(), 1.0), rtol=1e-15, atol=0)
    eps = 0.2
    ours, _ = policy_loss("ppo_clip", PolicyLossInput(lp, prox, adv, mask, mask.sum(), w), PolicyLossParams(eps, eps, None))
    (g_ours,) = torch.autograd.grad(ours, lp)
    r = (lp.detach() - ewma.detach()).exp()
    a = adv[:, None].expand_as(r)
    unclipped = (-a * r >= -a * r.clamp(1 - eps, 1 + eps))  # the max picks the unclipped term: gradient -A r w
    expected = torch.where(mask & unclipped, -a * r * w, 0.0) / mask.sum()
    assert torch.allclose(g_ours, expected, rtol=1e-12, atol=0)


# -- A-3PO ----------------------------------------------------------------------------------------------------
def test_a3po_alpha_and_interpolations():
    alpha = a3po_alpha(torch.tensor([1, 2, 4, 4]), 3, torch.tensor([5, 5, 5, 4]))
    assert torch.allclose(alpha, torch.tensor([0.5, 1 / 3, 0.0, 0.0]), rtol=1e-15)  # v_theta == v_behave -> 0
    lp, _, mu, _, _ = _case(2)
    assert torch.equal(a3po_proximal_logprobs(lp, mu, 0.0), mu)
    assert torch.allclose(a3po_proximal_logprobs(lp, mu, 1.0), lp, rtol=1e-15)
    assert torch.allclose(a3po_proximal_logprobs(lp, mu, 0.25), mu + 0.25 * (lp - mu), rtol=1e-15)
    lin = a3po_proximal_logprobs(lp, mu, 0.25, "linear")
    assert torch.allclose(lin, torch.log(0.75 * mu.exp() + 0.25 * lp.exp()), rtol=1e-13)
    per_seq = a3po_proximal_logprobs(lp, mu, torch.tensor([0.0, 1.0, 0.5, 0.5, 0.5]))
    assert torch.equal(per_seq[0], mu[0]) and torch.allclose(per_seq[1], lp[1], rtol=1e-15)
    with pytest.raises(ValueError, match="loglinear"):
        a3po_proximal_logprobs(lp, mu, 0.5, "cubic")


# -- DLC ------------------------------------------------------------------------------------------------------
def test_dlc_centre_and_truncate_through_correct():
    """DLC as update.batch_correction applies it: the centre c shifts the engine's log-probs, so the token weight
    is clamp(exp(log rho - c), lower, upper) at defined tokens and 1 elsewhere."""
    log_rho = torch.tensor([[math.log(2.0), math.log(0.5), math.log(4.0), 0.0]])
    defined = torch.tensor([[True, True, True, False]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    c = discrepancy_center(log_rho, defined, "log_mean")
    assert c.item() == pytest.approx(math.log(4.0) / 3, rel=1e-14)  # mean log rho over defined tokens
    w = correct(CorrectionSpec("token", "none"), log_rho - c, defined, mask).weights
    expected = [2 / 4 ** (1 / 3), 0.5 / 4 ** (1 / 3), 4 / 4 ** (1 / 3), 1.0]
    assert torch.allclose(w[0], torch.tensor(expected), rtol=1e-14, atol=0)
    assert discrepancy_center(log_rho, defined, "weight_mean").item() == pytest.approx(math.log(6.5 / 3), rel=1e-14)
    truncated = correct(CorrectionSpec("token", "truncate", 0.0, 2.0), log_rho, defined, mask).weights
    assert torch.allclose(truncated[0], torch.tensor([2.0, 0.5, 2.0, 1.0]), rtol=1e-15, atol=0)
    assert discrepancy_center(log_rho, defined, "none").item() == 0.0


def test_normalized_ess_hand_computed_empty_and_without_overflow():
    w = torch.tensor([[2.0, 1.0, 1.8]])  # the third is masked
    mask = torch.tensor([[True, True, False]])
    assert normalized_ess(w.log(), mask).item() == pytest.approx(9 / (2 * 5), rel=1e-14)
    assert normalized_ess(torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool)).item() == 1.0
    big = torch.tensor([800.0, 800.0 + math.log(2.0)])  # sequence log-weights: exp would overflow float64
    assert normalized_ess(big, torch.ones(2, dtype=torch.bool)).item() == pytest.approx(9 / (2 * 5), rel=1e-12)


# -- AIS ------------------------------------------------------------------------------------------------------
def test_ais_lambda_hand_computed_and_zero_without_mismatch():
    log_rho = torch.log(torch.tensor([[2.0, 0.5]]))
    defined = torch.ones(1, 2, dtype=torch.bool)
    lam, diag = ais_lambda(log_rho, defined, severity_scale=0.1)
    w = torch.tensor([2.0, 0.5])
    ess = w.sum() ** 2 / (2 * (w * w).sum())
    sev = (w - 1 - w.log()).mean()
    amp = (w * w).mean() - 1
    assert diag["ais/reliability"].item() == pytest.approx(ess.item(), rel=1e-14)
    assert diag["ais/severity"].item() == pytest.approx(sev.item(), rel=1e-14)
    assert diag["ais/amplification"].item() == pytest.approx(amp.item(), rel=1e-14)
    assert lam.item() == pytest.approx((sev / (sev + 0.1) * ess / (1 + amp)).item(), rel=1e-14)
    lam0, _ = ais_lambda(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool))
    assert lam0.item() == 0.0


def test_ais_mix_gives_the_interpolated_gradient():
    """update.batch_correction puts AIS's lambda into the spec's mix: w_eff = (1 - lambda) + lambda w, so for a
    loss linear in the weight the loss (and gradient) is (1 - lambda) uncorrected + lambda corrected."""
    lp, old, rollout, adv, mask = _case(3)
    log_rho, defined = correction_log_ratio("decoupled", lp, old, rollout, mask, torch.ones_like(mask))
    w = torch.where(defined, log_rho.exp(), 1.0)
    lam, _ = ais_lambda(log_rho, defined)
    assert 0 < lam.item() < 1

    def loss(weights):
        return policy_loss("ppo_clip", PolicyLossInput(lp, old, adv, mask, mask.sum(), weights), PolicyLossParams())[0]

    def mixed(mix):
        return correct(CorrectionSpec("token", "none", mix=mix), log_rho, defined, mask).weights

    assert torch.allclose(mixed(1.0), w, rtol=1e-15, atol=0)
    assert loss(mixed(float(lam))).item() == pytest.approx(((1 - lam) * loss(None) + lam * loss(w)).item(), rel=1e-12)
    assert torch.equal(mixed(0.0)[mask], torch.ones(int(mask.sum())))


# -- on-policy distillation -----------------------------------------------------------------------------------
def test_opd_advantages_loop_reference_with_discount():
    _, student, teacher, _, mask = _case(4)
    for coef, gamma in ((1.0, 0.0), (0.5, 0.9)):
        adv, metrics = opd_advantages(student, teacher, mask, coef, gamma)
        for i in range(student.shape[0]):
            valid = [k for k in range(student.shape[1]) if mask[i, k]]  # one discount step per valid token
            for t in range(student.shape[1]):
                later = [k for k in valid if k >= t]
                ref = sum(gamma ** j * -coef * float(student[i, k] - teacher[i, k]) for j, k in enumerate(later))
                assert adv[i, t].item() == pytest.approx(ref if mask[i, t] else 0.0, rel=1e-12, abs=1e-15)
        rkl = torch.where(mask, student - teacher, 0.0)
        assert metrics["teacher_kl"].item() == pytest.approx((rkl.sum() / mask.sum()).item(), rel=1e-13)
    assert torch.equal(reverse_kl_tokens(student, student.clone(), mask), torch.zeros_like(student))


def test_opd_discount_carries_the_return_through_observation_tokens():
    # verl #7278's case: gamma 0.5, tool observation at positions 2-3, rewards -rkl = [0, 0, ., ., 2]: the fixed
    # semantics give [0.5, 1.0, 0, 0, 2.0] (one step per model token), not [0.125, 0.25, 0, 0, 2.0]
    student = torch.tensor([[-1.0, -1.0, float("nan"), float("inf"), -3.0]])
    teacher = torch.tensor([[-1.0, -1.0, 0.0, float("nan"), -1.0]])
    model_tokens = torch.tensor([[True, True, False, False, True]])
    adv, _ = opd_advantages(student, teacher, model_tokens, 1.0, 0.5)
    assert adv.tolist() == [[0.5, 1.0, 0.0, 0.0, 2.0]]
    # inserting three observation tokens leaves every model token's advantage exactly where it was
    g = torch.Generator().manual_seed(11)
    s, t = -torch.rand(1, 6, generator=g) * 3, -torch.rand(1, 6, generator=g) * 3
    plain, _ = opd_advantages(s, t, torch.ones(1, 6, dtype=torch.bool), 0.7, 0.9)
    nan3 = torch.full((1, 3), float("nan"))  # three observation tokens: their log-probs are never read
    s_obs, t_obs = (torch.cat([x[:, :3], nan3, x[:, 3:]], 1) for x in (s, t))
    model_tokens = torch.tensor([[True] * 3 + [False] * 3 + [True] * 3])
    with_obs, _ = opd_advantages(s_obs, t_obs, model_tokens, 0.7, 0.9)
    assert torch.equal(with_obs[:, [0, 1, 2, 6, 7, 8]], plain)
    assert torch.equal(with_obs[:, 3:6], torch.zeros(1, 3))


def test_opd_loss_is_tinker_importance_sampling_with_engine_logprobs():
    lp, _, rollout, _, mask = _case(5)
    teacher = rollout - 0.2
    lp.requires_grad_(True)
    adv, _ = opd_advantages(rollout, teacher, mask)
    loss, _ = policy_loss("importance_sampling", PolicyLossInput(lp, rollout, adv, mask, mask.sum()), PolicyLossParams())
    (grad,) = torch.autograd.grad(loss, lp)
    ratio = torch.exp(lp.detach() - rollout)
    expected = torch.where(mask, -ratio * adv / mask.sum(), 0.0)
    assert loss.item() == pytest.approx(torch.where(mask, -ratio * adv, 0.0).sum().item() / mask.sum().item(), rel=1e-12)
    assert torch.allclose(grad, expected, rtol=1e-12, atol=1e-16)
    bad = teacher.masked_fill(~mask, float("nan"))
    assert torch.equal(opd_advantages(rollout, bad, mask)[0], adv)


# -- diagnostics ----------------------------------------------------------------------------------------------
def test_fraction_with_global_denominator_adds_up_over_micro_batches():
    g = torch.Generator().manual_seed(6)
    ind, mask = torch.rand(6, 5, generator=g) > 0.5, torch.rand(6, 5, generator=g) > 0.3
    full = fraction(ind, mask)
    parts = sum(fraction(ind[r], mask[r], mask.sum()) for r in (slice(0, 2), slice(2, 6)))
    assert full.item() == pytest.approx(((ind & mask).sum() / mask.sum()).item(), rel=1e-15)
    assert parts.item() == pytest.approx(full.item(), rel=1e-14)
