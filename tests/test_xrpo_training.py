"""XRPO wired into training ([xrpo]; config/xrpo.py, rollouts/allocation.py, training/phases.novelty_sharpening,
docs/math.md sec. 26): the advantage phase's sharpening against values computed by hand; the allocator source on a
scripted engine (the uncertain prompt gets the extra rollouts, one group per prompt of unequal size, the step's total
unchanged, requests no larger than the engine's parallel limit); seeding (a zero-reward prompt's extra samples are
drawn with a solved problem in context and form their own group under that prompt; its chat prompt); the real Trainer
on the tiny model with [xrpo] on end to end; the config's keys, ranges and refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from nearpolicy.batching import collate
from nearpolicy.config.schema import ConfigError, load_config
from nearpolicy.ops.advantages import AdvantageResult, compute_advantages
from nearpolicy.ops.xrpo import novelty_sharpened_advantages, sequence_scores
from nearpolicy.rollouts.allocation import (SEEDED_GROUP_OFFSET, AllocationSettings, Exemplar, RolloutAllocation)
from nearpolicy.rollouts.inline import InlineRollouts
from nearpolicy.tasks import Problem
from nearpolicy.training.phases import apply_data_policy
from nearpolicy.types import Rollout, SamplingParams
from tiny_trainer import step as _step, tiny_trainer


# -- sharpening in the advantage phase ---------------------------------------------------------------------------------
def _rollout(group: int, index: int, logprobs: list[float]) -> Rollout:
    n = len(logprobs)
    return Rollout(group, index, [1, 2], list(range(3, 3 + n)), logprobs, [0] * n, "stop")


def test_the_advantage_phase_sharpens_by_hand():
    """Group 5: scores s = -1, -2, -1.5 (mean -1.5), advantages 0.5, 0.5, -1. Row 0 is more likely than its group
    (eta = e^0.5 > 1): no gain; row 1 less (eta = e^-0.5): gain min(0.5 (1 - e^-0.5), 0.5 x 0.5) = 0.19673...; row 2
    has A < 0: unchanged. Group 9 is a singleton (eta = 1): unchanged."""
    cfg = load_config(None, ["xrpo.allocate=false"])
    rollouts = [_rollout(5, 0, [-1.0, -1.0]), _rollout(5, 1, [-2.0]), _rollout(5, 2, [-1.0, -2.0, -1.5]),
                _rollout(9, 0, [-3.0])]
    batch = collate(rollouts, 0, 64)
    advantages = torch.tensor([0.5, 0.5, -1.0, 0.7])
    keep = torch.ones(4, dtype=torch.bool)
    adv = AdvantageResult(advantages, keep)
    rewards, groups = torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([5, 5, 5, 9])
    _, out, metrics = apply_data_policy(cfg, adv, advantages, rewards, groups, batch)
    gain = 0.5 * (1 - math.exp(-0.5))
    torch.testing.assert_close(out, torch.tensor([0.5, 0.5 + gain, -1.0, 0.7]), rtol=0, atol=1e-6)
    assert metrics["xrpo/sharpened_frac"] == 0.25 and metrics["xrpo/bonus_mean"] == pytest.approx(gain, abs=1e-6)
    _, plain, none = apply_data_policy(load_config(None), adv, advantages, rewards, groups, batch)
    assert torch.equal(plain, advantages) and "xrpo/sharpened_frac" not in none  # no [xrpo]: unchanged
    with pytest.raises(ValueError, match="batch"):
        apply_data_policy(cfg, adv, advantages, rewards, groups)


# -- the allocator source on a scripted engine -------------------------------------------------------------------------
class ScriptedEngine:
    """Samples completion [call, k + 3] of log-probs -0.5 for sample k of each request; records the requests."""

    version = 0

    def __init__(self):
        self.calls: list[list] = []
        self.closed = False

    def generate(self, requests, sampling, seed):
        self.calls.append(list(requests))
        return [Rollout(q.group_id, k, list(q.prompt_ids), [len(self.calls), k + 3], [-0.5, -0.5], [0, 0], "length")
                for q in requests for k in range(q.n)]

    def close(self):
        self.closed = True


class IndexTask:
    """Problem i: question "q<i>" (the tests score it by its index)."""

    def train_problem(self, index: int) -> Problem:
        return Problem(f"q{index}", "a", {"index": index})


def _allocation(script, seeding=False, exploration=0.0, prompts=3, max_parallel=4, max_prompt_tokens=100,
                group_size=4):
    engine = ScriptedEngine()
    inner = InlineRollouts(engine, lambda: None, IndexTask(), lambda p: [100 + p.entry["index"]], SamplingParams(),
                           group_size, prompts, 0)

    def score(rollouts, problems):
        return [float(script[problems[r.group_id].entry["index"]](r.sample_index)) for r in rollouts]

    def seeded_prompt(problem, exemplar):
        return [900, *map(ord, exemplar.question), 901, 100 + problem.entry["index"]]

    settings = AllocationSettings(2, group_size, 0.05, exploration, seeding, max_parallel, max_prompt_tokens)
    source = RolloutAllocation(inner, score, lambda ids: " ".join(map(str, ids)), seeded_prompt, settings)
    source.start(0, 0, None)
    return source, engine


def _sizes(rollouts: list[Rollout]) -> dict[int, int]:
    sizes: dict[int, int] = {}
    for r in rollouts:
        sizes[r.group_id] = sizes.get(r.group_id, 0) + 1
    return sizes


def test_the_uncertain_prompt_gets_the_extra_rollouts_as_one_group():
    """First round of 2: prompt 0 scores 1, 0 (std 0.707), prompts 1 and 2 are constant (std 0, priority 0 without
    the bonus): all 3 x (4 - 2) = 6 extra samples go to prompt 0, in requests of at most max_parallel = 4, and come
    back in prompt 0's group with sample indices 2..7; the step still holds 12 samples."""
    source, engine = _allocation({0: lambda k: k % 2 == 0, 1: lambda k: 1, 2: lambda k: 0})
    got = source.collect(0, 0, 0)
    assert _sizes(got.rollouts) == {0: 8, 1: 2, 2: 2} and len(got.rollouts) == 12
    assert [r.group_id for r in got.rollouts] == [0] * 8 + [1, 1, 2, 2]  # each group contiguous
    assert [r.sample_index for r in got.rollouts if r.group_id == 0] == list(range(8))
    assert [(q.prompt_ids, q.n) for q in engine.calls[1]] == [((100,), 4), ((100,), 2)]
    assert [q.n for q in engine.calls[0]] == [2, 2, 2]
    assert got.problems == {i: IndexTask().train_problem(i) for i in range(3)} and got.next_position == 3
    assert (got.metrics["xrpo/group_size_min"], got.metrics["xrpo/group_size_max"]) == (2, 8)
    assert (got.metrics["xrpo/extra_max"], got.metrics["xrpo/constant_prompts"]) == (6, 2)


def test_the_exploration_bonus_spreads_the_budget_over_constant_prompts():
    """All prompts constant: priorities are the bonus sqrt(ln(1 + 1) / n) alone, equal at n = 2, so the 6 extra go
    round robin (ties to the lowest index): 2 each."""
    source, _ = _allocation({0: lambda k: 1, 1: lambda k: 0, 2: lambda k: 1}, exploration=1.0)
    assert _sizes(source.collect(0, 0, 0).rollouts) == {0: 4, 1: 4, 2: 4}


def test_seeding_draws_a_zero_reward_prompts_extra_samples_with_a_solved_problem_in_context():
    """Prompt 0 scores all 0, prompt 1 all 1 (solved: its first full-reward response, "1 3", is the exemplar). Ties
    share the 4 extra samples 2 / 2; prompt 0's 2 are drawn from the seeded prompt and form their own group, mapped to
    problem 0; prompt 1's stay in its group. The exemplars survive a checkpoint."""
    source, engine = _allocation({0: lambda k: 0, 1: lambda k: 1}, seeding=True, exploration=1.0, prompts=2)
    got = source.collect(0, 0, 0)
    seeded_id = SEEDED_GROUP_OFFSET + 0
    assert _sizes(got.rollouts) == {0: 2, seeded_id: 2, 1: 4}
    seeded = [900, *map(ord, "q1"), 901, 100]
    assert [(q.prompt_ids, q.n) for q in engine.calls[1]] == [(tuple(seeded), 2), ((101,), 2)]
    assert all(r.prompt_ids == seeded for r in got.rollouts if r.group_id == seeded_id)
    assert got.problems[seeded_id] == got.problems[0] and got.next_position == 2
    assert source.exemplars == [Exemplar("q1", "1 3")]
    assert (got.metrics["xrpo/seeded_groups"], got.metrics["xrpo/seeded_samples"]) == (1, 2)
    again, _ = _allocation({}, seeding=True, prompts=2)
    again.start(0, 2, source.state_dict())
    assert again.exemplars == source.exemplars


def test_seeding_needs_an_exemplar_of_another_question_that_fits_and_two_extra_samples():
    """No exemplar yet (both prompts all 0), or only one too long for max_prompt_tokens: the extra samples stay in
    the prompt's own group, counted in xrpo/unseeded_zero_prompts. One extra sample (group_size 3: 2 x 1 extra) is
    not seeded either: a seeded group of one would get advantage 0."""
    source, _ = _allocation({0: lambda k: 0, 1: lambda k: 0}, seeding=True, exploration=1.0, prompts=2)
    got = source.collect(0, 0, 0)
    assert _sizes(got.rollouts) == {0: 4, 1: 4} and got.metrics["xrpo/unseeded_zero_prompts"] == 2
    short, _ = _allocation({0: lambda k: 0, 1: lambda k: 1}, seeding=True, exploration=1.0, prompts=2,
                           max_prompt_tokens=3)
    assert _sizes(short.collect(0, 0, 0).rollouts) == {0: 4, 1: 4}
    single, _ = _allocation({0: lambda k: 0, 1: lambda k: 1}, seeding=True, exploration=1.0, prompts=2, group_size=3)
    got = single.collect(0, 0, 0)
    assert _sizes(got.rollouts) == {0: 3, 1: 3} and single.exemplars and got.metrics["xrpo/seeded_groups"] == 0


def test_the_seeded_chat_prompt_puts_the_exemplar_before_the_question(smollm2_tokenizer):
    from nearpolicy.model.load import chat_prompt_ids
    from nearpolicy.training.xrpo import seeded_messages

    example = [{"role": "user", "content": "1 + 1"}, {"role": "assistant", "content": "Answer: 2"}]
    turns = seeded_messages(example, Exemplar("3 + 4", "Answer: 7"))
    text = smollm2_tokenizer.decode(chat_prompt_ids(smollm2_tokenizer, "Solve.", "5 + 6", turns))
    at = [text.index(s) for s in ("Solve.", "1 + 1", "Answer: 2", "3 + 4", "Answer: 7", "5 + 6")]
    assert at == sorted(at) and text.count("<|im_start|>user") == 3


# -- the real Trainer --------------------------------------------------------------------------------------------------
class ZeroOrParityTask:
    """The run's task whose even training positions always score 0 (all-wrong prompts: seeded) and odd ones score the
    response's length parity (mixed groups: the allocator and the sharpening have something to act on)."""

    def __init__(self, task):
        self.task = task

    def train_problem(self, index: int) -> Problem:
        p = self.task.train_problem(index)
        return Problem(p.question, p.answer, {**p.entry, "xrpo_index": index})

    def score(self, response: str, problem: Problem) -> float:
        index = problem.entry.get("xrpo_index", 1)
        return 0.0 if index % 2 == 0 else float(len(response) % 2 == 0)

    def __getattr__(self, name):
        if name == "task":
            raise AttributeError(name)
        return getattr(self.task, name)


@pytest.mark.slow
def test_a_run_with_xrpo_allocates_seeds_and_sharpens(tiny_model_dir, tmp_path):
    """Three steps of 2 prompts x 4 samples with [xrpo] (first_round 2, seeding): each step's groups reach the
    update with 8 samples in all, their sizes unequal in some step; a seeded group's prompt is the chat prompt with the exemplar's
    question and response before its question; the update's advantages are the GRPO advantages by group id of the
    trainer's rewards, sharpened with the engine's log-probs (computed here)."""
    from nearpolicy.model.load import chat_prompt_ids
    from nearpolicy.training.xrpo import seeded_messages

    sets = ["algorithm.lr=1e-2", "xrpo.first_round=2", "xrpo.seeding=true", "xrpo.exploration=1.0",
            "xrpo.novelty_lambda=1.0", "xrpo.novelty_kappa=1.0"]
    trainer, _ = tiny_trainer(tiny_model_dir, tmp_path, "xrpo", sets, ZeroOrParityTask, lambda engine: engine)
    collected, banks, updates = [], [], []
    collect, update = trainer.rollouts.collect, trainer.update
    trainer.rollouts.collect = lambda *a: collected.append(collect(*a)) or banks.append(
        list(trainer.rollouts.exemplars)) or collected[-1]
    trainer.update = lambda batch, advantages, keep, old, timer: updates.append(advantages.clone()) or update(
        batch, advantages, keep, old, timer)
    try:
        rows = [_step(trainer) for _ in range(3)]
    finally:
        trainer.close()
    cfg, tokenizer = trainer.cfg, trainer.s.tokenizer
    seeded_steps = unequal_steps = 0
    for got, bank, advantages, row in zip(collected, banks, updates, rows):
        sizes = _sizes(got.rollouts)
        assert len(got.rollouts) == 8
        unequal_steps += len(set(sizes.values())) > 1
        assert row["xrpo/group_size_min"] == min(sizes.values()) and row["xrpo/group_size_max"] == max(sizes.values())
        for gid in [g for g in sizes if g >= SEEDED_GROUP_OFFSET]:
            seeded_steps += 1
            problem = got.problems[gid]
            exemplar = next(e for e in bank if e.question != problem.question)  # the newest of another question
            expected = chat_prompt_ids(tokenizer, cfg.task.system_prompt, problem.question,
                                       seeded_messages(cfg.task.example, exemplar))
            assert all(r.prompt_ids == expected for r in got.rollouts if r.group_id == gid)
        rewards = torch.tensor([r.reward for r in got.rollouts], dtype=torch.float32)
        groups = torch.tensor([r.group_id for r in got.rollouts])
        batch = collate(got.rollouts, trainer.s.pad_id, trainer.s.vocab_size)
        plain = compute_advantages("grpo", rewards, groups).advantages
        scores = sequence_scores(batch.rollout_logprobs, batch.mask & batch.has_rollout)
        torch.testing.assert_close(advantages, novelty_sharpened_advantages(plain, scores, groups, 1.0, 1.0),
                                   rtol=0, atol=1e-6)
    assert seeded_steps >= 1 and unequal_steps >= 1 and any(row["xrpo/sharpened_frac"] > 0 for row in rows)
    assert all(math.isfinite(row["actor/loss"]) for row in rows)


@pytest.mark.slow
def test_a_resumed_xrpo_run_continues_bit_for_bit(tiny_model_dir, tmp_path):
    """The exemplars ride in the checkpoint: a run cut after step 2 and resumed takes step 3 as the straight run did
    (same allocation, seeding, weights)."""
    sets = ["algorithm.lr=1e-2", "xrpo.first_round=2", "xrpo.seeding=true", "xrpo.exploration=1.0"]
    straight, _ = tiny_trainer(tiny_model_dir, tmp_path, "straight", sets, ZeroOrParityTask, lambda e: e)
    try:
        rows = [_step(straight) for _ in range(3)]
        weights = {k: v.clone() for k, v in straight.s.model.state_dict().items()}
    finally:
        straight.close()
    cut, _ = tiny_trainer(tiny_model_dir, tmp_path, "cut", sets, ZeroOrParityTask, lambda e: e)
    try:
        _step(cut)
        _step(cut)
        cut.checkpoint()
        kept = list(cut.rollouts.exemplars)
    finally:
        cut.close()
    resumed, _ = tiny_trainer(tiny_model_dir, tmp_path, "cut", sets, ZeroOrParityTask, lambda e: e, resume=True)
    try:
        assert resumed.state.step == 2 and resumed.rollouts.exemplars == kept and kept
        row = _step(resumed)
        assert all(torch.equal(resumed.s.model.state_dict()[k], v) for k, v in weights.items())
    finally:
        resumed.close()
    for key in ("reward/mean", "actor/loss", "xrpo/group_size_max", "xrpo/seeded_samples", "xrpo/sharpened_frac"):
        assert row[key] == rows[2][key], key


# -- config ------------------------------------------------------------------------------------------------------------
def test_xrpo_is_off_by_default_and_on_with_its_table(tmp_path: Path):
    off = load_config(None).xrpo
    assert not off.enabled and not off.sharpening and not off.allocating
    config = tmp_path / "x.toml"
    config.write_text("[xrpo]\n")
    on = load_config(config).xrpo
    assert on.enabled and on.sharpening and on.allocating and not on.seeding
    assert (on.novelty_lambda, on.novelty_kappa, on.alpha, on.exploration) == (0.5, 0.5, 0.05, 0.1)
    assert on.first_round_of(8) == 4 and on.first_round_of(3) == 2
    assert not load_config(None, ["xrpo.enabled=false"]).xrpo.sharpening
    assert load_config(None, ["xrpo.allocate=false"]).xrpo.sharpening


@pytest.mark.parametrize("key, bad", [("novelty_lambda", "-1"), ("novelty_kappa", "-0.5"), ("first_round", "1"),
                                      ("alpha", "1"), ("alpha", "0"), ("alpha", "1e-17"), ("exploration", "-1"),
                                      ("exploration", "0"), ("seeding", "2")])
def test_xrpo_ranges_name_the_key(key, bad):
    with pytest.raises(ConfigError, match=rf"xrpo\.{key}"):
        load_config(None, [f"xrpo.{key}={bad}"])


@pytest.mark.parametrize("sets, named", [
    (["xrpo.first_round=8"], r"xrpo\.first_round = 8 .*algorithm\.group_size \(8\); set xrpo\.first_round lower, "
                             r"algorithm\.group_size >= 9, or xrpo\.allocate = false"),
    (["algorithm.group_size=2", "engine.max_parallel_sequences=2"],
     r"xrpo\.first_round \(unset: 2\) leaves .*\(2\); set algorithm\.group_size >= 3, or"),
    (["xrpo.first_round=true"], r"xrpo\.first_round.*valid integer"),
    (["xrpo.novelty=false", "xrpo.allocate=false"], r"xrpo\.novelty = false and xrpo\.allocate = false"),
    (["xrpo.allocate=false", "xrpo.seeding=true"], r"xrpo\.seeding .*xrpo\.allocate = true"),
    (["rollout.engines=1", "rollout.staleness=1"], r"rollout\.engines"),
    (["episode.enabled=true"], r"episode\.enabled"),
    (["popo.enabled=true", "correction.preset=tis"], r"popo\.enabled"),
    (["lora.enabled=true"], r"lora\.enabled"),
    (["mipu.enabled=true"], r"mipu\.enabled"),
    (["distill.teacher=smollm2"], r"distill\.teacher"),
])
def test_xrpo_refuses_what_it_was_not_built_for_naming_the_keys(sets, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, ["xrpo.enabled=true", *sets])
    if not any(s.startswith("xrpo.") for s in sets):
        load_config(None, sets)  # each is fine without [xrpo]


@pytest.mark.parametrize("sets, named", [
    (["xrpo.enabled=false", "xrpo.first_round=3"], r"xrpo\.first_round has no effect while xrpo\.enabled = false"),
    (["xrpo.novelty=false", "xrpo.novelty_lambda=2"], r"xrpo\.novelty_lambda has no effect while xrpo\.novelty = false"),
    (["xrpo.allocate=false", "xrpo.alpha=0.2"], r"xrpo\.alpha has no effect while xrpo\.allocate = false"),
    (["task.mixture_floor=0.5"], r"task\.mixture_floor has no effect while task\.mixture = 'fixed'")])
def test_settings_that_nothing_reads_are_refused_by_name(sets, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, sets)
