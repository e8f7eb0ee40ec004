"""The arena's less noisy outcomes (arena/outcomes.py, issue 37) against hand-computed values on run folders written
here (no training): the eval AUC (trapezoid over uneven eval steps / run.steps; None without the step-0 or last
eval), the mean training reward of the last N steps (its default N, a missing step), each problem's AUC from
eval_outcomes.jsonl and its bootstrap over problems x seeds, arena.late_steps's validation, a late-reward comparison
whose CI excludes 0 (computed independently here), and the page through a fake arena run."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from nearpolicy.arena.comparisons import compare_paired, paired_comparisons
from nearpolicy.arena.outcomes import default_late_steps, trapezoid
from nearpolicy.arena.paired import paired_bootstrap, verdict
from nearpolicy.arena.runner import run_arena
from nearpolicy.arena.spec import ArenaError, load_arena
from nearpolicy.arena.state import CellRecord
from nearpolicy.arena.table import CellResult, aggregate, cell_result

T975_DF2 = 4.302653  # Student's t quantile 0.975 at 2 degrees of freedom (the table rounds it to 4.303)

BASE = """
[run]
steps = 10
[task]
eval_size = 4
[logging]
eval_every = 1
"""

from test_arena_paired import ARENA  # noqa: E402  (off and tis under q8_0, 3 seeds: the paired tests' arena)


def _spec(tmp_path: Path, arena: str = ARENA, base: str = BASE):
    (tmp_path / "base.toml").write_text(base)
    (tmp_path / "arena.toml").write_text(arena)
    return load_arena(tmp_path / "arena.toml", out=tmp_path / "out")


def _write(cell, evals: dict[int, float | None], rewards: dict[int, float | None], outcomes=None) -> None:
    """The cell's metrics.jsonl: an eval-only row at step 0, then training steps with reward/mean (and an eval where
    `evals` has one); `outcomes` {step: rewards} as eval_outcomes.jsonl."""
    run_dir = cell.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"step": 0, "eval/accuracy": evals[0]}] if 0 in evals else []
    for step in sorted(set(rewards) | set(evals) - {0}):
        row = {"step": step}
        if step in rewards:
            row["reward/mean"] = rewards[step]
        if step in evals:
            row["eval/accuracy"] = evals[step]
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if outcomes is not None:
        lines = [{"step": s, "rewards": r} for s, r in sorted(outcomes.items())]
        (run_dir / "eval_outcomes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


REWARDS = {s: s / 10 for s in range(1, 11)}  # reward/mean 0.1, 0.2, ..., 1.0 at steps 1..10


def test_the_eval_auc_is_the_trapezoid_over_uneven_eval_steps(tmp_path):
    cell = _spec(tmp_path).cells[0]
    _write(cell, {0: 0.2, 3: 0.5, 4: 0.4, 10: 0.8}, REWARDS)
    result, warnings = cell_result(cell, CellRecord("done"))
    # 3 x (0.2 + 0.5) / 2 + 1 x (0.5 + 0.4) / 2 + 6 x (0.4 + 0.8) / 2 = 1.05 + 0.45 + 3.6 = 5.1, / 10 steps = 0.51
    assert result.auc_accuracy == pytest.approx(0.51, abs=1e-12) and warnings == []
    assert (result.final_accuracy, result.best_accuracy) == (0.8, 0.8)
    assert result.auc_outcomes is None  # no eval_outcomes.jsonl: no per-problem AUCs, and nothing to warn about
    assert trapezoid([(0, 1.0), (2, 0.0)], 2) == 0.5
    with pytest.raises(ValueError, match="from step 0 to step 10"):
        trapezoid([(1, 0.2), (10, 0.8)], 10)


@pytest.mark.parametrize("evals,note", [
    ({0: 0.2, 3: 0.5, 4: 0.4}, "eval at step 10 missing: reported as n/a"),  # stopped early: no last eval
    ({0: 0.2, 3: 0.5, 10: float("nan")}, "eval at step 10 is nan: reported as n/a"),
    ({3: 0.5, 10: 0.8}, "eval at step 0 missing: reported as n/a"),
    ({0: 0.2, 3: float("nan"), 10: 0.8}, "eval AUC n/a: the eval at step 3 is nan"),
], ids=["last-missing", "last-nan", "first-missing", "middle-nan"])
def test_an_auc_without_its_first_or_last_eval_or_with_a_bad_one_is_none(tmp_path, evals, note):
    cell = _spec(tmp_path).cells[0]
    _write(cell, evals, REWARDS)
    result, _ = cell_result(cell, CellRecord("done"))
    assert result.auc_accuracy is None and note in result.notes


def test_the_late_reward_is_the_mean_of_the_last_n_steps_default_a_quarter(tmp_path):
    spec = _spec(tmp_path)
    cell = spec.cells[0]
    assert spec.late_steps is None
    assert (default_late_steps(10), default_late_steps(3), default_late_steps(12)) == (2, 1, 3)
    _write(cell, {0: 0.2, 10: 0.8}, REWARDS)
    result, _ = cell_result(cell, CellRecord("done"))
    assert result.late_steps == 2 and result.late_reward == pytest.approx((0.9 + 1.0) / 2, abs=1e-12)
    result, _ = cell_result(cell, CellRecord("done"), late_steps=4)
    assert result.late_reward == pytest.approx((0.7 + 0.8 + 0.9 + 1.0) / 4, abs=1e-12)
    result, _ = cell_result(cell, CellRecord("done"), late_steps=10)
    assert result.late_reward == pytest.approx(0.55, abs=1e-12)
    with pytest.raises(ValueError, match="1 <= n <= steps"):
        cell_result(cell, CellRecord("done"), late_steps=11)


def test_a_missing_or_non_finite_late_step_gives_no_late_reward(tmp_path):
    cell = _spec(tmp_path).cells[0]
    _write(cell, {0: 0.2, 10: 0.8}, {s: r for s, r in REWARDS.items() if s != 9})
    result, _ = cell_result(cell, CellRecord("done"))
    assert result.late_reward is None and "mean reward of the last 2 steps n/a: reward/mean of step 9 missing" in \
        result.notes
    result, _ = cell_result(cell, CellRecord("done"), late_steps=1)  # step 9 is outside the last 1 step
    assert result.late_reward == 1.0
    _write(cell, {0: 0.2, 10: 0.8}, REWARDS | {10: None})  # NaN is logged as null
    result, _ = cell_result(cell, CellRecord("done"))
    assert result.late_reward is None and "mean reward of the last 2 steps n/a: reward/mean of step 10 is None" in \
        result.notes


# eval accuracy 0.25, 0.5, 0.75 at steps 0, 4, 10; each problem's rewards at those steps
EVALS = {0: 0.25, 4: 0.5, 10: 0.75}
PROBLEMS = {0: [0.0, 1.0, 0.0, 0.0], 4: [1.0, 1.0, 0.0, 0.0], 10: [1.0, 1.0, 1.0, 0.0]}


def test_each_problems_auc_is_its_own_trapezoid_and_their_mean_the_eval_auc(tmp_path):
    cell = _spec(tmp_path).cells[0]
    _write(cell, EVALS, REWARDS, PROBLEMS)
    result, warnings = cell_result(cell, CellRecord("done"))
    # problem 0: 4 x (0 + 1) / 2 + 6 x 1 = 8 -> 0.8; problem 1: 1.0; problem 2: 6 x (0 + 1) / 2 = 3 -> 0.3; 3: 0
    assert result.auc_outcomes == pytest.approx([0.8, 1.0, 0.3, 0.0], abs=1e-12) and warnings == []
    # the curve's own: 4 x (0.25 + 0.5) / 2 + 6 x (0.5 + 0.75) / 2 = 1.5 + 3.75 = 5.25 -> 0.525 = mean(0.8, 1, 0.3, 0)
    assert result.auc_accuracy == pytest.approx(0.525, abs=1e-12)
    # an unscorable answer at step 4 leaves problem 3 out; the step's accuracy is the mean of the other three
    _write(cell, EVALS | {4: 2 / 3}, REWARDS, PROBLEMS | {4: [1.0, 1.0, 0.0, None]})
    result, warnings = cell_result(cell, CellRecord("done"))
    assert result.auc_outcomes == pytest.approx([0.8, 1.0, 0.3, None], abs=1e-12) and warnings == []


@pytest.mark.parametrize("outcomes,warning", [
    (PROBLEMS | {4: [1.0, 1.0, 1.0, 0.0]}, "eval_outcomes.jsonl's step-4 rewards do not give the logged accuracy 0.5"),
    ({s: r for s, r in PROBLEMS.items() if s != 4}, "eval_outcomes.jsonl has no row of 4 rewards for eval step 4"),
    (PROBLEMS | {10: [1.0, 1.0, 1.0]}, "eval_outcomes.jsonl has no row of 4 rewards for eval step 10"),
], ids=["wrong-mean", "missing-step", "short-row"])
def test_per_problem_aucs_that_do_not_match_the_curve_are_left_out_with_a_warning(tmp_path, outcomes, warning):
    cell = _spec(tmp_path).cells[0]
    _write(cell, EVALS, REWARDS, outcomes)
    result, warnings = cell_result(cell, CellRecord("done"))
    assert result.auc_outcomes is None and result.auc_accuracy == pytest.approx(0.525)
    mine = [w for w in warnings if "AUCs" in w]  # a short last row is also final_outcomes' warning
    assert len(mine) == 1 and mine[0].startswith(warning) and mine[0].endswith("per-problem AUCs left out")


@pytest.mark.parametrize("value,match", [
    ("0", "arena.late_steps must be an integer >= 1 .*got 0"),
    ("-2", "arena.late_steps must be an integer >= 1 .*got -2"),
    ("2.5", "arena.late_steps must be an integer >= 1 .*got 2.5"),
    ("true", "arena.late_steps must be an integer >= 1 .*got True"),
    ('"3"', "arena.late_steps must be an integer >= 1 .*got '3'"),
    ("11", r"arena.late_steps = 11 is more than cell off/q8/s0's run.steps = 10"),
])
def test_bad_late_steps_are_refused(tmp_path, value, match):
    with pytest.raises(ArenaError, match=match):
        _spec(tmp_path, ARENA.replace("baseline", f"late_steps = {value}\nbaseline"))


def test_late_steps_is_checked_against_the_shortest_cell(tmp_path):
    arena = ARENA.replace("baseline", 'vary = ["run.steps"]\nlate_steps = 6\nbaseline') + (
        '[[override]]\ncells = "tis/*/s2"\nset = ["run.steps=5"]\n')
    with pytest.raises(ArenaError, match="is more than cell tis/q8/s2's run.steps = 5"):
        _spec(tmp_path, arena)
    assert _spec(tmp_path, arena.replace("late_steps = 6", "late_steps = 5")).late_steps == 5


def _cell(correction: str, seed: int, late: float | None = None, auc: list[float] | None = None,
          final: float = 0.5) -> CellResult:
    return CellResult(f"{correction}/q8/s{seed}", correction, "q8", seed, "done", final_accuracy=final,
                      best_accuracy=final, late_reward=late, late_steps=3 if late is not None else None,
                      auc_accuracy=None if auc is None else statistics.fmean(auc), auc_outcomes=auc)


def test_a_late_reward_difference_is_detected_with_the_hand_computed_ci():
    off, tis = [0.40, 0.55, 0.30], [0.50, 0.60, 0.40]
    results = [_cell("off", s, v) for s, v in enumerate(off)] + [_cell("tis", s, v) for s, v in enumerate(tis)]
    aggs = [aggregate(results, c, "q8") for c in ("off", "tis")]
    c = compare_paired(results, aggs, ("tis", "q8"), ("off", "q8"), "late_reward", 20)
    # d = 0.10, 0.05, 0.10: mean 0.083333, sd 0.028868, SE = sd / sqrt(3) = 0.016667, half-width t x SE = 0.071711
    d = [0.10, 0.05, 0.10]
    mean, se = statistics.fmean(d), statistics.stdev(d) / math.sqrt(3)
    assert (mean, se) == (pytest.approx(0.0833333, abs=1e-6), pytest.approx(0.0166667, abs=1e-6))
    p = c.seeds
    assert p.difference == pytest.approx(mean, abs=1e-12) and p.se == pytest.approx(se, abs=1e-12)
    assert p.eval_floor == 0.0  # no count of correct answers: no eval-set floor, though 0.40 = 8 / 20 would be one
    assert p.low == pytest.approx(mean - T975_DF2 * se, abs=1e-5) and p.high == pytest.approx(mean + T975_DF2 * se,
                                                                                               abs=1e-5)
    assert (p.low, p.high) == (pytest.approx(0.011622, abs=1e-5), pytest.approx(0.155044, abs=1e-5)) and p.detected
    assert c.welch is None and c.problems is None and c.problems_reason is None
    said = c.statement()
    assert said.startswith("tis vs off under q8, mean training reward of the last 3 steps: paired over seeds 0, 1, 2: "
                           "difference detected: +0.083 (CI [+0.012, +0.155], MDE 0.094)")
    assert "training samples" in said and "no difference" not in said
    # the same numbers as final accuracies on 20 problems: whole counts, so the eval-set floor widens the CI past 0
    final = compare_paired([_cell("off", s, final=v) for s, v in enumerate(off)]
                           + [_cell("tis", s, final=v) for s, v in enumerate(tis)], aggs, ("tis", "q8"), ("off", "q8"),
                           "final", 20)
    assert final.seeds.eval_floor > 0 and final.seeds.difference == pytest.approx(mean) and not final.seeds.detected
    assert "no difference detected (CI [" in final.statement()


# each problem's AUC per seed (4 problems); tis gains on problems 1 and 2
AUC_OFF = [[0.8, 0.2, 0.0, 0.5], [0.6, 0.4, 0.1, 0.5], [0.9, 0.0, 0.3, 0.4]]
AUC_TIS = [[0.8, 0.6, 0.4, 0.5], [0.7, 0.7, 0.3, 0.5], [0.9, 0.5, 0.5, 0.4]]


def test_the_auc_is_bootstrapped_over_problems_and_paired_over_seeds():
    results = ([_cell("off", s, auc=a) for s, a in enumerate(AUC_OFF)]
               + [_cell("tis", s, auc=a) for s, a in enumerate(AUC_TIS)])
    aggs = [aggregate(results, c, "q8") for c in ("off", "tis")]
    c = compare_paired(results, aggs, ("tis", "q8"), ("off", "q8"), "auc", 4)
    # seeds' AUC differences: (0.4 + 0.4) / 4 = 0.2, (0.1 + 0.3 + 0.2) / 4 = 0.15, (0.5 + 0.2) / 4 = 0.175
    d = [0.2, 0.15, 0.175]
    assert [v for _, v in c.seeds.per_seed] == pytest.approx(d, abs=1e-12) and c.seeds.eval_floor == 0.0
    assert c.seeds.se == pytest.approx(statistics.stdev(d) / math.sqrt(3), abs=1e-12)
    expected = paired_bootstrap(np.array(AUC_TIS), np.array(AUC_OFF), [0, 1, 2])
    assert c.problems == expected and expected.difference == pytest.approx(0.175, abs=1e-12)
    assert c.welch is None
    said = c.statement()
    assert said.startswith("tis vs off under q8, eval AUC: paired over seeds 0, 1, 2: ")
    assert "over problems x seeds: " + verdict(expected) + " (4 problems x 3 seeds, paired bootstrap)" in said
    # one cell without per-problem AUCs: the seeds' comparison stands, the bootstrap says why it is missing
    results[0] = _cell("off", 0, auc=None)
    results[0].auc_accuracy = statistics.fmean(AUC_OFF[0])
    c = compare_paired(results, aggs, ("tis", "q8"), ("off", "q8"), "auc", 4)
    assert c.seeds.difference == pytest.approx(0.175) and c.problems is None
    assert c.problems_reason.startswith("not available: eval_outcomes.jsonl does not hold every eval problem's")


def test_every_outcome_is_compared_and_unrecorded_ones_are_left_out():
    results = ([_cell("off", s, late=0.3, auc=a) for s, a in enumerate(AUC_OFF)]
               + [_cell("tis", s, late=0.4, auc=a) for s, a in enumerate(AUC_TIS)])
    aggs = [aggregate(results, c, "q8") for c in ("off", "tis")]
    found = paired_comparisons(results, aggs, ["off", "tis"], ["q8"], "off", 4)
    assert [(c.which, c.what, c.short) for c in found] == [
        ("final", "final accuracy", "final"), ("best", "best accuracy", "best"), ("auc", "eval AUC", "eval AUC"),
        ("late_reward", "mean training reward of the last 3 steps", "late reward (last 3 steps)")]
    bare = [_cell(c, s) for c in ("off", "tis") for s in range(3)]
    assert [c.which for c in paired_comparisons(bare, aggs, ["off", "tis"], ["q8"], "off", 4)] == ["final", "best"]
    assert [c.which for c in paired_comparisons(results, aggs, ["off", "tis"], ["q8"], "off", 4,
                                                outcomes=("late_reward",))] == ["late_reward"]


class CurveTrain:
    """A fake `train` for run_arena (run.steps 2, 4 eval problems): every eval's rewards in eval_outcomes.jsonl and
    metrics.jsonl with the evals they give and a known reward/mean per step."""

    EVALS = {"off": ([0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]), "tis": ([0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0])}
    REWARD = {"off": (0.2, 0.3), "tis": (0.4, 0.6)}

    def __call__(self, cfg, resume, log, progress):
        run_dir = cfg.run.output_dir / cfg.run.name
        run_dir.mkdir(parents=True, exist_ok=True)
        arm, shift = cfg.run.name.split("__")[0], 0.05 * cfg.run.seed
        evals = self.EVALS[arm]
        rows = [{"step": 0, "eval/accuracy": 0.0}] + [
            {"step": s, "reward/mean": self.REWARD[arm][s - 1] + shift, "eval/accuracy": sum(evals[s]) / 4}
            for s in (1, 2)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        lines = [{"step": s, "rewards": [float(v) for v in evals[s]]} for s in (0, 1, 2)]
        (run_dir / "eval_outcomes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        return 0, "done"


def test_the_page_shows_every_outcome_and_arena_json_keeps_the_numbers(tmp_path):
    spec = _spec(tmp_path, ARENA.replace("baseline", "late_steps = 2\nbaseline"), BASE.replace("steps = 10",
                                                                                               "steps = 2"))
    assert run_arena(spec, say=lambda _: None, train=CurveTrain()) == 0
    data = json.loads((tmp_path / "out" / "arena.json").read_text())
    assert data["late_steps"] == 2 and data["outcomes"]["auc"] == "eval AUC"
    # off's AUC: (1 x (0 + 0.25) / 2 + 1 x (0.25 + 0.5) / 2) / 2 = 0.25; tis's: (0.25 + 0.625) / 2 = 0.4375
    off = next(c for c in data["cells"] if c["id"] == "off/q8/s1")
    assert off["auc_accuracy"] == pytest.approx(0.25) and off["auc_outcomes"] == pytest.approx([0.75, 0.25, 0, 0])
    assert off["late_reward"] == pytest.approx((0.2 + 0.3) / 2 + 0.05) and off["late_steps"] == 2
    tis_agg = next(a for a in data["aggregates"] if a["correction"] == "tis")
    assert tis_agg["auc"][0] == pytest.approx(0.4375) and tis_agg["late_reward"][0] == pytest.approx(0.55)
    paired = {c["which"]: c for c in data["paired"]}
    assert list(paired) == ["final", "best", "auc", "late_reward"]
    # late reward: every seed differs by 0.25 (sd 0): not established; auc: every seed differs by 0.1875
    assert paired["late_reward"]["seeds"]["difference"] == pytest.approx(0.25)
    assert paired["auc"]["problems"]["difference"] == pytest.approx(0.1875)
    assert paired["auc"]["outcome"] == "eval AUC"
    md = (tmp_path / "out" / "arena.md").read_text()
    assert "| tis vs off under q8 | eval AUC | 0, 1, 2 | +0.188, +0.188, +0.188 | +0.188 | 0.000 | " \
           "- (in the bootstrap) |" in md
    assert "| tis vs off under q8 | late reward (last 2 steps) | 0, 1, 2 | +0.250, +0.250, +0.250 |" in md
    assert "| off | q8 | 3/3 | 0.500 ± 0.000 | 0.500 ± 0.000 | 0.250 ± 0.000 | 0.300 ± 0.050 |" in md
    assert "N = 2 (arena.late_steps)" in md and "Two less noisy outcomes" in md
    assert "late reward (last 2 steps)" in (tmp_path / "out" / "arena.html").read_text()


def test_a_cell_reports_its_truncated_share_and_a_note_above_the_limit(tmp_path):
    """Issue 37 item 2: the token budget must cut few responses; the page shows each cell's mean over steps of
    response/frac_truncated and notes a cell above TRUNCATION_LIMIT (10 %)."""
    from nearpolicy.arena.table import TRUNCATION_LIMIT

    spec = _spec(tmp_path)
    low, high = spec.cells[0], spec.cells[1]
    shares = {low.id: [0.0, 0.1, 0.05, 0.05] + [0.1] * 6, high.id: [0.5, 0.25, 0.0, 0.05] + [0.1] * 6}  # 10 steps
    for cell in (low, high):
        _write(cell, {0: 0.5, 10: 0.75}, {s: 0.5 for s in range(1, 11)})
        rows = [json.loads(line) for line in (cell.run_dir / "metrics.jsonl").read_text().splitlines()]
        for row in rows:
            if "reward/mean" in row:
                row["response/frac_truncated"] = shares[cell.id][row["step"] - 1]
        (cell.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = {c.id: cell_result(c, CellRecord(status="done"))[0] for c in (low, high)}
    assert results[low.id].truncated == pytest.approx(0.08, abs=1e-12)  # (0.2 + 0.6) / 10
    assert results[high.id].truncated == pytest.approx(0.14, abs=1e-12)  # (0.8 + 0.6) / 10
    assert not any("training responses cut" in n for n in results[low.id].notes)
    assert any("14.0 % of its training responses cut" in n for n in results[high.id].notes)
    assert TRUNCATION_LIMIT == 0.10
