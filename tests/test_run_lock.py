"""One live run per run folder (runs/lock.py): while another process holds a run folder's lock, a start, a resume
and a dry run in it are refused naming that process; the lock goes with the process, however it ends."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from nearpolicy.runs.folder import RunExistsError
from nearpolicy.runs.lock import RUN_LOCK, check_not_in_use, lock_run_folder, release_run_folder

HOLD = "import sys, time; from nearpolicy.runs.lock import lock_run_folder; lock_run_folder(sys.argv[1]); " \
       "print('held', flush=True); time.sleep(600)"


@pytest.fixture
def holder(tmp_path):
    run_dir = tmp_path / "runs" / "live"
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    yield run_dir, child
    child.kill()
    child.wait()


def test_a_folder_another_process_holds_is_refused_and_freed_when_it_ends(holder):
    run_dir, child = holder
    for attempt in (check_not_in_use, lock_run_folder):
        with pytest.raises(RunExistsError, match=rf"{run_dir} is in use by a running nearpolicy process \(pid "
                                                 rf"{child.pid}\)"):
            attempt(run_dir)
    child.kill()  # SIGKILL: no clean-up code runs, the kernel drops the lock
    child.wait()
    check_not_in_use(run_dir)
    lock_run_folder(run_dir)
    try:
        assert (run_dir / RUN_LOCK).read_text().strip() == str(__import__("os").getpid())
        lock_run_folder(run_dir)  # re-entrant within this process
        check_not_in_use(run_dir)
    finally:
        release_run_folder(run_dir)
    assert (run_dir / RUN_LOCK).read_text() == ""  # released: no pid left to signal by mistake


def test_train_and_its_dry_run_refuse_a_folder_in_use(holder):
    from nearpolicy.config.schema import load_config
    from nearpolicy.training.run import dry_run
    from nearpolicy.training.trainer import open_trainer

    run_dir, child = holder
    cfg = load_config(None, [f"run.output_dir='{run_dir.parent}'", "run.name='live'"])
    code, _, said = dry_run(cfg, resume=False)
    assert code == 2 and f"pid {child.pid}" in said
    built = []
    with pytest.raises(RunExistsError, match="in use by a running nearpolicy process"):
        open_trainer(cfg, build=lambda *args: built.append(args))
    assert not built and [p.name for p in run_dir.iterdir()] == [RUN_LOCK]  # nothing loaded, nothing written
