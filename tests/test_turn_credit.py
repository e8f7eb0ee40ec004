"""Turn-level credit (ops/turn_credit.py: outcome, trace, rtpo), ECHO's observation loss (ops/observation_loss.py)
and TRACE's model side (model/turn_values.py), against hand-computed values, ADVANTAGES["grpo"] and a direct per-row
computation on the tiny llama of conftest.py."""

from __future__ import annotations

import math

import pytest
import torch

from nearpolicy.batching import collate
from nearpolicy.ops.advantages import ADVANTAGES
from nearpolicy.ops.observation_loss import observation_loss, raw_logprobs
from nearpolicy.ops.turn_credit import (TURN_CREDIT, TurnCreditParams, compute_turn_credit, episode_turns,
                                        td_turn_rewards)
from nearpolicy.types import Rollout

NAN = float("nan")
TOL = 1e-6

# Four episodes of one group: turns [2, 3, 1, 4]; model tokens carry their turn, observation tokens (mask False)
# carry arbitrary turn numbers, padding -1.
REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.0])
GROUPS = torch.tensor([0, 0, 0, 0])
TURNS = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 0, 1, 1, 2, 2], [0, 0, -1, -1, -1, -1], [0, 1, 1, 2, 3, -1]])
MODEL = torch.tensor([[1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 0, 1, 1, 0]]).bool()
VALUES = torch.tensor([[0.0, 0.5, NAN, NAN], [0.0, -0.2, 0.1, NAN], [0.0, NAN, NAN, NAN], [0.0, 0.3, 0.2, 0.9]])


def _credit(name, rewards=REWARDS, groups=GROUPS, turns=TURNS, model=MODEL, values=VALUES, **params):
    return compute_turn_credit(name, rewards, groups, turns, model, values, TurnCreditParams(**params))


def _ragged(seed: int, n: int = 12, t: int = 10):
    """Random episodes: rewards in {0, 1, NaN}, 3 groups, 0-4 turns each, model / observation tokens interleaved."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    rewards[torch.rand(n, generator=g) < 0.15] = NAN
    groups = torch.randint(0, 3, (n,), generator=g) * 7 - 3  # non-contiguous, negative ids
    turns = torch.full((n, t), -1)
    model = torch.zeros((n, t), dtype=torch.bool)
    for i in range(n):
        length = int(torch.randint(0, t + 1, (1,), generator=g))
        turn = 0
        for pos in range(length):
            model[i, pos] = bool(torch.rand(1, generator=g) < 0.7)
            turns[i, pos] = turn
            if not model[i, pos] and pos and model[i, pos - 1]:
                turn += 1
    values = torch.randn((n, t + 1), generator=g, dtype=torch.float64).float()
    return rewards, groups, turns, model, values


# -- outcome -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_outcome_is_grpo_broadcast_to_model_tokens_exactly(seed):
    rewards, groups, turns, model, values = _ragged(seed)
    grpo = ADVANTAGES.get("grpo")(rewards, groups).advantages
    result = compute_turn_credit("outcome", rewards, groups, turns, model, values)
    assert result.advantages.dtype == torch.float32 and result.keep.all()
    assert torch.equal(result.advantages, torch.where(model, grpo[:, None].expand_as(model), torch.tensor(0.0)))


# -- trace ---------------------------------------------------------------------------------------------------


def test_trace_hand_computed():
    rewards, groups = torch.tensor([1.0, 0.0]), torch.tensor([5, 5])
    turns = torch.tensor([[0, 0, 1, -1, -1], [0, 1, 1, 2, 2]])
    model = torch.tensor([[1, 0, 1, 0, 0], [1, 0, 1, 0, 1]]).bool()
    values = torch.tensor([[0.0, 0.5, NAN], [0.0, -0.5, 0.5]])
    # A_out = +-sqrt(1/2); TD rewards 0.5 | -0.5, 1.0: mean 1/3, unbiased std sqrt(7/12)
    out, s = math.sqrt(0.5), math.sqrt(7 / 12)
    turn = [(0.5 - 1 / 3) / s, (-0.5 - 1 / 3) / s, (1.0 - 1 / 3) / s]
    expected = torch.tensor([[out + 0.5 * turn[0], 0, out, 0, 0],
                             [-out + 0.5 * turn[1], 0, -out + 0.5 * turn[2], 0, -out]])
    result = compute_turn_credit("trace", rewards, groups, turns, model, values, TurnCreditParams(trace_weight=0.5))
    torch.testing.assert_close(result.advantages, expected.float(), atol=TOL, rtol=0)
    assert float(result.metrics["turn_credit/td_reward_mean"]) == pytest.approx(1 / 3, abs=1e-12)
    assert int(result.metrics["turn_credit/td_turns"]) == 3


def test_trace_four_episodes_of_different_turn_counts():
    # TD rewards: 0.5 | -0.2, 0.3 | none | 0.3, -0.1, 0.7 (turn 3 of episode 3 has no boundary after it)
    td = torch.tensor([0.5, -0.2, 0.3, 0.3, -0.1, 0.7], dtype=torch.float64)
    z = (td - td.mean()) / td.std()
    out = math.sqrt(3) / 2  # GRPO of [1, 0, 1, 0]
    expected = torch.tensor([[out + z[0], 0, 0, out, out, 0],
                             [-out + z[1], 0, -out + z[2], 0, -out, -out],
                             [out, out, 0, 0, 0, 0],
                             [-out + z[3], -out + z[4], 0, -out + z[5], -out, 0]])
    torch.testing.assert_close(_credit("trace").advantages, expected.float(), atol=TOL, rtol=0)


def test_td_turn_rewards_telescope():
    g = torch.Generator().manual_seed(3)
    values = torch.randn((6, 5), generator=g, dtype=torch.float64)
    n_turns = torch.tensor([4, 4, 2, 1, 3, 4])
    td = td_turn_rewards(values, n_turns)
    for i, n in enumerate(n_turns.tolist()):
        last = min(n, values.shape[1] - 1)
        assert float(td[i][torch.isfinite(td[i])].sum()) == pytest.approx(float(values[i, last] - values[i, 0]),
                                                                           abs=1e-12)
        assert torch.isnan(td[i, n:]).all()


def test_trace_weight_zero_and_one_turn_episodes_give_outcome():
    torch.testing.assert_close(_credit("trace", trace_weight=0.0).advantages, _credit("outcome").advantages,
                               atol=0, rtol=0)
    one_turn = torch.where(MODEL, torch.zeros_like(TURNS), TURNS)
    assert torch.equal(_credit("trace", turns=one_turn, values=VALUES[:, :1]).advantages,
                       _credit("outcome", turns=one_turn).advantages)


def test_trace_needs_values():
    with pytest.raises(ValueError, match="trace.*needs values"):
        _credit("trace", values=None)


# -- rtpo ----------------------------------------------------------------------------------------------------


def test_rtpo_hand_computed():
    # turns from the end j = 0: all four, GRPO of [1, 0, 1, 0] = +-sqrt(3)/2; j = 1: episodes 0, 1, 3 with
    # R = 1, 0, 0: mean 1/3, std sqrt(1/3); j = 2: episodes 1, 3, R = 0, 0: constant -> 0; j = 3: episode 3 alone.
    out, hi, lo = math.sqrt(3) / 2, (2 / 3) / math.sqrt(1 / 3), (-1 / 3) / math.sqrt(1 / 3)
    expected = torch.tensor([[hi, 0, 0, out, out, 0],
                             [0, 0, lo, 0, -out, -out],
                             [out, out, 0, 0, 0, 0],
                             [0, 0, 0, lo, -out, 0]])
    result = _credit("rtpo")
    torch.testing.assert_close(result.advantages, expected.float(), atol=TOL, rtol=0)
    assert float(result.metrics["turn_credit/unpaired_turn_frac"]) == pytest.approx(1 / 10, abs=1e-12)


def test_rtpo_one_turn_episodes_give_outcome():
    rewards, groups, turns, model, _ = _ragged(5)
    one_turn = torch.where(model, torch.zeros_like(turns), turns)
    assert torch.equal(compute_turn_credit("rtpo", rewards, groups, one_turn, model).advantages,
                       compute_turn_credit("outcome", rewards, groups, one_turn, model).advantages)


# -- invariants shared by every estimator ----------------------------------------------------------------------


@pytest.mark.parametrize("name", TURN_CREDIT.names())
def test_singleton_and_constant_groups_give_zero(name):
    singleton = _credit(name, groups=torch.tensor([0, 1, 2, 3]))
    assert torch.equal(singleton.advantages, torch.zeros_like(singleton.advantages))
    constant_values = torch.tensor([[0.0, 0.25, NAN, NAN], [0.0, 0.25, 0.5, NAN], [0.0, NAN, NAN, NAN],
                                    [0.0, 0.25, 0.5, 0.75]])  # every TD reward exactly 0.25
    constant = _credit(name, rewards=torch.ones(4), values=constant_values)
    assert torch.equal(constant.advantages, torch.zeros_like(constant.advantages))


def test_trace_credits_turns_of_a_group_whose_outcome_is_constant():
    """A constant outcome gives A_out = 0, but the TD rewards still differ: that is TRACE's dense signal."""
    result = _credit("trace", rewards=torch.zeros(4))
    assert float(result.advantages.abs().max()) > 0.5
    assert torch.equal(result.advantages[2], torch.zeros(6))  # the one-turn episode has no TD reward


@pytest.mark.parametrize("name", TURN_CREDIT.names())
@pytest.mark.parametrize("seed", range(3))
def test_unscorable_episodes_get_zero_and_are_left_out(name, seed):
    rewards, groups, turns, model, values = _ragged(seed)
    rewards[0] = NAN
    full = compute_turn_credit(name, rewards, groups, turns, model, values)
    assert torch.equal(full.advantages[0], torch.zeros(turns.shape[1]))
    rest = compute_turn_credit(name, rewards[1:], groups[1:], turns[1:], model[1:], values[1:])
    torch.testing.assert_close(full.advantages[1:], rest.advantages, atol=TOL, rtol=0)
    assert torch.isfinite(full.advantages).all()


@pytest.mark.parametrize("name", TURN_CREDIT.names())
def test_masks_respected_and_junk_off_the_model_tokens_ignored(name):
    rewards, groups, turns, model, values = _ragged(7)
    result = compute_turn_credit(name, rewards, groups, turns, model, values)
    assert torch.equal(result.advantages[~model], torch.zeros(int((~model).sum())))
    assert float(result.advantages.abs().max()) > 0.1  # not trivially zero
    junk_turns = torch.where(model, turns, torch.randint(-1, 50, turns.shape))
    n_turns = episode_turns(turns, model)
    junk_values = torch.where(torch.arange(values.shape[1]) > n_turns[:, None], torch.tensor(float("inf")), values)
    again = compute_turn_credit(name, rewards, groups, junk_turns, model, junk_values)
    assert torch.equal(again.advantages, result.advantages)


@pytest.mark.parametrize("name", TURN_CREDIT.names())
def test_row_order_and_group_numbering_do_not_matter(name):
    rewards, groups, turns, model, values = _ragged(2)
    perm = torch.randperm(len(rewards), generator=torch.Generator().manual_seed(1))
    base = compute_turn_credit(name, rewards, groups, turns, model, values)
    moved = compute_turn_credit(name, rewards[perm], groups[perm] * 3 + 100, turns[perm], model[perm], values[perm])
    torch.testing.assert_close(moved.advantages, base.advantages[perm], atol=TOL, rtol=0)


def test_bad_inputs_are_named():
    with pytest.raises(KeyError, match="unknown turn-credit estimator 'trac'.*did you mean 'trace'"):
        _credit("trac")
    with pytest.raises(ValueError, match="turn_index < 0"):
        _credit("outcome", turns=torch.where(MODEL, -1, TURNS))
    with pytest.raises(ValueError, match="model_mask must be a bool"):
        _credit("outcome", model=MODEL.long())
    with pytest.raises(ValueError, match="group_ids"):
        _credit("outcome", groups=torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="values"):
        _credit("trace", values=VALUES[:3])
    with pytest.raises(ValueError, match="trace_weight"):
        TurnCreditParams(trace_weight=-1.0)


def test_registry_lists_three_estimators_with_sources():
    assert TURN_CREDIT.names() == ["outcome", "rtpo", "trace"]
    assert all(entry.summary and entry.source for entry in TURN_CREDIT)
    assert "reconstructed" in {e.name: e.source for e in TURN_CREDIT}["rtpo"]


# -- ECHO observation loss -------------------------------------------------------------------------------------


def test_observation_loss_value_and_gradient_only_on_observation_tokens():
    logprobs = torch.tensor([[-1.0, -2.0, NAN], [-3.0, -4.0, -5.0]], requires_grad=True)
    mask = torch.tensor([[False, True, False], [True, False, True]])
    loss = observation_loss(logprobs, mask)
    assert float(loss.detach()) == pytest.approx(10 / 3, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.where(mask, -1 / 3, 0.0), atol=1e-7, rtol=0)


def test_observation_loss_without_observations_is_zero_with_a_zero_gradient():
    logprobs = torch.tensor([[-1.0, NAN]], requires_grad=True)
    loss = observation_loss(logprobs, torch.zeros((1, 2), dtype=torch.bool))
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.equal(logprobs.grad, torch.zeros((1, 2)))


def test_observation_loss_micro_batches_sum_to_the_full_batch():
    g = torch.Generator().manual_seed(0)
    logprobs, mask = -torch.rand((6, 5), generator=g), torch.rand((6, 5), generator=g) < 0.4
    full = observation_loss(logprobs, mask)
    parts = sum(observation_loss(logprobs[i:i + 2], mask[i:i + 2], mask.sum()) for i in range(0, 6, 2))
    assert float(parts) == pytest.approx(float(full), abs=1e-6)
    with pytest.raises(ValueError, match="one shape"):
        observation_loss(logprobs, mask[:, :3])


def test_raw_logprobs_gradient_reaches_only_observation_positions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn((2, 4, 7), generator=g, requires_grad=True)
    ids = torch.randint(0, 7, (2, 4), generator=g)
    mask = torch.tensor([[False, True, True, False], [False, False, False, True]])
    observation_loss(raw_logprobs(logits, ids), mask).backward()
    expected = (torch.softmax(logits.detach(), -1) - torch.nn.functional.one_hot(ids, 7)) / 3
    torch.testing.assert_close(logits.grad, torch.where(mask[..., None], expected, 0.0), atol=1e-6, rtol=0)


# -- the model side: sequence_logprobs_with_raw, turn_values ---------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from nearpolicy.model.load import load_policy

    torch.set_num_threads(1)
    return load_policy(str(tiny_model_dir))[0].eval()


def test_sequence_logprobs_with_raw_matches_the_raw_softmax(model):
    from nearpolicy.model.policy import sequence_logprobs, sequence_logprobs_with_raw
    from nearpolicy.types import SamplingParams

    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 49152, (5,), generator=g).tolist()
    rows = [Rollout(0, k, prompt, torch.randint(3, 49152, (n,), generator=g).tolist(), [None] * n, [0] * n, "stop")
            for k, n in enumerate([4, 6])]
    batch = collate(rows, 2, 49152)
    sampling = SamplingParams(0.7, 0.9, 20, 8)
    with torch.no_grad():
        logprobs, _, raw = sequence_logprobs_with_raw(model, batch, sampling)
        expected_lp = sequence_logprobs(model, batch, sampling)[0]
        for i, r in enumerate(rows):
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            n = len(r.completion_ids)
            direct = logp[len(prompt) - 1 + torch.arange(n), torch.tensor(r.completion_ids)]
            torch.testing.assert_close(raw[i, :n], direct, atol=1e-5, rtol=0)
    torch.testing.assert_close(logprobs, expected_lp, atol=0, rtol=0)
    assert float((raw - logprobs)[batch.mask].abs().max()) > 1e-3  # the transform matters here


def _episodes():
    """Two groups of episodes: random prompt / model ids; observation runs at given completion slices."""
    g = torch.Generator().manual_seed(11)
    specs = [(0, 9, [(3, 5), (7, 9)]), (0, 6, [(2, 4)]), (0, 4, []), (1, 8, [(1, 3), (5, 6)])]
    prompts = {0: torch.randint(3, 49152, (6,), generator=g).tolist(), 1: torch.randint(3, 49152, (4,), generator=g).tolist()}
    rows, obs = [], torch.zeros((4, 9), dtype=torch.bool)
    for i, (group, n, runs) in enumerate(specs):
        rows.append(Rollout(group, i, prompts[group], torch.randint(3, 49152, (n,), generator=g).tolist(),
                            [None] * n, [0] * n, "stop"))
        for a, b in runs:
            obs[i, a:b] = True
    gold = {0: [1023, 88, 415], 1: [77, 9001]}
    return rows, obs, [gold[r.group_id] for r in rows]


def test_boundary_ends():
    from nearpolicy.model.turn_values import boundary_ends

    mask = torch.tensor([False, True, True, False, True, False, True, True])
    assert boundary_ends(mask, 8) == [0, 3, 5, 8]
    assert boundary_ends(mask, 7) == [0, 3, 5, 7]
    assert boundary_ends(mask, 0) == [0]


def test_gold_logprobs_equal_a_direct_per_row_computation(model):
    from nearpolicy.model.turn_values import boundary_ends, gold_logprobs, turn_values

    rows, obs, gold = _episodes()
    batch = collate(rows, 2, 49152)
    got = gold_logprobs(model, batch, obs, gold, micro=3)
    assert got.shape == (4, 3)
    with torch.no_grad():
        for i, r in enumerate(rows):
            ends = boundary_ends(obs[i], len(r.completion_ids))
            for k, end in enumerate(ends):
                prefix = r.prompt_ids + r.completion_ids[:end]
                logp = torch.log_softmax(model(input_ids=torch.tensor([prefix + gold[i]])).logits[0].float(), -1)
                direct = sum(float(logp[len(prefix) - 1 + j, tok]) for j, tok in enumerate(gold[i]))
                assert float(got[i, k]) == pytest.approx(direct, abs=1e-5), (i, k)
            assert torch.isnan(got[i, len(ends):]).all()
    torch.testing.assert_close(gold_logprobs(model, batch, obs, gold, micro=1), got, atol=1e-5, rtol=0,
                               equal_nan=True)
    values = turn_values(model, batch, obs, gold, micro=8)
    assert torch.equal(values[:, 0], torch.zeros(4))
    # micro=8 batches the rows differently from `got`'s pass: float32 reduction order only, so 1e-5 as above
    torch.testing.assert_close(values, got - got[:, :1], atol=1e-5, rtol=0, equal_nan=True)
    mask = batch.mask & ~obs
    turns = torch.tensor([[sum(1 for e in boundary_ends(obs[i], t)[1:]) for t in range(9)] for i in range(4)])
    credit = compute_turn_credit("trace", torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([r.group_id for r in rows]),
                                 torch.where(batch.mask, turns, -1), mask, values)
    assert torch.isfinite(credit.advantages).all() and int(credit.metrics["turn_credit/td_turns"]) == 3


def test_gold_answer_ids_follow_the_answer_format(smollm2_tokenizer):
    from nearpolicy.model.turn_values import gold_answer_ids

    ids = gold_answer_ids(smollm2_tokenizer, "42")
    assert smollm2_tokenizer.decode(ids) == "Answer: 42" and smollm2_tokenizer.bos_token_id not in ids
    assert smollm2_tokenizer.decode(gold_answer_ids(smollm2_tokenizer, "7", "<answer>{answer}</answer>")) == \
        "<answer>7</answer>"
    with pytest.raises(ValueError, match="placeholder"):
        gold_answer_ids(smollm2_tokenizer, "42", "Answer:")


# -- config ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, needle", [
    (["algorithm.turn_credit=trac"], r"unknown name 'trac' \(did you mean 'trace'\?\); valid: outcome, rtpo, trace"),
    (["episode.enabled=true", "algorithm.turn_credit=trace", "algorithm.advantage=rloo"], r"set algorithm.advantage = 'grpo'"),
    (["episode.enabled=true", "algorithm.turn_credit=rtpo", "distill.teacher=smollm2"], r"distillation \(distill.teacher\)"),
    (["algorithm.turn_credit=rtpo"], r"multi-turn episodes: set episode.enabled = true"),
    (["algorithm.observation_loss_coef=0.1"], r"multi-turn episodes: set episode.enabled = true"),
    (["algorithm.trace_answer_format=Answer:"], r"trace_answer_format.*no \{answer\} placeholder"),
    (["algorithm.trace_answer_format='Answer: {{answer}}'"], r"trace_answer_format.*no \{answer\} placeholder"),
    (["algorithm.trace_answer_format='{answer} {unit}'"], r"not a format string with only an \{answer\} field"),
    (["algorithm.observation_loss_coef=-0.1"], r"'algorithm.observation_loss_coef': Input should be greater"),
    (["algorithm.trace_weight=-1"], r"'algorithm.trace_weight': Input should be greater"),
])
def test_config_keys_are_validated(overrides, needle):
    from nearpolicy.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)


def test_config_keys_reach_the_estimator_params():
    from nearpolicy.config.schema import load_config

    a = load_config(None, ["episode.enabled=true", "algorithm.turn_credit=trace", "algorithm.trace_weight=0.25",
                           "algorithm.observation_loss_coef=0.1"]).algorithm
    assert (a.turn_credit, a.observation_loss_coef) == ("trace", 0.1)
    assert TurnCreditParams(trace_weight=a.trace_weight) == TurnCreditParams(0.25)


def test_turn_credit_advantages_is_the_one_call_the_trainer_makes(model, smollm2_tokenizer):
    from nearpolicy.config.schema import load_config
    from nearpolicy.training.phases import turn_credit_advantages
    from nearpolicy.model.turn_values import boundary_ends, gold_answer_ids, turn_values

    rows, obs, _ = _episodes()
    batch = collate(rows, 2, 49152)
    turns = torch.tensor([[len(boundary_ends(obs[i], t)) - 1 for t in range(9)] for i in range(4)])
    turns = torch.where(batch.mask, turns, -1)
    rewards, groups = torch.tensor([1.0, 0.0, NAN, 1.0]), torch.tensor([r.group_id for r in rows])
    answers = ["12", "12", "12", "7"]
    cfg = load_config(None, ["episode.enabled=true", "algorithm.turn_credit=trace", "algorithm.trace_weight=0.5"])
    adv, keep, metrics = turn_credit_advantages(cfg, model, smollm2_tokenizer, batch, obs, turns, rewards, groups,
                                                answers)
    gold = [gold_answer_ids(smollm2_tokenizer, a, "Answer: {answer}") for a in answers]
    values = turn_values(model, batch, obs, gold)
    direct = compute_turn_credit("trace", rewards, groups, turns, batch.mask & ~obs, values, TurnCreditParams(0.5))
    torch.testing.assert_close(adv, direct.advantages, atol=1e-6, rtol=0)
    assert keep.tolist() == [True, True, False, True] and metrics["turn_credit/td_turns"] == 3.0  # 2 + 1 in group 0
    assert float(adv[0].abs().max()) > 0 and torch.equal(adv[obs], torch.zeros(int(obs.sum())))
    outcome, _, _ = turn_credit_advantages(load_config(None), None, smollm2_tokenizer, batch, obs, turns, rewards,
                                           groups, answers)
    grpo = ADVANTAGES.get("grpo")(rewards, groups).advantages
    assert torch.equal(outcome, torch.where(batch.mask & ~obs, grpo[:, None].expand(4, 9), torch.tensor(0.0)))
    with pytest.raises(ValueError, match="needs the frozen reference model"):
        turn_credit_advantages(cfg, None, smollm2_tokenizer, batch, obs, turns, rewards, groups, answers)
