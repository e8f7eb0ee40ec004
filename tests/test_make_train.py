"""`make train` and a graceful stop (issue 38 item 9): the run exits 130 / 143 after checkpointing the step in progress
and printing how to continue; the recipe takes those codes as success, so make adds no `Error 130` of its own, and
any other failure still fails make. (A Ctrl-C typed in the terminal also reaches make itself, which then prints its own
`make: *** [...] Interrupt` after the run's message: README, "make train".)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
@pytest.mark.parametrize("code, make_code", [(130, 0), (143, 0), (0, 0), (1, 2), (2, 2)])
def test_a_graceful_stop_is_not_a_make_error(tmp_path, code, make_code):
    fake = tmp_path / "venv" / "bin" / "nearpolicy"  # stands in for the trainer: exits with `code`
    fake.parent.mkdir(parents=True)
    fake.write_text(f"#!/bin/sh\necho \"trainer: exit {code}\"\nexit {code}\n")
    fake.chmod(0o755)
    done = subprocess.run(["make", "-s", "-C", str(ROOT), "train", f"VENV={fake.parent.parent}", "STAMP=",
                           "NEEDS_VLLM="], capture_output=True, text=True, timeout=60)
    assert done.returncode == make_code, done.stderr
    assert f"trainer: exit {code}" in done.stdout
    assert ("Error" in done.stderr) == (make_code != 0)
