"""The correction arena's machinery without a model: the arena file's validation, the cells it expands into, the
state file (a changed arena refused), the runner's bookkeeping (finished cells never re-run, failures recorded and
classified, a stop ends the arena) and the table's numbers, with a fake `train` that writes known metrics.
tests/test_arena_run.py runs a tiny arena through the real training API."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from nearpolicy.arena.runner import classify, run_arena
from nearpolicy.arena.spec import ArenaError, load_arena
from nearpolicy.arena.state import ArenaState
from nearpolicy.arena.table import Aggregate, changed_fraction, collapsed, spread_statements

BASE = """
[run]
steps = 2
[task]
eval_size = 4
[logging]
eval_every = 1
"""

ARENA = """
[arena]
base = "base.toml"
seeds = [0, 1]
set = ["algorithm.lr=1e-5"]
baseline = "off"

[corrections]
off = { preset = "off" }
tis = { preset = "tis", set = ["correction.upper=3.0"] }

[sources]
q8 = { set = ["engine.precision='q8_0'"], note = "the default engine" }
noise = { set = ["engine.logit_noise=0.5"] }
"""


def _arena(tmp_path: Path, text: str = ARENA, base: str | None = BASE) -> Path:
    if base is not None:
        (tmp_path / "base.toml").write_text(base)
    path = tmp_path / "arena.toml"
    path.write_text(text)
    return path


def test_cells_are_every_correction_source_and_seed_as_validated_configs(tmp_path):
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    assert [c.id for c in spec.cells] == ["off/q8/s0", "off/q8/s1", "off/noise/s0", "off/noise/s1",
                                          "tis/q8/s0", "tis/q8/s1", "tis/noise/s0", "tis/noise/s1"]
    cell = spec.cells[7]
    cfg = cell.config
    assert (cfg.run.seed, cfg.run.name, cfg.run.output_dir) == (1, "tis__noise__s1", tmp_path / "out" / "cells")
    assert (cfg.correction.preset, cfg.correction.upper, cfg.engine.logit_noise) == ("tis", 3.0, 0.5)
    assert cfg.algorithm.lr == 1e-5 and cfg.run.steps == 2  # arena.set and the base file
    assert spec.cells[0].config.correction.preset == "off" and spec.cells[0].config.engine.logit_noise == 0.0
    assert [c.id for c in spec.select("*/noise/s0")] == ["off/noise/s0", "tis/noise/s0"]
    assert [c.id for c in spec.select(["tis/q8/s1", "off/noise/*"])] == [  # repeated --only: any glob, grid order
        "off/noise/s0", "off/noise/s1", "tis/q8/s1"]
    with pytest.raises(ArenaError, match="--only 'tis/none/\\*' matches no cell"):
        spec.select(["tis/q8/s1", "tis/none/*"])


def test_the_base_can_be_a_runs_config_json_or_a_json_config(tmp_path, monkeypatch, started_elsewhere):
    """arena.base naming a run folder's config.json takes that run's whole config, its relative paths read where the
    run started (plan.json), whatever the current folder; the cells set their own seed, name and output folder. Any
    other .json is an ordinary config; a repeated JSON key is refused with the arena key named."""
    from nearpolicy.config.schema import load_config
    from nearpolicy.runs.folder import write_json

    started, elsewhere = started_elsewhere
    cfg = load_config(None, ["run.output_dir='runs'", "run.name=first", "task.kind=jsonl", "task.path='data.jsonl'",
                             "algorithm.lr_schedule=cosine", "run.steps=3", "run.seed=7"])
    run = started / "runs" / "first"
    run.mkdir(parents=True)
    write_json(run / "config.json", cfg.model_dump(mode="json"))
    write_json(run / "plan.json", {"working_dir": str(started)})
    monkeypatch.chdir(elsewhere)
    text = ARENA.replace('"base.toml"', json.dumps(str(run / "config.json")))
    spec = load_arena(_arena(tmp_path, text, base=None), out=tmp_path / "out")
    cell = spec.cells[-1].config
    assert cell.task.path == started / "data.jsonl" and cell.algorithm.lr_schedule == "cosine"
    assert (cell.run.steps, cell.run.seed, cell.run.name, cell.run.output_dir) == (
        3, 1, "tis__noise__s1", tmp_path / "out" / "cells")
    (tmp_path / "plain.json").write_text(json.dumps({"run": {"steps": 4}, "task": {"eval_size": 4}}))
    plain = load_arena(_arena(tmp_path, ARENA.replace('"base.toml"', '"plain.json"'), base=None))
    assert plain.cells[0].config.run.steps == 4
    (tmp_path / "plain.json").write_text('{"run": {"steps": 4, "steps": 5}}')
    with pytest.raises(ArenaError, match=r"arena.base: .*plain.json: .*steps"):
        load_arena(_arena(tmp_path, ARENA.replace('"base.toml"', '"plain.json"'), base=None))


OVERRIDE = '\n[[override]]\ncells = "tis/*/s1"\nset = ["run.steps=3"]\n'


def test_an_override_applies_to_the_cells_its_glob_matches(tmp_path):
    spec = load_arena(_arena(tmp_path, ARENA.replace("baseline", 'vary = ["run.steps"]\nbaseline') + OVERRIDE))
    assert {c.id: c.config.run.steps for c in spec.cells if c.config.run.steps == 3} == {"tis/q8/s1": 3,
                                                                                         "tis/noise/s1": 3}


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.replace("seeds = [0, 1]", "seeds = [0, 1, 0]"), "arena.seeds repeats 0"),
    (lambda t: t.replace('noise = {', 'q8 = {'), "not a valid TOML file"),
    (lambda t: t.replace('noise = {', 'Q8 = {'), "sources.Q8: the name differs from sources.q8 only in case"),
    (lambda t: t.replace('noise = {', 'a__b = {'), "sources.a__b: a name is letters"),
    (lambda t: t.replace('noise = {', '"a/b" = {'), "sources.a/b: a name is letters"),
    (lambda t: t.replace("correction.upper=3.0", "correction.uper=3.0"),
     "corrections.tis: .*unknown key 'correction.uper'"),
    (lambda t: t.replace("correction.upper=3.0", "correction.upper=-1"), "corrections.tis: .*correction.upper"),
    (lambda t: t.replace("baseline", "sede = 1\nbaseline"), "arena: unknown key 'sede'"),
    (lambda t: t.replace("logit_noise=0.5", "logit_noise=0.5\", \"run.seed=3"), "sources.noise.set: run.seed is set"),
    (lambda t: t.replace('"base.toml"', '"nope.toml"'), "arena.base: the base config .*nope.toml does not exist"),
    (lambda t: t.replace('"base.toml"', '"."'), "arena.base: .* is a folder, not a config file"),
    (lambda t: t.replace('baseline = "off"', 'baseline = "tiss"'), "arena.baseline 'tiss' is not one"),
    (lambda t: t.replace("engine.logit_noise=0.5", "task.eval_size=8"),
     "cell off/noise/s0 has task.eval_size = 8 but cell off/q8/s0 has 4"),
    (lambda t: t + OVERRIDE, r"cell tis/q8/s1 has run.steps = 3 but cell off/q8/s0 has 2: .*arena.vary"),
    (lambda t: t.replace("engine.logit_noise=0.5", "algorithm.group_size=2"),
     "cell off/noise/s0 has algorithm.group_size = 2 but cell off/q8/s0 has 8"),
    (lambda t: t.replace("baseline", 'vary = ["task.eval_size"]\nbaseline'), "arena.vary: 'task.eval_size' is not"),
    (lambda t: t + OVERRIDE.replace("tis/*/s1", "tis/*/s7"), r"override\[0\].cells 'tis/\*/s7' matches no cell"),
    (lambda t: t.replace("note =", "nose ="), "sources.q8: unknown key 'nose'"),
    (lambda t: t + "deep = " + "[" * 100_000 + "]" * 100_000 + "\n", "not a valid TOML file .*recursion"),
], ids=["repeated-seed", "repeated-name", "case-collision", "double-underscore", "slash", "unknown-key",
        "bad-value", "unknown-arena-key", "owned-key", "missing-base", "base-is-folder", "bad-baseline", "different-eval",
        "different-steps", "different-group-size", "vary-task", "override-matches-nothing", "arm-key",
        "nested-past-recursion-limit"])
def test_bad_arena_files_are_refused_naming_the_problem(tmp_path, edit, match):
    with pytest.raises(ArenaError, match=match):
        load_arena(_arena(tmp_path, edit(ARENA)))


def test_arms_may_differ_in_the_task_mixture_which_draws_training_problems_only(tmp_path):
    composite = BASE.replace("[task]\n", "[task]\nname = 'composite'\n"
                             "options = {datasets=[{name='chain_sum', weight=1}, {name='products', weight=1}]}\n")
    text = ARENA.replace('preset = "off" }', 'preset = "off", set = ["task.mixture=\'fixed\'"] }').replace(
        'set = ["correction.upper=3.0"]', 'set = ["task.mixture=\'adaptive\'", "task.mixture_decay=0.5"]')
    spec = load_arena(_arena(tmp_path, text, base=composite))
    tasks = {c.id: (c.config.task.mixture, c.config.task.mixture_decay) for c in spec.cells if c.seed == 0}
    assert tasks["off/q8/s0"][0] == "fixed" and tasks["tis/q8/s0"] == ("adaptive", 0.5)
    with pytest.raises(ArenaError, match="task.eval_size = 8 but"):  # the held-out set itself still may not differ
        load_arena(_arena(tmp_path, text.replace("task.mixture_decay=0.5", "task.eval_size=8"), base=composite))


def test_a_dry_run_refuses_a_cell_whose_start_would_be_refused(tmp_path, capsys):
    from nearpolicy.cli import main

    composite = BASE.replace("[task]\n", "[task]\nname = 'composite'\ntrain_size = 1\n"
                             "options = {datasets=[{name='chain_sum', weight=1}, {name='products', weight=1}]}\n")
    text = ARENA.replace('preset = "off" }', 'preset = "off", set = ["task.mixture=\'fixed\'"] }').replace(
        'set = ["correction.upper=3.0"]', 'set = ["task.mixture=\'adaptive\'"]')
    path = _arena(tmp_path, text, base=composite)
    assert main(["arena", str(path), "--out", str(tmp_path / "out"), "--dry-run"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all("have no problem among the 1 training problems" in line for line in err)
    assert [line.split()[2] for line in err] == ["tis/q8/s0", "tis/noise/s0"]  # once per arm, the fixed arms pass
    assert not (tmp_path / "out").exists()
    assert main(["arena", str(path), "--out", str(tmp_path / "out"), "--dry-run", "--only", "off/*"]) == 0


def _row(step, acc=None, k3=None, rejected=0.0, high=0.0, low=0.0, seconds=2.0):
    row = {"step": step}
    if step:
        row |= {"reward/mean": 0.5, "mismatch/k3": k3, "correction/rejected_frac": rejected,
                "correction/frac_high": high, "correction/frac_low": low, "time/step": seconds}
    if acc is not None:
        row["eval/accuracy"] = acc
    return row


# (final accuracy by cell id; k3 of steps 1 and 2 by source); step-0 accuracy 0.5 everywhere
FINAL = {"off/q8/s0": 0.50, "off/q8/s1": 0.70, "tis/q8/s0": 0.90, "tis/q8/s1": 0.95,
         "off/noise/s0": 0.40, "off/noise/s1": 0.60, "tis/noise/s0": 0.55, "tis/noise/s1": 0.65}
K3 = {"q8": (0.001, 0.003), "noise": (0.1, 0.3)}


class FakeTrain:
    """`train` for run_arena: writes each cell's known metrics.jsonl and returns a chosen outcome per cell id."""

    def __init__(self, outcomes=None):
        self.calls, self.outcomes = [], dict(outcomes or {})

    def __call__(self, cfg, resume, log, progress):
        cell = cfg.run.name.replace("__", "/")
        self.calls.append((cell, resume))
        run_dir = cfg.run.output_dir / cfg.run.name
        run_dir.mkdir(parents=True, exist_ok=True)
        outcome = self.outcomes.pop(cell, (0, "done"))
        if isinstance(outcome, Exception):
            raise outcome
        k3 = K3[cell.split("/")[1]]
        rows = [_row(0, 0.5), _row(1, 0.6, k3[0], rejected=0.1, high=0.2), _row(2, FINAL.get(cell, 0.5), k3[1], high=0.4)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return outcome


def test_the_table_holds_each_cells_numbers_and_the_seed_spread_statements(tmp_path):
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    assert run_arena(spec, say=lambda _: None, train=FakeTrain()) == 0
    data = json.loads((tmp_path / "out" / "arena.json").read_text())
    cells = {c["id"]: c for c in data["cells"]}
    tis = cells["tis/q8/s0"]
    assert (tis["initial_accuracy"], tis["final_accuracy"], tis["best_accuracy"]) == (0.5, 0.9, 0.9)
    assert tis["k3_median"] == pytest.approx(0.002) and tis["step_seconds"] == pytest.approx(2.0)
    assert tis["changed_fraction"] == pytest.approx((0.1 + 0.2 + 0.4) / 2)  # truncate: rejected + clipped
    assert cells["off/q8/s0"]["changed_fraction"] == pytest.approx(0.1 / 2)  # off never clips: rejected only
    agg = {(a["correction"], a["source"]): a for a in data["aggregates"]}
    off = agg[("off", "q8")]
    assert off["final"] == pytest.approx([0.6, statistics.stdev([0.5, 0.7])])
    assert off["best"] == pytest.approx([0.65, statistics.stdev([0.6, 0.7])]) and off["diverged"] == 0
    assert agg[("tis", "noise")]["k3_median"] == pytest.approx(0.2)  # median of 0.1, 0.3, 0.1, 0.3
    assert data["statements"][0] == ("tis vs off under q8: final +0.325: not established: 2 seeds; at least 3 "
                                     "needed; best +0.275: not established: 2 seeds; at least 3 needed")
    md = (tmp_path / "out" / "arena.md").read_text()
    assert "| off | 0.600 ± 0.141; div 0/2; k3 2.0e-03 | 0.500 ± 0.141; div 0/2; k3 2.0e-01 |" in md
    html = (tmp_path / "out" / "arena.html").read_text()
    assert html.count("data:image/png;base64,") == 2 and "not established: 2 seeds" in html


def test_finished_cells_never_rerun_and_failures_are_recorded_and_classified(tmp_path):
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    train = FakeTrain({"off/noise/s0": (1, "error: 3 consecutive steps up to step 2 had a non-finite loss or gradient"),
                       "tis/q8/s1": RuntimeError("disk on fire")})
    assert run_arena(spec, only="off/*", say=lambda _: None, train=train) == 0
    assert [c for c, _ in train.calls] == ["off/q8/s0", "off/q8/s1", "off/noise/s0", "off/noise/s1"]
    assert run_arena(spec, say=lambda _: None, train=train) == 1  # one infrastructure failure: exit 1, goes on
    assert [c for c, _ in train.calls[4:]] == ["tis/q8/s0", "tis/q8/s1", "tis/noise/s0", "tis/noise/s1"]
    state = json.loads((tmp_path / "out" / "arena-state.json").read_text())["cells"]
    assert (state["off/noise/s0"]["status"], state["off/noise/s0"]["failure"]) == ("diverged", "divergence")
    assert (state["tis/q8/s1"]["status"], state["tis/q8/s1"]["failure"]) == ("failed", "infrastructure")
    assert "RuntimeError: disk on fire" in state["tis/q8/s1"]["error"]
    assert run_arena(spec, say=lambda _: None, train=train) == 0  # only the failed cell is tried again, resumed
    assert train.calls[8:] == [("tis/q8/s1", True)]
    assert state["off/q8/s0"]["attempts"] == 1


def test_a_stop_ends_the_arena_and_the_next_start_continues_that_cell(tmp_path):
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    train = FakeTrain({"off/q8/s1": (143, "stopped by SIGTERM at step 1")})
    lines = []
    assert run_arena(spec, say=lines.append, train=train) == 143
    assert [c for c, _ in train.calls] == ["off/q8/s0", "off/q8/s1"]
    assert any(line.startswith("arena 2/8 off/q8/s1: step 0/2 | 1 done, 0 diverged, 0 failed | ETA ") for line in lines)
    assert run_arena(spec, say=lambda _: None, train=train) == 0
    assert train.calls[2] == ("off/q8/s1", True) and len(train.calls) == 9  # the stopped cell, then 6 more


def test_a_changed_arena_is_refused_naming_what_changed(tmp_path):
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    ArenaState.open(spec.out, spec).save()
    changed = load_arena(_arena(tmp_path, ARENA.replace("correction.upper=3.0", "correction.upper=4.0")),
                         out=tmp_path / "out")
    with pytest.raises(ArenaError, match=r"changed: cell tis/q8/s0: correction.upper 3.0 -> 4.0"):
        ArenaState.open(changed.out, changed)
    fewer = load_arena(_arena(tmp_path, ARENA.replace("seeds = [0, 1]", "seeds = [0]")), out=tmp_path / "out")
    with pytest.raises(ArenaError, match=r"4 cell\(s\) removed: off/q8/s1"):
        ArenaState.open(fewer.out, fewer)


def test_cells_added_to_an_arena_join_as_pending_and_the_done_ones_stay_done(tmp_path):
    """A wider grid (another seed here; the shipped files' commented arms) continues the arena: finished cells are
    not run again, the new ones run."""
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    train = FakeTrain({})
    assert run_arena(spec, say=lambda _: None, train=train) == 0 and len(train.calls) == 8
    more = load_arena(_arena(tmp_path, ARENA.replace("seeds = [0, 1]", "seeds = [0, 1, 2]")), out=tmp_path / "out")
    assert run_arena(more, say=lambda _: None, train=train) == 0
    assert sorted(c for c, _ in train.calls[8:]) == sorted(c.id for c in more.cells if c.id.endswith("/s2"))
    assert ArenaState.open(more.out, more).counts()["done"] == 12


def test_a_key_added_to_the_schema_since_the_start_counts_as_its_default(tmp_path):
    """An arena started by an older nearpolicy lacks the keys added since: at their defaults they are no change (a
    code update does not strand an arena); a non-default value of such a key is refused."""
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    state = ArenaState.open(spec.out, spec)
    for config in state.arena["cells"].values():
        del config["algorithm"]["observation_loss_coef"], config["episode"]  # as an arena from before those keys
    state.save()
    assert ArenaState.open(spec.out, spec).cells.keys() == state.cells.keys()  # opens: nothing changed
    state.save()
    for config in state.arena["cells"].values():
        del config["algorithm"]["entropy_coef"]
    state.save()
    changed = load_arena(_arena(tmp_path, ARENA.replace("correction.upper=3.0", "correction.upper=3.0\",\n  \"algorithm.entropy_coef=0.01")),
                         out=tmp_path / "out")
    with pytest.raises(ArenaError, match=r"algorithm.entropy_coef null -> 0.01"):
        ArenaState.open(changed.out, changed)


def test_classify_and_changed_fraction():
    assert classify(0, "done") == ("done", None) and classify(130, "") == ("stopped", None)
    assert classify(1, "error: weights became non-finite at step 3") == ("diverged", "divergence")
    assert classify(1, "error: engine llamacpp:q8_0 died with SIGSEGV") == ("failed", "infrastructure")
    assert classify(2, "error: bad input") == ("failed", "infrastructure")
    row = {"correction/rejected_frac": 0.25, "correction/frac_high": 0.5, "correction/frac_low": 0.5}
    assert changed_fraction(row, "mask") == 0.25 and changed_fraction(row, "truncate") == 1.0
    assert changed_fraction({}, "mask") is None
    # 64 eval problems: 0.40 -> 0.15 is a collapse (2 SE = 0.15 < 0.25); 0.40 -> 0.21 is not below half;
    # on 4 problems 0.75 -> 0.25 is eval noise (2 SE = 0.71)
    assert collapsed(0.40, 0.15, 64) and not collapsed(0.40, 0.21, 64) and not collapsed(0.75, 0.25, 4)


def test_dry_run_lists_cells_and_the_estimated_budget(tmp_path, capsys):
    from nearpolicy.cli import main

    override = '[[override]]\ncells = "tis/noise/*"\nset = ["algorithm.lr=3e-5"]\n'
    path = _arena(tmp_path, ARENA.replace("baseline", "step_seconds = 10.0\neval_seconds = 5.0\nstart_seconds = 20.0\n"
                                          "baseline") + override)
    assert main(["arena", str(path), "--out", str(tmp_path / "out"), "--dry-run", "--only", "tis/*"]) == 0
    out = capsys.readouterr().out
    assert "off/q8/s0" not in out and out.count("pending") == 4
    every = 'algorithm.lr=1e-5 engine.logit_noise=0.5 correction.preset="tis" correction.upper=3.0 algorithm.lr=3e-5'
    assert next(line for line in out.splitlines() if line.startswith("tis/noise/s1")).endswith(every)
    assert next(line for line in out.splitlines() if line.startswith("tis/q8/s0")).endswith(
        'algorithm.lr=1e-5 engine.precision=\'q8_0\' correction.preset="tis" correction.upper=3.0')
    # 4 cells x (20 s start + 3 evals x 5 s + 2 steps x 10 s) = 220 s
    assert "8 training steps" in out and "estimated 3m40s" in out
    assert "# 2 corrections x 2 sources x 2 seeds = 8 cells; 4 selected, 4 to run" in out
    assert main(["arena", str(path), "--out", str(tmp_path / "out"), "--dry-run", "--only", "tis/q8/s0",
                 "--only", "off/noise/s1"]) == 0
    out = capsys.readouterr().out
    assert "2 selected, 2 to run" in out and [line.split()[0] for line in out.splitlines() if "pending" in line] == [
        "off/noise/s1", "tis/q8/s0"]
    one = _arena(tmp_path, ARENA.replace('noise = { set = ["engine.logit_noise=0.5"] }', "").replace("[0, 1]", "[0]"))
    assert main(["arena", str(one), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    assert "# 2 corrections x 1 source x 1 seed = 2 cells;" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()
    assert main(["arena", str(tmp_path / "missing.toml")]) == 2


@pytest.mark.parametrize("name,cells", [("arena", 24), ("arena-staleness", 18), ("arena-mc-grpo", 18),
                                        ("arena-aligned", 9)])
def test_the_shipped_arenas_load_with_at_least_three_seeds(name, cells):
    spec = load_arena(Path(__file__).resolve().parent.parent / "configs" / f"{name}.toml")
    assert len(spec.cells) == cells and len(spec.seeds) >= 3
    cfg = spec.cells[0].config
    assert (cfg.run.steps, cfg.algorithm.prompts_per_step, cfg.sampling.max_new_tokens, cfg.task.eval_size) == (
        12, 4, 32, 64)


def test_the_mc_grpo_arena_samples_g_plus_one_in_the_papers_arm():
    spec = load_arena(Path(__file__).resolve().parent.parent / "configs" / "arena-mc-grpo.toml")
    sizes = {c.id.rsplit("/", 1)[0]: (c.config.algorithm.advantage, c.config.algorithm.group_size) for c in spec.cells}
    assert sizes == {"grpo/G2": ("grpo", 2), "grpo/G8": ("grpo", 8), "mc_grpo/G2": ("mc_grpo", 2),
                     "mc_grpo/G8": ("mc_grpo", 8), "mc_grpo_g1/G2": ("mc_grpo", 3), "mc_grpo_g1/G8": ("mc_grpo", 9)}


def test_the_alignment_arena_aligns_its_arms_to_the_engine_it_samples_with():
    spec = load_arena(Path(__file__).resolve().parent.parent / "configs" / "arena-aligned.toml")
    arms = {c.id.split("/")[0]: c.config for c in spec.cells if c.id.endswith("/s0")}
    assert {k: (c.algorithm.precision_alignment, c.engine.export_rounding, c.correction.preset)
            for k, c in arms.items()} == {"tis": ("off", "nearest", "tis"), "aligned": ("engine", "nearest", "tis"),
                                          "aligned_sr": ("engine", "stochastic", "tis")}
    assert all(c.engine.precision == "q4_1" and dict(c.engine.tensor_precision) == {"embeddings": "q8_0"}
               for c in arms.values())


def test_eta_from_the_running_cells_pace_then_from_finished_cells(tmp_path):
    from nearpolicy.arena.runner import eta_seconds

    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")  # 2 steps per cell
    state = ArenaState.open(spec.out, spec)
    todo = list(spec.cells[:3])
    assert eta_seconds(spec, state, todo, 100.0, (1, 1)) == (100.0 + 200.0 * 2, True)  # 100 s per step
    state.cells[spec.cells[7].id].status, state.cells[spec.cells[7].id].seconds = "done", 300.0
    assert eta_seconds(spec, state, todo, 100.0, (1, 1)) == (100.0 + 300.0 * 2, True)  # finished cells' mean
    assert eta_seconds(spec, state, todo, 0.0) == (900.0, True)
    state.cells[spec.cells[6].id].status, state.cells[spec.cells[6].id].seconds = "diverged", 10.0  # stopped early
    assert eta_seconds(spec, state, todo, 0.0) == (900.0, True)  # not (300 + 10) / 2 per cell


def test_arena_help_says_what_it_does_and_what_it_does_not(capsys):
    from nearpolicy.cli import main

    with pytest.raises(SystemExit) as done:
        main(["arena", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "--dry-run" in out and "--only CELL_GLOB" in out
    assert "Ray workers are not supported" in out and "arena-state.json" in out


def _agg(correction: str, finals: list[float]) -> Aggregate:
    sd = statistics.stdev(finals) if len(finals) > 1 else None
    mean = statistics.fmean(finals)
    return Aggregate(correction, "q8", len(finals), len(finals), (mean, sd), (mean, sd), 0, None, None, None, 0)


def test_no_difference_is_claimed_below_three_seeds_or_from_seeds_that_happen_to_agree():
    # 2 seeds of equal accuracy per arm: sd 0, yet no claim
    two = spread_statements([_agg("off", [0.5, 0.5]), _agg("tis", [0.6, 0.6])], "off", 64)
    assert two == ["tis vs off under q8: final +0.100: not established: 2 seeds; at least 3 needed; "
                   "best +0.100: not established: 2 seeds; at least 3 needed"]
    # 3 equal seeds per arm on 64 problems: the SE is the binomial floor sqrt(p (1 - p) / 64 / 3), not 0. By hand:
    # va = 0.55 * 0.45 / 192 = 1.2891e-3, vb = 0.25 / 192 = 1.3021e-3, SE = sqrt(va + vb) = 0.050903; Welch
    # df = (va + vb)^2 / ((va^2 + vb^2) / 2) = 3.9996 -> 3, t(0.975, 3) = 3.182; bound = 3.182 x 0.050903 = 0.162
    equal = spread_statements([_agg("off", [0.5] * 3), _agg("tis", [0.55] * 3)], "off", 64)[0]
    assert equal.startswith("tis vs off under q8: final +0.050 (inside the seed spread: 95 % bound t(0.975, df 3) "
                            "x SE = 0.162, Welch")


def test_a_clearly_separated_difference_lies_outside_the_t_bound():
    # off 0.50 +- 0.02 vs tis 0.80 +- 0.10 on 64 problems, 4 seeds each: off's sd is below its binomial floor
    # by hand: tis's variance 0.02 / 3, va = 1.6667e-3 (above its floor 0.8 * 0.2 / 256 = 6.25e-4); off's sd 0.016 is
    # below its floor, vb = 0.25 / 256 = 9.7656e-4; SE = sqrt(va + vb) = 0.051412; Welch df = (va + vb)^2 /
    # ((va^2 + vb^2) / 3) = 5.617 -> 5, t(0.975, 5) = 2.571; bound = 2.571 x 0.051412 = 0.132
    off, tis = [0.48, 0.50, 0.50, 0.52], [0.70, 0.80, 0.80, 0.90]
    said = spread_statements([_agg("off", off), _agg("tis", tis)], "off", 64)[0]
    assert said.startswith("tis vs off under q8: final +0.300 (OUTSIDE the seed spread: 95 % bound t(0.975, df 5) "
                           "x SE = 0.132, Welch")


class NanFinalTrain(FakeTrain):
    """FakeTrain whose cell off/q8/s0 logs a NaN eval at its last step (step 2) after a finite one at step 1."""

    def __call__(self, cfg, resume, log, progress):
        outcome = super().__call__(cfg, resume, log, progress)
        if cfg.run.name == "off__q8__s0":
            path = cfg.run.output_dir / cfg.run.name / "metrics.jsonl"
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            rows[1]["eval/accuracy"], rows[2]["eval/accuracy"] = 0.1, float("nan")
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return outcome


def test_a_nan_final_eval_is_reported_missing_never_replaced_by_an_earlier_one(tmp_path):
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    assert run_arena(spec, say=lambda _: None, train=NanFinalTrain()) == 0
    data = json.loads((tmp_path / "out" / "arena.json").read_text())
    cell = next(c for c in data["cells"] if c["id"] == "off/q8/s0")
    assert (cell["initial_accuracy"], cell["final_accuracy"], cell["best_accuracy"]) == (0.5, None, 0.5)
    assert cell["diverged"] is None and cell["notes"] == ["eval at step 2 is nan: reported as n/a"]
    off = next(a for a in data["aggregates"] if (a["correction"], a["source"]) == ("off", "q8"))
    assert off["n"] == 1 and off["final"] == [0.7, None]  # only s1's final
    md = (tmp_path / "out" / "arena.md").read_text()
    assert "| off/q8/s0 | done | 2 | 0.500 | n/a | 0.500 |" in md and "eval at step 2 is nan: reported as n/a" in md


def test_a_collapsed_seed_is_counted_diverged_and_marks_the_means_it_is_in(tmp_path):
    # 2 seeds of off/q8 on 64 problems: s0 collapses 0.5 -> 0.05 (2 SE of the difference = 0.13)
    spec = load_arena(_arena(tmp_path, base=BASE.replace("eval_size = 4", "eval_size = 64")), out=tmp_path / "out")
    FINAL["off/q8/s0"], saved = 0.05, FINAL["off/q8/s0"]
    try:
        assert run_arena(spec, only="off/q8/*", say=lambda _: None, train=FakeTrain()) == 0
    finally:
        FINAL["off/q8/s0"] = saved
    data = json.loads((tmp_path / "out" / "arena.json").read_text())
    off = next(a for a in data["aggregates"] if (a["correction"], a["source"]) == ("off", "q8"))
    assert (off["n"], off["finished"], off["diverged"], off["diverged_in_mean"]) == (2, 2, 1, 1)
    md = (tmp_path / "out" / "arena.md").read_text()
    assert "| off | 0.375 ± 0.460 (incl. 1 diverged); div 1/2;" in md


@pytest.mark.parametrize("name,cells,minibatches", [("arena-lora", 24, 1), ("arena-methods", 36, 1),
                                                    ("arena-staleness-mb4", 16, 4), ("arena-mc-grpo-power", 40, 1),
                                                    ("arena-mixture", 6, 1), ("arena-distill", 9, 1)])
def test_the_main_job_budget_arenas_load(name, cells, minibatches):
    """The arenas at the main job's budget (30 steps, 4 prompts, 64 new tokens) with 256 held-out problems."""
    spec = load_arena(Path(__file__).resolve().parent.parent / "configs" / f"{name}.toml")
    assert len(spec.cells) == cells and len(spec.seeds) >= 3
    for cell in spec.cells:
        cfg = cell.config
        assert (cfg.run.steps, cfg.algorithm.prompts_per_step, cfg.sampling.max_new_tokens, cfg.task.eval_size,
                cfg.algorithm.minibatches, cfg.run.threads) == (30, 4, 64, 256, minibatches, 1), cell.id
    if name == "arena-lora":
        ranks = {c.id.split("/")[0]: (c.config.lora.enabled, c.config.lora.rank, c.config.lora.lr) for c in spec.cells}
        assert ranks == {"full": (False, 8, 1e-4), "r1": (True, 1, 1e-4), "r8": (True, 8, 1e-4),
                         "r32": (True, 32, 1e-4)}


def test_a_config_hint_names_the_arenas_set_lists_not_a_command_line_flag(tmp_path):
    """`nearpolicy arena` has no --set: a config error's "add --set ..." hint names arena.set instead."""
    base = BASE + '[algorithm]\nlr_schedule = "cosine"\nwarmup_steps = 2\n'
    with pytest.raises(ArenaError, match=r"add to arena.set: algorithm.warmup_steps=1") as raised:
        load_arena(_arena(tmp_path, base=base))
    assert "--set" not in str(raised.value)
