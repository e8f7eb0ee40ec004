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
