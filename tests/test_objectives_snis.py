"""Self-normalised importance sampling (CorrectionSpec.self_normalize) against per-token loop references
(float64)."""

import math

import pytest
import torch

from nearpolicy.ops.correction_presets import correction_spec
from nearpolicy.ops.corrections import CorrectionSpec, correct
from nearpolicy.ops.losses import PolicyLossInput, PolicyLossParams, policy_loss

torch.set_default_dtype(torch.float64)  # for module-level constants; tests: conftest._default_dtype
DEFAULT_DTYPE = torch.float64


def _case(seed=0, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    log_rho = 0.8 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    defined = mask & (torch.rand(B, T, generator=g) > 0.15)
    defined[-1] = False  # a sequence without any engine log-prob
    return torch.where(defined, log_rho, torch.zeros_like(log_rho)), defined, mask


def test_token_self_normalisation_matches_a_loop_with_rejected_tokens_counting_zero():
    log_rho, defined, mask = _case(1)
    spec = CorrectionSpec("token", "mask", 0.5, 2.0, self_normalize="token")
    res = correct(spec, log_rho, defined, mask)
    B, T = mask.shape
    raw, total, n = {}, 0.0, 0
    for b in range(B):
        for t in range(T):
            if defined[b, t]:
                r = math.exp(log_rho[b, t].item())
                raw[b, t] = r if 0.5 <= r <= 2.0 else 0.0
                total, n = total + raw[b, t], n + 1
    mean = total / n
    assert res.metrics["correction/sn_factor"].item() == pytest.approx(mean, rel=1e-14)
    for b in range(B):
        for t in range(T):
            expected = raw[b, t] / mean if defined[b, t] else 1.0  # no engine log-prob / padding: exactly 1
            assert res.weights[b, t].item() == pytest.approx(expected, rel=1e-14), (b, t)
    assert (~res.keep[defined]).any() and (res.weights[defined & ~res.keep] == 0).all()
    assert res.weights[defined].sum().item() == pytest.approx(n, rel=1e-13)  # the mean weight is now 1


def test_sequence_self_normalisation_is_the_mean_over_sequences_of_per_sequence_means():
    log_rho, defined, mask = _case(2)
    spec = CorrectionSpec("sequence", "truncate", 0.0, 2.0, self_normalize="sequence")
    res = correct(spec, log_rho, defined, mask)
    seq_w = {}
    for b in range(mask.shape[0]):
        if defined[b].any():
            s = sum(log_rho[b, t].item() for t in range(mask.shape[1]) if defined[b, t])
            seq_w[b] = min(math.exp(max(-20.0, min(20.0, s))), 2.0)
    mean = sum(seq_w.values()) / len(seq_w)
    assert res.metrics["correction/sn_factor"].item() == pytest.approx(mean, rel=1e-14)
    for b in range(mask.shape[0]):
        expected = seq_w[b] / mean if b in seq_w else 1.0  # a sequence without engine log-probs keeps w = 1
        assert torch.allclose(res.weights[b][mask[b]], torch.full((int(mask[b].sum()),), expected), rtol=1e-14)


def test_micro_batches_given_the_batch_mean_reproduce_the_full_batch_weights():
    log_rho, defined, mask = _case(3)
    spec = CorrectionSpec("token", "truncate", 0.0, 2.0, self_normalize="token")
    full = correct(spec, log_rho, defined, mask)
    factor = full.metrics["correction/sn_factor"]
    for rows in (slice(0, 2), slice(2, 6)):
        part = correct(spec, log_rho[rows], defined[rows], mask[rows], normalizer=factor)
        assert torch.equal(part.weights, full.weights[rows])
        alone = correct(spec, log_rho[rows], defined[rows], mask[rows])
        assert not torch.equal(alone.weights, full.weights[rows])  # without the batch mean it would differ


@pytest.mark.parametrize("kind", ["token", "sequence"])
def test_self_normalisation_removes_a_batch_wide_constant_ratio_and_all_ones_is_uncorrected(kind):
    """Every defined ratio equal to c (or 1): self-normalised weights are exactly 1, so the loss equals the
    uncorrected one (and, for all-ones ratios, the plain IS one)."""
    g = torch.Generator().manual_seed(4)
    B, T = 4, 5
    lp = -torch.rand(B, T, generator=g) * 2
    old = lp + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    _, defined, mask = _case(4, B, T)
    params = PolicyLossParams(0.2, 0.28, 3.0)
    plain, _ = policy_loss("ppo_clip", PolicyLossInput(lp, old, adv, mask, mask.sum()), params)
    level = "token" if kind == "token" else "geometric"
    for c in (0.0, math.log(1.7)):
        log_rho = torch.where(defined, torch.full((B, T), c), torch.zeros(B, T))
        res = correct(CorrectionSpec(level, "none", self_normalize=kind), log_rho, defined, mask)
        assert torch.allclose(res.weights[mask], torch.ones(int(mask.sum())), rtol=1e-14, atol=0)
        loss, _ = policy_loss("ppo_clip", PolicyLossInput(lp, old, adv, mask, mask.sum(), res.weights), params)
        assert loss.item() == pytest.approx(plain.item(), rel=1e-14)


def test_self_normalised_presets_and_validation():
    assert correction_spec("tis_snis") == CorrectionSpec("token", "truncate", 0.5, 2.0, self_normalize="token")
    assert correction_spec("seq_tis_snis").self_normalize == "sequence"
    with pytest.raises(ValueError, match="self_normalize"):
        CorrectionSpec(self_normalize="batch")


@pytest.mark.parametrize("kind", ["token", "sequence"])
def test_self_normalisation_ignores_nan_and_inf_at_masked_or_missing_positions(kind):
    """Invariants 4 and 5 for the self-normalised weights: poisoned log-ratios where the token is padding or has
    no engine log-prob change neither the weights nor the batch mean."""
    log_rho, defined, mask = _case(7)
    spec = CorrectionSpec("token" if kind == "token" else "geometric", "truncate", 0.0, 3.0, self_normalize=kind)
    base = correct(spec, log_rho, defined, mask)
    poisoned = log_rho.masked_fill(~defined, math.nan).masked_fill(~mask, math.inf)
    out = correct(spec, poisoned, defined, mask)
    assert torch.equal(out.weights, base.weights) and torch.equal(out.keep, base.keep)
    assert all(torch.isfinite(v) for v in out.metrics.values())
