"""The arena's paired statistics (arena/paired.py, arena/comparisons.py) against values computed by hand on small
tables: the paired t over seeds, the eval set's noise floor, the two-way bootstrap over problems x seeds, the MDE
multiplier (checked by simulation), the wording of a null, a shared seed effect that the paired analysis sees and
Welch's unpaired test cannot, and the page's paired table through a fake arena run (with and without every eval
problem's outcome recorded, in samples.jsonl or eval_outcomes.jsonl), and which file a cell's outcomes come from."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from nearpolicy.arena.comparisons import compare_paired, eval_floor, paired_comparisons
from nearpolicy.arena.keys import arm_pairs
from nearpolicy.arena.paired import M80, Paired, m80, paired_bootstrap, paired_seeds, problem_noise_floor, verdict
from nearpolicy.arena.runner import run_arena
from nearpolicy.arena.spec import load_arena
from nearpolicy.arena.table import CellResult, aggregate, compare, final_outcomes


def test_the_paired_t_over_seeds_is_the_hand_computed_one():
    # d = 0.05, 0.08, 0.04: mean 0.17 / 3; deviations -0.02 / 3, +0.07 / 3, -0.05 / 3: sum of squares 0.0078 / 9
    # sd^2 = 0.0078 / 18 = 4.3333e-4, se = sqrt(4.3333e-4 / 3) = 0.0120185; t(0.975, 2) = 4.303, M80(2) = 5.653
    p = paired_seeds({0: 0.50, 1: 0.60, 2: 0.70}, {0: 0.45, 1: 0.52, 2: 0.66, 3: 0.9})  # seed 3: unmatched, left out
    assert (p.method, p.seeds, p.df) == ("seeds", 3, 2)
    assert [s for s, _ in p.per_seed] == [0, 1, 2]
    assert p.difference == pytest.approx(0.17 / 3, abs=1e-12)
    assert p.se == pytest.approx(0.0120185, abs=1e-7) and p.se_seeds == p.se and p.eval_floor == 0.0
    assert (p.low, p.high) == (pytest.approx(0.056667 - 0.051716, abs=1e-6), pytest.approx(0.056667 + 0.051716,
                                                                                             abs=1e-6))
    assert p.mde == pytest.approx(5.653 * 0.0120185, abs=1e-6) and p.detected
    assert paired_seeds({0: 0.5}, {0: 0.4}) is None  # one matched seed: no sd


def test_the_eval_set_floor_is_added_in_quadrature():
    # floor 0.02, se over seeds 0.0120185: SE = sqrt(0.02^2 + 0.0120185^2) = 0.0233333
    p = paired_seeds({0: 0.50, 1: 0.60, 2: 0.70}, {0: 0.45, 1: 0.52, 2: 0.66}, eval_floor=0.02)
    assert p.se == pytest.approx(0.0233333, abs=1e-6) and p.se_seeds == pytest.approx(0.0120185, abs=1e-7)
    assert p.low == pytest.approx(0.056667 - 4.303 * 0.0233333, abs=1e-5) and not p.detected


def test_the_problem_noise_floor_is_the_hand_computed_least_variance():
    # net 1 + 2 + 2 = 5 over S = 3 seeds, P = 64: five problems at delta 1/3, the rest 0:
    # Var_p = 5 / 9 / 64 - (5 / 192)^2 = 8.6806e-3 - 6.7817e-4 = 8.0024e-3; SE = sqrt(8.0024e-3 / 64) = 0.0111820
    assert problem_noise_floor([1, 2, 2], 64) == pytest.approx(0.0111820, abs=1e-7)
    # net 100 over S = 2, P = 64: q = 1, r = 36: 36 problems at 2/2, 28 at 1/2:
    # mean square (36 * 4 + 28) / (4 * 64) = 0.671875, minus (100 / 128)^2 = 0.6103516: 0.0615234 / 64 -> 0.0310049
    assert problem_noise_floor([50, 50], 64) == pytest.approx(0.0310049, abs=1e-7)
    assert problem_noise_floor([3, -3], 64) == 0.0  # the differences cancel: no bound
    with pytest.raises(ValueError):
        problem_noise_floor([], 64)


def test_the_floor_comes_from_whole_counts_only():
    a, b = {0: 33 / 64, 1: 40 / 64, 2: 20 / 64}, {0: 32 / 64, 1: 38 / 64, 2: 18 / 64}  # counts differ by 1, 2, 2
    assert eval_floor(a, b, 64) == pytest.approx(0.0111820, abs=1e-7)
    assert eval_floor({0: 0.5151, 1: 0.6, 2: 0.3}, b, 64) == 0.0  # not a count of 64 (unscorable answers)


def test_the_two_way_bootstrap_matches_its_exact_variance():
    # D = a - b = [[1, 0, 1], [0, 0, 1]]: mean 0.5. With independent multinomial counts c_s (S = 2) and c_p (P = 3),
    # E[c_i c_j] = 2 - 1/n on the diagonal, 1 - 1/n off it, so Var = tr(M_S D M_P D^T) / (S P)^2 - 0.5^2 = 0.0787037
    # (M_S = [[1.5, .5], [.5, 1.5]], M_P = 2/3 + I): SE 0.280542
    a = np.array([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    b = a - np.array([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    p = paired_bootstrap(a, b, seeds=[4, 7])
    assert (p.method, p.seeds, p.problems, p.df) == ("problems x seeds", 2, 3, None)
    assert p.difference == 0.5 and p.per_seed == ((4, pytest.approx(2 / 3)), (7, pytest.approx(1 / 3)))
    assert p.se == pytest.approx(0.280542, rel=0.02)  # 10 000 replicates: the SE's own error is about 0.7 %
    assert p.mde == pytest.approx(2.801585 * p.se, rel=1e-5)
    assert paired_bootstrap(a, b, seeds=[4, 7]) == p  # a fixed generator: the page is reproducible


def test_one_seed_reduces_the_bootstrap_to_the_problems_bootstrap():
    # 10 of 50 problems gained: mean 0.2, SE sqrt(0.2 x 0.8 / 50) = 0.0565685, CI about 0.2 +- 1.96 SE
    a, b = np.zeros((1, 50)), np.zeros((1, 50))
    a[0, :10] = 1.0
    p = paired_bootstrap(a, b)
    assert p.difference == pytest.approx(0.2) and p.se == pytest.approx(0.0565685, rel=0.03)
    assert p.low == pytest.approx(0.2 - 1.96 * 0.0565685, abs=0.021) and p.high == pytest.approx(
        0.2 + 1.96 * 0.0565685, abs=0.021)
    with pytest.raises(ValueError):
        paired_bootstrap(a, np.zeros((2, 50)))


def test_m80_has_80_percent_power_by_simulation():
    # T' = (Z + delta) / sqrt(V / 2), V ~ chi2(2): P(|T'| > t(0.975, 2) = 4.303) at delta = M80[df 2]
    rng = np.random.default_rng(1)
    z, v = rng.standard_normal(400_000), rng.chisquare(2, 400_000)
    power = lambda delta: float(np.mean(np.abs((z + delta) / np.sqrt(v / 2)) > 4.303))  # noqa: E731
    assert m80(2) == M80[1] == 5.653
    assert power(5.653) == pytest.approx(0.80, abs=0.004)
    assert power(4.303 + 1.061) == pytest.approx(0.766, abs=0.004)  # Bloom's t + t approximation falls short
    assert m80(0) == M80[0] and m80(99) == M80[-1]


def _paired(low: float, high: float, mde: float, se: float = 0.05) -> Paired:
    return Paired("seeds", (low + high) / 2, low, high, se, mde, 3, df=2)


def test_a_null_is_worded_as_no_difference_detected_with_its_ci_and_mde():
    said = verdict(_paired(-0.1, 0.15, 0.21))
    assert said == "no difference detected (CI [-0.100, +0.150], MDE 0.210)"
    assert "same" not in said and "as well as" not in said
    assert verdict(_paired(0.025, 0.075, 0.033)) == "difference detected: +0.050 (CI [+0.025, +0.075], MDE 0.033)"
    assert verdict(_paired(0.2, 0.2, 0.0, se=0.0)).startswith("not established: every seed's difference is +0.200")


def _cell(correction: str, source: str, seed: int, final: float, best: float | None = None,
          outcomes: list[float] | None = None) -> CellResult:
    return CellResult(f"{correction}/{source}/s{seed}", correction, source, seed, "done", final_accuracy=final,
                      best_accuracy=final if best is None else best, outcomes_recorded=len(outcomes or []) or 4,
                      final_outcomes=outcomes)


def test_paired_sees_a_shared_seed_effect_that_welch_cannot():
    # a hard data order (seed 0) and an easy one (seed 2) move both arms alike; tis gains 10, 10, 9 of 64 problems
    off = [20 / 64, 36 / 64, 52 / 64]
    tis = [30 / 64, 46 / 64, 61 / 64]
    results = [_cell("off", "q8", s, v) for s, v in enumerate(off)] + [_cell("tis", "q8", s, v)
                                                                        for s, v in enumerate(tis)]
    aggs = [aggregate(results, "off", "q8"), aggregate(results, "tis", "q8")]
    welch = compare(aggs[1], aggs[0], 64)
    # Welch: var(off) = 0.0625, var(tis) = 0.0586751 over seeds; SE^2 = (0.0625 + 0.0586751) / 3 = 0.0403917,
    # df = SE^4 / ((0.0625 / 3)^2 / 2 + (0.0586751 / 3)^2 / 2) = 3.996 -> 3, bound 3.182 x 0.200977 = 0.63951
    assert welch.bound == pytest.approx(0.63951, abs=1e-4) and int(welch.df) == 3
    assert abs(welch.difference) <= welch.bound  # unpaired: inside the seed spread
    c = compare_paired(results, aggs, ("tis", "q8"), ("off", "q8"), "final", 64)
    p = c.seeds
    # d = 10, 10, 9 of 64: mean 29 / 192 = 0.151042, sd 0.0090211, se over seeds 0.0052083;
    # floor of net 29 over 3 seeds, 64 problems: sqrt((29 / 9 / 64 - (29 / 192)^2) / 64) = 0.0207417;
    # SE = 0.0213856, half-width 4.303 x SE = 0.092022: CI [0.0590, 0.2431]
    assert p.difference == pytest.approx(29 / 192, abs=1e-12)
    assert p.se_seeds == pytest.approx(0.0052083, abs=1e-6) and p.eval_floor == pytest.approx(0.0207417, abs=1e-6)
    assert (p.low, p.high) == (pytest.approx(0.0590, abs=1e-4), pytest.approx(0.2431, abs=1e-4)) and p.detected
    assert c.problems is None and c.problems_reason.startswith("not available: samples.jsonl records 4 of 64")
    said = c.statement()
    assert said.startswith("tis vs off under q8, final accuracy: paired over seeds 0, 1, 2: difference detected: "
                           "+0.151 (CI [+0.059, +0.243], MDE 0.121)")
    assert "unpaired Welch 95 % bound +-0.640" in said


def test_with_every_problem_recorded_the_bootstrap_stands_beside_the_seeds():
    off = [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]]
    tis = [[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]]
    results = ([_cell("off", "q8", s, float(np.mean(o)), outcomes=o) for s, o in enumerate(off)]
               + [_cell("tis", "q8", s, float(np.mean(o)), outcomes=o) for s, o in enumerate(tis)])
    aggs = [aggregate(results, c, "q8") for c in ("off", "tis")]
    c = compare_paired(results, aggs, ("tis", "q8"), ("off", "q8"), "final", 4)
    expected = paired_bootstrap(np.array(tis), np.array(off), [0, 1, 2])
    assert c.problems == expected and c.problems.difference == pytest.approx(2 / 12)
    assert "over problems x seeds: " + verdict(expected) + " (4 problems x 3 seeds, paired bootstrap)" in c.statement()
    best = compare_paired(results, aggs, ("tis", "q8"), ("off", "q8"), "best", 4)
    assert best.problems is None and best.problems_reason is None  # the bootstrap is the final accuracy's


def test_comparisons_are_corrections_against_the_baseline_and_sources_against_the_first():
    assert arm_pairs(["off", "tis", "icepop"], ["q4", "noise"], "off") == [
        (("tis", "q4"), ("off", "q4")), (("icepop", "q4"), ("off", "q4")), (("tis", "noise"), ("off", "noise")),
        (("icepop", "noise"), ("off", "noise")), (("off", "noise"), ("off", "q4")), (("tis", "noise"), ("tis", "q4")),
        (("icepop", "noise"), ("icepop", "q4"))]
    results = [_cell("off", "q4", s, 0.5) for s in (0, 1)] + [_cell("off", "noise", s, 0.6) for s in (0, 1)]
    found = paired_comparisons(results, [aggregate(results, "off", s) for s in ("q4", "noise")], ["off"],
                               ["q4", "noise"], "off", 64)
    assert [(c.label, c.which) for c in found] == [("off: noise vs q4", "final"), ("off: noise vs q4", "best")]
    assert found[0].statement() == "off: noise vs q4, final accuracy: not established: 2 seeds; at least 3 needed"


from test_arena import BASE  # noqa: E402  (the same two-step base config as the arena tests)

ARENA = """
[arena]
base = "base.toml"
seeds = [0, 1, 2]
baseline = "off"

[corrections]
off = { preset = "off" }
tis = { preset = "tis" }

[sources]
q8 = { set = ["engine.precision='q8_0'"] }
"""

OUTCOMES = {"off": [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0]], "tis": [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]]}


class OutcomeTrain:
    """A fake `train` writing metrics.jsonl and samples.jsonl with known per-problem outcomes at the last step
    (all 4 problems, or only the first `recorded`), and with `outcomes` eval_outcomes.jsonl with all 4 at each eval
    (as a run writes it since the file exists)."""

    def __init__(self, recorded: int = 4, outcomes: bool = False):
        self.recorded, self.outcomes = recorded, outcomes

    def __call__(self, cfg, resume, log, progress):
        run_dir = cfg.run.output_dir / cfg.run.name
        run_dir.mkdir(parents=True, exist_ok=True)
        outcome = OUTCOMES[cfg.run.name.split("__")[0]][cfg.run.seed]
        final = sum(outcome) / 4
        rows = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "reward/mean": 0.5, "eval/accuracy": 0.25},
                {"step": 2, "reward/mean": 0.5, "eval/accuracy": final}]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        samples = [{"step": 2, "index": i, "reward": float(r)} for i, r in enumerate(outcome[:self.recorded])]
        (run_dir / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
        if self.outcomes:
            evals = [{"step": 0, "rewards": [0.0, 1.0, 0.0, 0.0]}, {"step": 2, "rewards": [float(r) for r in outcome]}]
            (run_dir / "eval_outcomes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
        return 0, "done"


@pytest.mark.parametrize("recorded,outcomes", [(4, False), (2, False), (2, True)])
def test_the_page_carries_every_comparisons_paired_ci_and_mde(tmp_path: Path, recorded: int, outcomes: bool):
    (tmp_path / "base.toml").write_text(BASE)
    (tmp_path / "arena.toml").write_text(ARENA)
    spec = load_arena(tmp_path / "arena.toml", out=tmp_path / "out")
    assert run_arena(spec, say=lambda _: None, train=OutcomeTrain(recorded, outcomes)) == 0
    data = json.loads((tmp_path / "out" / "arena.json").read_text())
    final = data["paired"][0]
    assert (final["label"], final["which"]) == ("tis vs off under q8", "final")
    # d = 1, 1, 1 of 4 problems: sd 0, so the SE is the eval floor: net 3 over 3 seeds, 4 problems:
    # three problems at delta 1/3: Var_p = 3 / 9 / 4 - (3 / 12)^2 = 0.0208333, SE = sqrt(0.0208333 / 4) = 0.0721688
    assert final["seeds"]["se_seeds"] == 0.0 and final["seeds"]["eval_floor"] == pytest.approx(0.0721688, abs=1e-6)
    assert final["seeds"]["low"] == pytest.approx(0.25 - 4.303 * 0.0721688, abs=1e-6)
    md = (tmp_path / "out" / "arena.md").read_text()
    assert "| tis vs off under q8 | final | 0, 1, 2 | +0.250, +0.250, +0.250 | +0.250 | 0.000 | 0.072 | " \
           "[-0.061, +0.561] | 0.408 | no difference detected | eval set |" in md
    assert "Paired statistics." in md and "no difference detected" in (tmp_path / "out" / "arena.html").read_text()
    if recorded == 4 or outcomes:  # every problem's outcome, from samples.jsonl or eval_outcomes.jsonl
        boot = paired_bootstrap(np.array(OUTCOMES["tis"], float), np.array(OUTCOMES["off"], float), [0, 1, 2])
        assert final["problems"]["low"] == pytest.approx(boot.low) and verdict(boot) in final["statement"]
    else:
        assert final["problems"] is None
        assert "not available: samples.jsonl records 2 of 4 eval problems at the last step" in final["statement"]
    assert [c["outcomes_recorded"] for c in data["cells"]] == [4 if outcomes else recorded] * 6


def _run_cell(tmp_path: Path, samples: list[float], outcomes: list | None, final: float = 0.5):
    """A cell of 4 eval problems and run.steps 2 whose run folder holds samples.jsonl rows of the first problems'
    `samples` rewards at step 2 and, unless None, eval_outcomes.jsonl's step-2 row `outcomes`; final_outcomes of it."""
    rows = [{"step": 2, "index": i, "reward": r} for i, r in enumerate(samples)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if outcomes is not None:
        evals = [{"step": 0, "rewards": [0.0] * 4}, {"step": 2, "rewards": outcomes}]
        (tmp_path / "eval_outcomes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    cell = SimpleNamespace(run_dir=tmp_path, config=SimpleNamespace(task=SimpleNamespace(eval_size=4),
                                                                    run=SimpleNamespace(steps=2)))
    return final_outcomes(cell, final)


def test_final_outcomes_read_eval_outcomes_first_and_samples_when_it_lacks_the_step(tmp_path):
    # eval_outcomes.jsonl's last-step row is every problem's reward (an unscorable one None, out of the mean 0.5)
    assert _run_cell(tmp_path, [1.0, 0.0], [1.0, None, 0.0, 0.5]) == (4, [1.0, None, 0.0, 0.5], [])
    # a run from before the file: samples.jsonl holding every problem still gives them
    (tmp_path / "eval_outcomes.jsonl").unlink()
    assert _run_cell(tmp_path, [1.0, 0.0, 1.0, 0.0], None) == (4, [1.0, 0.0, 1.0, 0.0], [])
    # neither holds every problem: the count samples.jsonl records, no list
    assert _run_cell(tmp_path, [1.0, 0.0], None) == (2, None, [])


def test_eval_outcomes_of_another_length_or_mean_are_left_out_with_a_warning(tmp_path):
    recorded, outcomes, warnings = _run_cell(tmp_path, [1.0, 0.0], [1.0, 0.0, 1.0])
    assert (recorded, outcomes) == (2, None)
    assert warnings == ["eval_outcomes.jsonl's step-2 row has 3 rewards for 4 eval problems: left out, "
                        "samples.jsonl read instead"]
    recorded, outcomes, warnings = _run_cell(tmp_path, [1.0, 0.0], [1.0, 1.0, 1.0, 0.0])  # mean 0.75, logged 0.5
    assert (recorded, outcomes) == (4, None)
    assert warnings == ["eval_outcomes.jsonl's step-2 rewards do not give the logged final accuracy 0.5: "
                        "per-problem outcomes left out"]


def test_a_constant_difference_with_float_rounding_is_not_established():
    """Review finding: 0.3 - 0.2, 0.2 - 0.1, 0.7 - 0.6 differ by float rounding only (SE about 1e-17), which read
    'difference detected ... MDE 0.000'; like an exactly constant difference it has no spread to bound it."""
    from nearpolicy.arena.paired import NO_SPREAD, paired_bootstrap, paired_seeds, verdict

    a = {0: 0.3, 1: 0.2, 2: 0.7}
    p = paired_seeds(a, {s: v - 0.1 for s, v in a.items()})
    assert 0 < p.se <= NO_SPREAD
    assert verdict(p).startswith("not established")
    boot = paired_bootstrap(np.full((3, 4), 0.3), np.full((3, 4), 0.2))
    assert boot.se <= NO_SPREAD and verdict(boot).startswith("not established")
    assert verdict(paired_seeds(a, {0: 0.2, 1: 0.1, 2: 0.5})).startswith(("difference detected", "no difference"))


def test_seeds_for_mde_scales_the_observed_se_by_root_seeds():
    from nearpolicy.arena.paired import seeds_for_mde

    # 3 seeds, SE 0.0346 (the dose sweep's noise1 vs f32): M80[n-1] * 0.0346 * sqrt(3 / n) first <= 0.05 at n = 14
    # (13 seeds: 3.031 * 0.0346 * 0.4804 = 0.0504; 14: 3.013 * 0.0346 * 0.4629 = 0.0483)
    p = Paired("seeds", -0.04, -0.19, 0.11, 0.0346, M80[1] * 0.0346, 3, None, 2)
    assert seeds_for_mde(p, 0.05) == 14
    assert seeds_for_mde(p, 0.2) == 3  # already met at 3 seeds (MDE 0.196)
    assert seeds_for_mde(p, 1e-4) is None  # not within MOST_SEEDS
    boot = Paired("problems x seeds", 0.0, -0.1, 0.1, 0.03, 0.084, 3, 256)
    assert seeds_for_mde(boot, 0.05) is None
    with pytest.raises(ValueError):
        seeds_for_mde(p, 0.0)


def test_a_null_statement_says_how_many_seeds_its_spread_needs():
    from nearpolicy.arena.comparisons import PairedComparison
    from nearpolicy.arena.paired import seeds_for_mde

    p = paired_seeds({0: 0.50, 1: 0.60, 2: 0.55}, {0: 0.52, 1: 0.55, 2: 0.60})
    c = PairedComparison(("tis", "q4_1"), ("off", "q4_1"), "late_reward", p, None, None, None, None, 3)
    assert "no difference detected" in c.statement()
    assert f"about {seeds_for_mde(p, 0.05)} seeds would bring its MDE to 0.05" in c.statement()
    detected = paired_seeds({0: 0.70, 1: 0.71, 2: 0.72}, {0: 0.50, 1: 0.52, 2: 0.50})
    c2 = PairedComparison(("tis", "q4_1"), ("off", "q4_1"), "late_reward", detected, None, None, None, None, 3)
    assert "seeds would bring" not in c2.statement()


def test_seeds_for_mde_says_nothing_without_an_observed_spread():
    from nearpolicy.arena.paired import seeds_for_mde

    flat = Paired("seeds", 0.1, 0.1, 0.1, 0.0, 0.0, 3, None, 2)
    assert seeds_for_mde(flat, 1e-9) is None
    assert seeds_for_mde(Paired("seeds", 0.1, 0.0, 0.2, float("nan"), 0.1, 3, None, 2), 0.05) is None
    with pytest.raises(ValueError):
        seeds_for_mde(flat, float("nan"))


def test_a_corrections_name_labels_its_first_drawn_line_even_when_its_first_cell_logged_nothing():
    """Found by the sixth sitting's new-user trial: the label went on each correction's first cell, so a correction whose first cell had no
    evals drew unlabelled lines and matplotlib warned "No artists with labels found to put in legend"."""
    import warnings
    from types import SimpleNamespace

    from nearpolicy.arena.page import source_figure

    spec = SimpleNamespace(corrections=[SimpleNamespace(name="tis")])
    empty = _cell("tis", "q8", 0, 0.5)
    drawn = _cell("tis", "q8", 1, 0.5)
    drawn.accuracy, drawn.k3 = [(0, 0.3), (10, 0.5)], [(1, 0.004), (2, 0.003)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        png = source_figure(spec, [empty, drawn], "q8")
    assert png.startswith(b"\x89PNG")
