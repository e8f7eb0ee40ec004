"""MC-GRPO advantages and its pivot keep-mask (float64, loop reference + hand-computed cases)."""

import math

import pytest
import torch

from nearpolicy.ops.advantages import (ADVANTAGES, GROUP_RELATIVE, compute_advantages, mc_grpo_advantages,
                                      mc_grpo_pivot)
from nearpolicy.ops.losses import PolicyLossInput, policy_loss, PolicyLossParams

torch.set_default_dtype(torch.float64)  # for module-level constants; tests: conftest._default_dtype
DEFAULT_DTYPE = torch.float64
MC = ["mc_grpo", "mc_grpo_mad", "mc_grpo_released"]


def _lower_median(xs):
    return sorted(xs)[(len(xs) - 1) // 2]


def _loop_reference(rewards, groups, scale, rescale):
    """Plain-Python MC-GRPO: (advantages, keep)."""
    r, g = rewards.tolist(), groups.tolist()
    adv, keep = [0.0] * len(r), [True] * len(r)
    for gid in set(g):
        members = [i for i in range(len(r)) if g[i] == gid and math.isfinite(r[i])]
        if len(members) < 2:
            continue
        ranked = sorted(members, key=lambda i: (r[i], i))
        pivot = ranked[(len(ranked) - 1) // 2]
        med = r[pivot]
        keep[pivot] = False
        s = _lower_median([abs(r[i] - med) for i in members]) if scale == "mad" else 1.0
        a = {i: (r[i] - med) / (s if s > 1e-6 else 1.0) for i in members}
        if rescale:
            nonzero = [i for i in members if abs(a[i]) > 1e-6]
            for i in nonzero:
                a[i] *= len(members) / len(nonzero)
        for i in members:
            adv[i] = 0.0 if i == pivot else a[i]
    return torch.tensor(adv), torch.tensor(keep)


def test_hand_computed_three_samples():
    rewards, groups = torch.tensor([3.0, 1.0, 2.0]), torch.tensor([0, 0, 0])
    out = mc_grpo_advantages(rewards, groups)
    assert torch.equal(out.advantages, torch.tensor([1.0, -1.0, 0.0]))
    assert torch.equal(out.keep, torch.tensor([True, True, False]))
    mad = mc_grpo_advantages(rewards, groups, "mad").advantages  # |dev| = [1, 1, 0] -> MAD 1
    assert torch.allclose(mad, torch.tensor([1.0, -1.0, 0.0]), rtol=1e-15, atol=0)
    released = mc_grpo_advantages(rewards, groups, "mad", rescale_nonzero=True).advantages
    assert torch.allclose(released, torch.tensor([1.5, -1.5, 0.0]), rtol=1e-15, atol=0)
    halved = mc_grpo_advantages(rewards / 4, groups, "mad").advantages  # MAD 0.25: scale-free, as the std
    assert torch.allclose(halved, torch.tensor([1.0, -1.0, 0.0]), rtol=1e-15, atol=0)


@pytest.mark.parametrize("rewards,expected,released", [
    ([1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [4.0, 0.0, 0.0, 0.0]),  # released code: 1000, 4000
    ([0.0] + [0.95] * 7, [-0.95] + [0.0] * 7, [-7.6] + [0.0] * 7),  # released code: -950, -7600
])
def test_zero_mad_is_not_divided_by(rewards, expected, released):
    """The MAD of binary rewards is 0 whenever more than half the group agrees: below the 1e-6 floor the centred
    reward is kept (as grpo keeps it when the std is 0), never divided by MAD + 1e-3 (NeMo-RL #1518's +-1e6)."""
    rewards, groups = torch.tensor(rewards), torch.zeros(len(rewards), dtype=torch.long)
    mad = compute_advantages("mc_grpo_mad", rewards, groups).advantages
    assert torch.allclose(mad, torch.tensor(expected), rtol=1e-12, atol=1e-12)
    out = compute_advantages("mc_grpo_released", rewards, groups).advantages  # x n / #nonzero: bounded by n
    assert torch.allclose(out, torch.tensor(released), rtol=1e-12, atol=1e-12)


def test_binary_rewards_with_ties_pick_one_pivot():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0])  # lower median 1; stable order puts index 0 at position 2
    median, keep = mc_grpo_pivot(rewards, torch.zeros(5, dtype=torch.long))
    assert torch.equal(median, torch.ones(5))
    assert torch.equal(keep, torch.tensor([False, True, True, True, True]))
    assert torch.equal(mc_grpo_advantages(rewards, torch.zeros(5, dtype=torch.long)).advantages,
                       torch.tensor([0.0, 0.0, -1.0, 0.0, -1.0]))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("scale,rescale", [("none", False), ("mad", False), ("mad", True)])
def test_matches_loop_reference_on_random_uneven_groups(seed, scale, rescale):
    g = torch.Generator().manual_seed(seed)
    groups = torch.randint(0, 5, (23,), generator=g) * 7  # uneven sizes, non-contiguous ids
    rewards = torch.randint(0, 4, (23,), generator=g).double() + (0.5 * torch.rand(23, generator=g) if seed % 2 else 0)
    rewards[torch.rand(23, generator=g) < 0.15] = float("nan")
    out = mc_grpo_advantages(rewards, groups, scale, rescale)
    adv, keep = _loop_reference(rewards, groups, scale, rescale)
    assert torch.allclose(out.advantages, adv, rtol=1e-13, atol=0)
    assert torch.equal(out.keep, keep)


def test_permuting_the_batch_permutes_the_result():
    g = torch.Generator().manual_seed(11)
    groups = torch.randint(0, 4, (17,), generator=g)
    rewards = torch.rand(17, generator=g)  # no ties, so the pivot is unique
    perm = torch.randperm(17, generator=g)
    a, b = mc_grpo_advantages(rewards, groups, "mad"), mc_grpo_advantages(rewards[perm], groups[perm], "mad")
    assert torch.equal(b.advantages, a.advantages[perm]) and torch.equal(b.keep, a.keep[perm])


@pytest.mark.parametrize("name", MC)
def test_degenerate_groups_give_finite_zeros_and_keep_singletons(name):
    rewards = torch.tensor([2.0, 2.0, 2.0, 7.0, float("nan"), 1.0, float("nan")])
    groups = torch.tensor([0, 0, 0, 1, 2, 2, 3])  # constant, singleton, one scorable member, all unscorable
    out = compute_advantages(name, rewards, groups)
    assert torch.equal(out.advantages, torch.zeros(7))
    assert torch.equal(out.keep, torch.tensor([True, False, True, True, True, True, True]))  # middle of the tie
    empty = compute_advantages(name, torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert empty.advantages.numel() == 0 and empty.keep.numel() == 0


def test_compute_advantages_keeps_every_sample_for_other_estimators():
    rewards, groups = torch.tensor([1.0, 0.0, 3.0]), torch.tensor([0, 0, 0])
    for name in ADVANTAGES.names():
        out = compute_advantages(name, rewards, groups)
        assert out.keep.all() == (name not in MC)
        if name in MC:  # the registered estimator's own keep-mask is the pivot (computed once, with the advantages)
            assert torch.equal(out.keep, mc_grpo_pivot(rewards, groups)[1])
    with pytest.raises(KeyError, match="mc_grpo_mad"):
        compute_advantages("median", rewards, groups)


def test_pivot_excluded_from_loss_and_denominator():
    """Masking the pivot's tokens: the loss equals the loss of the batch without the pivot row."""
    rewards, groups = torch.tensor([3.0, 1.0, 2.0, 0.0]), torch.tensor([0, 0, 0, 0])
    out = compute_advantages("mc_grpo", rewards, groups)  # lower median 1 -> pivot index 1
    g = torch.Generator().manual_seed(0)
    lp, old = -torch.rand(4, 5, generator=g), -torch.rand(4, 5, generator=g)
    mask = torch.ones(4, 5, dtype=torch.bool)
    eff = mask & out.keep[:, None]
    loss, _ = policy_loss("ppo_clip", PolicyLossInput(lp, old, out.advantages, eff, eff.sum()), PolicyLossParams())
    rows = out.keep
    ref, _ = policy_loss("ppo_clip", PolicyLossInput(lp[rows], old[rows], out.advantages[rows], mask[rows], mask[rows].sum()),
                         PolicyLossParams())
    assert not out.keep[1] and loss.item() == ref.item()


def test_std_below_the_floor_is_not_divided_by():
    """Invariant 6: a group whose std is positive but below 1e-6 keeps its centred rewards (+-5e-9 here) instead
    of being blown up to +-0.71 by the division; the other group is normalised as usual."""
    rewards = torch.tensor([1.0, 1.0 + 1e-8, 0.0, 1.0], dtype=torch.float64)
    adv = compute_advantages("grpo", rewards, torch.tensor([0, 0, 1, 1])).advantages
    assert torch.allclose(adv[:2], torch.tensor([-5e-9, 5e-9], dtype=torch.float64), rtol=1e-6, atol=0)
    assert torch.allclose(adv[2:], torch.tensor([-1.0, 1.0], dtype=torch.float64) / math.sqrt(2), rtol=1e-12, atol=0)


def test_group_relative_names_exactly_the_estimators_that_give_a_singleton_group_zero():
    """ops/advantages.GROUP_RELATIVE (what config refuses with algorithm.group_size = 1) is held to the registry: a
    batch of singleton groups gets advantage 0 everywhere from exactly these, the reward itself from the others."""
    rewards, groups = torch.tensor([0.25, 1.0, 0.0, 0.5]), torch.tensor([0, 1, 2, 3])
    for name in ADVANTAGES.names():
        out = compute_advantages(name, rewards, groups).advantages
        if name in GROUP_RELATIVE:
            assert torch.equal(out, torch.zeros(4)), name
        else:
            assert torch.equal(out, rewards), name
    assert GROUP_RELATIVE <= set(ADVANTAGES.names())
