"""What a CLI user expects on the first day, in process (no model is loaded): --version, "did you mean" hints,
`nearpolicy list` within 100 columns and `list NAME`, `train --dry-run`, the routing of `--resume RUN_DIR`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nearpolicy.cli import main
from nearpolicy.config.schema import ConfigError, load_config
from nearpolicy.runs.folder import write_json
from test_resume import save_small_checkpoint


def test_version(capsys):
    from nearpolicy import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"nearpolicy {__version__}\n"


@pytest.mark.parametrize("override, hint", [
    ("algorithm.lrr=1", "unknown key 'algorithm.lrr' (did you mean 'algorithm.lr'?)"),
    ("algo.lr=1", "unknown key 'algo' (did you mean 'algorithm'?)"),
    ("run.stepz=3", "unknown key 'run.stepz' (did you mean 'run.steps'?)"),
    ("correction.preset=icepopp", "unknown name 'icepopp' (did you mean 'icepop'?)"),
    ("algorithm.advantage=rlo", "unknown name 'rlo' (did you mean 'rloo'?)"),
    ("algorithm.loss=ppo_clp", "unknown name 'ppo_clp' (did you mean 'ppo_clip'?)"),
    ("algorithm.kl_estimator=k2is", "unknown name 'k2is' (did you mean 'k2_is' or 'k3_is'?)"),
    ("engine.kv_cache=f61", "(got 'f61') (did you mean 'f16'?)"),
])
def test_unknown_names_get_a_did_you_mean(override, hint):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert hint in str(err.value)


def test_nothing_close_gets_no_hint():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.zzzzzz=1"])
    assert str(err.value) == "invalid config: unknown key 'algorithm.zzzzzz'"


def test_reasoning_gym_name_and_missing_jsonl_path_are_named(tmp_path):
    from nearpolicy.tasks import make_task

    with pytest.raises(ValueError, match=r"task.name: unknown reasoning-gym dataset 'chain_sums' \(did you mean "
                                         r"'chain_sum'"):
        make_task("reasoning_gym", name="chain_sums")
    with pytest.raises(FileNotFoundError, match=f"task.path {tmp_path / 'no.jsonl'} does not exist"):
        make_task("jsonl", path=tmp_path / "no.jsonl")


def test_list_fits_100_columns_and_list_name_shows_the_whole_entry(capsys):
    from nearpolicy.ops.correction_presets import CORRECTIONS
    from nearpolicy.ops.kl import KL_ESTIMATORS

    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100
    k3_is = next(line for line in lines if line.startswith("  k3_is "))
    assert k3_is.endswith(" ...") and len(k3_is) > 90  # shortened at a word, not dropped
    assert "  tis                          truncated token IS w = min(rho_t, 2)" in lines
    assert main(["list", "k3_is"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    entry = next(e for e in KL_ESTIMATORS if e.name == "k3_is")
    assert shown.startswith("KL estimator k3_is ") and entry.summary in shown and f"source: {entry.source}" in shown
    assert main(["list", "icepop"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "computes: icepop: token mask [0.5, 5], decoupled" in shown and repr(CORRECTIONS.get("icepop")()) in shown
    assert main(["list", "reinforce"]) == 0  # an advantage estimator and a policy loss share the name
    heads = [line for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    assert heads == ["advantage estimator reinforce", "policy loss reinforce"]
    assert main(["list", "icepopp"]) == 2
    assert "no registered name 'icepopp' (did you mean 'icepop'?)" in capsys.readouterr().err


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_dry_run_prints_a_config_that_loads_back_and_the_plan_and_writes_nothing(tmp_path, capsys):
    sets = [f"run.output_dir='{tmp_path / 'runs'}'", "run.steps=3", "algorithm.group_size=4", "task.train_size=20",
            "engine.tensor_precision={'blk.0-2'='f16'}", "correction.preset=icepop"]
    assert main(["train", "--dry-run", *(a for s in sets for a in ("--set", s))]) == 0
    out, err = capsys.readouterr()
    assert not (tmp_path / "runs").exists() and "dry run: nothing written" in err
    assert f"# new run in {tmp_path / 'runs' / 'grpo-smollm2-chain-sum'}\n" in out
    assert "#   samples_per_step = 16\n" in out and "#   total_samples = 48\n" in out
    assert '#   correction_effective = "icepop: token mask [0.5, 5], decoupled"' in out
    (tmp_path / "dry.toml").write_text(out)
    assert load_config(tmp_path / "dry.toml") == load_config(None, sets)  # stdout is the effective config


def _finished_run(tmp_path: Path) -> Path:
    cfg = load_config(None, [f"run.output_dir='{tmp_path}'", "run.name=done", "run.steps=2", "task.train_size=20"])
    run = tmp_path / "done"
    save_small_checkpoint(run, 2)
    write_json(run / "config.json", cfg.model_dump(mode="json"))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(3)))
    return run


def test_resume_run_dir_routes_and_dry_run_says_what_the_resume_does(tmp_path, capsys):
    run = _finished_run(tmp_path)
    before = _listing(run)
    for argv in (["train", "--resume", str(run)], ["train", str(run), "--resume"]):
        assert main([*argv, "--dry-run", "--set", "run.steps=5"]) == 0
        out = capsys.readouterr().out
        assert f"# resumes {run} from step_000002: steps 3 to 5\n" in out and "\nsteps = 5\n" in out
    assert main(["train", "--resume", str(run), "--dry-run"]) == 0  # finished: said, nothing to do
    assert f"# nothing to do: {run} is finished" in capsys.readouterr().out
    assert main(["train", "--resume", str(run), "--dry-run", "--set", "algorithm.lr=1e-3"]) == 2
    out, err = capsys.readouterr()
    assert "# refused: --resume with a config that differs" in out and "algorithm.lr" in err
    assert main(["train", str(run), "--dry-run"]) == 2
    assert f"{run} is a folder, not a config file; to continue the run in it: nearpolicy train --resume {run}" in \
        capsys.readouterr().err
    assert main(["train", "--dry-run", "--set", f"run.output_dir='{tmp_path}'", "--set", "run.name=done"]) == 2
    assert "already holds a finished run (it trained all of its run.steps = 2); set a new run.name" in \
        capsys.readouterr().err
    config = tmp_path / "c.toml"
    config.write_text(f"[run]\noutput_dir = '{tmp_path}'\nname = 'done'\nsteps = 4\n[task]\ntrain_size = 20\n")
    assert main(["train", "--resume", str(config), "--dry-run"]) == 0  # the flag before CONFIG: CONFIG, resumed
    assert f"# resumes {run} from step_000002: steps 3 to 4\n" in capsys.readouterr().out
    assert main(["train", str(config), "--resume", str(run), "--dry-run"]) == 2
    assert "give CONFIG or --resume RUN_DIR, not both" in capsys.readouterr().err
    assert _listing(run) == before  # a dry run writes nothing
