"""The run-folder checks before a start (runs.start_checks.check_run_folder), the config of a run read back from its folder
(`nearpolicy train --resume RUN_DIR`), the keys a resume may change, and the whole flow through the real CLI."""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch

from nearpolicy.config.schema import Config, ConfigError, load_config
from nearpolicy.runs.start_checks import RESTARTED_METRICS, check_run_folder, stored_config
from nearpolicy.runs.folder import RunExistsError, RunFinished, checkpoint_step, save_checkpoint, write_json


def _cfg(tmp_path: Path, *sets: str) -> Config:
    return load_config(None, [f"run.output_dir='{tmp_path}'", "run.name=r", "task.train_size=20", "task.eval_size=4",
                              *sets])


def save_small_checkpoint(run: Path, step: int) -> Path:
    """A real checkpoint of a 2 x 2 linear model and its AdamW state."""
    model = torch.nn.Linear(2, 2)
    return save_checkpoint(run, step, model, torch.optim.AdamW(model.parameters()), {"data_position": step}, keep=10)


def _folder(cfg: Config, logged=None, checkpoints=()) -> Path:
    """A run folder as a run leaves it: config.json, the metrics rows of `logged` steps, the checkpoints."""
    run = cfg.run.output_dir / cfg.run.name
    run.mkdir(parents=True)
    write_json(run / "config.json", cfg.model_dump(mode="json"))
    if logged is not None:
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "eval/accuracy": 0.25}) + "\n" for s in logged))
    for step in checkpoints:
        save_small_checkpoint(run, step)
    return run


def test_a_new_run_needs_a_folder_without_a_run(tmp_path):
    cfg = _cfg(tmp_path)
    check = check_run_folder(cfg, resume=False)
    assert check.said == f"new run in {tmp_path / 'r'}" and not check.restart
    assert check.data["kind"] == "reasoning_gym" and check.data["name"] == "chain_sum"
    run = _folder(cfg, logged=[0, 1, 2])  # steps logged, no checkpoint (killed before the first one)
    with pytest.raises(RunExistsError, match=r"logged steps up to 2 but wrote no checkpoint; pass --resume"):
        check_run_folder(cfg, resume=False)
    save_small_checkpoint(run, 2)
    with pytest.raises(RunExistsError, match=rf"already holds a run \(last checkpoint step_000002\); continue it with "
                                             rf"--resume \([^;]*nearpolicy train --resume {run}; for the main job "
                                             rf"`make train ARGS=--resume`\)"):
        check_run_folder(cfg, resume=False)
    with pytest.raises(RunExistsError, match="continue it with --resume"):  # the new run.steps does not finish it
        check_run_folder(_cfg(tmp_path, "run.steps=2"), resume=False)


def test_a_start_on_a_finished_run_points_to_report_and_export_not_to_resume(tmp_path):
    import shutil

    cfg = _cfg(tmp_path, "run.steps=2", "run.name=f")
    run = _folder(cfg, logged=[0, 1, 2], checkpoints=[1, 2])
    head = (rf"already holds a finished run \(it trained all of its run.steps = 2\); set a new run.name \(for the main "
            rf"job `make train ARGS=\"--set run.name=NEW\"`; its results: nearpolicy report {run}; its model: "
            rf"nearpolicy export {run}\); ")
    for steps in (2, 5):  # the run's own run.steps decides, not the new config's
        with pytest.raises(RunExistsError, match=head + rf"to train further, resume with more steps: nearpolicy train "
                                                        rf"--resume {run} --set run.steps=N \(N > 2\)$"):
            check_run_folder(_cfg(tmp_path, f"run.steps={steps}", "run.name=f"), resume=False)
    cosine = _cfg(tmp_path, "run.steps=2", "run.name=f", "algorithm.lr_schedule=cosine")
    write_json(run / "config.json", cosine.model_dump(mode="json"))  # a decayed schedule cannot be extended
    with pytest.raises(RunExistsError, match=head + r"its cosine lr schedule ended at run.steps, so it cannot be "
                                                    r"extended; to train further, start a new run"):
        check_run_folder(cosine, resume=False)
    final = run / "checkpoints" / "step_000002"
    (final / "optimizer.safetensors").unlink()  # without the optimizer but not marked weights only: damaged
    with pytest.raises(RunExistsError, match=r"already holds a run \(last checkpoint step_000001; newer, damaged: "
                                             r"step_000002\); continue it with --resume"):
        check_run_folder(cosine, resume=False)  # as --resume, which continues from step_000001
    state = json.loads((final / "trainer_state.json").read_text())
    write_json(final / "trainer_state.json", state | {"weights_only": True})  # logging.final_weights_only's checkpoint
    with pytest.raises(RunExistsError, match=head + r"its last checkpoint holds the weights only, so it cannot be "
                                                    rf"resumed; .* --set model.path={run}/export/step_000002 "):
        check_run_folder(cosine, resume=False)
    shutil.rmtree(run / "checkpoints" / "step_000002")  # killed between step 2's metrics row and its checkpoint
    with pytest.raises(RunExistsError, match=r"already holds a run \(last checkpoint step_000001\); continue it with "
                                             r"--resume"):
        check_run_folder(cosine, resume=False)
    save_small_checkpoint(run, 2)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")  # metrics cut short, final checkpoint whole:
    with pytest.raises(RunFinished, match="nothing to do"):  # --resume has nothing left to do
        check_run_folder(cosine, resume=True)
    with pytest.raises(RunExistsError, match="already holds a finished run"):  # and the plain start says so
        check_run_folder(cosine, resume=False)


def test_an_interrupted_start_with_only_the_step0_eval_is_started_over_by_a_plain_retry(tmp_path):
    """Ctrl-C during the step-0 eval: the eval's row is written, no step completes, no checkpoint. A plain retry is
    accepted; open_trainer keeps the old row aside before anything loads."""
    from nearpolicy.training.trainer import open_trainer

    cfg = _cfg(tmp_path)
    run = _folder(cfg, logged=[0])
    check = check_run_folder(cfg, resume=False)
    assert check.restart and "holds only the step-0 eval of an interrupted start" in check.said
    said = []

    def build(cfg, run_dir, log):
        raise RuntimeError("assembly stops here")

    with pytest.raises(RuntimeError, match="assembly stops here"):
        open_trainer(cfg, log=said.append, build=build)
    assert said == [f"starting over: {check.said}"]
    assert not (run / "metrics.jsonl").exists() and run.is_dir()  # a folder it did not create is left in place
    assert json.loads((run / RESTARTED_METRICS).read_text()) == {"step": 0, "eval/accuracy": 0.25}
    assert not check_run_folder(cfg, resume=False).restart  # the retry after that is a plain new run


def test_a_failed_start_leaves_neither_the_run_folder_nor_a_new_output_dir(tmp_path):
    from nearpolicy.training.trainer import open_trainer

    def build(cfg, run_dir, log):
        assert run_dir.is_dir()
        raise ValueError("task.name: unknown reasoning-gym dataset")

    cfg = _cfg(tmp_path / "new" / "runs")
    with pytest.raises(ValueError, match="unknown reasoning-gym"):
        open_trainer(cfg, log=lambda m: None, build=build)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()  # an output_dir that was there before stays
    with pytest.raises(ValueError, match="unknown reasoning-gym"):
        open_trainer(_cfg(tmp_path / "kept"), log=lambda m: None, build=build)
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and list((tmp_path / "kept").iterdir()) == []


def test_resume_says_what_it_continues_and_that_a_finished_run_has_nothing_to_do(tmp_path):
    cfg = _cfg(tmp_path, "run.steps=2")
    run = _folder(cfg, logged=[0, 1, 2], checkpoints=[1, 2])
    with pytest.raises(RunFinished, match=rf"nothing to do: {run} is finished \(its last checkpoint step_000002 is at "
                                          rf"step 2, run.steps = 2\); to train further, resume with more steps: "
                                          rf"nearpolicy train --resume {run} --set run.steps=N \(N > 2\)"):
        check_run_folder(cfg, resume=True)
    longer = _cfg(tmp_path, "run.steps=5")
    assert check_run_folder(longer, resume=True).said == f"resumes {run} from step_000002: steps 3 to 5"


def test_a_finished_run_on_a_decaying_schedule_is_not_told_to_add_steps(tmp_path):
    cfg = _cfg(tmp_path, "run.steps=2", "algorithm.lr_schedule=cosine")
    run = _folder(cfg, logged=[0, 1, 2], checkpoints=[1, 2])
    with pytest.raises(RunFinished, match=r"run\.steps = 2\); its cosine lr schedule ended at run\.steps, so it cannot "
                                          r"be extended; to train further, start a new run \(fresh optimizer and lr schedule\) with its config from its "
                                          rf"exported checkpoint: nearpolicy export {run}, then nearpolicy train "
                                          rf"{run}/config.json --set model.path={run}/export/step_000002 --set "
                                          r"run.name=NEW --set run.seed=S \(another seed draws other training "
                                          r"problems; the held-out set stays\)$"):
        check_run_folder(cfg, resume=True)


@pytest.mark.parametrize("damage", ["model.safetensors", "optimizer.safetensors", "trainer_state.json"])
def test_a_damaged_last_checkpoint_is_not_a_finished_run(tmp_path, damage):
    """The newest checkpoint cut short (a kill, a full disk): the resume continues from the one before, as the load
    does (runs.folder.resume_checkpoint), instead of calling the run finished."""
    cfg = _cfg(tmp_path, "run.steps=2")
    run = _folder(cfg, logged=[0, 1, 2], checkpoints=[1, 2])
    newest = run / "checkpoints" / "step_000002"
    assert checkpoint_step(newest) == 2
    file = newest / damage
    file.write_bytes(file.read_bytes()[: file.stat().st_size - 3])
    assert checkpoint_step(newest) is None and checkpoint_step(run / "checkpoints" / "step_000001") == 1
    assert check_run_folder(cfg, resume=True).said == (f"resumes {run} from step_000001 (newer, damaged: "
                                                       "step_000002): steps 2 to 2")
    with pytest.raises(RunExistsError, match=r"already holds a run \(last checkpoint step_000001; newer, damaged: "
                                             r"step_000002\); continue it with --resume"):
        check_run_folder(cfg, resume=False)  # not "finished": its final checkpoint can be neither resumed nor exported
    file = run / "checkpoints" / "step_000001" / "rng.safetensors"
    file.write_bytes(b"\xff" * 8 + file.read_bytes()[8:])  # a header length past the end of the file
    assert check_run_folder(cfg, resume=True).said == (f"--resume in {run}, which has no loadable checkpoint: "
                                                       "starts from step 0")
    with pytest.raises(RunExistsError, match=r"already holds a run \(no loadable checkpoint: step_000001, step_000002 "
                                             r"damaged, so --resume starts from step 0\)"):
        check_run_folder(cfg, resume=False)


@pytest.mark.parametrize("change", ["run.threads=1", "rollout.engine_threads=3", "run.max_bad_steps=9",
                                    "logging.eval_every=1", "logging.progress=false", "engine.precision=f16"])
def test_resume_accepts_keys_that_do_not_change_the_math(tmp_path, change):
    cfg = _cfg(tmp_path, "run.steps=2")
    _folder(cfg, logged=[0, 1], checkpoints=[1])
    assert "from step_000001: steps 2 to 2" in check_run_folder(_cfg(tmp_path, "run.steps=2", change), True).said


@pytest.mark.parametrize("change, key", [("algorithm.lr=1e-3", "algorithm.lr"), ("run.seed=1", "run.seed"),
                                         ("engine.max_parallel_sequences=8", "engine.max_parallel_sequences")])
def test_resume_refuses_a_key_that_changes_the_math_naming_it(tmp_path, change, key):
    cfg = _cfg(tmp_path, "run.steps=2")
    _folder(cfg, logged=[0, 1], checkpoints=[1])
    with pytest.raises(RunExistsError, match=rf"differs from .*config.json in: {key} \(only run.steps, .*run.threads"):
        check_run_folder(_cfg(tmp_path, "run.steps=2", change), resume=True)


def test_stored_config_is_the_runs_own_config_pointed_at_its_folder_with_sets_on_top(tmp_path):
    cfg = _cfg(tmp_path, "sampling.max_new_tokens=6", "correction.preset=icepop", "correction.upper=inf",
               "engine.tensor_precision={'blk.0-1'='f16'}", "algorithm.loss=gspo")
    run = _folder(cfg)
    moved = tmp_path / "elsewhere" / "renamed"
    moved.parent.mkdir()
    run.rename(moved)  # a folder moved after the run: RUN_DIR, not the stored run.output_dir / run.name, is the run
    got = stored_config(moved, ["run.steps=9", "logging.progress=false"])
    want = cfg.model_copy(update={"run": cfg.run.model_copy(update={"output_dir": moved.parent, "name": "renamed",
                                                                       "steps": 9}),
                                  "logging": cfg.logging.model_copy(update={"progress": False})})
    assert got == want
    with pytest.raises(ConfigError, match="run.name and run.output_dir cannot be set"):
        stored_config(moved, ["run.name=other"])
    with pytest.raises(ConfigError, match=r"invalid config: 'algorithm.lr'"):
        stored_config(moved, ["algorithm.lr=-1"])
    with pytest.raises(ConfigError, match="holds no config.json"):
        stored_config(tmp_path, [])


def test_a_relative_task_path_is_read_from_where_the_run_started_on_resume_run_dir(tmp_path, monkeypatch,
                                                                                  started_elsewhere):
    """Issue 38 item 7: `--resume RUN_DIR` from another folder read a relative task.path from the current folder (the
    file was not there, or another one of the same name was). plan.json records the absolute path; the resume reads
    that file, and the config counts as unchanged; a run without the record is told where the path is read from."""
    from nearpolicy.tasks.identity import data_identity

    started, elsewhere = started_elsewhere
    cfg = _cfg(tmp_path / "runs", "task.kind=jsonl", "task.path='data.jsonl'")
    run = _folder(cfg, logged=[0, 1], checkpoints=[1])
    write_json(run / "plan.json", {"data": data_identity("jsonl", cfg.task.path)})
    monkeypatch.chdir(elsewhere)
    (elsewhere / "data.jsonl").write_text('{"prompt": "other", "answer": 1}\n')  # a different file, same name
    got = stored_config(run)
    assert got.task.path == started / "data.jsonl"
    assert check_run_folder(got, resume=True).said == f"resumes {run} from step_000001: steps 2 to {cfg.run.steps}"
    monkeypatch.chdir(started)  # `train CONFIG --resume` from where it started: the relative path, the same file
    assert check_run_folder(cfg, resume=True).data["resolved"] == str(started / "data.jsonl")
    (run / "plan.json").unlink()  # a run from before the record, resumed from a folder without the file
    (elsewhere / "data.jsonl").unlink()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(ConfigError, match=rf"task.path data.jsonl of .*config.json is relative and is read from the "
                                          rf"current folder {elsewhere}, where it does not exist"):
        stored_config(run)


def test_relative_model_teacher_and_reward_paths_are_read_from_where_the_run_started_on_resume_run_dir(tmp_path,
                                                                                                    monkeypatch):
    """Issue 38, item 7's leftover: `--resume RUN_DIR` from another folder read a relative model.path, distill.teacher
    and task.reward_function file from the current folder (there: missing, or another file of the same name).
    plan.json records the folder the run started in (working_dir); the resume reads each path from there, and the
    config counts as unchanged. The shipped model's name and a module name are not paths and stay as they are."""
    started, elsewhere = tmp_path / "started", tmp_path / "elsewhere"
    for folder in (started, elsewhere):  # the same names in both folders, different files
        (folder / "teacher").mkdir(parents=True)
        (folder / "teacher" / "config.json").write_text(json.dumps({"from": folder.name}))
        (folder / "policy.gguf").write_text(folder.name)
        (folder / "rewards.py").write_text(f"# {folder.name}\ndef reward(completion, **kwargs):\n    return 0.0\n")
    monkeypatch.chdir(started)
    sets = ("model.path='policy.gguf'", "distill.teacher='teacher'", "task.reward_function='rewards.py:reward'")
    cfg = _cfg(tmp_path / "runs", *sets)
    run = _folder(cfg, logged=[0, 1], checkpoints=[1])
    write_json(run / "plan.json", {"working_dir": str(started)})  # what the trainer records at the start
    monkeypatch.chdir(elsewhere)
    got = stored_config(run)
    assert (got.model.path, got.distill.teacher, got.task.reward_function) == (
        str(started / "policy.gguf"), str(started / "teacher"), f"{started / 'rewards.py'}:reward")
    assert check_run_folder(got, resume=True).said == f"resumes {run} from step_000001: steps 2 to {cfg.run.steps}"
    moved = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(elsewhere / "policy.gguf")})})
    with pytest.raises(RunExistsError, match=r"differs from .*config\.json in: model\.path \(only"):
        check_run_folder(moved, resume=True)  # another file of the same name is another model
    monkeypatch.chdir(started)  # `train CONFIG --resume` from where it started: the relative paths, the same files
    assert check_run_folder(cfg, resume=True).said.startswith(f"resumes {run}")

    names = _cfg(tmp_path / "names", "distill.teacher='smollm2'", "task.reward_function='rewards:reward'")
    named = _folder(names)
    (started / "smollm2").write_text("not the shipped model")
    write_json(named / "plan.json", {"working_dir": str(started)})
    got = stored_config(named)  # "smollm2" and a module are names, even where a file of that name exists
    assert (got.model.path, got.distill.teacher, got.task.reward_function) == ("smollm2", "smollm2", "rewards:reward")

    (run / "plan.json").unlink()  # a run from before the record, resumed from a folder without the file
    (elsewhere / "policy.gguf").unlink()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(ConfigError, match=rf"model.path policy.gguf of .*config.json is relative and is read from the "
                                          rf"current folder {elsewhere}, where it does not exist"):
        stored_config(run)
    write_json(run / "plan.json", {"working_dir": str(tmp_path / "gone")})  # recorded, but the file has moved
    with pytest.raises(ConfigError, match=r"model.path policy.gguf of .*is relative and is neither at .*gone/policy.gguf "
                                          r"\(where the run started\) nor in the current folder"):
        stored_config(run)


@pytest.mark.slow  # two short training runs through the real CLI
def test_plain_retry_after_an_interrupted_start_then_resume_by_run_dir_through_the_cli(tiny_gguf_factory, tmp_path):
    from test_cli import _base, _metrics, _train

    model = tiny_gguf_factory("f32")
    run = tmp_path / "r"
    run.mkdir()  # what Ctrl-C during the step-0 eval leaves (besides config, plan, engine/): the eval's row only
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    first = _train(_base(model, tmp_path, "r", "logging.progress=false"), tmp_path)  # the same command, again
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"starting over: new run in {run}, which holds only the step-0 eval" in first.stderr
    assert (run / RESTARTED_METRICS).read_text() == '{"step": 0, "eval/accuracy": 0.5}\n'
    assert [r["step"] for r in _metrics(run)] == [0, 1, 2]

    resumed = _train(["--resume", str(run), "--set", "run.steps=3"], tmp_path)  # no CONFIG, no retyped --set
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_000002'} at step 2" in resumed.stderr
    assert [r["step"] for r in _metrics(run)] == [0, 1, 2, 3]
    saved = json.loads((run / "config.json").read_text())
    assert saved["run"]["steps"] == 3 and saved["sampling"]["max_new_tokens"] == 6 and saved["model"]["path"] == str(model)

    finished = _train(["--resume", str(run)], tmp_path)
    assert finished.returncode == 0, finished.stderr[-3000:]
    program = "nearpolicy" if shutil.which("nearpolicy") else f"{shlex.quote(sys.executable)} -m nearpolicy"
    assert finished.stderr.strip().splitlines()[-1] == (  # the program as the user typed it (python -m here)
        f"nothing to do: {run} is finished (its last checkpoint step_000003 is at step 3, run.steps = 3); to train "
        f"further, resume with more steps: {program} train --resume {run} --set run.steps=N (N > 3)")
    refused = _train(["--resume", str(run), "--set", "run.steps=4", "--set", "algorithm.lr=1e-3"], tmp_path)
    assert refused.returncode == 2 and "differs from" in refused.stderr and "in: algorithm.lr (only" in refused.stderr
    assert [r["step"] for r in _metrics(run)] == [0, 1, 2, 3]  # neither touched the run


@pytest.mark.parametrize("header", [b"[1, 2]", b'{"w": {"dtype": "F32", "shape": [1]}}',
                                    b'{"w": {"data_offsets": "0-4"}}', b'{"w": {"data_offsets": []}}'],
                         ids=["list", "no-offsets", "string-offsets", "empty-offsets"])
def test_a_safetensors_header_of_another_shape_is_damage_not_a_crash(tmp_path, header):
    cfg = _cfg(tmp_path, "run.steps=3")
    run = _folder(cfg, logged=[0, 1, 2], checkpoints=[1, 2])
    (run / "checkpoints" / "step_000002" / "rng.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    assert checkpoint_step(run / "checkpoints" / "step_000002") is None
    assert check_run_folder(cfg, resume=True).said.startswith(f"resumes {run} from step_000001 (newer, damaged: ")
    with pytest.raises(RunExistsError, match=r"last checkpoint step_000001; newer, damaged: step_000002"):
        check_run_folder(cfg, resume=False)


def test_only_step_numbered_folders_are_checkpoints_in_step_order(tmp_path):
    from nearpolicy.runs.folder import list_checkpoints

    cfg = _cfg(tmp_path, "run.steps=20")
    run = _folder(cfg, logged=[0, 1], checkpoints=[1, 10])
    (run / "checkpoints" / "step_1").mkdir()  # unpadded: step 1, older than step 10
    (run / "checkpoints" / "step_backup").mkdir()  # a user's folders: not checkpoints (the rotation would delete them)
    (run / "checkpoints" / "step_000010.old").mkdir()
    assert [p.name for p in list_checkpoints(run)] == ["step_000001", "step_1", "step_000010"]
    assert check_run_folder(cfg, resume=True).said == f"resumes {run} from step_000010: steps 11 to 20"


def test_a_damaged_weights_only_final_checkpoint_is_skipped_as_the_resume_skips_it(tmp_path):
    cfg = _cfg(tmp_path, "run.steps=2")
    run = _folder(cfg, logged=[0, 1, 2], checkpoints=[1, 2])
    final = run / "checkpoints" / "step_000002"
    (final / "optimizer.safetensors").unlink()
    state = json.loads((final / "trainer_state.json").read_text())
    write_json(final / "trainer_state.json", state | {"weights_only": True})
    with pytest.raises(RunExistsError, match="holds the weights only"):  # whole: export it, not resume
        check_run_folder(cfg, resume=True)
    (final / "model.safetensors").write_bytes((final / "model.safetensors").read_bytes()[:-3])  # cut short
    assert check_run_folder(cfg, resume=True).said == (f"resumes {run} from step_000001 (newer, damaged: "
                                                       "step_000002): steps 2 to 2")
    with pytest.raises(RunExistsError, match=r"already holds a run \(last checkpoint step_000001; newer, damaged"):
        check_run_folder(cfg, resume=False)


def test_a_plain_start_calls_a_run_finished_where_resume_has_nothing_to_do(tmp_path):
    cfg = _cfg(tmp_path, "run.steps=2")
    run = _folder(cfg, logged=[0, 1], checkpoints=[3])  # a checkpoint past run.steps
    with pytest.raises(RunFinished, match="nothing to do"):
        check_run_folder(cfg, resume=True)
    with pytest.raises(RunExistsError, match=r"already holds a finished run \(it trained all of its run.steps = 2\).*"
                                             r"resume with more steps: .* --set run.steps=N \(N > 3\)"):
        check_run_folder(cfg, resume=False)  # the advice counts from the checkpoint's step
    (run / "config.json").unlink()  # without the run's own config, the new config's run.steps counts, as for --resume
    with pytest.raises(RunExistsError, match="already holds a finished run"):
        check_run_folder(cfg, resume=False)
    with pytest.raises(RunExistsError, match=r"already holds a run \(last checkpoint step_000003\); continue it"):
        check_run_folder(_cfg(tmp_path, "run.steps=5"), resume=False)


def test_a_runs_config_json_starts_a_new_run_beside_it_from_any_folder(tmp_path, monkeypatch, capsys,
                                                                       started_elsewhere):
    """`nearpolicy train RUN/config.json` (the 'train further' advice): the new run lands beside RUN whatever the
    current folder, its relative paths are read where RUN started (plan.json), and `--resume RUN/config.json` is
    `--resume RUN`, never a new run in the current folder."""
    import argparse

    from nearpolicy.cli import _train_config
    from nearpolicy.tasks.identity import data_identity

    started, elsewhere = started_elsewhere
    cfg = load_config(None, ["run.output_dir='runs'", "run.name=first", "task.kind=jsonl", "task.path='data.jsonl'",
                             "algorithm.lr_schedule=cosine", "run.steps=2"])
    run = started / _folder(cfg, logged=[0, 1, 2], checkpoints=[2])
    write_json(run / "plan.json", {"data": data_identity("jsonl", cfg.task.path), "working_dir": str(started)})
    monkeypatch.chdir(elsewhere)
    args = lambda *sets, resume=None: argparse.Namespace(config=run / "config.json", resume=resume,  # noqa
                                                         set=list(sets))
    new, resume = _train_config(args("run.name=NEW", "run.seed=3"))
    assert not resume and new.run.output_dir == started / "runs" and new.run.name == "NEW" and new.run.seed == 3
    assert new.task.path == started / "data.jsonl" and new.algorithm.lr_schedule == "cosine"
    assert check_run_folder(new, resume=False).said == f"new run in {started / 'runs' / 'NEW'}"
    again, resume = _train_config(args(resume=True))  # --resume RUN/config.json: the run itself, not ./runs/first
    assert resume and again.run.output_dir == started / "runs" and again.run.name == "first"
    with pytest.raises(RunFinished, match="nothing to do"):
        check_run_folder(again, resume=True)
    (run / "plan.json").unlink()  # any other JSON file is an ordinary config file
    plain, _ = _train_config(args())
    assert plain.run.output_dir == Path("runs")


def test_a_runs_config_json_layers_like_the_file_it_came_from(tmp_path):
    """config.json writes every key out; used as a lower layer (train RUN/config.json, an arena's base) it must take
    overrides as its source file did: a LoRA or XRPO override turns the section on (the stored run had it off), and
    a layer that leaves gspo takes the new loss's aggregation. Unchanged, the config is the stored one. A repeated
    key in a hand-edited config.json is refused."""
    from nearpolicy.runs.start_checks import config_from_run

    cfg = load_config(None, [f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=g", "algorithm.loss=gspo"])
    run = _folder(cfg)
    assert cfg.algorithm.aggregation == "seq-mean-token-mean" and not cfg.lora.enabled
    again = config_from_run(run, [])
    assert again.model_dump() == cfg.model_dump()
    new = config_from_run(run, ["run.name=h", "lora.rank=4", "algorithm.loss=ppo_clip"])
    assert new.lora.enabled and new.lora.rank == 4 and new.algorithm.aggregation == "token-mean"
    assert config_from_run(run, ["run.name=x", "xrpo.alpha=0.1"]).xrpo.enabled
    text = (run / "config.json").read_text()
    (run / "config.json").write_text(text.replace('"loss": "gspo"', '"loss": "gspo", "loss": "ppo_clip"', 1))
    with pytest.raises(ConfigError, match="loss.*appears twice|appears twice.*loss"):
        config_from_run(run, ["run.name=y"])
