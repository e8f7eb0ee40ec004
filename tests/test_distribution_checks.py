"""ops/distribution_checks.py against hand-computed values and float64 loops: the top-k TV / KL bounds, the support
replay of top-k / top-p, and the maximum-likelihood temperature of sampled tokens."""

from __future__ import annotations

import math

import pytest
import torch

from nearpolicy.ops.distribution_checks import (TEMPERATURE_GRID, fit_temperature, support_replay,
                                                temperature_fit_stats, topk_bounds)

DEFAULT_DTYPE = torch.float64


def _bounds(p: list[float], listed: dict[int, float], k: int = 2) -> dict[str, float]:
    ref = torch.tensor([p]).log()
    ids = torch.tensor([list(listed)])
    lps = torch.tensor([[math.log(v) for v in listed.values()]])
    return {key: float(v[0]) for key, v in topk_bounds(ref, ids, lps, k).items()}


def test_topk_bounds_match_hand_computed_values():
    # p = (0.5, 0.3, 0.2); the engine lists q_0 = 0.6, q_1 = 0.2 (so q(S) = 0.8, q's tail 0.2 against p's 0.2)
    b = _bounds([0.5, 0.3, 0.2], {0: 0.6, 1: 0.2})
    assert b["tv_lower"] == pytest.approx(0.5 * (0.1 + 0.1 + 0.0), abs=1e-12)
    kl = 0.6 * math.log(0.6 / 0.5) + 0.2 * math.log(0.2 / 0.3) + 0.2 * math.log(0.2 / 0.2)
    kl_rev = 0.5 * math.log(0.5 / 0.6) + 0.3 * math.log(0.3 / 0.2)
    assert b["kl_lower"] == pytest.approx(kl, abs=1e-12)
    assert b["kl_reverse_lower"] == pytest.approx(kl_rev, abs=1e-12)
    assert (b["engine_mass"], b["ref_mass"]) == (pytest.approx(0.8), pytest.approx(0.8))
    assert b["top1_agree"] == 1.0 and b["topk_overlap"] == 1.0 and b["listed"] == 2.0
    # the engine ranks id 1 first where the reference ranks id 0 first; only 1 of its top-2 is the reference's
    b = _bounds([0.5, 0.3, 0.2], {1: 0.5, 2: 0.3})
    assert b["top1_agree"] == 0.0 and b["topk_overlap"] == 0.5


def test_topk_bounds_are_exact_with_the_whole_vocabulary_and_below_the_truth_otherwise():
    torch.manual_seed(0)
    V = 12
    p = torch.softmax(torch.randn(6, V) * 2, -1)
    q = torch.softmax(p.log() + 0.3 * torch.randn(6, V), -1)
    tv = 0.5 * (p - q).abs().sum(-1)
    kl = (q * (q / p).log()).sum(-1)
    kl_rev = (p * (p / q).log()).sum(-1)
    full = topk_bounds(p.log(), torch.arange(V).expand(6, V), q.log(), V)
    torch.testing.assert_close(full["tv_lower"], tv, rtol=0, atol=1e-12)
    torch.testing.assert_close(full["kl_lower"], kl, rtol=0, atol=1e-12)
    torch.testing.assert_close(full["kl_reverse_lower"], kl_rev, rtol=0, atol=1e-12)
    for K in (1, 3, 6):
        ids = torch.topk(q, K, -1).indices
        part = topk_bounds(p.log(), ids, q.gather(1, ids).log(), K)
        assert (part["tv_lower"] <= tv + 1e-12).all() and (part["kl_lower"] <= kl + 1e-12).all()
        assert (part["kl_reverse_lower"] <= kl_rev + 1e-12).all() and (part["kl_lower"] >= 0).all()


def test_topk_bounds_of_identical_distributions_are_zero_and_absent_entries_are_ignored():
    p = torch.softmax(torch.randn(3, 10), -1)
    ids = torch.tensor([[4, 1, -1], [0, -1, -1], [-1, -1, -1]])
    lps = torch.where(ids >= 0, p.log().gather(1, ids.clamp_min(0)), torch.full(ids.shape, -math.inf))
    lps[1, 1] = math.nan  # a NaN entry counts as absent too
    b = topk_bounds(p.log(), ids, lps, 2)
    torch.testing.assert_close(b["tv_lower"], torch.zeros(3), rtol=0, atol=1e-12)
    torch.testing.assert_close(b["kl_lower"], torch.zeros(3), rtol=0, atol=1e-12)
    assert b["listed"].tolist() == [2.0, 1.0, 0.0] and b["topk_overlap"][2] == 1.0


def test_support_replay_measures_how_far_outside_top_k_and_top_p_a_token_lies():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    # top-k 2: token 2 lies 1 nat (of logit / T, T = 1) below the 2nd largest; token 1 is inside
    out = support_replay(logits, torch.tensor([2]), 1.0, 2, 1.0)
    assert out["outside"].tolist() == [True] and out["topk_gap"].item() == pytest.approx(1.0)
    assert not support_replay(logits, torch.tensor([1]), 1.0, 2, 1.0)["outside"].item()
    # at T = 0.5 the gap doubles (scaled logits)
    assert support_replay(logits, torch.tensor([2]), 0.5, 2, 1.0)["topk_gap"].item() == pytest.approx(2.0)
    # top-p 0.6: probs e^(2, 1, 0, -1) / Z; token 1 has mass p_0 = 0.6439 above it: outside by 0.0439
    probs = torch.softmax(logits[0], -1)
    out = support_replay(logits, torch.tensor([1]), 1.0, 0, 0.6)
    assert out["outside"].item() and out["topp_excess"].item() == pytest.approx(float(probs[0]) - 0.6, abs=1e-7)
    inside = support_replay(logits, torch.tensor([0]), 1.0, 0, 0.6)
    assert not inside["outside"].item() and inside["topp_excess"].item() == pytest.approx(-0.6)
    none = support_replay(logits, torch.tensor([3]), 1.0, 0, 1.0)
    assert not none["outside"].item() and none["topk_gap"].item() == 0.0


def _loop_stats(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """temperature_fit_stats by a per-position float64 loop, without top-k / top-p."""
    out = torch.zeros(len(TEMPERATURE_GRID), 3, dtype=torch.float64)
    for g, ratio in enumerate(TEMPERATURE_GRID):
        beta = 1.0 / (ratio * temperature)
        for z, y in zip(logits.double(), ids):
            p = torch.softmax(beta * z, -1)
            mean = float((p * z).sum())
            out[g, 0] += float(beta * z[y] - torch.logsumexp(beta * z, -1))
            out[g, 1] += float(z[y]) - mean
            out[g, 2] += float((p * (z - mean) ** 2).sum())
    return out


def test_temperature_fit_stats_match_a_loop_and_add_up_over_micro_batches():
    torch.manual_seed(1)
    logits, ids = torch.randn(20, 30) * 3, torch.randint(0, 30, (20,))
    whole = temperature_fit_stats(logits, ids, 0.8)
    torch.testing.assert_close(whole, _loop_stats(logits, ids, 0.8), rtol=1e-10, atol=1e-9)
    parts = temperature_fit_stats(logits[:7], ids[:7], 0.8) + temperature_fit_stats(logits[7:], ids[7:], 0.8)
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("true_temperature", [0.7, 1.0, 1.3])
def test_the_fit_recovers_the_temperature_the_tokens_were_drawn_at(true_temperature):
    torch.manual_seed(2)
    logits = torch.randn(4000, 50) * 2.5
    ids = torch.multinomial(torch.softmax(logits / true_temperature, -1), 1).squeeze(1)
    fit = fit_temperature(temperature_fit_stats(logits, ids, 1.0), 1.0)
    assert abs(float(fit["temperature"]) - true_temperature) < 4 * float(fit["se"])
    assert float(fit["se"]) < 0.02
    if true_temperature == 1.0:
        assert abs(float(fit["z"])) < 4
    else:  # colder draws: positive score; hotter: negative
        assert math.copysign(1, float(fit["z"])) == (1 if true_temperature < 1 else -1) and abs(fit["z"]) > 10


def test_the_fit_keeps_the_claimed_kept_set_under_top_k():
    torch.manual_seed(3)
    logits = torch.randn(3000, 40) * 2
    scaled = logits / 0.9
    keep = scaled >= torch.topk(scaled, 10, -1).values[:, -1:]
    ids = torch.multinomial(torch.softmax(scaled.masked_fill(~keep, -math.inf), -1), 1).squeeze(1)
    fit = fit_temperature(temperature_fit_stats(logits, ids, 0.9, top_k=10), 0.9)
    assert abs(float(fit["temperature"]) - 0.9) < 4 * float(fit["se"])


def test_fit_temperature_needs_the_claimed_temperature_on_the_grid():
    with pytest.raises(ValueError, match="ratio 1.0"):
        fit_temperature(torch.zeros(2, 3), 1.0, grid=(0.5, 2.0))
