"""Run untrusted Python (a model's tool call) in a separate process with limits.

- its own interpreter (`python -I -S`: no site-packages, no environment variables, no user site), in a fresh
  temporary directory that is deleted afterwards, in its own session (a timeout kills the whole group);
- wall-clock limit `timeout_s` (the process group is killed) and CPU-time limit (RLIMIT_CPU) as a backstop;
- address-space limit `memory_mb` (RLIMIT_AS): an allocation past it raises MemoryError in the child;
- no network, no new processes, no native code: an audit hook (PEP 578) installed before the code runs refuses
  importing socket / ssl / ctypes / subprocess / multiprocessing and the socket, exec, fork, spawn and dlopen
  events. A hook is a guard inside the interpreter, not a kernel boundary: run the server in a container or a
  network namespace where the code may be hostile;
- output (stdout and stderr together) truncated to `max_output` characters.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

_BLOCKED_MODULES = ("socket", "_socket", "ssl", "_ssl", "ctypes", "_ctypes", "subprocess", "_posixsubprocess",
                    "multiprocessing", "_multiprocessing", "asyncio")
_BLOCKED_EVENT_PREFIXES = ("socket.", "subprocess.", "os.exec", "os.fork", "os.posix_spawn", "os.spawn", "os.system",
                           "ctypes.", "os.kill", "os.killpg")
# the child's prelude: the hook, then the code (read from stdin) run as __main__
_PRELUDE = f"""
import sys
def _guard(event, args, _mods={_BLOCKED_MODULES!r}, _prefixes={_BLOCKED_EVENT_PREFIXES!r}):
    if event == "import" and args[0].split(".")[0] in _mods:
        raise PermissionError(f"import of {{args[0]}} is not allowed in the sandbox (no network, processes or native code)")
    if event.startswith(_prefixes):
        raise PermissionError(f"{{event}} is not allowed in the sandbox")
_code = sys.stdin.read()
sys.addaudithook(_guard)
del _guard
try:
    exec(compile(_code, "<tool call>", "exec"), {{"__name__": "__main__"}})
except SystemExit:
    raise
except BaseException as err:  # the code's own frames only, not this prelude's
    import traceback
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == "<tool call>"]
    sys.stderr.write("Traceback (most recent call last):\\n" + "".join(traceback.format_list(frames))
                     + "".join(traceback.format_exception_only(err)))
    sys.exit(1)
"""


@dataclass(frozen=True)
class SandboxResult:
    """status: ok, error (the code raised: the output ends with the traceback), timeout, memory (MemoryError or
    killed at the memory limit) or killed (another signal); output: what it printed, truncated; seconds: wall time."""

    status: str
    output: str
    seconds: float


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output: int = 2000) -> SandboxResult:
    """Run `code` under the module docstring's limits and return its SandboxResult (never raises for what the code
    does; ValueError for limits that are not positive)."""
    import time

    if timeout_s <= 0 or memory_mb <= 0 or max_output <= 0:
        raise ValueError(f"sandbox limits must be positive, got timeout_s={timeout_s}, memory_mb={memory_mb}, "
                         f"max_output={max_output}")
    folder = tempfile.mkdtemp(prefix="nearpolicy-sandbox-")
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _PRELUDE], cwd=folder, env={"PATH": "/usr/bin:/bin"},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=_limits(timeout_s, memory_mb))
    try:
        out, _ = proc.communicate(code.encode(), timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        timed_out = True
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    text = out.decode("utf-8", errors="replace")
    text = text if len(text) <= max_output else text[:max_output] + f"\n... [output truncated at {max_output} characters]"
    return SandboxResult(_status(proc.returncode, text, timed_out), text, time.monotonic() - started)


def _limits(timeout_s: float, memory_mb: int):
    def apply() -> None:  # runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        cpu = int(timeout_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))  # no file over 16 MB in its folder
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _status(returncode: int, text: str, timed_out: bool) -> str:
    if timed_out or returncode == -signal.SIGXCPU:
        return "timeout"
    last = text.strip().splitlines()[-1] if text.strip() else ""
    if last.startswith("MemoryError"):
        return "memory"
    if returncode == 0:
        return "ok"
    if returncode < 0:
        return "memory" if returncode in (-signal.SIGKILL, -signal.SIGSEGV) else "killed"
    return "error"
