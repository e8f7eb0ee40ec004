"""POPO's prioritized group replay (ops/popo.py, rollouts/replay.py; docs/math.md sec. 25): the math against values
computed by hand; the replay source on a scripted inner source (which groups are replaced, by which stored group, with
their own ids, versions and engine log-probs; the buffer's capacity, age limit and checkpoint round trip); the real
Trainer on the tiny model, where a replayed group's tokens are stale and weighted by pi_old / mu computed here
independently, and a resumed run continues bit for bit; the config's refusals name the keys."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from nearpolicy.config.schema import ConfigError, load_config
from nearpolicy.engines.fake import OffsetEngine
from nearpolicy.ops.popo import group_spread, replay_priority, replayed_token_stats, top_priority
from nearpolicy.rollouts.base import StepSamples
from nearpolicy.rollouts.replay import GroupReplay, ReplaySettings
from nearpolicy.tasks import Problem
from nearpolicy.types import Rollout
from tiny_trainer import step as _step, tiny_trainer

S1, S2 = math.sqrt(3) / 4, 0.5  # population std of {1, 0, 0, 0} and of {1, 1, 0, 0} / {0, 1}


# -- the math ---------------------------------------------------------------------------------------------------------
def test_group_spread_by_hand():
    nan = float("nan")
    rewards = torch.tensor([1, 0, 0, 0, 1, 1, 1, 1, 0, nan, 1, nan, nan, nan, 1, nan], dtype=torch.float32)
    ids = torch.tensor([7] * 4 + [3] * 4 + [9] * 4 + [5] * 4)
    got = group_spread(rewards, ids)
    assert got.ids.tolist() == [3, 5, 7, 9]
    assert got.effective.tolist() == [False, False, True, True]  # constant; one scorable; {1,0,0,0}; {0, 1}
    torch.testing.assert_close(got.spread, torch.tensor([0.0, 0.0, S1, S2], dtype=torch.float64), rtol=0, atol=1e-12)


def test_priority_and_selection_by_hand():
    spread = torch.tensor([0.5, S1, 0.5, 0.2], dtype=torch.float64)
    age = torch.tensor([1, 0, 3, 2])
    p = replay_priority(spread, age, 0.5)
    torch.testing.assert_close(p, torch.tensor([0.25, S1, 0.0625, 0.05], dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(replay_priority(spread, age, 1.0), spread, rtol=0, atol=0)
    with pytest.raises(ValueError, match="decay"):
        replay_priority(spread, age, 0.0)
    eligible = torch.tensor([True, True, True, False])
    assert top_priority(p, eligible, 2).tolist() == [1, 0]
    assert top_priority(p, eligible, 10).tolist() == [1, 0, 2]  # the ineligible last one never
    assert top_priority(torch.tensor([0.3, 0.1, 0.3]), torch.ones(3, dtype=torch.bool), 1).tolist() == [0]  # tie
    assert top_priority(p, eligible, 0).tolist() == []


def test_replayed_token_stats_by_hand():
    versions = torch.tensor([[2, 2, -1], [0, 0, 0], [1, 1, -1]])
    old = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.5, -0.5], [-2.0, -1.0, 0.0]])
    rollout = torch.tensor([[-1.0, -2.0, 0.0], [-1.2, -1.0, -0.5], [-1.0, -1.0, 0.0]])
    defined = torch.tensor([[True, True, False], [True, True, False], [True, True, False]])
    got = replayed_token_stats(old, rollout, defined, versions, 2)
    assert float(got["tokens"]) == 5  # row 1's 3 and row 2's 2
    assert float(got["age_mean"]) == pytest.approx((2 * 3 + 1 * 2) / 5, abs=1e-12)
    # defined stale tokens: 0.2, -0.5 (row 1), -1.0, 0.0 (row 2)
    assert float(got["log_weight_mean"]) == pytest.approx((0.2 - 0.5 - 1.0 + 0.0) / 4, abs=1e-6)
    assert float(got["log_weight_abs_mean"]) == pytest.approx((0.2 + 0.5 + 1.0) / 4, abs=1e-6)
    fresh = replayed_token_stats(old, rollout, defined, torch.where(versions >= 0, 2, -1), 2)
    assert float(fresh["tokens"]) == 0 and math.isnan(float(fresh["age_mean"]))


# -- the replay source on a scripted inner source ---------------------------------------------------------------------
class Scripted:
    """A synchronous source whose step k hands back `script[k]`: per group, the rewards its members will score
    (encoded as each completion's first id). Log-probs are distinct per (group, sample, position), versions the
    collect's version."""

    def __init__(self, script: list[list[list[int]]]):
        self.script, self.published, self.closed = script, [], False

    def start(self, version, data_position, state):
        self.started = (version, data_position, state)

    def collect(self, step, version, data_position):
        rollouts, problems = [], {}
        for i, rewards in enumerate(self.script[step]):
            gid = data_position + i
            problems[gid] = problem(gid)
            for j, reward in enumerate(rewards):
                n = 2 + j
                rollouts.append(Rollout(gid, j, [5, gid], [reward] + [10 + j] * (n - 1),
                                        [-0.1 * (gid + 1) - 0.01 * j - 0.001 * t for t in range(n)], [version] * n,
                                        "stop"))
        return StepSamples(rollouts, problems, data_position + len(self.script[step]), {"inner/x": 1.0})

    def step_metrics(self, *args):
        return {}

    def publish(self, version):
        self.published.append(version)

    def state_dict(self):
        return {"inner": True}

    def close(self):
        self.closed = True


def problem(gid: int) -> Problem:
    return Problem(f"question {gid}", str(gid), {"index": gid})


def score(rollouts, problems):
    assert all(r.group_id in problems for r in rollouts)
    return [float(r.completion_ids[0]) for r in rollouts]


def _replay(script, buffer_groups=8, max_age=4, decay=0.5):
    return GroupReplay(Scripted(script), score, problem, ReplaySettings(buffer_groups, max_age, decay))


def _groups(samples: StepSamples) -> list[int]:
    return list(dict.fromkeys(r.group_id for r in samples.rollouts))


def _fields(rollouts: list[Rollout]) -> list[tuple]:
    """What a replay must keep of each rollout (Rollout's own == would compare the NaN rewards)."""
    return [(r.group_id, r.sample_index, r.prompt_ids, r.completion_ids, r.rollout_logprobs, r.versions,
             r.finish_reason) for r in rollouts]


def test_constant_groups_are_replaced_by_stored_effective_ones_as_sampled():
    source = _replay([[[1, 0, 0, 0], [1, 1, 1, 1]], [[1, 1, 0, 0], [0, 0, 0, 0]], [[1, 1, 1, 1], [0, 0, 0, 0]]])
    source.start(0, 0, None)
    first = source.collect(0, 0, 0)
    assert _groups(first) == [0, 1] and first.next_position == 2  # nothing stored yet: the constant group stays
    assert first.metrics == {"inner/x": 1.0, "popo/constant_groups": 1.0, "popo/replayed_groups": 0.0,
                             "popo/buffer_groups": 1.0}
    sampled = json.loads(json.dumps(_fields([r for r in first.rollouts if r.group_id == 0])))
    for r in first.rollouts:  # the trainer scores in place; nothing it does reaches the buffer's copies
        r.reward, r.completion_ids[-1], r.rollout_logprobs[0] = 0.5, 999, 0.0
    second = source.collect(1, 1, 2)
    assert _groups(second) == [2, 0]  # group 3 (constant) gave its slot to group 0; group 2 (effective) is kept
    assert set(second.problems) == {0, 2} and second.problems[0] == problem(0) and second.next_position == 4
    replayed = [r for r in second.rollouts if r.group_id == 0]
    assert json.loads(json.dumps(_fields(replayed))) == sampled  # ids, the engine's mu and version 0, as sampled
    assert all(r.versions == [0] * len(r.completion_ids) and math.isnan(r.reward) for r in replayed)
    assert (second.metrics["popo/replayed_groups"], second.metrics["popo/buffer_groups"]) == (1.0, 1.0)
    third = source.collect(2, 2, 4)
    assert _groups(third) == [2, 5]  # two constant groups, one stored group (2): group 5 stays; replayed once
    assert (third.metrics["popo/constant_groups"], third.metrics["popo/replayed_groups"]) == (2.0, 1.0)
    assert third.metrics["popo/buffer_groups"] == 0.0


@pytest.mark.parametrize("decay, max_age, picked, left", [(0.5, 4, 2, [5, 3, 0]), (1.0, 4, 0, [5, 2, 3]),
                                                         (1.0, 1, 2, [5, 3])])
def test_recency_decay_and_max_age_decide_between_quality_and_freshness(decay, max_age, picked, left):
    """At step 2 (version 2) one slot; stored: group 0 (s 0.5, age 2), groups 2 and 3 (s 0.433, age 1). decay 0.5:
    0.433 x 0.5 = 0.217 beats 0.5 x 0.25 = 0.125, and the tie 2 / 3 goes to 2; decay 1: 0.5 > 0.433; max_age 1:
    group 0 has expired."""
    script = [[[1, 1, 0, 0], [1, 1, 1, 1]], [[1, 0, 0, 0], [0, 1, 0, 0]], [[0, 0, 0, 0], [1, 0, 1, 0]]]
    source = _replay(script, decay=decay, max_age=max_age)
    source.start(0, 0, None)
    assert _groups(source.collect(0, 0, 0)) == [0, 1]
    assert _groups(source.collect(1, 1, 2)) == [2, 3]
    assert [g.group_id for g in source.buffer] == [2, 3, 0]
    third = source.collect(2, 2, 4)
    assert _groups(third) == [picked, 5]
    assert [g.group_id for g in source.buffer] == left  # the fresh effective group 5 first


def test_the_buffer_keeps_the_highest_priorities_up_to_its_capacity():
    """Priorities at age 0: 0.433, 0.5, 0.433: group 1, then the tie 0 / 2 goes to the earlier one (0)."""
    source = _replay([[[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 1]]], buffer_groups=2)
    source.start(0, 0, None)
    source.collect(0, 0, 0)
    assert [(g.group_id, g.version) for g in source.buffer] == [(0, 0), (1, 0)]
    assert [g.spread for g in source.buffer] == pytest.approx([S1, S2], abs=1e-12)


def test_the_buffer_survives_a_checkpoint_and_the_resumed_source_continues_alike():
    """Step 1 replays group 1 (0.5 x 0.5 > 0.433 x 0.5) for group 2; step 2's two constant groups take 3 and 0."""
    script = [[[1, 0, 0, 0], [1, 1, 0, 0]], [[0, 0, 0, 0], [0, 1, 1, 1]], [[1, 1, 1, 1], [0, 0, 0, 0]]]
    straight = _replay(script)
    straight.start(0, 0, None)
    steps = [straight.collect(step, step, 2 * step) for step in range(3)]
    assert [_groups(s) for s in steps] == [[0, 1], [1, 3], [3, 0]]
    cut = _replay(script)
    cut.start(0, 0, None)
    for step in range(2):
        cut.collect(step, step, 2 * step)
    state = json.loads(json.dumps(cut.state_dict()))  # as trainer_state.json holds it
    assert state["inner"] == {"inner": True} and [g["group_id"] for g in state["buffer"]] == [3, 0]
    resumed = _replay(script)
    resumed.start(2, 4, state)
    assert resumed.inner.started == (2, 4, {"inner": True})
    again = resumed.collect(2, 2, 4)
    assert _fields(again.rollouts) == _fields(steps[2].rollouts) and again.metrics == steps[2].metrics
    assert resumed.state_dict() == straight.state_dict()
    resumed.close()
    assert resumed.inner.closed


# -- the real Trainer --------------------------------------------------------------------------------------------------
class HalfConstantTask:
    """The run's task whose even training positions always score 0 (constant groups) and odd ones score the response's
    length parity (about half right: effective groups). Module-level, so the scoring processes can unpickle it."""

    def __init__(self, task):
        self.task = task

    def train_problem(self, index: int) -> Problem:
        p = self.task.train_problem(index)
        return replace(p, entry={**p.entry, "popo_index": index})

    def score(self, response: str, problem: Problem) -> float:
        return 0.0 if problem.entry.get("popo_index", 1) % 2 == 0 else float(len(response) % 2 == 0)

    def __getattr__(self, name):
        if name == "task":
            raise AttributeError(name)
        return getattr(self.task, name)


class Recorder(OffsetEngine):
    """The hf engine as is (no offset), keeping every sampled rollout by group id."""

    def __init__(self, engine):
        super().__init__(engine)
        self.sampled: dict[int, list[Rollout]] = {}

    def generate(self, requests, sampling, seed):
        out = super().generate(requests, sampling, seed)
        for r in out:
            self.sampled.setdefault(r.group_id, []).append(replace(r, completion_ids=list(r.completion_ids)))
        return out


def _trainer(model_dir, out, name, *sets, resume=False):
    sets = ["algorithm.lr=1e-2", "correction.preset=tis", "popo.enabled=true", *sets]
    return tiny_trainer(model_dir, out, name, sets, HalfConstantTask, Recorder, resume)


def _logprobs(trainer, rollouts: list[Rollout]) -> torch.Tensor:
    """The trainer's current log-probs of `rollouts`' sampled tokens, flattened over the valid ones."""
    from nearpolicy.batching import collate
    from nearpolicy.model.policy import recompute_logprobs

    batch = collate(rollouts, trainer.s.pad_id, trainer.s.vocab_size, False)
    return recompute_logprobs(trainer.s.model, batch, trainer.sampling, 4)[0][batch.mask]


@pytest.mark.slow
def test_the_trainer_replays_a_stale_group_and_weights_it_by_pi_old_over_mu(tiny_model_dir, tmp_path):
    """Step 1 (version 0): group 0 is constant, nothing is stored: it stays; group 1 is effective and stored. Step 2
    (version 1): group 2 is constant and gives its slot to group 1, whose tokens are one version old: the update
    weights them by pi_old / mu with pi_old the trainer's log-probs after step 1 (computed here) and mu the engine's
    from step 1 (recorded here)."""
    trainer, engine = _trainer(tiny_model_dir, tmp_path, "popo")
    try:
        first = _step(trainer)
        assert (first["popo/constant_groups"], first["popo/replayed_groups"], first["popo/buffer_groups"]) == (1, 0, 1)
        assert first["popo/replayed_tokens"] == 0 and math.isnan(first["popo/replayed_age_mean"])
        stored = engine.sampled[1]
        pi_old = _logprobs(trainer, stored)  # the weights step 2 is recomputed at (version 1)
        mu = torch.tensor([lp for r in stored for lp in r.rollout_logprobs])
        second = _step(trainer)
        assert sorted(engine.sampled) == [0, 1, 2, 3]  # the engine sampled groups 2 and 3; group 1 was not resampled
        assert (second["popo/constant_groups"], second["popo/replayed_groups"]) == (1, 1)
        assert second["popo/replayed_tokens"] == sum(len(r.completion_ids) for r in stored) == pi_old.numel()
        assert second["popo/replayed_age_mean"] == 1.0
        expected = pi_old.double() - mu.double()
        assert second["popo/replayed_log_weight_mean"] == pytest.approx(float(expected.mean()), abs=2e-5)
        assert second["popo/replayed_log_weight_abs_mean"] == pytest.approx(float(expected.abs().mean()), abs=2e-5)
        assert float(expected.abs().mean()) > 1e-2  # the policy moved: the weight pi_old / mu is not 1
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_resumed_popo_run_continues_bit_for_bit(tiny_model_dir, tmp_path):
    straight, _ = _trainer(tiny_model_dir, tmp_path, "straight")
    try:
        rows = [_step(straight) for _ in range(3)]
        weights = {k: v.clone() for k, v in straight.s.model.state_dict().items()}
    finally:
        straight.close()
    cut, _ = _trainer(tiny_model_dir, tmp_path, "cut")
    try:
        _step(cut)
        _step(cut)
        saved = cut.checkpoint()
    finally:
        cut.close()
    buffer = json.loads((saved / "trainer_state.json").read_text())["scheduler"]["buffer"]
    assert [g["group_id"] for g in buffer] == [3]  # group 1 was replayed at step 2; group 3 was stored then
    resumed, _ = _trainer(tiny_model_dir, tmp_path, "cut", resume=True)
    try:
        assert resumed.state.step == 2 and [g.group_id for g in resumed.rollouts.buffer] == [3]
        row = _step(resumed)
        assert all(torch.equal(resumed.s.model.state_dict()[k], v) for k, v in weights.items())
    finally:
        resumed.close()
    assert rows[2]["popo/replayed_groups"] == 1.0  # step 3 replays group 3 in place of the constant group 4
    for key in ("reward/mean", "actor/loss", "popo/replayed_groups", "popo/replayed_log_weight_mean",
                "popo/buffer_groups", "mismatch/k1"):
        assert row[key] == rows[2][key], key


# -- config ------------------------------------------------------------------------------------------------------------
def test_popo_is_off_by_default_and_on_with_the_default_correction():
    assert load_config(None).popo.enabled is False
    cfg = load_config(None, ["popo.enabled=true"])
    assert (cfg.popo.buffer_groups, cfg.popo.max_age, cfg.popo.recency_decay) == (64, 4, 0.5)
    assert cfg.correction.spec().mode == "decoupled"


@pytest.mark.parametrize("sets, named", [
    (["correction.preset=off"], r"correction\.mode = 'decoupled'.*correction\.action = 'off'"),
    (["correction.preset=bypass_ppo_clip"], r"correction\.mode = 'bypass'"),
    (["correction.mix=0"], r"correction\.mix = 0"),
    (["algorithm.advantage=reinforce"], r"algorithm\.advantage = 'reinforce'"),
    (["rollout.engines=1", "rollout.staleness=1"], r"rollout\.engines"),
    (["episode.enabled=true"], r"episode\.enabled"),
    (["lora.enabled=true"], r"lora\.enabled"),
    (["mipu.enabled=true"], r"mipu\.enabled"),
    (["distill.teacher=smollm2", "distill.divergence=forward", "distill.ropd=true"],
     r"distill\.ropd, distill\.teacher"),
])
def test_popo_refuses_what_it_was_not_built_for_naming_the_keys(sets, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, ["popo.enabled=true", *sets])
    load_config(None, sets)  # each is fine without popo


def test_nearpolicy_list_shows_popo_with_its_source(capsys):
    from nearpolicy.cli import main

    assert main(["list"]) == 0
    assert "  popo " in capsys.readouterr().out
    assert main(["list", "popo"]) == 0
    assert "arXiv:2606.01281" in capsys.readouterr().out
