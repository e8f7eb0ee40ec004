"""One live run per run folder: a start holds an exclusive advisory lock (flock) on RUN_LOCK inside the folder for the
rest of its process, so a second start, resume or dry run in another process is refused while the first runs
(without it, a second start took over the folder of a live run that had written no checkpoint yet: it set the live
run's metrics aside and rewrote its config and engine file, and both then wrote one metrics.jsonl). The kernel drops
the lock when the process ends, however it ends, so a crashed run never leaves a stale lock; a run that exits
normally also empties the file, so only a killed run leaves its dead pid in it. Within one process the
lock is re-entrant (a library user may open a folder's trainer again, e.g. to resume it)."""

from __future__ import annotations

import atexit
import fcntl
import os
from pathlib import Path
from typing import IO

from nearpolicy.runs.folder import RunExistsError

RUN_LOCK = ".nearpolicy.lock"
_HELD: dict[Path, IO] = {}  # run folder (resolved) -> the open lock file this process holds


def _drop(handle: IO) -> None:
    """Empty the lock file (so no dead pid is left in it to signal) and close it, which releases the lock."""
    try:
        handle.seek(0)
        handle.truncate()
    except OSError:
        pass  # the folder may be gone; the kernel drops the lock when the file closes or the process ends
    handle.close()


atexit.register(lambda: [_drop(handle) for handle in _HELD.values()])  # not left to the interpreter's teardown


def lock_run_folder(run_dir: Path) -> None:
    """Create `run_dir` if needed and hold its lock for this process's life (the folder's RUN_LOCK records the pid).
    Raises RunExistsError naming the holder's pid when another process holds it; OSError when the folder cannot be
    written."""
    run_dir = Path(run_dir)
    key = run_dir.resolve()
    if key in _HELD:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = open(run_dir / RUN_LOCK, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise RunExistsError(_in_use(run_dir, holder)) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    _HELD[key] = handle


def check_not_in_use(run_dir: Path) -> None:
    """Raise RunExistsError when another process holds `run_dir`'s lock (a live run); writes nothing."""
    path = Path(run_dir) / RUN_LOCK
    if Path(run_dir).resolve() in _HELD or not path.is_file():
        return
    with open(path) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunExistsError(_in_use(Path(run_dir), handle.read().strip() or "unknown")) from None


def release_run_folder(run_dir: Path) -> None:
    """Drop this process's lock on `run_dir` (a start that failed before training removes its new folder)."""
    handle = _HELD.pop(Path(run_dir).resolve(), None)
    if handle is not None:
        _drop(handle)


def _in_use(run_dir: Path, holder: str) -> str:
    return (f"{run_dir} is in use by a running nearpolicy process (pid {holder}): wait for it to end or stop it "
            f"(`kill -TERM {holder}`, or Ctrl-C in its terminal, checkpoints it; then --resume continues it), or set a "
            "new run.name")
