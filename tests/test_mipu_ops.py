"""ops/mipu.py: MIPU's improvement proxy and accept rule against hand-computed values, a per-row float64 loop, and the
invariances (identical log-probs give exactly 0; masked values, NaN and inf included, are never read)."""

from __future__ import annotations

import math

import pytest
import torch

from nearpolicy.ops.mipu import MIPU_LEVELS, accepts, improvement_proxy

DEFAULT_DTYPE = torch.float64
NAN = float("nan")


def _hand_batch():
    """Three rows: r = (2, 0.5, 1) with A = 1; r = 1.5 on one token (then padding) with A = -2; an empty row with a
    NaN advantage. Behaviour log-probs 0, candidate log r."""
    log_r = torch.tensor([[math.log(2.0), math.log(0.5), 0.0], [math.log(1.5), NAN, NAN], [NAN, NAN, NAN]])
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    behaviour = torch.where(mask, torch.zeros(3, 3), torch.full((3, 3), NAN))
    return behaviour + log_r, behaviour, torch.tensor([1.0, -2.0, NAN]), mask


def test_token_proxy_is_the_token_mean_of_ratio_minus_one_times_the_advantage():
    candidate, behaviour, adv, mask = _hand_batch()
    # ((2 - 1) + (0.5 - 1) + 0) x 1 + (1.5 - 1) x (-2) = 0.5 - 1 = -0.5 over 4 tokens
    assert improvement_proxy(candidate, behaviour, adv, mask, "token").item() == pytest.approx(-0.125, abs=1e-15)


def test_sequence_proxy_is_the_row_mean_of_the_sequence_weight_minus_one_times_the_mean_advantage():
    candidate, behaviour, adv, mask = _hand_batch()
    # row 0: w = 2 x 0.5 x 1 = 1 -> 0; row 1: w = 1.5 -> 0.5 x (-2) = -1; the empty row is not counted: -1 / 2
    assert improvement_proxy(candidate, behaviour, adv, mask, "sequence").item() == pytest.approx(-0.5, abs=1e-15)


def test_token_advantages_are_used_per_token():
    candidate, behaviour, _, mask = _hand_batch()
    adv = torch.tensor([[1.0, 2.0, 3.0], [-2.0, NAN, NAN], [NAN, NAN, NAN]])
    # row 0: 1 x 1 + (-0.5) x 2 + 0 x 3 = 0; row 1: 0.5 x (-2) = -1; over 4 tokens
    assert improvement_proxy(candidate, behaviour, adv, mask, "token").item() == pytest.approx(-0.25, abs=1e-15)
    # sequence: row 0 has w - 1 = 0 (its mean advantage 2 does not matter); row 1: -1; over 2 rows
    assert improvement_proxy(candidate, behaviour, adv, mask, "sequence").item() == pytest.approx(-0.5, abs=1e-15)


@pytest.mark.parametrize("level", MIPU_LEVELS)
def test_an_unchanged_policy_gives_exactly_zero(level):
    torch.manual_seed(0)
    logprobs = -torch.rand(4, 6) * 3
    adv = torch.randn(4)
    mask = torch.rand(4, 6) > 0.3
    assert improvement_proxy(logprobs, logprobs.clone(), adv, mask, level).item() == 0.0
    assert improvement_proxy(logprobs, logprobs, adv, torch.zeros(4, 6, dtype=torch.bool), level).item() == 0.0


@pytest.mark.parametrize("level", MIPU_LEVELS)
def test_masked_values_are_never_read(level):
    torch.manual_seed(1)
    candidate, behaviour = -torch.rand(3, 5) * 2, -torch.rand(3, 5) * 2
    adv = torch.randn(3, 5)
    mask = torch.rand(3, 5) > 0.4
    clean = improvement_proxy(candidate, behaviour, adv, mask, level)
    poison = lambda x, v: torch.where(mask, x, torch.full_like(x, v))  # noqa: E731
    dirty = improvement_proxy(poison(candidate, math.inf), poison(behaviour, NAN), poison(adv, NAN), mask, level)
    assert torch.equal(clean, dirty) and torch.isfinite(clean)


@pytest.mark.parametrize("level", MIPU_LEVELS)
def test_matches_a_per_row_loop_in_float64(level):
    torch.manual_seed(2)
    B, T = 5, 7
    candidate, behaviour = -torch.rand(B, T) * 3, -torch.rand(B, T) * 3
    adv = torch.randn(B, T)
    mask = torch.rand(B, T) > 0.35
    mask[3] = False  # a row without tokens
    terms, tokens = [], 0
    for i in range(B):
        idx = [t for t in range(T) if mask[i, t]]
        if level == "token":
            terms += [(math.exp(float(candidate[i, t] - behaviour[i, t])) - 1) * float(adv[i, t]) for t in idx]
            tokens += len(idx)
        elif idx:
            w = math.exp(sum(float(candidate[i, t] - behaviour[i, t]) for t in idx))
            terms.append((w - 1) * sum(float(adv[i, t]) for t in idx) / len(idx))
    expected = sum(terms) / (tokens if level == "token" else len(terms))
    assert improvement_proxy(candidate, behaviour, adv, mask, level).item() == pytest.approx(expected, rel=1e-12)


def test_log_ratios_are_clamped_to_20_nats():
    mask = torch.ones(1, 2, dtype=torch.bool)
    candidate, behaviour = torch.tensor([[100.0, 0.0]]), torch.zeros(1, 2)
    assert improvement_proxy(candidate, behaviour, torch.tensor([1.0]), mask).item() == pytest.approx(
        (math.exp(20) - 1) / 2, rel=1e-12)
    assert improvement_proxy(candidate, behaviour, torch.tensor([1.0]), mask, "sequence").item() == pytest.approx(
        math.exp(20) - 1, rel=1e-12)


def test_accept_rule():
    assert bool(accepts(torch.tensor(0.0)))  # an unchanged engine policy is kept at margin 0
    assert bool(accepts(torch.tensor(1e-3)))
    assert not bool(accepts(torch.tensor(-1e-12)))
    assert not bool(accepts(torch.tensor(0.05), margin=0.1))
    assert bool(accepts(torch.tensor(-0.05), margin=-0.1))
    assert not bool(accepts(torch.tensor(NAN))) and not bool(accepts(torch.tensor(math.inf)))


def test_an_unknown_level_is_refused():
    with pytest.raises(ValueError, match="token, sequence"):
        improvement_proxy(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1, dtype=torch.bool), "seq")
