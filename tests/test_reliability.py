"""Faults provoked for real, in process: full disk, kills during a checkpoint write, NaN steps and weights, hostile
engines, rewards and datasets, damaged model files, fuzzed configs (docs/reliability.md lists each fault).

The CLI runs that need a whole process (SIGKILL, SIGTERM, deterministic resume) are in test_reliability_cli.py."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from nearpolicy import runs
from nearpolicy.config import Config, ConfigError, load_config
from nearpolicy.guards import BadStepGuard, NonFiniteError, check_prompt_lengths, step_fault
from nearpolicy.runs import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint


# ---------------------------------------------------------------- checkpoints: full disk, non-finite weights, kills
def _small_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A 512x512 linear layer (1 MiB of weights, 2 MiB of Adam state) after one optimizer step."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    return model, opt


def _assert_loads_as(path: Path, model: torch.nn.Module | dict) -> dict:
    """Load `path` into a different model; its weights must equal `model`'s (a module or a state dict) bit for bit."""
    fresh, opt = _small_model(seed=1)
    state = load_checkpoint(path, fresh, opt)
    expected = model if isinstance(model, dict) else model.state_dict()
    for name, value in expected.items():
        assert torch.equal(fresh.state_dict()[name], value), name
    return state


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    model, opt = _small_model()
    first = save_checkpoint(tmp_path, 1, model, opt, {"data_position": 4}, keep=1)
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}

    def fills_the_disk(tensors, filename):
        Path(filename).write_bytes(b"\0" * 1000)  # part of the file reached the disk
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(runs, "save_file", fills_the_disk)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(CheckpointError, match=r"step_000002 \(No space left on device\); the previous checkpoint "
                                              r".*step_000001 is intact") as err:
        save_checkpoint(tmp_path, 2, model, opt, {"data_position": 8}, keep=1)
    assert err.value.errno == errno.ENOSPC
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]  # no temporary left
    assert _assert_loads_as(first, saved_weights)["data_position"] == 4


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_disk_full_on_a_real_small_tmpfs(tmp_path):
    """A 4 MiB tmpfs holds one 3 MiB checkpoint but not a second: the real ENOSPC of safetensors."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "4m"):
        pytest.skip("mounting a tmpfs needs root (the failing-writer test above covers the same path)")
    try:
        model, opt = _small_model()
        first = save_checkpoint(disk, 1, model, opt, {}, keep=1)
        with pytest.raises(CheckpointError, match="No space left on device.*step_000001 is intact"):
            save_checkpoint(disk, 2, model, opt, {}, keep=1)
        assert [p.name for p in (disk / "checkpoints").iterdir()] == ["step_000001"]
        _assert_loads_as(first, model)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_non_finite_weights_are_never_saved(tmp_path):
    model, opt = _small_model()
    first = save_checkpoint(tmp_path, 1, model, opt, {}, keep=2)
    with torch.no_grad():
        model.bias[3] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite weights at step 2.*bias"):
        save_checkpoint(tmp_path, 2, model, opt, {}, keep=2)
    assert list_checkpoints(tmp_path) == [first]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]


_KILL_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch
    from pathlib import Path
    from nearpolicy import runs
    from nearpolicy.runs import save_checkpoint
    run_dir, where, ready = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 512)).sum().backward()
    opt.step()

    def hang():
        ready.write_text("ready")
        time.sleep(600)

    save_checkpoint(run_dir, 1, model, opt, {"data_position": 4}, keep=1)
    if where == "mid-file":
        real = runs.save_file
        def half_then_hang(tensors, filename):
            real(tensors, filename)
            data = Path(filename).read_bytes()
            Path(filename).write_bytes(data[: len(data) // 2])
            hang()
        runs.save_file = half_then_hang
    elif where == "before-rename":
        real_write = runs._write_checkpoint_files
        def written_then_hang(*args):
            real_write(*args)
            hang()
        runs._write_checkpoint_files = written_then_hang
    elif where == "mid-prune":
        real_rmtree = runs.shutil.rmtree
        def rmtree(path, ignore_errors=False):
            if str(path).endswith(".deleting") and Path(path).exists():
                (Path(path) / "model.safetensors").unlink()  # half deleted
                hang()
            real_rmtree(path, ignore_errors=ignore_errors)
        runs.shutil.rmtree = rmtree
    save_checkpoint(run_dir, 2, model, opt, {"data_position": 8}, keep=1)
""")


@pytest.mark.parametrize("where,survivor", [("mid-file", 1), ("before-rename", 1), ("mid-prune", 2)])
def test_sigkill_during_a_checkpoint_write_leaves_a_loadable_checkpoint(tmp_path, where, survivor):
    """A real SIGKILL of a process held at three moments of save_checkpoint(step 2) over a step-1 checkpoint."""
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(tmp_path), where, str(ready)],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    saved = list_checkpoints(tmp_path)
    assert [p.name for p in saved] == [f"step_{survivor:06d}"]
    model, _ = _small_model()
    assert _assert_loads_as(saved[-1], model)["data_position"] == 4 * survivor
    leftovers = {p.name for p in (tmp_path / "checkpoints").iterdir()} - {saved[-1].name}
    assert leftovers == ({".step_000002.tmp"} if survivor == 1 else {".step_000001.deleting"})
    model, opt = _small_model()
    save_checkpoint(tmp_path, 3, model, opt, {}, keep=1)  # the next save clears what the kill left
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000003"]


# ---------------------------------------------------------------- non-finite guard (unit)
def test_step_fault_names_the_cause():
    assert step_fault({"actor/skipped_minibatches": 0.0, "actor/loss": 0.1, "actor/grad_norm": 1.0}) is None
    assert step_fault({"actor/skipped_minibatches": 1.0, "actor/loss": float("nan"),
                       "actor/grad_norm": float("nan")}) == "1 mini-batch(es) skipped: non-finite loss and gradient norm"
    assert step_fault({"actor/skipped_minibatches": 2.0, "actor/loss": 0.3,
                       "actor/grad_norm": float("inf")}) == "2 mini-batch(es) skipped: non-finite gradient norm"


def test_bad_step_guard_counts_and_stops_after_k_in_a_row():
    guard, logs = BadStepGuard(max_consecutive=2), []
    bad = {"actor/skipped_minibatches": 1.0, "actor/loss": float("nan"), "actor/grad_norm": float("nan")}
    good = {"actor/skipped_minibatches": 0.0, "actor/loss": 0.1, "actor/grad_norm": 1.0}
    seen = []
    for step, metrics in enumerate([bad, good, bad], start=1):
        seen.append(guard.observe(step, metrics, logs.append))
        guard.check(step)
    assert [m["guard/bad_steps"] for m in seen] == [1.0, 1.0, 2.0]
    assert [m["guard/consecutive_bad_steps"] for m in seen] == [1.0, 0.0, 1.0]
    assert logs[0] == "warning: step 1: 1 mini-batch(es) skipped: non-finite loss and gradient norm (1 in a row, 1 in this run)"
    guard.observe(4, bad, logs.append)
    with pytest.raises(NonFiniteError, match=r"2 consecutive steps up to step 4 .*run.max_bad_steps = 2"):
        guard.check(4)
    restored = BadStepGuard(2)
    restored.restore(guard.state())
    assert (restored.total, restored.consecutive) == (3, 2)


def test_prompt_longer_than_the_context_is_named():
    prompt_ids = lambda problem: list(range(problem))  # noqa: E731 - a "problem" here is its prompt length
    check_prompt_lengths(prompt_ids, {"train": [10, 20], "eval": [26]}, max_context=32, max_new_tokens=6)
    with pytest.raises(ValueError, match=r"2 prompt\(s\) longer than model.max_context \(32\) minus "
                                         r"sampling.max_new_tokens \(6\) = 26 tokens: train problem 1 \(27 tokens\), "
                                         r"eval problem 0 \(40 tokens\)"):
        check_prompt_lengths(prompt_ids, {"train": [10, 27], "eval": [40]}, max_context=32, max_new_tokens=6)
    with pytest.raises(ValueError, match="leaves no room"):
        check_prompt_lengths(prompt_ids, {"train": [1]}, max_context=16, max_new_tokens=16)


# ---------------------------------------------------------------- the trainer under hostile engines, rewards, NaNs
def _cfg(model_path, out: Path, *extra: str) -> Config:
    return load_config(None, [f"model.path='{model_path}'", f"run.output_dir='{out}'", "run.name=t", "run.steps=2",
                              "run.threads=1", "algorithm.prompts_per_step=2", "algorithm.group_size=2",
                              "algorithm.micro_batch_size=2", "sampling.max_new_tokens=6", "task.eval_size=4",
                              "task.train_size=50", "logging.eval_every=100", "logging.checkpoint_every=1",
                              "logging.tensorboard=false", "logging.progress=false", "model.max_context=256",
                              "engine.kind=hf", *extra])


def _trainer(tiny_model_dir, tmp_path, *extra: str):
    from nearpolicy.trainer import Trainer

    logs: list[str] = []
    return Trainer(_cfg(tiny_model_dir, tmp_path, *extra), log=logs.append), logs


class _Rewriting:
    """The real engine, with each sampled rollout passed through `rewrite` (a hostile engine)."""

    def __init__(self, engine, rewrite):
        self.engine, self.rewrite = engine, rewrite

    def generate(self, requests, sampling, seed):
        return [self.rewrite(r) for r in self.engine.generate(requests, sampling, seed)]

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.s.model.state_dict().items()}


def test_engine_returning_empty_completions_gives_a_zero_update(tiny_model_dir, tmp_path):
    from nearpolicy.types import Rollout

    trainer, _ = _trainer(tiny_model_dir, tmp_path)
    trainer.s.engine = _Rewriting(trainer.s.engine, lambda r: Rollout(r.group_id, r.sample_index, r.prompt_ids,
                                                                       [], [], [], "length"))
    before = _weights(trainer)
    metrics = trainer.train_step()
    assert metrics["response/length_mean"] == 0.0 and metrics["reward/mean"] == 0.0
    assert metrics["actor/loss"] == 0.0 and metrics["actor/grad_norm"] == 0.0
    assert step_fault(metrics) is None
    after = _weights(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing to learn from, nothing learnt


def test_engine_token_id_outside_the_vocabulary_is_named(tiny_model_dir, tmp_path):
    from dataclasses import replace

    trainer, _ = _trainer(tiny_model_dir, tmp_path)
    trainer.s.engine = _Rewriting(trainer.s.engine, lambda r: replace(r, completion_ids=[49157] * len(r.completion_ids)))
    with pytest.raises(ValueError, match=r"token ids \[49157, 49157.*outside the vocabulary \[0, 49152\)"):
        trainer.train_step()
    assert trainer.state.data_position == 0  # the step was not counted


def test_raising_reward_scores_zero_and_is_counted(tiny_model_dir, tmp_path, monkeypatch):
    trainer, _ = _trainer(tiny_model_dir, tmp_path)
    calls = []

    def flaky(response, problem):
        calls.append(response)
        if len(calls) % 2:
            raise RuntimeError("checker crashed")
        return 1.0

    monkeypatch.setattr(trainer.s.task, "score", flaky)
    first = trainer.train_step()
    assert len(calls) == 4 and first["reward/scorer_errors"] == 2.0 and first["reward/mean"] == 0.5
    assert trainer.train_step()["reward/scorer_errors"] == 4.0  # cumulative


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(tiny_model_dir, tmp_path, monkeypatch):
    """NaN advantages (a NaN loss and gradient) at steps 1, 3 and 4, +-1 at step 2; run.max_bad_steps = 2 stops the
    run at step 4."""
    from dataclasses import replace

    from nearpolicy import trainer as trainer_module

    trainer, logs = _trainer(tiny_model_dir, tmp_path, "run.steps=6", "run.max_bad_steps=2")
    real, calls, snapshots = trainer_module.compute_advantages, [], []

    def poisoned(*args):
        calls.append(1)
        snapshots.append(_weights(trainer))
        adv = real(*args)
        signs = torch.tensor([1.0, -1.0]).repeat(len(adv.advantages) // 2)  # random-model rewards are all 0
        return replace(adv, advantages=signs * (float("nan") if len(calls) in (1, 3, 4) else 1.0))

    monkeypatch.setattr(trainer_module, "compute_advantages", poisoned)
    with pytest.raises(NonFiniteError, match=r"2 consecutive steps up to step 4 had a non-finite loss or gradient"):
        trainer.fit()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["guard/bad_steps"] for r in rows[1:]] == [1.0, 1.0, 2.0, 3.0]
    assert [r["guard/consecutive_bad_steps"] for r in rows[1:]] == [1.0, 0.0, 1.0, 2.0]
    assert [r["actor/skipped_minibatches"] for r in rows[1:]] == [1.0, 0.0, 1.0, 1.0]
    assert rows[1]["actor/loss"] is None  # NaN is written as null
    assert "warning: step 1: 1 mini-batch(es) skipped: non-finite loss and gradient norm" in "\n".join(logs)
    now = _weights(trainer)
    assert all(torch.equal(snapshots[0][k], snapshots[1][k]) for k in now)  # bad step 1 left the weights alone
    assert not all(torch.equal(snapshots[1][k], snapshots[2][k]) for k in now)  # good step 2 moved them
    assert all(torch.equal(snapshots[2][k], now[k]) for k in now)  # bad steps 3 and 4 did not
    assert json.loads((trainer.run_dir / "checkpoints" / "step_000004" / "trainer_state.json").read_text())[
        "consecutive_bad_steps"] == 2


def test_non_finite_weights_are_never_exported_or_saved(tiny_model_dir, tmp_path):
    trainer, _ = _trainer(tiny_model_dir, tmp_path)
    trainer.checkpoint()  # step 0
    with torch.no_grad():
        trainer.s.model.model.layers[0].mlp.up_proj.weight[0, 0] = float("inf")
    version = trainer.s.engine.version
    with pytest.raises(NonFiniteError, match=r"weights became non-finite at step 1 \(model.layers.0.mlp.up_proj.weight\)"):
        trainer.train_step()
    assert trainer.s.engine.version == version  # the engine never got them
    with pytest.raises(FloatingPointError, match="refusing to checkpoint non-finite weights"):
        trainer.checkpoint()
    assert [p.name for p in list_checkpoints(trainer.run_dir)] == ["step_000000"]


# ---------------------------------------------------------------- the real CLI, in process, with a fault injected
def _cli(model_path, out: Path, capsys, *extra: str, resume: bool = False) -> tuple[int, str]:
    from nearpolicy.cli import main

    sets = [f"model.path='{model_path}'", f"run.output_dir='{out}'", "run.name=c", "run.steps=2", "run.threads=1",
            "algorithm.prompts_per_step=2", "algorithm.group_size=2", "algorithm.micro_batch_size=2",
            "sampling.max_new_tokens=6", "task.eval_size=4", "task.train_size=50", "logging.eval_every=100",
            "logging.checkpoint_every=1", "logging.tensorboard=false", "logging.progress=false",
            "model.max_context=256", *extra]
    capsys.readouterr()
    rc = main(["train", *[a for s in sets for a in ("--set", s)], *(["--resume"] if resume else [])])
    return rc, capsys.readouterr().err


@pytest.mark.slow
def test_disk_full_during_the_engine_gguf_export_keeps_checkpoint_and_engine_file(tiny_gguf_factory, tmp_path,
                                                                                 capsys, monkeypatch):
    """Exports: 1 at startup, 1 per step's sync. The third (step 2's sync) hits ENOSPC half-way."""
    import gguf

    from nearpolicy.models import resolve_model

    model = tiny_gguf_factory("f32")  # exported before the writer is broken
    real, calls = gguf.GGUFWriter.write_tensors_to_file, []

    def filling(self, *, progress=False):
        calls.append(1)
        if len(calls) == 3:
            self.fout[0].write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, progress=progress)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", filling)
    rc, err = _cli(model, tmp_path, capsys, "engine.precision=q8_0")
    run = tmp_path / "c"
    assert rc == 1, err
    assert (f"error: [Errno 28] could not write the engine GGUF {run}/engine/policy-q8_0.gguf (No space left on "
            f"device); the previous policy-q8_0.gguf is unchanged at step 1; the last checkpoint "
            f"{run}/checkpoints/step_000001 is intact (continue with --resume)") in err
    assert sorted(p.name for p in (run / "engine").iterdir()) == ["policy-q8_0.gguf"]  # no temporary left
    assert resolve_model(str(run / "engine" / "policy-q8_0.gguf")).kind == "gguf"  # complete, readable
    state = json.loads((run / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    assert (state["step"], state["version"], state["engine_precision"]) == (1, 1, "q8_0")


@pytest.mark.slow
def test_engine_crash_stops_the_run_with_the_checkpoint_named(tiny_gguf_factory, tmp_path, capsys, monkeypatch):
    from nearpolicy.engines.base import EngineError
    from nearpolicy.engines.llamacpp import LlamaCppEngine

    real, calls = LlamaCppEngine.generate, []

    def crashing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise EngineError("llama_decode failed with code -3")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LlamaCppEngine, "generate", crashing)
    rc, err = _cli(tiny_gguf_factory("f32"), tmp_path, capsys)
    assert rc == 1
    assert (f"error: llama_decode failed with code -3 at step 1; the last checkpoint {tmp_path}/c/checkpoints/"
            "step_000001 is intact (continue with --resume)") in err
    rows = [json.loads(line) for line in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]


@pytest.mark.slow
def test_prompt_longer_than_the_context_fails_at_startup(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": f"What is {i} + {i}?", "answer": 2 * i} for i in range(6)]
    rows[3]["prompt"] = "What is " + " + ".join(["1"] * 150) + "?"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, err = _cli(tiny_model_dir, tmp_path, capsys, "engine.kind=hf", "task.kind=jsonl", f"task.path='{data}'",
                   "task.eval_size=2")
    assert rc == 2
    assert "error: 1 prompt(s) longer than model.max_context (256) minus sampling.max_new_tokens (6) = 250 tokens: " in err
    assert "problem" in err and "raise model.max_context" in err
    assert not (tmp_path / "c" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_resume_of_a_run_that_never_existed_says_it_starts_fresh(tiny_model_dir, tmp_path, capsys):
    rc, err = _cli(tiny_model_dir, tmp_path, capsys, "engine.kind=hf", "run.steps=1", resume=True)
    assert rc == 0
    assert f"no loadable checkpoint in {tmp_path}/c: starting from step 0" in err
    assert [p.name for p in list_checkpoints(tmp_path / "c")] == ["step_000001"]


# ---------------------------------------------------------------- hostile datasets and model files
def test_jsonl_line_that_is_not_utf8_is_numbered_and_skippable(tmp_path):
    from nearpolicy.tasks.jsonl import JsonlTask

    path = tmp_path / "data.jsonl"
    good = [json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1}).encode() for i in range(4)]
    path.write_bytes(b"\n".join(good[:2] + [b'{"prompt": "caf\xe9?", "answer": 1}'] + good[2:]) + b"\n")
    with pytest.raises(ValueError, match=r"1 bad line\(s\) at \[3\]: line 3: not UTF-8 \(byte 0xe9 at column 16\)"):
        JsonlTask(path, 1, 0, 1)
    task = JsonlTask(path, 1, 0, 1, skip_bad_lines=True)
    assert task.skipped_lines == [3] and task.train_size + len(task.eval_problems()) == 4


def test_damaged_or_missing_model_files_exit_2_naming_the_file(tiny_model_dir, tiny_gguf_factory, tmp_path, capsys):
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(tiny_model_dir, hf)
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a real truncation
    gguf_file = tmp_path / "tiny.gguf"
    gguf_file.write_bytes(tiny_gguf_factory("f32").read_bytes()[:200_000])
    cases = [(hf, f"error: model.path '{hf}': cannot load the model from {hf} (SafetensorError: "),
             (gguf_file, f"{gguf_file} is not a valid GGUF file (bad magic or truncated)"),
             (tmp_path / "missing.gguf", f"model.path '{tmp_path}/missing.gguf' does not exist")]
    for path, needle in cases:
        rc, err = _cli(path, tmp_path, capsys, "engine.kind=hf")
        assert rc == 2 and needle in err, err[-2000:]
        assert "Traceback" not in err
    assert not (tmp_path / "c" / "checkpoints").exists()


# ---------------------------------------------------------------- fuzzing: the config loader, the reward path
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_FIELDS = {section: list(field.annotation.model_fields) for section, field in Config.model_fields.items()}
_KNOWN_KEYS = [f"{section}.{key}" for section, keys in _FIELDS.items() for key in keys]
_KEY = st.sampled_from(_KNOWN_KEYS) | st.text(alphabet="abcdrunstep._", min_size=1, max_size=14)
_SCALAR = (st.integers(-2**70, 2**70) | st.floats() | st.booleans() | st.text(max_size=12)
           | st.sampled_from(["q8_0", "hf", "grpo", "tis", "jsonl", "token-mean", "none", "bypass", "x.jsonl"]))
_VALUE = _SCALAR | st.lists(_SCALAR, max_size=3) | st.dictionaries(st.sampled_from(["a", "min_terms", "x_y"]),
                                                                      _SCALAR, max_size=3)


def _toml(value) -> str:
    """A TOML literal (possibly invalid TOML for odd strings: the loader must still give a ConfigError)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return {"inf": "inf", "-inf": "-inf", "nan": "nan"}.get(repr(value), repr(value))
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _loads_or_config_error(path, overrides) -> Config | None:
    try:
        cfg = load_config(path, overrides)
    except ConfigError as err:
        assert str(err)
        return None
    assert Config.model_validate(json.loads(json.dumps(cfg.model_dump(mode="json")))) == cfg  # config.json reloads
    return cfg


def _plausible(key: str):
    """A value of the key's default type, in a range where many are valid (about 1 config in 7 loads)."""
    section, name = key.split(".")
    default = getattr(getattr(Config(), section), name)
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int):
        return st.integers(0, 64)
    if isinstance(default, float):
        return st.floats(0, 2)
    return st.sampled_from(["q8_0", "f32", "hf", "grpo", "rloo", "tis", "token_mis", "gspo", "k2", "fp32", "x"])


_OVERRIDE = (st.sampled_from(_KNOWN_KEYS).flatmap(lambda k: st.tuples(st.just(k), _plausible(k).map(_toml)))
             | st.tuples(_KEY, _VALUE.map(_toml) | st.text(max_size=15)))


@settings(max_examples=400, deadline=None)
@given(st.lists(_OVERRIDE, max_size=4))
def test_fuzz_overrides_give_a_config_or_a_config_error(pairs):
    _loads_or_config_error(None, [f"{key}={raw}" for key, raw in pairs])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(list(_FIELDS)) | st.text("abc", min_size=1, max_size=3),
                       st.dictionaries(st.sampled_from(sum(_FIELDS.values(), [])) | st.text("xyz", min_size=1, max_size=3),
                                       _VALUE, max_size=4), max_size=4) | st.binary(max_size=40))
def test_fuzz_config_files_give_a_config_or_a_config_error(tmp_path, document):
    path = tmp_path / "c.toml"
    if isinstance(document, bytes):
        path.write_bytes(document)
    else:
        path.write_text("".join(f"[{s}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in t.items())
                                for s, t in document.items()), encoding="utf-8", errors="surrogatepass")
    _loads_or_config_error(path, [])


_RESPONSE = (st.lists(st.sampled_from(list("0123456789-+.,/${}\\ \n:x") + ["\\boxed{", "\\frac{", "Answer:",
                                                                           "The answer is ", "\\fbox{"]),
                      max_size=25).map("".join) | st.text(max_size=50))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_RESPONSE, _RESPONSE | st.sampled_from(["7", "-3", "0.5", "\\frac{1}{2}", "(1, 2)"]))
def test_fuzz_reward_path_scores_0_or_1_and_never_raises(tmp_path, response, reference):
    """The trainer's reward path (safe_score over a JSONL task: extraction + math-verify) on random text."""
    from nearpolicy.tasks import Problem
    from nearpolicy.tasks.base import safe_score
    from nearpolicy.tasks.jsonl import JsonlTask

    path = tmp_path / "d.jsonl"
    if not path.exists():
        path.write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": 2}\n')
    task = JsonlTask(path, 0, 0, 1)
    reward, error = safe_score(task, response, Problem("q", reference, {}))
    assert error is None and reward in (0.0, 1.0)
    if reference.strip() and response == f"Answer: {reference}" and reference in ("7", "-3", "0.5"):
        assert reward == 1.0
