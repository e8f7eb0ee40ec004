"""Unequal group sizes within a step (XRPO's allocator, issue 43): every registered advantage estimator and every
loss aggregation against values computed by hand / by a plain-Python loop, on a batch whose groups have 2, 5 and 3
members, interleaved (group ids not contiguous, not sorted)."""

import math

import pytest
import torch

from nearpolicy.ops.advantages import ADVANTAGES, compute_advantages
from nearpolicy.ops.losses import PolicyLossInput, PolicyLossParams, policy_loss
from nearpolicy.ops.masked import AGGREGATIONS, aggregate, aggregation_denominator
from nearpolicy.ops.turn_credit import TURN_CREDIT

# group 7 has 2 members (rows 0, 5), group 3 has 5 (rows 1, 2, 4, 7, 8), group 9 has 3 (rows 3, 6, 9)
GROUPS = torch.tensor([7, 3, 3, 9, 3, 7, 9, 3, 3, 9])
REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.2, 0.5, 0.0, 0.8, 1.0, 0.0, 0.8], dtype=torch.float64)
S2 = 1 / math.sqrt(2)  # group 7: mean 0.5, unbiased std sqrt(0.5)
S9 = 0.2 / math.sqrt(0.12)  # group 9: mean 0.6, unbiased std sqrt(0.24 / 2)

# Hand-computed per estimator (derivations in the comments; row order as REWARDS). keep = None: all kept.
HAND = {
    # (R - mean) / std: group 3 has mean 0.5, std sqrt(1.0 / 4) = 0.5
    "grpo": ([S2, -1.0, 1.0, -2 * S9, 0.0, -S2, S9, 1.0, -1.0, S9], None),
    "dr_grpo": ([0.5, -0.5, 0.5, -0.4, 0.0, -0.5, 0.2, 0.5, -0.5, 0.2], None),
    # n / (n - 1) (R - mean): factors 2, 5/4, 3/2
    "rloo": ([1.0, -0.625, 0.625, -0.6, 0.0, -1.0, 0.3, 0.625, -0.625, 0.3], None),
    "reinforce": (REWARDS.tolist(), None),
    # pivots (lower median by (reward, row)): row 5 (med 0), row 4 (med 0.5), row 6 (med 0.8)
    "mc_grpo": ([1.0, -0.5, 0.5, -0.6, 0.0, 0.0, 0.0, 0.5, -0.5, 0.0], [5, 4, 6]),
    # MADs: group 7 lower median of (1, 0) = 0 (not divided), group 3 0.5, group 9 lower median of (.6, 0, 0) = 0
    "mc_grpo_mad": ([1.0, -1.0, 1.0, -0.6, 0.0, 0.0, 0.0, 1.0, -1.0, 0.0], [5, 4, 6]),
    # nonzero advantages x n / #nonzero: 2 / 1, 5 / 4, 3 / 1
    "mc_grpo_released": ([2.0, -1.25, 1.25, -1.8, 0.0, 0.0, 0.0, 1.25, -1.25, 0.0], [5, 4, 6]),
}


def test_every_registered_estimator_has_a_hand_computed_case():
    assert set(HAND) == set(ADVANTAGES.names())


@pytest.mark.parametrize("name", sorted(HAND))
def test_estimator_with_groups_of_2_5_3(name):
    expected, pivots = HAND[name]
    out = compute_advantages(name, REWARDS, GROUPS)
    torch.testing.assert_close(out.advantages, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    keep = torch.ones(10, dtype=torch.bool)
    if pivots:
        keep[pivots] = False
    assert torch.equal(out.keep, keep)


@pytest.mark.parametrize("name", TURN_CREDIT.names())
def test_turn_credit_one_turn_episodes_with_groups_of_2_5_3(name):
    """Every turn-credit estimator gives a one-turn episode the outcome GRPO advantage: HAND["grpo"] at its model
    tokens (turn 0), 0 at padding, with the unequal groups above."""
    turn_index = torch.tensor([[0, 0, -1]] * 10)
    model_mask = turn_index >= 0
    values = torch.zeros(10, 2, dtype=torch.float64)
    out = TURN_CREDIT.get(name)(REWARDS, GROUPS, turn_index, model_mask, values)
    expected = torch.tensor(HAND["grpo"][0], dtype=torch.float32)[:, None] * model_mask
    torch.testing.assert_close(out.advantages, expected, rtol=0, atol=1e-6)


def _loop_grpo_family(name, r, g):
    """Plain-Python grpo / dr_grpo / rloo over scorable members of each group (NaN -> 0, left out)."""
    adv = [0.0] * len(r)
    for gid in set(g):
        members = [i for i in range(len(r)) if g[i] == gid and math.isfinite(r[i])]
        n = len(members)
        if n < 2:
            continue
        mean = sum(r[i] for i in members) / n
        std = math.sqrt(sum((r[i] - mean) ** 2 for i in members) / (n - 1))
        for i in members:
            if name == "grpo":
                adv[i] = (r[i] - mean) / std if std > 1e-6 else r[i] - mean
            elif name == "dr_grpo":
                adv[i] = r[i] - mean
            else:  # rloo: R minus the mean of the others
                adv[i] = r[i] - sum(r[j] for j in members if j != i) / (n - 1)
    return adv


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_unequal_groups_match_loop(name, seed):
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 5, 3, 8]  # a singleton group too (advantage 0)
    groups = torch.cat([torch.full((s,), 10 * k + seed) for k, s in enumerate(sizes)])
    groups = groups[torch.randperm(groups.numel(), generator=gen)]
    rewards = torch.rand(groups.numel(), generator=gen, dtype=torch.float64)
    rewards[3] = float("nan")
    expected = _loop_grpo_family(name, rewards.tolist(), groups.tolist())
    out = compute_advantages(name, rewards, groups)
    torch.testing.assert_close(out.advantages, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)


# -- aggregation: rows of groups of 2, 5, 3, each of its own length ----------------------------------------
LENGTHS = [3, 1, 6, 2, 4, 5, 0, 2, 6, 1]  # row 6 is empty (no valid token)
T = 6


def _layout():
    mask = torch.tensor([[t < n for t in range(T)] for n in LENGTHS])
    loss = torch.arange(1, 1 + 10 * T, dtype=torch.float64).reshape(10, T) / 7.0
    return loss, mask


def _loop_aggregate(loss, mode, constant=None):
    rows = [[loss[i][t] for t in range(n)] for i, n in enumerate(LENGTHS)]
    nonempty = [row for row in rows if row]
    if mode == "token-mean":
        return sum(sum(row) for row in rows) / sum(LENGTHS)
    if mode == "seq-mean-token-mean":
        return sum(sum(row) / len(row) for row in nonempty) / len(nonempty)
    if mode == "seq-mean-token-sum":
        return sum(sum(row) for row in nonempty) / len(nonempty)
    return sum(sum(row) for row in nonempty) / (len(nonempty) * constant)  # seq-mean-token-sum-norm


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregation_with_unequal_groups_and_split_by_group(mode):
    loss, mask = _layout()
    constant = 6.0 if mode == "seq-mean-token-sum-norm" else None
    denom = aggregation_denominator(mask, mode, constant)
    expected = _loop_aggregate(loss.tolist(), mode, constant)
    assert float(aggregate(loss, mask, mode, denom)) == pytest.approx(expected, rel=1e-12)
    # micro-batches of one group each (sizes 2, 5, 3) against the global denominator sum to the same value
    parts = [[0, 5], [1, 2, 4, 7, 8], [3, 6, 9]]
    total = sum(float(aggregate(loss[p], mask[p], mode, denom)) for p in parts)
    assert total == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_policy_loss_with_unequal_group_advantages(mode):
    """ppo_clip at ratio 1 has per-token loss -A: the aggregated loss is the hand value of -A under `mode`."""
    _, mask = _layout()
    adv = compute_advantages("rloo", REWARDS, GROUPS).advantages
    lp = torch.zeros(10, T, dtype=torch.float64, requires_grad=True)
    constant = 6.0 if mode == "seq-mean-token-sum-norm" else None
    denom = aggregation_denominator(mask, mode, constant)
    inp = PolicyLossInput(lp, lp.detach(), adv, mask, mask.sum())
    loss, _ = policy_loss("ppo_clip", inp, PolicyLossParams(dual_clip=None), mode, denom)
    per_token = [[-a] * T for a in adv.tolist()]
    assert float(loss.detach()) == pytest.approx(_loop_aggregate(per_token, mode, constant), rel=1e-12)
