"""algorithm.data_policy (ops/data_policies.py, docs/math.md sec. 23): which groups of a step train and with what weight,
by hand on 3 groups of 4 (rewards [1,1,1,1], [1,0,0,0], [1,1,0,0]) down to the token-mean loss; the weight as a
per-sample multiplier of every registered loss; the adaptive mixture rule; the composite (fixed-mixture) task; one
real Trainer step with the policy set."""

from __future__ import annotations

import math

import pytest
import torch

from nearpolicy.config.schema import load_config
from nearpolicy.ops.advantages import compute_advantages
from nearpolicy.ops.data_policies import (DATA_POLICIES, DataPolicyParams, adaptive_mixture_probs, data_policy_metrics,
                                          group_reward_variance, mixture_accuracy_ema)
from nearpolicy.ops.losses import POLICY_LOSSES, PolicyLossInput, PolicyLossParams, policy_loss
from nearpolicy.ops.masked import aggregation_denominator
from nearpolicy.training.phases import apply_data_policy

REWARDS = torch.tensor([1.0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0])
GROUPS = torch.tensor([0] * 4 + [1] * 4 + [2] * 4)
LENGTHS = [1, 1, 1, 1, 2, 1, 1, 1, 3, 1, 1, 1]  # response tokens of each sample: 4, 5 and 6 per group
SQRT3 = math.sqrt(3)
# population variances: p (1 - p) = 0, 1/4 x 3/4 = 3/16, 1/2 x 1/2 = 1/4; mean over the two kept groups 7/32, so
# reward_variance weighs group 1 by (3/16) / (7/32) = 6/7 and group 2 by (1/4) / (7/32) = 8/7
BY_HAND = {  # policy, k -> (per-group keep, per-group weight)
    ("uniform", 4): ([True, True, True], [1.0, 1.0, 1.0]),
    ("drop_zero_variance", 4): ([False, True, True], [0.0, 1.0, 1.0]),
    ("reward_variance", 4): ([False, True, True], [0.0, 6 / 7, 8 / 7]),
    ("top_variance_k", 1): ([False, False, True], [0.0, 0.0, 1.0]),
    ("top_variance_k", 2): ([False, True, True], [0.0, 1.0, 1.0]),
    ("top_variance_k", 5): ([False, True, True], [0.0, 1.0, 1.0]),  # never a constant group: = drop_zero_variance
}
# GRPO advantages (unbiased std): group 0: 0; group 1: mean 1/4, std 1/2 -> (1.5, -0.5, -0.5, -0.5); group 2: mean 1/2,
# std 1/sqrt(3) -> +-sqrt(3)/2. With logprobs -1 the reinforce loss of a token is -A lp = A, so a group's numerator is
# sum_i A_i n_i: 0; 1.5 x 2 - 0.5 x 3 = 1.5; sqrt(3)/2 x (3 + 1 - 1 - 1) = sqrt(3). Denominators: kept tokens.
TOKEN_MEAN = {
    ("uniform", 4): (1.5 + SQRT3) / 15,
    ("drop_zero_variance", 4): (1.5 + SQRT3) / 11,
    ("reward_variance", 4): (6 / 7 * 1.5 + 8 / 7 * SQRT3) / 11,
    ("top_variance_k", 1): SQRT3 / 6,
    ("top_variance_k", 2): (1.5 + SQRT3) / 11,
    ("top_variance_k", 5): (1.5 + SQRT3) / 11,
}


def _cfg(policy: str, k: int = 4):  # 8 prompts a step: a top-k of 5 is a selection there (the table has 3 groups)
    return load_config(None, [f"algorithm.data_policy={policy}", f"algorithm.data_policy_top_k={k}",
                              "algorithm.prompts_per_step=8"])


def _token_mean_loss(policy: str, k: int) -> float:
    """The step's token-mean reinforce loss after the data policy, logprobs -1 at every response token."""
    adv = compute_advantages("grpo", REWARDS, GROUPS)
    adv, advantages, _ = apply_data_policy(_cfg(policy, k), adv, adv.advantages.float(), REWARDS, GROUPS)
    mask = torch.arange(3)[None, :] < torch.tensor(LENGTHS)[:, None]
    loss_mask = mask & adv.keep[:, None]  # what update.policy_update does with the keep-mask
    lp = -torch.ones(mask.shape)
    tokens = aggregation_denominator(loss_mask, "token-mean")
    loss, _ = policy_loss("reinforce", PolicyLossInput(lp, lp, advantages, loss_mask, tokens), PolicyLossParams())
    return float(loss)


def test_group_reward_variance_is_the_population_variance_of_the_scorable_rewards():
    inverse, var = group_reward_variance(REWARDS, GROUPS)
    assert inverse.tolist() == GROUPS.tolist()
    assert var.tolist() == pytest.approx([0.0, 3 / 16, 1 / 4], abs=1e-15)
    # NaN is left out; one scorable member is constant
    _, var = group_reward_variance(torch.tensor([1.0, float("nan"), 0.0, 0.5, float("nan")]), torch.tensor([0, 0, 0, 1, 1]))
    assert var.tolist() == pytest.approx([0.25, 0.0], abs=1e-15)


@pytest.mark.parametrize(("policy", "k"), list(BY_HAND))
def test_each_policy_keeps_and_weighs_the_groups_by_hand(policy, k):
    result = DATA_POLICIES.get(policy)(REWARDS, GROUPS, DataPolicyParams(k))
    keep, weight = BY_HAND[policy, k]
    assert result.keep.tolist() == [keep[g] for g in GROUPS.tolist()]
    assert result.weights.tolist() == pytest.approx([weight[g] for g in GROUPS.tolist()], rel=1e-12)
    metrics = data_policy_metrics(result, GROUPS)
    assert float(metrics["kept_groups"]) == sum(keep)
    assert float(metrics["weight_mean"]) == pytest.approx(sum(weight) / 3, rel=1e-12)  # over all 12 samples
    assert float(metrics["weight_max"]) == pytest.approx(max(weight), rel=1e-12)


@pytest.mark.parametrize(("policy", "k"), list(TOKEN_MEAN))
def test_the_token_mean_loss_after_the_policy_is_the_hand_value(policy, k):
    assert _token_mean_loss(policy, k) == pytest.approx(TOKEN_MEAN[policy, k], rel=1e-6)


def test_dropping_constant_groups_changes_the_denominator_only():
    # a constant group adds 0 to the numerator but its 4 tokens to uniform's denominator: drop_zero_variance's loss is
    # uniform's x 15 / 11 (fails if the keep is not ANDed into the loss mask); reward_variance differs from it only by
    # its weights (fails if they are not applied)
    uniform, dropped = _token_mean_loss("uniform", 4), _token_mean_loss("drop_zero_variance", 4)
    assert dropped == pytest.approx(uniform * 15 / 11, rel=1e-6) and abs(dropped - uniform) > 0.05
    assert abs(_token_mean_loss("reward_variance", 4) - dropped) > 1e-3


def test_uniform_changes_nothing_and_a_dropped_sample_gets_advantage_zero_by_selection():
    adv = compute_advantages("grpo", REWARDS, GROUPS)
    advantages = adv.advantages.float().clone()
    advantages[0] = float("nan")  # a NaN advantage: kept as is by uniform, never multiplied by a 0 weight
    out, scaled, metrics = apply_data_policy(_cfg("uniform"), adv, advantages, REWARDS, GROUPS)
    torch.testing.assert_close(scaled, advantages, rtol=0, atol=0, equal_nan=True)
    assert out.keep.tolist() == adv.keep.tolist()
    assert metrics == {"data/kept_groups": 3.0, "data/weight_mean": 1.0, "data/weight_max": 1.0}
    _, scaled, _ = apply_data_policy(_cfg("drop_zero_variance"), adv, advantages, REWARDS, GROUPS)
    assert scaled[:4].tolist() == [0.0] * 4
    # token advantages [N, T] (distillation, turn credit): each row times its sample's weight
    tokens = torch.arange(36, dtype=torch.float32).reshape(12, 3)
    _, scaled, _ = apply_data_policy(_cfg("reward_variance"), adv, tokens, REWARDS, GROUPS)
    weight = torch.tensor([0.0] * 4 + [6 / 7] * 4 + [8 / 7] * 4)
    torch.testing.assert_close(scaled, tokens * weight[:, None])


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
@pytest.mark.parametrize("token_advantages", [False, True])
def test_scaling_the_advantage_is_a_per_sample_multiplier_of_every_registered_loss(name, token_advantages):
    # the trainer applies a data weight w_i >= 0 to the advantage; for each loss that equals multiplying the sample's
    # per-token policy-gradient loss by w_i (the `weights` path of the mismatch correction), clip decisions included
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(6, 5, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    prox = lp.detach() + 0.3 * torch.randn(6, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(6, 5, generator=g, dtype=torch.float64) if token_advantages else torch.randn(6, generator=g,
                                                                                                   dtype=torch.float64)
    mask = torch.rand(6, 5, generator=g) > 0.2
    w = torch.tensor([0.0, 0.5, 1.0, 6 / 7, 8 / 7, 2.5], dtype=torch.float64)
    scaled_adv = adv * (w[:, None] if token_advantages else w)
    fn, params = POLICY_LOSSES.get(name), PolicyLossParams()
    by_advantage = fn(PolicyLossInput(lp, prox, scaled_adv, mask, mask.sum()), params)
    by_weight = fn(PolicyLossInput(lp, prox, adv, mask, mask.sum(), weights=w[:, None].expand(6, 5)), params)
    torch.testing.assert_close(by_advantage.loss, by_weight.loss, rtol=1e-12, atol=1e-12)
    live = mask & (w[:, None] > 0)
    assert torch.equal(by_advantage.clipped & live, by_weight.clipped & live)
    grad_a = torch.autograd.grad(by_advantage.loss.sum(), lp, retain_graph=True)[0]
    grad_w = torch.autograd.grad(by_weight.loss.sum(), lp)[0]
    torch.testing.assert_close(grad_a, grad_w, rtol=1e-12, atol=1e-12)


def test_top_variance_k_breaks_ties_to_the_lower_group_id():
    rewards = torch.tensor([1.0, 0, 1, 0, 0, 1, 1, 1])  # groups 7, 3, 5 have variance 1/4, group 9 is constant
    groups = torch.tensor([7, 7, 3, 3, 5, 5, 9, 9])
    result = DATA_POLICIES.get("top_variance_k")(rewards, groups, DataPolicyParams(2))
    assert result.keep.tolist() == [False, False, True, True, True, True, False, False]


def test_reward_variance_with_no_signal_keeps_nothing():
    result = DATA_POLICIES.get("reward_variance")(torch.ones(8), GROUPS[:8], DataPolicyParams())
    assert not result.keep.any() and result.weights.tolist() == [0.0] * 8
    metrics = data_policy_metrics(result, GROUPS[:8])
    assert [float(metrics[k]) for k in ("kept_groups", "weight_mean", "weight_max")] == [0.0, 0.0, 0.0]


def test_the_adaptive_mixture_after_given_rewards():
    # three sub-tasks, fixed weights 1 : 1 : 2, accuracy prior 0.5 each. One step: sub-task 0 scores [1, 1, 1, 1] (mean
    # 1), sub-task 1 [1, 0, 0, 0] (mean 1/4, a NaN left out), sub-task 2 nothing: p = 0.9 x 0.5 + 0.1 x (1, 0.25) and
    # 0.5 kept -> (0.55, 0.475, 0.5)
    accuracy = torch.full((3,), 0.5, dtype=torch.float64)
    rewards = torch.tensor([1.0, 1, 1, 1, 1, 0, 0, 0, float("nan")])
    tasks = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1])
    p = mixture_accuracy_ema(accuracy, rewards, tasks, decay=0.9)
    assert p.tolist() == pytest.approx([0.55, 0.475, 0.5], abs=1e-15)
    # wbar = (1/4, 1/4, 1/2); wbar p (1 - p) = (0.061875, 0.06234375, 0.125), sum 0.24921875; pi = 0.1 wbar + 0.9 q
    interest = [0.061875, 0.06234375, 0.125]
    want = [0.1 * b + 0.9 * i / sum(interest) for b, i in zip([0.25, 0.25, 0.5], interest)]
    probs = adaptive_mixture_probs(p, torch.tensor([1.0, 1.0, 2.0]), floor=0.1)
    assert probs.tolist() == pytest.approx(want, abs=1e-15) and float(probs.sum()) == pytest.approx(1.0, abs=1e-15)
    # a solved and an unsolved sub-task keep only the floor; intermediate accuracy takes the rest
    probs = adaptive_mixture_probs(torch.tensor([1.0, 0.5, 0.0]), torch.ones(3), floor=0.1)
    assert probs.tolist() == pytest.approx([0.1 / 3, 0.1 / 3 + 0.9, 0.1 / 3], abs=1e-15)
    # no sub-task of intermediate accuracy, or every accuracy at the prior: the fixed mixture
    assert adaptive_mixture_probs(torch.tensor([1.0, 0.0]), torch.tensor([3.0, 1.0])).tolist() == [0.75, 0.25]
    assert adaptive_mixture_probs(torch.full((2,), 0.5), torch.tensor([3.0, 1.0])).tolist() == pytest.approx([0.75, 0.25])
    with pytest.raises(ValueError, match="weights must be > 0"):
        adaptive_mixture_probs(p, torch.tensor([1.0, 0.0, 1.0]))


def test_the_composite_task_is_a_fixed_mixture_scored_by_each_datasets_checker():
    from nearpolicy.tasks.factory import make_task

    one_digit = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    options = {"datasets": [{"name": "chain_sum", "weight": 3, "config": one_digit},
                            {"name": "basic_arithmetic", "weight": 1}]}
    task = make_task("reasoning_gym", name="composite", options=options, train_size=40, eval_size=4, seed=0)
    sources = [task.train_problem(i).entry["metadata"]["source_dataset"] for i in range(task.train_size)]
    assert set(sources) == {"chain_sum", "basic_arithmetic"} and sources.count("chain_sum") > sources.count(
        "basic_arithmetic")
    problem = task.train_problem(0)
    assert task.score(f"Answer: {problem.answer}", problem) == 1.0
    with pytest.raises(ValueError, match="task.options.datasets"):
        make_task("reasoning_gym", name="composite", options={"datasets": [{"name": "chain_sum"}]}, train_size=4,
                  eval_size=2)


def test_the_default_is_uniform_and_an_unknown_policy_names_the_key():
    assert load_config(None).algorithm.data_policy == "uniform"
    with pytest.raises(Exception, match="algorithm.data_policy.*did you mean 'reward_variance'"):
        load_config(None, ["algorithm.data_policy=reward_varianc"])


def test_a_trainer_step_applies_the_policy_and_logs_it(tiny_model_dir, tmp_path, monkeypatch):
    """The real Trainer on the tiny model, reward_variance, 4 prompts x 4 samples whose rewards are set by (group,
    sample) to [1,1,1,1], [1,0,0,0], [1,1,0,0], [0,0,0,0]: groups 1 and 2 train with weights 6/7 and 8/7, the logged
    data/* and the advantages the update got are the hand values."""
    from nearpolicy.training.trainer import Trainer
    from test_trainer_families import _run, record_advantages

    pattern = [[1.0, 1, 1, 1], [1.0, 0, 0, 0], [1.0, 1, 0, 0], [0.0, 0, 0, 0]]

    def score(self, rollouts, problems):
        for r in rollouts:
            r.reward = pattern[r.group_id % 4][r.sample_index]
        return {"reward/unscorable": 0.0, "reward/timeouts": 0.0}

    monkeypatch.setattr(Trainer, "score", score)
    seen = record_advantages(monkeypatch)
    rows, _ = _run(tiny_model_dir, tmp_path, "data-policy", "algorithm.data_policy=reward_variance",
                   "algorithm.prompts_per_step=4", "algorithm.micro_batch_size=16", steps=1)
    metrics, (samples, adv, advantages) = rows[0], seen[0]
    assert metrics["data/kept_groups"] == 2.0
    assert metrics["data/weight_mean"] == pytest.approx((6 / 7 + 8 / 7) * 4 / 16, rel=1e-12)
    assert metrics["data/weight_max"] == pytest.approx(8 / 7, rel=1e-12)
    assert metrics["advantage/nonzero_frac"] == 1.0  # every kept sample has a signal
    weight = [0.0, 6 / 7, 8 / 7, 0.0]
    grpo = [[0.0] * 4, [1.5, -0.5, -0.5, -0.5], [SQRT3 / 2, SQRT3 / 2, -SQRT3 / 2, -SQRT3 / 2], [0.0] * 4]
    for k, (g, i, _, reward) in enumerate(samples):
        assert reward == pattern[g % 4][i]
        assert bool(adv.keep[k]) == (g % 4 in (1, 2))
        assert float(advantages[k]) == pytest.approx(grpo[g % 4][i] * weight[g % 4], rel=1e-6, abs=1e-7)
    assert sorted({g % 4 for g, *_ in samples}) == [0, 1, 2, 3]


def test_a_top_k_that_keeps_every_group_of_a_step_is_refused_by_name() -> None:
    from nearpolicy.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"data_policy_top_k \(4\) keeps every group of a step of prompts_per_step = 4"):
        load_config(None, ["algorithm.data_policy='top_variance_k'"])
    assert load_config(None, ["algorithm.data_policy='top_variance_k'", "algorithm.data_policy_top_k=3"])
    assert load_config(None, ["algorithm.data_policy_top_k=9"])  # another policy: the key is unused
