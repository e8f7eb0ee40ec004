"""Run untrusted Python (a model's tool call) in a separate process with limits.

- its own interpreter (`python -I -S`: no site-packages, no environment variables, no user site), in a fresh
  temporary folder deleted afterwards, in its own session (a timeout kills the whole group);
- new network and PID namespaces where `unshare` can make them (as root, or through an unprivileged user
  namespace; `namespace_prefix`): no network interface, and no other process visible, so none can be signalled;
- wall-clock limit `timeout_s` (the process group is killed) and CPU-time limit (RLIMIT_CPU) as a backstop;
  address-space limit `memory_mb` (RLIMIT_AS: an allocation past it raises MemoryError); no file over
  OUTPUT_FILE_LIMIT bytes (RLIMIT_FSIZE), the captured output included, so output cannot fill the parent's memory;
- an audit hook (PEP 578) installed before the code runs refuses importing socket / ssl / ctypes / subprocess /
  multiprocessing / gc / signal and the socket, exec, fork, spawn, kill, chmod, rename and remove events, and
  writing any file outside the working folder; process, signal, identity and file-changing functions are removed
  from os / posix / _signal. The hook is a guard inside the interpreter, not a kernel boundary: against hostile
  code rely on the namespaces, and run the server as an unprivileged user or in a container (as root the code can
  still read any file, and a determined escape of the hook could write one);
- output (stdout and stderr together) truncated to `max_output` characters.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

_BLOCKED_MODULES = ("socket", "_socket", "ssl", "_ssl", "ctypes", "_ctypes", "subprocess", "_posixsubprocess",
                    "multiprocessing", "_multiprocessing", "asyncio", "gc", "signal", "_signal", "resource", "pty",
                    "fcntl", "mmap", "select", "selectors")
_BLOCKED_EVENT_PREFIXES = ("socket.", "subprocess.", "os.exec", "os.fork", "os.posix_spawn", "os.spawn", "os.system",
                           "ctypes.", "os.kill", "os.killpg", "os.chmod", "os.chown", "os.rename", "os.remove",
                           "os.rmdir", "os.link", "os.symlink", "os.truncate", "os.setxattr", "os.removexattr")
# functions taken out of the already-loaded posix module (and so of os, _signal) before the code runs: processes,
# signals to other processes, identity, scheduling, and file changes outside the open() check below
_STRIPPED = ("kill", "killpg", "pidfd_open", "fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp",
             "execv", "execve", "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setsid",
             "setpgid", "setpgrp", "chroot", "nice", "sched_setaffinity", "sched_setparam", "sched_setscheduler",
             "chown", "lchown", "fchown", "chmod", "lchmod", "fchmod", "link", "symlink", "rename", "replace",
             "unlink", "remove", "rmdir", "truncate", "ftruncate", "mkfifo", "mknod", "pidfd_send_signal",
             "pthread_kill", "prlimit", "setpriority", "register_at_fork", "kill_process")
# The child's prelude. The hook's lists are literals in its code (nothing the code can reach and edit); every
# module that could reach the hook object (gc) or other processes is refused at import.
_PRELUDE = f"""
import os, posix, _signal, sys
for _module in (os, posix, _signal):
    for _name in {_STRIPPED!r}:
        if hasattr(_module, _name):
            delattr(_module, _name)
def _guard(event, args, _home=os.getcwd() + os.sep, _real=os.path.realpath, _flags=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC):
    if event == "import" and args[0].split(".")[0] in {_BLOCKED_MODULES!r}:
        raise PermissionError(f"import of {{args[0]}} is not allowed in the sandbox (no network, processes or native code)")
    if event.startswith({_BLOCKED_EVENT_PREFIXES!r}):
        raise PermissionError(f"{{event}} is not allowed in the sandbox")
    if event == "open" and ((isinstance(args[1], str) and any(c in args[1] for c in "wax+")) or (args[2] or 0) & _flags):
        if not isinstance(args[0], (str, bytes)) or not _real(args[0] if isinstance(args[0], str) else args[0].decode()).startswith(_home):
            raise PermissionError(f"writing {{args[0]}} is not allowed: only files in the working folder")
_code = sys.stdin.read()
sys.addaudithook(_guard)
del _guard, _module, _name
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


OUTPUT_FILE_LIMIT = 4 << 20  # bytes: the largest file the code may write, its captured output included


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
    folder, out_dir = tempfile.mkdtemp(prefix="nearpolicy-sandbox-"), tempfile.mkdtemp(prefix="nearpolicy-out-")
    started = time.monotonic()
    try:
        with open(os.path.join(out_dir, "output"), "w+b") as out:  # a file capped by RLIMIT_FSIZE, not a pipe
            proc = subprocess.Popen([*namespace_prefix(), sys.executable, "-I", "-S", "-c", _PRELUDE], cwd=folder,
                                    env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.PIPE, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=_limits(timeout_s, memory_mb))
            try:
                proc.communicate(code.encode(), timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                timed_out = True
            out.seek(0)
            raw = out.read(4 * max_output + 4)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(out_dir, ignore_errors=True)
    text = raw.decode("utf-8", errors="replace")
    text = text if len(text) <= max_output else text[:max_output] + f"\n... [output truncated at {max_output} characters]"
    return SandboxResult(_status(proc.returncode, text, timed_out), text, time.monotonic() - started)


@functools.lru_cache(maxsize=1)
def namespace_prefix() -> tuple[str, ...]:
    """`unshare` arguments that put the code in new network and PID namespaces (no interface but a down loopback;
    no other process visible, so none can be signalled), as root or through an unprivileged user namespace;
    () where neither works here (then only the audit hook stands between the code and the network)."""
    if shutil.which("unshare") is None:
        return ()
    for prefix in (("unshare", "--net", "--pid", "--fork", "--kill-child", "--"),
                   ("unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--")):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            pass
    return ()


def _limits(timeout_s: float, memory_mb: int):
    def apply() -> None:  # runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        cpu = int(timeout_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (OUTPUT_FILE_LIMIT, OUTPUT_FILE_LIMIT))  # files and its output
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
