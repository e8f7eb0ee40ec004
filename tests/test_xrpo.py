"""XRPO's pure math (ops/xrpo.py; docs/math.md sec. 26): novelty-aware advantage sharpening and the rollout
allocator, against values computed by hand and Student-t quantiles from a printed table."""

import math

import pytest
import torch

from nearpolicy.cli import _registries, main
from nearpolicy.ops.xrpo import (ADVANTAGE_TRANSFORMS, ROLLOUT_ALLOCATORS, allocate_rollouts, allocation_priority,
                                 half_width, novelty_sharpened_advantages, prompt_reward_stats, sequence_scores,
                                 t_quantile)

# t_{0.975, df} and t_{0.95, df} from a printed Student-t table (3 decimals)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        15: 2.131, 30: 2.042}
T95 = {1: 6.314, 4: 2.132, 10: 1.812}


def test_sequence_scores_mean_over_valid_tokens():
    lp = torch.tensor([[-1.0, -2.0, -3.0, -9.0], [-0.5, -9.0, -9.0, -9.0], [-9.0, -9.0, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    s = sequence_scores(lp, mask)
    torch.testing.assert_close(s[:2], torch.tensor([-2.0, -0.5], dtype=torch.float64))
    assert math.isnan(float(s[2]))


def test_sharpening_by_hand_with_groups_of_3_and_3():
    # group 0: rows 0, 1, 5 (row 5's score unavailable: left out of the mean, not sharpened); group 5: rows 2, 3, 4
    groups = torch.tensor([0, 0, 5, 5, 5, 0])
    scores = torch.tensor([-1.0, -0.2, -0.5, -2.0, -0.1, float("nan")], dtype=torch.float64)
    adv = torch.tensor([0.7, -0.7, 0.5, 1.2, -1.0, 0.3], dtype=torch.float64)
    out = novelty_sharpened_advantages(adv, scores, groups, novelty_lambda=1.0, kappa=0.5)
    mean5 = (-0.5 - 2.0 - 0.1) / 3
    expected = [
        0.7 + min(1 - math.exp(-1.0 - (-0.6)), 0.5 * 0.7),  # rarer than its group (mean -0.6): gain 1 - e^-0.4
        -0.7,  # negative advantage: unchanged
        0.5,  # more likely than its group's mean: 1 - eta < 0, no gain
        1.2 + 0.5 * 1.2,  # 1 - exp(-2 - mean5) = 0.678 > kappa A = 0.6: the cap binds
        -1.0,
        0.3,  # no score
    ]
    assert 1 - math.exp(-2.0 - mean5) > 0.6  # the case above really exercises the cap
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_sharpening_is_group_relative_and_zero_lambda_is_identity():
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    scores = torch.tensor([-3.0, -3.0, -1.0, -5.0], dtype=torch.float64)
    # each member alone in its group: eta = 1, no gain whatever its absolute likelihood
    out = novelty_sharpened_advantages(adv, scores, torch.tensor([0, 1, 2, 3]), 1.0, 10.0)
    torch.testing.assert_close(out, adv, rtol=0, atol=0)
    out = novelty_sharpened_advantages(adv, scores, torch.tensor([0, 0, 1, 1]), 0.0, 10.0)
    torch.testing.assert_close(out, adv, rtol=0, atol=0)
    # group 1 (scores -1, -5, mean -3): only the rarer row 3 gains 1 - e^-2
    out = novelty_sharpened_advantages(adv, scores, torch.tensor([0, 0, 1, 1]), 1.0, 10.0)
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0, 1.0, 2.0 - math.exp(-2.0)], dtype=torch.float64))


@pytest.mark.parametrize("df", sorted(T975))
def test_t_quantile_matches_table(df):
    assert t_quantile(0.975, df) == pytest.approx(T975[df], abs=6e-4)
    if df in T95:
        assert t_quantile(0.95, df) == pytest.approx(T95[df], abs=6e-4)


def test_half_width_and_priority_by_hand():
    s0, s2 = math.sqrt(1 / 3), math.sqrt(2 / 7)  # 2 of 4 and 4 of 8 correct: unbiased std of 0/1 rewards
    assert half_width(s0, 4, 0.05) == pytest.approx(T975[3] * s0 / 2, abs=1e-3)
    pri = allocation_priority(torch.tensor([s0, 0.0, s2]), torch.tensor([4, 4, 8]), step=9, alpha=0.05,
                              explore_lambda=0.1)
    bonus = [0.1 * math.sqrt(math.log(10) / k) for k in (4, 4, 8)]
    expected = [s0 * (T975[3] / 2 - T975[4] / math.sqrt(5)) + bonus[0], bonus[1],
                s2 * (T975[7] / math.sqrt(8) - T975[8] / 3) + bonus[2]]
    torch.testing.assert_close(pri, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=2e-3)


def _greedy_reference(std, n, budget):
    """Plain-Python greedy on table quantiles, no exploration bonus."""
    n = list(n)
    gain = lambda s, k: s * (T975[k - 1] / math.sqrt(k) - T975[k] / math.sqrt(k + 1))  # noqa: E731
    for _ in range(budget):
        pri = [gain(s, k) for s, k in zip(std, n)]
        n[pri.index(max(pri))] += 1
    return n


def test_greedy_allocation_by_hand():
    std, n = [math.sqrt(1 / 3), 0.0, math.sqrt(2 / 7)], [4, 4, 8]
    # prompt 0's gains 0.202, 0.111, 0.072, 0.051, 0.039 all beat prompt 2's 0.036; its sixth (0.031) does not
    out = allocate_rollouts(torch.tensor(std), torch.tensor(n), budget=6, step=0)
    assert out.tolist() == [5, 0, 1]
    assert (out + torch.tensor(n)).tolist() == _greedy_reference(std, n, 6)
    # a constant group has no uncertainty to reduce: only the exploration bonus gives it rollouts
    out = allocate_rollouts(torch.tensor([0.0, 0.0]), torch.tensor([2, 4]), budget=3, step=5, explore_lambda=1.0)
    # bonus sqrt(ln 6 / n): 0.946 (n = 2) > 0.669 (n = 4); then 0.773 (n = 3) > 0.669; then a tie at n = 4: lowest index
    assert out.tolist() == [3, 0]


def test_prompt_reward_stats_with_unequal_groups():
    rewards = torch.tensor([1.0, 0.0, 1.0, float("nan"), 0.0, 1.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([4, 2, 2, 2, 4, 2, 9])
    ids, std, count = prompt_reward_stats(rewards, groups)
    assert ids.tolist() == [2, 4, 9] and count.tolist() == [3, 2, 1]
    torch.testing.assert_close(std, torch.tensor([math.sqrt(1 / 3), math.sqrt(1 / 2), 0.0], dtype=torch.float64))


def test_refusals():
    with pytest.raises(ValueError):
        half_width(0.5, 1, 0.05)
    with pytest.raises(ValueError):
        allocate_rollouts(torch.tensor([0.5]), torch.tensor([4]), budget=-1, step=0)
    with pytest.raises(ValueError):
        novelty_sharpened_advantages(torch.ones(2), torch.zeros(2), torch.zeros(2, dtype=torch.long), -1.0, 1.0)


def test_registered_and_listed(capsys):
    assert ADVANTAGE_TRANSFORMS.names() == ["xrpo_novelty"] and ROLLOUT_ALLOCATORS.names() == ["xrpo"]
    assert ADVANTAGE_TRANSFORMS in _registries() and ROLLOUT_ALLOCATORS in _registries()
    assert main(["list", "xrpo_novelty"]) == 0
    assert "2510.06672" in capsys.readouterr().out
