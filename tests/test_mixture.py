"""The adaptive task mixture (task.mixture = "adaptive"; ops/mixture.py, rollouts/mixture.py, docs/math.md sec. 27):
its update against values computed by hand, the shares reaching the drawn prompts, the floor, determinism and the
checkpoint round trip through the real inline source, a resumed tiny Trainer run equal to the uninterrupted one, and
the config's refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch

from nearpolicy.config.schema import ConfigError, load_config
from nearpolicy.rollouts.inline import InlineRollouts
from nearpolicy.ops.mixture import MIXTURES
from nearpolicy.rollouts.mixture import AdaptiveMixtureRollouts, MixtureDraws, adaptive_mixture
from nearpolicy.tasks import Problem
from nearpolicy.types import Rollout, SamplingParams
from tiny_trainer import step as _step, tiny_trainer

NAMES = ["easy", "hard"]


class TwoDatasets:
    """A composite-like task: position i is dataset "easy" for even i, "hard" for odd i (metadata.source_dataset, as
    reasoning-gym's composite writes it); 10 problems each."""

    name = "composite"
    train_size = 20

    def train_problem(self, index: int) -> Problem:
        i = index % self.train_size
        return Problem(f"q{i}", "0", {"metadata": {"source_dataset": NAMES[i % 2]}, "i": i})

    def eval_problems(self) -> list[Problem]:
        return []

    def score(self, response: str, problem: Problem) -> float:
        return 0.0


class EchoEngine:
    """An engine whose every sample is one token (the group id), log-prob -1."""

    version = 0

    def generate(self, requests, sampling, seed):
        return [Rollout(q.group_id, s, list(q.prompt_ids), [q.group_id], [-1.0], [0], "stop") for q in requests
                for s in range(q.n)]

    def update_weights(self, weights, version):
        self.version = version

    def close(self):
        pass


def _source(weights=(1.0, 1.0), decay=0.5, floor=0.2, seed=0, prompts=4) -> AdaptiveMixtureRollouts:
    inline = InlineRollouts(EchoEngine(), lambda: None, TwoDatasets(), lambda p: [1, 2], SamplingParams(), 2, prompts,
                            seed)
    options = {"datasets": [{"name": n, "weight": w} for n, w in zip(NAMES, weights)]}
    return adaptive_mixture(inline, options, decay, floor, seed)


def _step_of(source, step: int, reward) -> tuple[list[int], dict[str, float]]:
    """One step as the trainer takes it: collect, reward each rollout (reward(problem) -> float, as the trainer's
    scoring does in place), step_metrics. Returns (the drawn problems' indices, the metrics)."""
    got = source.collect(step, 0, step * source.prompts_per_step)
    for r in got.rollouts:
        r.reward = reward(got.problems[r.group_id])
    metrics = source.step_metrics(*[torch.zeros(0)] * 4, 0)
    return [p.entry["i"] for p in got.problems.values()], metrics


def _dataset(problem: Problem) -> str:
    return problem.entry["metadata"]["source_dataset"]


# -- the update rule ---------------------------------------------------------------------------------------------------
def test_the_update_by_hand():
    """weights (1, 3), beta = 0.5, eps = 0.2. Step 1: easy's samples score 3 of 4 right, hard's 0 of 3 (one NaN,
    left out): p = (0.5 0.5 + 0.5 3/4, 0.5 0.5 + 0.5 0) = (5/8, 1/4); wbar = (1/4, 3/4); wbar p (1 - p) = (15/256,
    36/256), q = (5/17, 12/17); pi = 0.2 wbar + 0.8 q = (0.05 + 4/17, 0.15 + 9.6/17). Step 2: only easy, 0 of 2:
    p_easy = 5/16, p_hard stays 1/4. Fails if the EMA is not updated (pi would stay wbar) or the rule changes."""
    source = _source(weights=(1.0, 3.0), decay=0.5, floor=0.2)
    source.start(0, 0, None)
    mixture = source.mixture
    assert mixture.shares().tolist() == pytest.approx([0.25, 0.75], abs=1e-15)  # the prior: the fixed mixture
    easy, hard = mixture.pools[0][0], mixture.pools[1][0]
    mixture.observe(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, math.nan]), [easy] * 4 + [hard] * 3)
    assert mixture.accuracy.tolist() == pytest.approx([5 / 8, 1 / 4], abs=1e-15)
    assert mixture.shares().tolist() == pytest.approx([0.05 + 4 / 17, 0.15 + 9.6 / 17], abs=1e-12)
    mixture.observe(torch.tensor([0.0, 0.0]), [easy, easy])
    assert mixture.accuracy.tolist() == pytest.approx([5 / 16, 1 / 4], abs=1e-15)


def test_the_rewards_reach_the_mixture_through_step_metrics():
    """Through the source as the trainer drives it: easy always scores 1, hard 0.5, beta = 0.5: after step 1 easy
    (drawn at seed 0) has p = 0.75, hard p = 0.5, and the logged shares are those step 1 drew with (the prior, 1/2
    each); the prompt counts are the drawn ones; step 2 draws with the moved shares (1/2 eps + (1 - eps) 3/7 for
    easy). Fails if step_metrics does not feed the rewards back."""
    source = _source()
    source.start(0, 0, None)
    drawn, metrics = _step_of(source, 0, lambda p: 1.0 if _dataset(p) == "easy" else 0.5)
    assert metrics["mixture/share/easy"] == metrics["mixture/share/hard"] == 0.5
    counts = [sum(i % 2 == k for i in drawn) for k in (0, 1)]
    assert [metrics["mixture/prompts/easy"], metrics["mixture/prompts/hard"]] == counts and counts[0] > 0
    assert [metrics["mixture/accuracy/easy"], metrics["mixture/accuracy/hard"]] == [0.75, 0.5]
    moved = source.mixture.shares().tolist()
    assert moved == pytest.approx([0.1 + 0.8 * 3 / 7, 0.1 + 0.8 * 4 / 7], abs=1e-12)
    _, metrics = _step_of(source, 1, lambda p: 0.0)
    assert [metrics["mixture/share/easy"], metrics["mixture/share/hard"]] == moved  # step 2 drew with them


# -- the draws ---------------------------------------------------------------------------------------------------------
def test_the_shares_reach_the_drawn_prompts():
    """With p = (0.95, 0.5), weights (1, 1), eps = 0.2: pi_easy = 0.1 + 0.8 (0.0475 / 0.2975); over 600 steps of 4
    prompts the share of easy prompts is within 4 binomial standard deviations of it (fails for draws that ignore
    the shares: 1/2 is 14 deviations away); each dataset's problems come in its own order, cycling."""
    source = _source(floor=0.2)
    source.start(0, 0, {"mixture": {"accuracy": {"easy": 0.95, "hard": 0.5}, "cursors": {"easy": 0, "hard": 0}}})
    pi_easy = 0.1 + 0.8 * 0.0475 / 0.2975
    assert float(source.mixture.shares()[0]) == pytest.approx(pi_easy, abs=1e-12)
    drawn = []
    for step in range(600):
        got = source.collect(step, 0, 4 * step)
        assert sorted(got.problems) == [4 * step + i for i in range(4)]  # group ids stay the data positions
        drawn += [p.entry["i"] for p in got.problems.values()]
    n = len(drawn)
    easy = [i for i in drawn if i % 2 == 0]
    assert abs(len(easy) / n - pi_easy) < 4 * math.sqrt(pi_easy * (1 - pi_easy) / n)
    assert easy[:12] == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 0, 2]  # easy's pool in order, cycling


def test_the_floor_keeps_a_solved_dataset_in_the_mixture():
    """easy solved (p = 1: learnability 0) keeps pi = eps wbar = 0.1 x 1/2, and is still drawn at that rate; a floor
    of 0 or above 1 is refused naming task.mixture_floor. Fails without the floor (pi_easy would be 0)."""
    source = _source(floor=0.1)
    source.start(0, 0, {"mixture": {"accuracy": {"easy": 1.0, "hard": 0.5}, "cursors": {"easy": 0, "hard": 0}}})
    assert source.mixture.shares().tolist() == pytest.approx([0.05, 0.95], abs=1e-15)
    drawn = [i for step in range(1000) for i in _step_of(source, step, lambda p: float(_dataset(p) == "easy"))[0]]
    assert abs(sum(i % 2 == 0 for i in drawn) / len(drawn) - 0.05) < 4 * math.sqrt(0.05 * 0.95 / len(drawn))
    assert float(source.mixture.shares()[0]) >= 0.05 - 1e-12
    for floor in (0.0, 1.5):
        with pytest.raises(ValueError, match="task.mixture_floor"):
            _source(floor=floor)


def test_unplanned_positions_are_refused():
    draws = MixtureDraws(TwoDatasets())
    draws.plan(8, [TwoDatasets().train_problem(3)])
    assert draws.train_problem(8).entry["i"] == 3
    with pytest.raises(KeyError, match="position 9 was not drawn"):
        draws.train_problem(9)


# -- determinism and resume --------------------------------------------------------------------------------------------
def _reward(problem: Problem) -> float:
    return float(_dataset(problem) == "easy" or problem.entry["i"] % 3 == 0)


def test_a_restored_source_continues_as_the_uninterrupted_one():
    """Two sources of the same seed draw alike; a source started from the JSON of another's state after 5 steps
    draws and moves exactly as that one does after it (fails if the accuracy or the cursors are not restored: both
    have moved). A different seed draws otherwise."""
    straight, twin = _source(), _source()
    straight.start(0, 0, None)
    twin.start(0, 0, None)
    runs = [[_step_of(s, step, _reward) for step in range(5)] for s in (straight, twin)]
    assert runs[0] == runs[1]
    saved = json.loads(json.dumps(straight.state_dict()))
    assert saved["mixture"]["accuracy"] != {"easy": 0.5, "hard": 0.5} and saved["mixture"]["cursors"] != {
        "easy": 0, "hard": 0}
    assert saved["inner"] is None  # the inline source keeps nothing
    resumed = _source()
    resumed.start(0, 20, saved)
    after = [[_step_of(s, step, _reward) for step in range(5, 12)] for s in (straight, resumed)]
    assert after[0] == after[1]
    other = _source(seed=1)
    other.start(0, 0, None)
    assert [_step_of(other, step, _reward)[0] for step in range(5)] != [drawn for drawn, _ in runs[0]]


# -- the real Trainer --------------------------------------------------------------------------------------------------
class ByDatasetTask:
    """The run's composite task scored by dataset: chain_sum always right, basic_arithmetic right when the response
    has even length. Module-level, so the scoring processes can unpickle it."""

    def __init__(self, task):
        self.task = task

    def score(self, response: str, problem: Problem) -> float:
        chain = problem.entry["metadata"]["source_dataset"] == "chain_sum"
        return 1.0 if chain else float(len(response) % 2 == 0)

    def __getattr__(self, name):
        if name == "task":
            raise AttributeError(name)
        return getattr(self.task, name)


MIXTURE_SETS = ["task.name=composite", "task.mixture=adaptive", "task.mixture_decay=0.5", "algorithm.lr=1e-2",
                "task.options={datasets=[{name='chain_sum', weight=1}, {name='basic_arithmetic', weight=1}]}"]


def _trainer(model_dir, out, name, resume=False):
    return tiny_trainer(model_dir, out, name, MIXTURE_SETS, ByDatasetTask, lambda engine: engine, resume)[0]


@pytest.mark.slow
def test_a_resumed_run_draws_and_trains_as_the_uninterrupted_one(tiny_model_dir, tmp_path):
    """3 steps straight vs 2 steps, a checkpoint, --resume, step 3: the same shares, prompts, rewards, loss and
    weights; the shares have moved by step 3 (chain_sum always solved)."""
    straight = _trainer(tiny_model_dir, tmp_path, "straight")
    try:
        rows = [_step(straight) for _ in range(3)]
        weights = {k: v.clone() for k, v in straight.s.model.state_dict().items()}
    finally:
        straight.close()
    assert rows[0]["mixture/share/chain_sum"] == 0.5 and rows[2]["mixture/share/chain_sum"] < 0.5
    cut = _trainer(tiny_model_dir, tmp_path, "cut")
    try:
        _step(cut)
        _step(cut)
        saved = cut.checkpoint()
    finally:
        cut.close()
    assert "mixture" in json.loads((saved / "trainer_state.json").read_text())["scheduler"]
    resumed = _trainer(tiny_model_dir, tmp_path, "cut", resume=True)
    try:
        assert resumed.state.step == 2
        row = _step(resumed)
        assert all(torch.equal(resumed.s.model.state_dict()[k], v) for k, v in weights.items())
    finally:
        resumed.close()
    for key in [k for k in rows[2] if k.startswith("mixture/")] + ["reward/mean", "actor/loss"]:
        assert row[key] == rows[2][key], key


# -- config ------------------------------------------------------------------------------------------------------------
COMPOSITE = ["task.name=composite", "task.options={datasets=[{name='chain_sum', weight=1}]}"]


def test_the_config_keys_their_defaults_and_nearpolicy_list(capsys):
    from nearpolicy.cli import _registries, main

    t = load_config(None).task
    assert (t.mixture, t.mixture_decay, t.mixture_floor) == ("fixed", 0.9, 0.1)
    t = load_config(None, [*COMPOSITE, "task.mixture=adaptive", "task.mixture_floor=1"]).task
    assert (t.mixture, t.mixture_floor) == ("adaptive", 1.0)
    assert MIXTURES.names() == ["adaptive", "fixed"] and MIXTURES in _registries()
    capsys.readouterr()
    assert main(["list", "adaptive"]) == 0
    assert "arXiv:2408.15099" in capsys.readouterr().out


@pytest.mark.parametrize("sets, named", [
    (["task.mixture=adaptive"], r"task\.mixture = 'adaptive'.*task\.name = 'chain_sum' is not one"),
    (["task.mixture=adaptive", "task.kind=jsonl", "task.path=x.jsonl"], r"task\.kind = 'jsonl'"),
    ([*COMPOSITE, "task.mixture=adaptive", "rollout.engines=1"], r"rollout\.engines"),
    ([*COMPOSITE, "task.mixture=adaptive", "popo.enabled=true"], r"popo\.enabled"),
    ([*COMPOSITE, "task.mixture=adaptiv"], r"task\.mixture.*did you mean 'adaptive'"),
    ([*COMPOSITE, "task.mixture_floor=0"], r"task\.mixture_floor"),
    ([*COMPOSITE, "task.mixture_decay=1"], r"task\.mixture_decay"),
])
def test_the_config_refuses_what_the_mixture_cannot_do(sets, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, sets)


def test_a_dataset_without_training_problems_is_refused_by_the_dry_run_before_anything_loads():
    from nearpolicy.training.assemble import dry_plan

    rare = ["task.name=composite", "task.train_size=8", "task.eval_size=4", "task.mixture=adaptive",
            "task.options={datasets=[{name='chain_sum', weight=1}, {name='products', weight=1e-9}]}"]
    with pytest.raises(ValueError, match=r"dataset\(s\) products have no problem among the 8 training problems"):
        dry_plan(load_config(None, rare))
    plan = dry_plan(load_config(None, [*rare[:-1], rare[-1].replace("1e-9", "1")]))  # both drawn: the plan is made
    assert plan["model_file"]
