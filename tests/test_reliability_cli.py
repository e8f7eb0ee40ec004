"""Whole `nearpolicy train` processes on the tiny model, stopped for real: SIGTERM (graceful stop with a checkpoint)
and SIGKILL (at a checkpoint write, and before the first one), then `--resume`; every resumed run must reproduce
the uninterrupted run's metrics bit for bit (fp32 trainer on CPU, same seed)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nearpolicy.runs.folder import list_checkpoints, load_checkpoint
from test_cli import _base, _metrics, _train

pytestmark = pytest.mark.slow

STEPS = 4


def _args(model: Path, out: Path, name: str, *extra: str) -> list[str]:
    return _base(model, out, name, f"run.steps={STEPS}", "logging.progress=false", "logging.tensorboard=false", *extra)


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nearpolicy", "train", *args], cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(proc: subprocess.Popen, ready, timeout: float = 300, poll: float = 0.001):
    """Poll `ready()` until it returns something truthy (returned); fails if the process ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = ready()
        if found:
            return found
        assert proc.poll() is None, f"the run ended before the moment came (rc {proc.returncode}): {proc.stderr.read()[-3000:]}"
        time.sleep(poll)
    raise AssertionError("timed out waiting for the moment to stop the run")


def _steps_written(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except ValueError:
            pass
    return steps


def _deterministic(row: dict) -> dict:
    """A metrics row without wall-clock timings (time/*, throughput/*), peak memory (memory/*) and the rollout's
    roofline (rollout/roofline_*: from the GEMM peak and memory bandwidth each start measures)."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/", "rollout/roofline_", "memory/"))}


def _assert_reproduces(run: Path, reference: list[dict]) -> None:
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    for got, want in zip(rows, reference):
        assert _deterministic(got) == _deterministic(want), f"step {got['step']} differs"


def _assert_loadable(path: Path, model_file: Path) -> dict:
    from nearpolicy.model.load import load_policy

    model = load_policy(str(model_file))[0]
    return load_checkpoint(path, model, torch.optim.AdamW(model.parameters()))


@pytest.fixture(scope="module")
def reference(tiny_gguf_factory, tmp_path_factory):
    """The uninterrupted run: (model file, metrics rows)."""
    model = tiny_gguf_factory("f32")
    out = tmp_path_factory.mktemp("reference")
    proc = _train(_args(model, out, "ref"), out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return model, _metrics(out / "ref")


def test_sigterm_checkpoints_the_last_step_and_resume_reproduces_the_run(reference, tmp_path):
    model, rows = reference
    args = _args(model, tmp_path, "term", "logging.checkpoint_every=100")  # only the stop writes a checkpoint
    run = tmp_path / "term"
    proc = _start(args, tmp_path)
    _wait_for(proc, lambda: 1 in _steps_written(run))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    stopped_at = _steps_written(run)[-1]
    assert 1 <= stopped_at < STEPS
    saved = run / "checkpoints" / f"step_{stopped_at:06d}"
    assert f"stopped by SIGTERM at step {stopped_at}; checkpoint {saved} (continue: {_hint_of_python_m(run)})" in err
    assert [p.name for p in list_checkpoints(run)] == [saved.name]
    assert _assert_loadable(saved, model)["step"] == stopped_at
    resumed = _train(args + ["--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {saved} at step {stopped_at}" in resumed.stderr
    _assert_reproduces(run, rows)


def _second_checkpoint_moment(run: Path) -> str | None:
    """The first moment checkpoint 2 is seen: being written (its temporary folder) or just renamed."""
    root = run / "checkpoints"
    if (root / ".step_000002.tmp").exists():
        return "while writing .step_000002.tmp"
    return "just after step_000002 was renamed" if (root / "step_000002").exists() else None


@pytest.mark.parametrize("moment", ["checkpoint", "first step"])  # at checkpoint 2's write; before any checkpoint
def test_sigkill_leaves_a_loadable_checkpoint_and_resume_reproduces_the_run(reference, tmp_path, moment):
    model, rows = reference
    args = _args(model, tmp_path, "kill")
    run = tmp_path / "kill"
    proc = _start(args, tmp_path)
    if moment == "checkpoint":
        seen = _wait_for(proc, lambda: _second_checkpoint_moment(run))
    else:
        seen = _wait_for(proc, lambda: "step 0 written" if _steps_written(run) == [0] else None)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    print(f"killed {moment}: {seen}; checkpoints {[p.name for p in list_checkpoints(run)]}")
    saved = list_checkpoints(run)
    for path in saved:  # every checkpoint that is there is complete
        assert _assert_loadable(path, model)["step"] == int(path.name.split("_")[1])
    assert (saved[0].name if saved else None) == ("step_000001" if moment == "checkpoint" else None)
    resumed = _train(args + ["--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    if saved:
        assert f"resumed from {saved[-1]}" in resumed.stderr
    else:
        assert f"no loadable checkpoint in {run}: starting from step 0" in resumed.stderr
        assert [json.loads(line)["step"] for line in (run / "metrics.before-resume.jsonl").read_text().splitlines()] == [0]
    _assert_reproduces(run, rows)


def _hint_of_python_m(run_dir) -> str:
    """The continue hint a `python -m nearpolicy` child prints (its argv[0] is nearpolicy/__main__.py)."""
    from unittest import mock

    from nearpolicy import signals

    with mock.patch.object(signals.sys, "argv", ["nearpolicy/__main__.py"]):
        return signals.resume_command(run_dir)
