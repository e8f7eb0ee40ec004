"""Graceful stop on SIGINT / SIGTERM: the first signal asks the run to stop after the step in progress (which then
writes a checkpoint of that completed step); a second one aborts at once (KeyboardInterrupt), keeping the last
checkpoint already on disk. During start-up (StartupInterrupt: imports, config, model loading) SIGINT and SIGTERM
raise StartupSignal (a KeyboardInterrupt) at once, so the start-up unwinds (its cleanup runs) and ends with a line
saying what stopped it and exit 128 + the signal (startup_stop), never a traceback nor SIGTERM's silent 143; the
signal is also recorded, so that one raised inside a finalizer (which Python drops) still stops the run."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
import threading
from pathlib import Path

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def program_name() -> str:
    """How the user can type this program again (shell-quoted), so that printed advice can be pasted: `nearpolicy`
    when that name on PATH is this very program; else the path it was started by (relative to the working directory
    when inside it, with a `./` where it has no slash; a symlink of another name is kept); for `python -m nearpolicy`,
    `PYTHON -m nearpolicy` unless PATH's nearpolicy sits beside this interpreter. `nearpolicy` when the process is
    not the nearpolicy program (a library user, a test runner)."""
    started = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("nearpolicy")
    on_path = shutil.which("nearpolicy")
    if started.name == "__main__.py" and started.parent.name == "nearpolicy":  # python -m nearpolicy
        beside = on_path is not None and Path(on_path).parent == Path(sys.executable).parent
        return "nearpolicy" if beside else f"{shlex.quote(sys.executable)} -m nearpolicy"
    resolved = started.resolve()
    if "nearpolicy" not in (started.name, resolved.name):
        return "nearpolicy"
    if on_path is not None and Path(on_path).resolve() == resolved:
        return "nearpolicy"
    absolute = Path(os.path.abspath(started))  # symlinks kept: the name the user typed
    text = os.path.relpath(absolute) if absolute.is_relative_to(Path.cwd()) else str(absolute)
    return shlex.quote(text if "/" in text else f"./{text}")


def resume_command(run_dir: Path | str) -> str:
    """The command that continues `run_dir`, as the user can type it: `PROGRAM train --resume RUN_DIR` (program_name,
    the folder shell-quoted)."""
    return f"{program_name()} train --resume {shlex.quote(str(run_dir))}"


def exit_description(exitcode: int | None) -> str:
    """How a child process ended, from its exit code: 'SIGSEGV' for one killed by signal 11 (exit code -11), else
    'exit code N' (the engine, replica and scoring processes' crash messages)."""
    if exitcode is not None and exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


class StopRequested(Exception):
    """The run stopped on a signal after a completed step; `checkpoint` is where it was saved (None at step 0)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = (f"checkpoint {checkpoint} (continue: {resume_command(Path(checkpoint).parent.parent)})"
                 if checkpoint
                 else "no step completed, nothing saved (run the same command again to start over)")
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; {where}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell convention: 130 for SIGINT, 143 for SIGTERM


class StartupSignal(KeyboardInterrupt):
    """SIGINT or SIGTERM during start-up (StartupInterrupt); `signum` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def startup_stop(err: KeyboardInterrupt | None = None, signum: int | None = None) -> tuple[int, str]:
    """(exit code, message) of a start-up stopped by `err` (a StartupSignal, or Python's own KeyboardInterrupt:
    SIGINT) or by `signum`: 130 "interrupted during startup; ..." for SIGINT, 143 "stopped by SIGTERM during startup;
    ..." for SIGTERM."""
    signum = signum if signum is not None else getattr(err, "signum", signal.SIGINT)
    said = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    return 128 + signum, f"{said} during startup; nothing was trained"


class StartupInterrupt:
    """Context manager for a run's start-up (imports, model loading, engine start: no step to stop after): SIGINT and
    SIGTERM raise StartupSignal (a KeyboardInterrupt) at once, as Python's own SIGINT handler does, and are recorded
    in `signum`. Python drops an exception raised inside a finalizer ("Exception ignored in ...": a __del__ or
    weakref callback that the garbage collector runs, e.g. tqdm's as transformers' "Loading weights" bar ends), and
    with it the signal, so the caller checks `signum` after the start-up too. Main thread only, and only in place of
    Python's own handlers (SIGINT's default_int_handler, SIGTERM's SIG_DFL; another one, or SIG_IGN, is left alone:
    so a StartupInterrupt inside another leaves the outer one in charge)."""

    DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StartupInterrupt":
        if threading.current_thread() is threading.main_thread():
            for sig, default in self.DEFAULTS.items():
                if signal.getsignal(sig) is default:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        self.signum = signum
        raise StartupSignal(signum)


class GracefulStop:
    """Context manager installing the handlers (main thread only; elsewhere it does nothing).

    `signum` is the first signal received, or None."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: aborting the step in progress")
        self.signum = signum
        # said at once (on its own line, not the progress bar's) because the step in progress may take a while
        sys.stderr.write(f"\n{signal.Signals(signum).name}: stopping after the step in progress and checkpointing it; "
                         "send it again to abort now\n")
