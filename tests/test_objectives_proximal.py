"""PPO-EWMA, A-3PO, DLC, AIS, on-policy distillation and sequence diagnostics (float64)."""

import math

import pytest
import torch

from nearpolicy.ops.corrections import correction_log_ratio
from nearpolicy.ops.diagnostics import fraction, sequence_mismatch_metrics
from nearpolicy.ops.distill import opd_advantages, reverse_kl_tokens
from nearpolicy.ops.losses import PolicyLossInput, PolicyLossParams, policy_loss
from nearpolicy.ops.proximal import (a3po_alpha, a3po_proximal_logprobs, ais_lambda, discrepancy_center, dlc_resync_signal,
                                     dlc_weights, ewma_update, mix_weights, normalized_ess, ppo_ewma_weights)

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


def test_ppo_ewma_through_ppo_clip_equals_the_reference_loss_and_gradient():
    lp, prox, rollout, adv, mask = _case(1)
    rollout = rollout - 5.0 * (torch.arange(6) == 2)  # some tokens hit the imp_samp_max = 100 cap
    eps = 0.2
    lp.requires_grad_(True)
    w = ppo_ewma_weights(prox, rollout, lp, mask)
    ours, _ = policy_loss("ppo_clip", PolicyLossInput(lp, prox, adv, mask, mask.sum(), w), PolicyLossParams(eps, eps, None))
    (g_ours,) = torch.autograd.grad(ours, lp)
    lp2 = lp.detach().clone().requires_grad_(True)  # openai/ppo-ewma ppo.py, written out
    mu_adj = torch.maximum(rollout, lp2.detach() - math.log(100))
    a = adv[:, None]
    l1 = -a * torch.exp(lp2 - mu_adj)
    l2 = -a * torch.exp((lp2 - prox).clamp(math.log(1 - eps), math.log(1 + eps)) + prox - mu_adj)
    ref = torch.where(mask, torch.maximum(l1, l2), 0.0).sum() / mask.sum()
    (g_ref,) = torch.autograd.grad(ref, lp2)
    assert (mu_adj != rollout)[mask].any()
    assert ours.item() == pytest.approx(ref.item(), rel=1e-12)
    assert torch.allclose(g_ours, g_ref, rtol=1e-12, atol=1e-15)
    assert not w.requires_grad


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
def test_dlc_weights_centre_and_truncate():
    log_rho = torch.tensor([[math.log(2.0), math.log(0.5), math.log(4.0), 0.0]])
    defined = torch.tensor([[True, True, True, False]])
    c = discrepancy_center(log_rho, defined, "log_mean")
    assert c.item() == pytest.approx(math.log(4.0) / 3, rel=1e-14)  # mean log rho over defined tokens
    w = dlc_weights(log_rho, defined, c)
    expected = [2 / 4 ** (1 / 3), 0.5 / 4 ** (1 / 3), 4 / 4 ** (1 / 3), 1.0]
    assert torch.allclose(w[0], torch.tensor(expected), rtol=1e-14)
    assert discrepancy_center(log_rho, defined, "weight_mean").item() == pytest.approx(math.log(6.5 / 3), rel=1e-14)
    assert torch.allclose(dlc_weights(log_rho, defined, 0.0, 0.0, 2.0)[0], torch.tensor([2.0, 0.5, 2.0, 1.0]), rtol=1e-15)
    assert discrepancy_center(log_rho, defined, "none").item() == 0.0


def test_dlc_resync_signal_hand_computed():
    lp = torch.log(torch.tensor([[0.2, 0.3, 0.9]]))
    old = torch.log(torch.tensor([[0.1, 0.3, 0.5]]))  # lag weights 2, 1 and (masked) 1.8
    mask = torch.tensor([[True, True, False]])
    ess, resync = dlc_resync_signal(lp, old, mask)
    assert ess.item() == pytest.approx(9 / (2 * 5), rel=1e-14) and not resync
    _, resync = dlc_resync_signal(lp, old, mask, threshold=0.95)
    assert resync
    assert normalized_ess(torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool)).item() == 1.0


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


def test_mix_weights_give_the_interpolated_gradient():
    lp, old, rollout, adv, mask = _case(3)
    log_rho, defined = correction_log_ratio("decoupled", lp, old, rollout, mask, torch.ones_like(mask))
    w = torch.where(defined, log_rho.exp(), 1.0)
    lam, _ = ais_lambda(log_rho, defined)
    assert 0 < lam.item() < 1

    def loss(weights):
        return policy_loss("ppo_clip", PolicyLossInput(lp, old, adv, mask, mask.sum(), weights), PolicyLossParams())[0]

    mixed = loss(mix_weights(w, lam, mask))
    assert mixed.item() == pytest.approx(((1 - lam) * loss(None) + lam * loss(w)).item(), rel=1e-12)
    assert torch.equal(mix_weights(w, 1.0, mask), w) and torch.equal(mix_weights(w, 0.0, mask)[mask], torch.ones(int(mask.sum())))


# -- on-policy distillation -----------------------------------------------------------------------------------
def test_opd_advantages_loop_reference_with_discount():
    _, student, teacher, _, mask = _case(4)
    for coef, gamma in ((1.0, 0.0), (0.5, 0.9)):
        adv, metrics = opd_advantages(student, teacher, mask, coef, gamma)
        for i in range(student.shape[0]):
            for t in range(student.shape[1]):
                rew = [-coef * float(student[i, k] - teacher[i, k]) if mask[i, k] else 0.0 for k in range(student.shape[1])]
                ref = sum(gamma ** (k - t) * rew[k] for k in range(t, len(rew))) if mask[i, t] else 0.0
                assert adv[i, t].item() == pytest.approx(ref, rel=1e-12, abs=1e-15)
        rkl = torch.where(mask, student - teacher, 0.0)
        assert metrics["teacher_kl"].item() == pytest.approx((rkl.sum() / mask.sum()).item(), rel=1e-13)
    assert torch.equal(reverse_kl_tokens(student, student.clone(), mask), torch.zeros_like(student))


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
def test_sequence_mismatch_metrics_hand_computed():
    pi = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.4, 0.4, 0.4], [0.3, 0.3, 0.3]]))
    mu = torch.log(torch.tensor([[0.25, 0.2, 0.1], [0.8, 0.2, 0.4], [0.3, 0.3, 0.3]]))
    defined = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
    m = sequence_mismatch_metrics(pi, mu.masked_fill(~defined, float("nan")), defined)
    d0 = (math.log(0.25) + math.log(0.2)) / 2 - (math.log(0.5) + math.log(0.2)) / 2  # mean mu - mean pi = -log 2 / 2
    d1 = (math.log(0.8) + math.log(0.2) + math.log(0.4)) / 3 - math.log(0.4)
    assert m["log_ppl_diff"].item() == pytest.approx((d0 + d1) / 2, rel=1e-13)
    assert m["log_ppl_diff_abs"].item() == pytest.approx((abs(d0) + abs(d1)) / 2, rel=1e-13)
    assert m["log_ppl_diff_max"].item() == pytest.approx(max(d0, d1), rel=1e-13)
    assert m["log_ppl_diff_min"].item() == pytest.approx(min(d0, d1), rel=1e-13)
    assert m["ppl_ratio"].item() == pytest.approx((math.exp(d0) + math.exp(d1)) / 2, rel=1e-13)
    ppl0 = math.exp(-(math.log(0.5) + math.log(0.2)) / 2)
    assert m["training_ppl"].item() == pytest.approx((ppl0 + 2.5) / 2, rel=1e-13)
    seq_r = [2.0, 0.5 * 2.0 * 1.0]  # products of pi / mu over defined tokens
    assert m["chi2_seq"].item() == pytest.approx(sum(r * r for r in seq_r) / 2 - 1, rel=1e-13)
    assert m["seqs"].item() == 2
    same = sequence_mismatch_metrics(pi, pi.clone(), defined)
    assert same["log_ppl_diff"].item() == 0 and same["ppl_ratio"].item() == 1 and same["chi2_seq"].item() == 0


def test_fraction_with_global_denominator_adds_up_over_micro_batches():
    g = torch.Generator().manual_seed(6)
    ind, mask = torch.rand(6, 5, generator=g) > 0.5, torch.rand(6, 5, generator=g) > 0.3
    full = fraction(ind, mask)
    parts = sum(fraction(ind[r], mask[r], mask.sum()) for r in (slice(0, 2), slice(2, 6)))
    assert full.item() == pytest.approx(((ind & mask).sum() / mask.sum()).item(), rel=1e-15)
    assert parts.item() == pytest.approx(full.item(), rel=1e-14)


def test_score_centering_term_hand_computed_and_zero_without_mismatch():
    from nearpolicy.ops.proximal import score_centering_term

    p = torch.tensor([[[0.4, 0.3, 0.1]]])
    q = torch.tensor([[[0.5, 0.3, 0.1]]])
    head = torch.tensor([[[True, True, False]]])  # engine's top-2; the third entry must be ignored
    mask = torch.ones(1, 1, dtype=torch.bool)
    logp = p.log().requires_grad_(True)
    c = score_centering_term(logp, q.log().masked_fill(~head, float("nan")), head, mask)
    rho_tail = 0.2 / 0.3
    coef = [0.5 - rho_tail * 0.4, 0.3 - rho_tail * 0.3]
    assert c.item() == pytest.approx(coef[0] * math.log(0.4) + coef[1] * math.log(0.3), rel=1e-13)
    (grad,) = torch.autograd.grad(c.sum(), logp)
    assert torch.allclose(grad, torch.tensor([[[coef[0], coef[1], 0.0]]]), rtol=1e-13, atol=0)
    tis = score_centering_term(p.log(), q.log(), head, mask, 0.9, 1.1)  # p/q = 0.8, 1.0
    alpha = min(max(1.0, 0.9 * rho_tail), 1.1 * rho_tail)
    expected = (0.45 - alpha * 0.4) * math.log(0.4) + (0.3 - alpha * 0.3) * math.log(0.3)
    assert tis.item() == pytest.approx(expected, rel=1e-13)
    assert score_centering_term(p.log(), q.log(), head, mask, 0.5, 2.0).item() == 0.0  # all ratios inside: no term
    logits = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    same = torch.log_softmax(logits, -1)
    top = torch.rand(3, 4, 6, generator=torch.Generator().manual_seed(1)) > 0.4
    top[0, 3] = True  # a head covering the whole support: value sum q log p, but zero gradient
    top[1, 0] = False  # an empty head
    c = score_centering_term(same, same.detach().clone(), top, torch.ones(3, 4, dtype=torch.bool))
    partial = ~top.all(-1)
    assert torch.equal(c[partial], torch.zeros(int(partial.sum())))  # p = q on a partial head: coefficient 0
    (g_logits,) = torch.autograd.grad(c.sum(), logits)
    assert torch.allclose(g_logits, torch.zeros_like(g_logits), atol=1e-12, rtol=0)
