"""The arena's sequential stopping (arena/sequential.py, runner.run_sequential): the pure rule on hand-built per-seed
differences, its t quantiles and MDE multipliers at the adjusted level against independent values, its false-effect
rate by simulation under a true null, the arena file's keys, and the runner with a fake `train` (like
tests/test_arena.py) whose metrics settle every comparison after 3 of 5 seeds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from nearpolicy.arena import comparisons, sequential
from nearpolicy.arena.paired import paired_seeds
from nearpolicy.arena.runner import dry_run, run_arena
from nearpolicy.arena.sequential import Judgment, Rule, decide, judge
from nearpolicy.arena.spec import ArenaError, load_arena
from nearpolicy.ops.t_quantiles import M80, T975, betainc, mde_multiplier, noncentral_power, t_quantile

LEVEL3 = 0.05 / 3  # K = 3 looks: 5 seeds listed, min_seeds 3


def _paired(differences: list[float]):
    """paired_seeds of per-seed differences d_s (arm a = d_s, base b = 0; no eval-set floor)."""
    return paired_seeds(dict(enumerate(differences)), {s: 0.0 for s in range(len(differences))})


# ---- quantiles -------------------------------------------------------------------------------------------------


def test_t_quantile_matches_closed_forms_and_the_printed_tables():
    for p in (0.6, 0.9, 0.975, 1 - LEVEL3 / 2, 0.9995):
        assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)  # Cauchy
        q = 2 * p - 1  # df 2: F(t) = 1/2 + t / (2 sqrt(2 + t^2))  =>  t = q sqrt(2 / (1 - q^2))
        assert t_quantile(p, 2) == pytest.approx(q * math.sqrt(2 / (1 - q * q)), rel=1e-9)
    assert t_quantile(1 - LEVEL3 / 2, 2) == pytest.approx(7.6488, abs=1e-4)  # the brief's value, from the closed form
    # NIST/SEMATECH e-Handbook 1.3.6.7.2, upper critical values of Student's t (3 decimals)
    for p, df, value in ((0.995, 2, 9.925), (0.999, 2, 22.327), (0.995, 4, 4.604), (0.999, 4, 7.173),
                         (0.995, 10, 3.169), (0.999, 10, 4.144), (0.995, 30, 2.750)):
        assert t_quantile(p, df) == pytest.approx(value, abs=6e-4)
    for df, value in enumerate(T975, start=1):
        assert t_quantile(0.975, df) == pytest.approx(value, abs=6e-4)
    assert t_quantile(0.5, 7) == pytest.approx(0.0, abs=1e-10) and t_quantile(0.1, 5) == -t_quantile(0.9, 5)
    assert betainc(2.0, 1.0, 0.3) == pytest.approx(0.09) and betainc(1.0, 1.0, 0.42) == pytest.approx(0.42)
    with pytest.raises(ValueError):
        t_quantile(1.0, 3)


def test_the_mde_multiplier_is_m80_at_five_percent_and_has_its_power_at_the_adjusted_level():
    for df in (1, 2, 3, 5, 10, 30):
        assert mde_multiplier(0.05, df) == pytest.approx(M80[df - 1], abs=6e-4)
    # the power at the adjusted level, by simulation of the noncentral t (400 000 draws, SE of a power 0.0006)
    rng = np.random.default_rng(7)
    for df in (2, 4):
        m, c = mde_multiplier(LEVEL3, df), t_quantile(1 - LEVEL3 / 2, df)
        t = (rng.standard_normal(400_000) + m) / np.sqrt(rng.chisquare(df, 400_000) / df)
        assert np.mean(np.abs(t) > c) == pytest.approx(0.80, abs=0.003)
    assert mde_multiplier(LEVEL3, 2) == pytest.approx(9.816, abs=2e-3)  # scipy-free value, checked above
    assert noncentral_power(0.0, t_quantile(1 - LEVEL3 / 2, 3), 3) == pytest.approx(LEVEL3, rel=1e-4)  # size


# ---- the rule --------------------------------------------------------------------------------------------------


def test_a_clear_effect_is_settled_at_the_first_look_with_the_adjusted_interval():
    rule = Rule(5, 3, 0.05)
    assert (rule.looks, rule.level) == (3, pytest.approx(LEVEL3))
    got = judge("tis vs off", _paired([0.30, 0.31, 0.31]), rule.level, rule.target_mde)
    # by hand: mean 0.306667, sd 0.0057735, SE 0.0033333; t(1 - 0.05/6, 2) = 7.648804: half-width 0.025496;
    # MDE 9.8164 x SE = 0.032721
    assert got.outcome == "effect" and got.seeds == 3
    assert (got.low, got.high) == (pytest.approx(0.281171, abs=2e-6), pytest.approx(0.332163, abs=2e-6))
    assert got.mde == pytest.approx(0.032721, abs=2e-5)
    decision = decide(rule, [[got]], (0, 1, 2))
    assert decision.stop and decision.verdicts[0].settled_at == 1 and decision.level == pytest.approx(LEVEL3)
    # the same differences at the unadjusted 95 % level would be narrower: the adjustment is what is applied
    assert got.high - got.low > 2 * 4.303 * 0.0033333


def test_a_null_with_a_small_mde_is_settled_and_a_wide_one_is_not():
    small = judge("a", _paired([0.001, -0.001, 0.0]), LEVEL3, 0.05)
    assert small.outcome == "null" and small.low < 0 < small.high
    assert small.mde == pytest.approx(9.8164 * 0.001 / math.sqrt(3), abs=1e-5)  # sd 0.001, SE 0.000577
    wide = judge("a", _paired([0.05, -0.04, 0.02]), LEVEL3, 0.05)
    assert wide.outcome is None and "MDE" in wide.reason and wide.mde > 0.05


def test_a_noisy_comparison_never_stops_the_arena():
    rule = Rule(5, 3, 0.05)
    differences = [0.10, -0.05, 0.20, -0.10, 0.05]
    history = []
    for done in (3, 4, 5):
        history.append([judge("tis vs off", _paired(differences[:done]), rule.level, rule.target_mde)])
        decision = decide(rule, history, tuple(range(done)))
        assert not decision.stop and decision.verdicts[0].settled_at is None
    assert decision.look == 3 and decision.looks == 3


def test_a_settled_comparison_stays_settled_and_the_arena_stops_when_the_last_one_settles():
    rule = Rule(5, 3, 0.05)
    a1, a2 = Judgment("a", "effect", 0.3, 0.2, 0.4, 0.1, 3), Judgment("a", None, 0.1, -0.1, 0.3, 0.2, 4, "wide")
    b1, b2 = Judgment("b", None, 0.0, -0.2, 0.2, 0.3, 3, "wide"), Judgment("b", "null", 0.0, -0.02, 0.02, 0.04, 4)
    assert not decide(rule, [[a1, b1]], (0, 1, 2)).stop
    decision = decide(rule, [[a1, b1], [a2, b2]], (0, 1, 2, 3))
    assert decision.stop and [v.settled_at for v in decision.verdicts] == [1, 2]
    assert decision.verdicts[0].settled == a1 and decision.verdicts[0].now == a2
    line = sequential.verdict_lines(decision, 0.05)[0]
    assert line.startswith("a settled at look 1: difference detected: +0.300") and "at look 2: not settled" in line


def test_without_a_paired_result_or_a_spread_nothing_is_settled_and_bad_histories_are_refused():
    assert judge("x", None, LEVEL3, 0.05, "not established: 2 seeds").reason == "not established: 2 seeds"
    same = judge("x", _paired([0.1, 0.1, 0.1]), LEVEL3, 0.05)
    assert same.outcome is None and "sd 0" in same.reason
    rule = Rule(4, 3, 0.05)
    with pytest.raises(ValueError, match="1 to 2 looks"):
        decide(rule, [], ())
    with pytest.raises(ValueError, match="1 to 2 looks"):
        decide(rule, [[same]] * 3, ())
    with pytest.raises(ValueError, match="same comparisons"):
        decide(rule, [[same], [Judgment("y", None)]], ())


def _false_effects(rule: Rule, arenas: int, sigma: float, level: float, rng) -> float:
    """The fraction of simulated arenas under a true null (d_s ~ N(0, sigma)) in which the rule, looking after
    min_seeds .. max_seeds seeds at `level` and stopping once the comparison is settled, settles on an effect."""
    false = 0
    for d in rng.normal(0.0, sigma, size=(arenas, rule.max_seeds)):
        history = []
        for done in range(rule.min_seeds, rule.max_seeds + 1):
            history.append([judge("c", _paired(list(d[:done])), level, rule.target_mde)])
            decision = decide(rule, history, tuple(range(done)))
            if decision.stop:
                false += decision.verdicts[0].settled.outcome == "effect"
                break
    return false / arenas


def test_under_a_true_null_the_rules_false_detection_rate_is_at_most_alpha():
    rng = np.random.default_rng(2024)
    arenas, bound = 2000, 0.05 + 3 * math.sqrt(0.05 * 0.95 / 2000)
    never_null = Rule(5, 3, 1e-9)  # no null stop: every look is taken, the worst case for false effects
    assert _false_effects(never_null, arenas, 0.05, never_null.level, rng) <= bound
    futile = Rule(5, 3, 0.2)  # nulls settle often (MDE at 3 seeds ~ 9.8 x 0.05 / sqrt(3) = 0.28, then smaller)
    assert _false_effects(futile, arenas, 0.05, futile.level, rng) <= bound
    # the test can fail: the same looks at the unadjusted 5 % level exceed alpha
    assert _false_effects(never_null, arenas, 0.05, 0.05, rng) > bound


# ---- the arena file --------------------------------------------------------------------------------------------

from test_arena import BASE  # noqa: E402  (the same two-step base config as the arena tests)

ARENA = """
[arena]
base = "base.toml"
seeds = [0, 1, 2, 3, 4]
baseline = "off"
sequential = true
target_mde = 0.05

[corrections]
off = { preset = "off" }
tis = { preset = "tis" }

[sources]
q8 = { set = ["engine.precision='q8_0'"] }
noise = { set = ["engine.logit_noise=0.5"] }
"""


def _arena(tmp_path: Path, text: str = ARENA) -> Path:
    (tmp_path / "base.toml").write_text(BASE)
    path = tmp_path / "arena.toml"
    path.write_text(text)
    return path


def test_the_sequential_keys_are_read_with_their_defaults(tmp_path):
    spec = load_arena(_arena(tmp_path))
    assert (spec.sequential.target_mde, spec.sequential.min_seeds, spec.sequential.stop_on) == (0.05, 3, "final")
    off = load_arena(_arena(tmp_path, ARENA.replace("sequential = true", "sequential = false")))
    assert off.sequential is None
    assert load_arena(_arena(tmp_path, ARENA.replace("target_mde", "min_seeds = 5\nstop_on = \"best\"\ntarget_mde"))
                      ).sequential.min_seeds == 5


def _add(line: str, text: str) -> str:
    """The arena file with `line` added to its [arena] table."""
    return text.replace("target_mde = 0.05", f"target_mde = 0.05\n{line}")


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.replace("sequential = true", 'sequential = "yes"'), "arena.sequential must be true or false"),
    (lambda t: t.replace("target_mde = 0.05", ""), "arena.target_mde is required with arena.sequential = true"),
    (lambda t: t.replace("target_mde = 0.05", "target_mde = 1.0"), r"arena.target_mde must be a number in \(0, 1\)"),
    (lambda t: t.replace("target_mde = 0.05", "target_mde = 0"), r"arena.target_mde must be a number in \(0, 1\)"),
    (lambda t: _add("min_seeds = 2", t), "arena.min_seeds must be an integer >= 3"),
    (lambda t: _add("min_seeds = 6", t), "arena.min_seeds must be .* at most the 5 seeds listed"),
    (lambda t: _add("min_seeds = 3.0", t), "arena.min_seeds must be an integer"),
    (lambda t: _add('stop_on = "worst"', t), "arena.stop_on must be one of final, best"),
    (lambda t: _add("stop_after = 3", t), "arena: unknown key 'stop_after'"),
], ids=["not-bool", "no-target", "target-1", "target-0", "min-2", "min-above-seeds", "min-float", "stop-on", "unknown"])
def test_bad_sequential_keys_are_refused_naming_the_key(tmp_path, edit, match):
    with pytest.raises(ArenaError, match=match):
        load_arena(_arena(tmp_path, edit(ARENA)))


def test_stop_on_accepts_every_outcome_the_comparisons_describe(tmp_path):
    from nearpolicy.arena.spec import OUTCOME_NAMES

    assert comparisons.WHICH == OUTCOME_NAMES  # one list: spec.py names them, comparisons.py describes each
    for name in OUTCOME_NAMES:
        (tmp_path / name).mkdir()
        spec = load_arena(_arena(tmp_path / name, ARENA.replace("target_mde", f'stop_on = "{name}"\ntarget_mde')))
        assert spec.sequential.stop_on == name


# ---- the runner ------------------------------------------------------------------------------------------------

BASELINE = [0.50, 0.52, 0.48, 0.51, 0.49]  # off/q8's final accuracy at seeds 0..4


def settling(correction: str, source: str, seed: int) -> float:
    """Final accuracies whose four comparisons settle at the first look (3 seeds): tis vs off under q8 +0.31 (an
    effect), tis vs off under noise ~0 with sd 0.001 (a null: MDE 0.006), and both sources' noise vs q8 (effects)."""
    value = BASELINE[seed]
    if source == "noise":
        value -= (0.10, 0.11, 0.11, 0.10, 0.11)[seed]
        if correction == "tis":
            value += (0.001, -0.001, 0.0, 0.001, 0.0)[seed]
    elif correction == "tis":
        value += (0.30, 0.31, 0.31, 0.30, 0.31)[seed]
    return value


def noisy(correction: str, source: str, seed: int) -> float:
    """As `settling`, but tis under q8 scatters by seed: tis vs off under q8 never settles."""
    if (correction, source) == ("tis", "q8"):
        return BASELINE[seed] + (0.20, -0.10, 0.15, -0.20, 0.10)[seed]
    return settling(correction, source, seed)


class FakeTrain:
    """`train` for run_arena: writes a cell's metrics.jsonl (step-0 accuracy 0.5, the final accuracy of `final`)
    and returns (0, "done"), or a chosen outcome per cell id."""

    def __init__(self, final=settling, outcomes=None):
        self.final, self.calls, self.outcomes = final, [], dict(outcomes or {})

    def __call__(self, cfg, resume, log, progress):
        cell = cfg.run.name.replace("__", "/")
        self.calls.append((cell, resume))
        run_dir = cfg.run.output_dir / cfg.run.name
        run_dir.mkdir(parents=True, exist_ok=True)
        correction, source, seed = cell.split("/")
        train = {"reward/mean": 0.5, "mismatch/k3": 0.01, "correction/rejected_frac": 0.0, "time/step": 1.0}
        rows = [{"step": 0, "eval/accuracy": 0.5}, {"step": 1, "eval/accuracy": 0.5} | train,
                {"step": 2, "eval/accuracy": self.final(correction, source, int(seed[1:]))} | train]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return self.outcomes.pop(cell, (0, "done"))


def _ids(seeds, cells=("off/q8", "off/noise", "tis/q8", "tis/noise")) -> list[str]:
    return [f"{c}/s{s}" for s in seeds for c in cells]


def test_the_arena_stops_after_three_of_five_seeds_and_records_the_rest_as_skipped(tmp_path):
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    train, lines = FakeTrain(), []
    assert run_arena(spec, say=lines.append, train=train) == 0
    assert [c for c, _ in train.calls] == _ids([0, 1, 2])  # seed-major; seeds 3 and 4 never run
    state = json.loads((tmp_path / "out" / "arena-state.json").read_text())["cells"]
    assert {cid for cid, rec in state.items() if rec["status"] == "skipped"} == set(_ids([3, 4]))
    head = "sequential stop after 3 seeds (0, 1, 2; look 1 of 3, level 0.0167): "
    said = [line[len(head):] for line in lines if line.startswith(head)]
    assert said[0].startswith("tis vs off under q8 settled at look 1: difference detected: +0.307 (98.3 % CI [")
    assert said[1].startswith("tis vs off under noise settled at look 1: no difference detected, MDE 0.006 <= target "
                              "0.050")
    assert len(said) == 4 and any("8 cell(s) of seed(s) 3, 4 recorded as skipped" in line for line in lines)
    record = json.loads((tmp_path / "out" / sequential.RECORD).read_text())
    assert record["stopped"] == {"look": 1, "after_seeds": [0, 1, 2], "skipped": _ids([3, 4])}
    assert [v["settled"]["outcome"] for v in record["looks"][0]["verdicts"]] == ["effect", "null", "effect", "effect"]
    md = (tmp_path / "out" / "arena.md").read_text()
    assert "8 skipped by the sequential rule" in md and "## Sequential stopping" in md
    assert "Stopped after look 1 (seeds 0, 1, 2)" in (tmp_path / "out" / "arena.html").read_text()
    # a rerun recomputes the rule from the stored results: the same stop, nothing run
    assert run_arena(spec, say=lambda _: None, train=train) == 0 and len(train.calls) == 12
    assert "skipped" in dry_run(spec).splitlines()[-2]


def _counts(spec) -> dict[str, int]:
    """The state's non-zero status counts."""
    from nearpolicy.arena.state import ArenaState

    return {k: v for k, v in ArenaState.open(spec.out, spec).counts().items() if v}


def test_the_skipped_cells_run_when_the_recomputed_rule_goes_on(tmp_path):
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    train = FakeTrain()
    run_arena(spec, say=lambda _: None, train=train)
    stricter = load_arena(_arena(tmp_path, ARENA.replace("target_mde = 0.05", "target_mde = 0.001")),
                          out=tmp_path / "out")  # the null (MDE 0.006) is no longer settled: every seed runs
    assert run_arena(stricter, say=lambda _: None, train=train) == 0
    assert [c for c, _ in train.calls[12:]] == _ids([3, 4])
    record = json.loads((tmp_path / "out" / sequential.RECORD).read_text())
    assert len(record["looks"]) == 3 and record["stopped"] is None and _counts(stricter) == {"done": 20}


def test_the_skipped_cells_run_when_the_rule_is_turned_off(tmp_path):
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    train = FakeTrain()
    run_arena(spec, say=lambda _: None, train=train)
    off = load_arena(_arena(tmp_path, ARENA.replace("sequential = true", "sequential = false")), out=tmp_path / "out")
    assert run_arena(off, say=lambda _: None, train=train) == 0
    assert [c for c, _ in train.calls[12:]] == [c.id for c in off.cells if c.seed in (3, 4)]  # the arena's order
    assert _counts(off) == {"done": 20}


def test_a_comparison_that_never_settles_runs_every_seed_seed_major(tmp_path):
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    train, lines = FakeTrain(noisy), []
    assert run_arena(spec, say=lines.append, train=train) == 0
    assert [c for c, _ in train.calls] == _ids(range(5))
    assert sum(line.startswith("sequential look after") for line in lines) == 2  # looks 1 and 2 go on
    last = "sequential: every seed run, after 5 seeds (0, 1, 2, 3, 4; look 3 of 3, level 0.0167): tis vs off under q8: "
    assert any(line.startswith(last + "not settled: CI contains 0 and MDE") for line in lines)
    record = json.loads((tmp_path / "out" / sequential.RECORD).read_text())
    assert [look["stop"] for look in record["looks"]] == [False, False, False] and record["stopped"] is None


def test_an_interrupted_sequential_arena_continues_then_stops_where_the_rule_says(tmp_path):
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    train = FakeTrain(outcomes={"tis/q8/s1": (143, "stopped by SIGTERM at step 1")})
    assert run_arena(spec, say=lambda _: None, train=train) == 143
    assert [c for c, _ in train.calls] == _ids([0]) + ["off/q8/s1", "off/noise/s1", "tis/q8/s1"]
    assert run_arena(spec, say=lambda _: None, train=train) == 0
    assert train.calls[7] == ("tis/q8/s1", True) and [c for c, _ in train.calls[8:]] == ["tis/noise/s1"] + _ids([2])
    assert _counts(spec) == {"done": 12, "skipped": 8}


def test_sequential_off_keeps_the_arenas_order(tmp_path):
    spec = load_arena(_arena(tmp_path, ARENA.replace("sequential = true", "sequential = false")), out=tmp_path / "o")
    train = FakeTrain()
    assert run_arena(spec, say=lambda _: None, train=train) == 0
    assert [c for c, _ in train.calls] == [c.id for c in spec.cells] and len(train.calls) == 20
    assert not (tmp_path / "o" / sequential.RECORD).exists()


def test_dry_run_states_the_rule_and_lists_the_cells_seed_major(tmp_path):
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    out = dry_run(spec)
    assert "K = 3 look(s) (5 seeds listed, min_seeds 3), each at two-sided level 0.05 / 3 = 0.0167" in out
    assert "target 0.05" in out and "look 1 after 3 seeds: t 7.649, MDE 9.816 x SE; look 2 after 4 seeds: t 4.857" \
        in out
    assert "at least 12 of the 20 selected cells run (the first 3 seeds), at most all 20" in out
    cells = [line.split()[0] for line in out.splitlines() if not line.startswith("#")]
    assert cells == _ids(range(5))
    assert not (tmp_path / "out").exists()


# ---- arena.stop_for: the comparisons the rule waits for -------------------------------------------------------

WAIT = 'stop_for = ["tis vs off under noise", "off: noise vs q8"]'


def test_stop_for_is_read_and_names_only_the_arenas_comparisons(tmp_path):
    spec = load_arena(_arena(tmp_path, _add(WAIT, ARENA)))
    assert spec.sequential.stop_for == ("tis vs off under noise", "off: noise vs q8")
    assert spec.sequential.waits_for("off: noise vs q8") and not spec.sequential.waits_for("tis vs off under q8")
    assert load_arena(_arena(tmp_path)).sequential.waits_for("tis vs off under q8")  # default: every comparison


@pytest.mark.parametrize("line,match", [
    ('stop_for = "tis vs off under q8"', "arena.stop_for must be a non-empty list of comparison labels"),
    ("stop_for = []", "arena.stop_for must be a non-empty list"),
    ('stop_for = ["tis vs off under q4_1"]', r"arena.stop_for: 'tis vs off under q4_1' is not one of this arena's "
                                            r"comparisons: 'tis vs off under q8'; 'tis vs off under noise'; "
                                            r"'off: noise vs q8'; 'tis: noise vs q8'"),
    ('stop_for = ["off: noise vs q8", "off: noise vs q8"]', "arena.stop_for lists a comparison twice"),
], ids=["string", "empty", "unknown", "twice"])
def test_bad_stop_for_is_refused_listing_the_valid_labels(tmp_path, line, match):
    with pytest.raises(ArenaError, match=match):
        load_arena(_arena(tmp_path, _add(line, ARENA)))


def test_the_arena_stops_once_the_comparisons_it_waits_for_settle(tmp_path):
    # `noisy`: tis under q8 scatters, so its two comparisons never settle and every seed runs without stop_for
    # (test_a_comparison_that_never_settles_runs_every_seed_seed_major); waiting only for the two comparisons
    # without it, both settle at the first look and the arena stops after 3 of 5 seeds
    spec = load_arena(_arena(tmp_path, _add(WAIT, ARENA)), out=tmp_path / "out")
    train, lines = FakeTrain(noisy), []
    assert run_arena(spec, say=lines.append, train=train) == 0
    assert [c for c, _ in train.calls] == _ids([0, 1, 2])
    record = json.loads((tmp_path / "out" / sequential.RECORD).read_text())
    assert record["rule"]["stop_for"] == list(spec.sequential.stop_for)
    assert [v["label"] for v in record["looks"][0]["verdicts"]] == list(spec.sequential.stop_for)
    assert record["stopped"]["skipped"] == _ids([3, 4])
    md = (tmp_path / "out" / "arena.md").read_text()
    assert "the comparisons it waits for (arena.stop_for): tis vs off under noise; off: noise vs q8" in md
    assert "every comparison it waits for settled" in md
    assert "tis vs off under q8" in md  # the page still reports the comparison the rule did not wait for
    assert "the comparisons it waits for (arena.stop_for): tis vs off under noise" in dry_run(spec)


def test_a_changed_stop_for_is_warned_about_and_marks_the_stored_looks_stale(tmp_path):
    from nearpolicy.arena.page import write_page
    from nearpolicy.arena.state import ArenaState

    first = load_arena(_arena(tmp_path, _add(WAIT, ARENA)), out=tmp_path / "out")
    train = FakeTrain(noisy)
    run_arena(first, say=lambda _: None, train=train)  # stops after 3 seeds
    edited = load_arena(_arena(tmp_path, _add('stop_for = ["off: noise vs q8"]', ARENA)), out=tmp_path / "out")
    write_page(edited, ArenaState.open(edited.out, edited))
    md = (tmp_path / "out" / "arena.md").read_text()
    assert ("Stale: arena.stop_for changed since the recorded looks (was: tis vs off under noise; off: noise vs q8; "
            "now: off: noise vs q8); running the arena again retakes the looks.") in md
    lines = []
    assert run_arena(edited, say=lines.append, train=train) == 0
    assert any(line.startswith("warning: arena.stop_for changed since the recorded looks") for line in lines)
    write_page(edited, ArenaState.open(edited.out, edited))
    assert "Stale:" not in (tmp_path / "out" / "arena.md").read_text()  # the looks were retaken with the new list


def test_the_rule_needs_a_comparison(tmp_path):
    one = ARENA.replace('tis = { preset = "tis" }\n', "").replace('noise = { set = ["engine.logit_noise=0.5"] }\n', "")
    with pytest.raises(ArenaError, match="arena.sequential = true needs a comparison to judge"):
        load_arena(_arena(tmp_path, one))
    assert load_arena(_arena(tmp_path, one.replace("sequential = true", "sequential = false"))).sequential is None
