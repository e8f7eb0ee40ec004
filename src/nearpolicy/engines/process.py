"""A rollout engine in its own process, so a native crash inside llama.cpp or vLLM (SIGSEGV, SIGILL, SIGABRT, an OOM
kill) ends that process, not the trainer.

`ProcessEngine` speaks the RolloutEngine protocol (engines/base.py) and forwards each call over a pipe to a child
that owns the engine its spec opens: a spawned multiprocessing child for a llama.cpp `EngineSpec`, or, for a spec
with a `python` (engines/vllm_child.VLLMSpec), `python -m nearpolicy.engines.vllm_child FD` run by that interpreter
(another environment) with only this checkout's nearpolicy package on its path. A spec has `open()` (the engine)
and `log_to(fd, first_load)` (where the engine's own log goes). When the child dies, the call in flight raises `EngineDied`, which names the
engine, the signal, the phase (startup probe, rollout, eval, scoring, weight sync) and the last lines of llama.cpp's
own log (written by the child to `log_path`, with faulthandler's Python stack of the child). Before it answers
"ready" the child runs a startup probe: a few greedy tokens of `probe_prompt` on the file it loaded, then their
teacher-forced log-probs, which must be finite.

Test hook: NEARPOLICY_TEST_ENGINE_CRASH="METHOD:N[:SIGNAL]" makes the child crash for real (a null-pointer read for
SIGSEGV, abort() for SIGABRT, else the signal; "raise": an EngineError instead of a crash) on its N-th call of
METHOD (generate, greedy, score, update_weights; probe for the startup probe); the vLLM child reads it too."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

from nearpolicy.engines.base import (DecodeCounts, EngineDied, EngineError, LoraAdapter, RewrittenGGUF,
                                     take_decode_counts)
from nearpolicy.engines.llamacpp import EngineSpec
from nearpolicy.signals import exit_description

PHASES = {"generate": "rollout", "take_decode_counts": "rollout", "greedy": "eval", "score": "scoring",
          "update_weights": "weight sync", "probe": "startup probe"}
CRASH_HOOK = "NEARPOLICY_TEST_ENGINE_CRASH"
PROBE_TOKENS = 4
LOG_MARKER = "--- nearpolicy engine process"


def tail_lines(path: Path | None, n: int = 6) -> list[str]:
    """The last `n` non-empty lines of an engine log before a crash report, plus the report's first lines
    (faulthandler's "Fatal Python error: ..." and the innermost frames); [] when the file is missing."""
    if path is None or not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
        text = f.read().decode("utf-8", errors="replace")
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    start = max((i for i, line in enumerate(lines) if line.startswith(LOG_MARKER)), default=-1)
    lines = lines[start + 1:]  # the newest engine process's own lines only
    crash = max((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), default=None)
    if crash is None:
        return lines[-n:]
    return lines[max(0, crash - n):crash] + lines[crash:crash + 4]


class ProcessEngine:
    """The engine of `spec` (llama.cpp's EngineSpec, or a spec with a `python`) in a child process (see the module
    docstring).

    Raises EngineDied when the child dies (at start or during a call), EngineError when it reports a failure
    (bad file, failed probe), and re-raises the engine's own exceptions (EngineError, ValueError) unchanged."""

    def __init__(self, spec: EngineSpec, label: str, *, log_path: Path | None = None,
                 probe_prompt: list[int] | None = None, start_timeout_s: float = 300.0):
        self.label, self.log_path, self.version = label, log_path, spec.version
        self._path_dir: str | None = None
        args = (spec, str(log_path) if log_path else None, probe_prompt)
        if getattr(spec, "python", None):
            self._conn, self._proc = self._start_interpreter(spec.python, args)
        else:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            self._conn, child_conn = ctx.Pipe()
            self._proc = ctx.Process(target=serve, args=(spec, child_conn, *args[1:]), daemon=True,
                                     name="nearpolicy-engine")
            self._proc.start()
            child_conn.close()
        self._stop_ids: frozenset[int] = frozenset(self._reply("probe" if probe_prompt else "load", start_timeout_s))

    def _start_interpreter(self, python: str, args: tuple):
        """`python -m nearpolicy.engines.vllm_child FD` with a socket pair as the pipe; PYTHONPATH is a fresh
        folder holding only a link to this checkout's nearpolicy package (nothing of this environment leaks in)."""
        import socket
        from multiprocessing.connection import Connection

        self._path_dir = tempfile.mkdtemp(prefix="nearpolicy-engine-path-")
        os.symlink(Path(__file__).resolve().parent.parent, Path(self._path_dir) / "nearpolicy")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env |= {"PYTHONPATH": self._path_dir, "PYTHONNOUSERSITE": "1"}
        mine, theirs = socket.socketpair()
        proc = subprocess.Popen([python, "-m", "nearpolicy.engines.vllm_child", str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        theirs.close()
        conn = Connection(mine.detach())
        conn.send(args)
        return conn, _Child(proc)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    # -- the RolloutEngine protocol --------------------------------------------------------------
    def generate(self, requests, sampling, seed, interrupt=None):
        if interrupt is not None:
            raise TypeError("ProcessEngine.generate does not take an interrupt callback (engine replicas do)")
        return self._call("generate", requests, sampling, seed)

    def greedy(self, prompts, max_new_tokens):
        return self._call("greedy", prompts, max_new_tokens)

    def score(self, prompt_ids, completion_ids, sampling):
        return self._call("score", prompt_ids, completion_ids, sampling)

    def take_decode_counts(self) -> DecodeCounts | None:
        """The child engine's decode counts since the last take (engines/base.take_decode_counts): None for an engine
        that does not count them (vLLM)."""
        return self._call("take_decode_counts")

    def is_stop_token(self, token: int) -> bool:
        return token in self._stop_ids

    def stop_token_ids(self) -> frozenset[int]:
        """Every id the engine ends a response on (llama.cpp: llama_vocab_is_eog; vLLM: the stop ids it was given)."""
        return self._stop_ids

    def update_weights(self, source, version: int) -> None:
        """The child engine's update_weights: a GGUF path, a RewrittenGGUF, or a LoraAdapter (the adapter sync: the
        child loads the adapter file into the model it holds, engines/llama_adapter.py)."""
        if not isinstance(source, (str, Path, RewrittenGGUF, LoraAdapter)):
            raise TypeError("the llama.cpp engine syncs from a GGUF path (see engines/gguf/export.py)")
        self._call("update_weights", source if isinstance(source, (RewrittenGGUF, LoraAdapter)) else str(source),
                   version)
        self.version = version

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("close", ()))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
        self._conn.close()
        if self._path_dir is not None:
            shutil.rmtree(self._path_dir, ignore_errors=True)  # the folder and its link, never the package
            self._path_dir = None

    # -- the pipe --------------------------------------------------------------------------------
    def _call(self, method: str, *args):
        if not self._proc.is_alive():
            raise self._died(method)
        try:
            self._conn.send((method, args))
        except (BrokenPipeError, OSError):
            raise self._died(method) from None
        return self._reply(method)

    def _reply(self, method: str, timeout_s: float | None = None):
        started = time.monotonic()
        while not self._conn.poll(0.1):
            if not self._proc.is_alive():
                raise self._died(method)
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                self._proc.kill()
                raise EngineError(f"engine {self.label} did not start within {timeout_s:.0f} s")
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            raise self._died(method) from None
        if kind == "ok":
            return payload
        if isinstance(payload, BaseException):
            raise payload
        raise EngineError(f"engine {self.label} failed during {PHASES.get(method, method)}:\n{payload}")

    def _died(self, method: str) -> EngineDied:
        self._proc.join(timeout=5)
        return EngineDied(self.label, exit_description(self._proc.exitcode), PHASES.get(method, method),
                          tail_lines(self.log_path))


class _Child:
    """A subprocess.Popen seen as a multiprocessing.Process (is_alive, exitcode, join, kill, pid); kill ends its
    whole process group (the child leads one: helpers it started go with it)."""

    def __init__(self, proc: subprocess.Popen):
        self._p = proc
        self.pid = proc.pid

    def is_alive(self) -> bool:
        return self._p.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self._p.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._p.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        try:
            os.killpg(self._p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self._p.kill()


# -- the child -----------------------------------------------------------------------------------
def serve(spec: EngineSpec, conn, log_path: str | None, probe_prompt: list[int] | None) -> None:
    """Child entry point: load the engine, probe it, then answer calls until "close" or the trainer is gone."""
    if os.getpgrp() != os.getpid():  # a signal to the trainer's process group (Ctrl-C, kill -TERM -PGID) is the
        os.setpgrp()  # trainer's to handle
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log_fd = _log_to_file(log_path, spec) if log_path else None
    crash = _CrashHook(os.environ.get(CRASH_HOOK, ""))
    try:
        engine = spec.open()
        if log_fd is not None:
            _enable_faulthandler(log_fd)
        crash.on("probe")
        if probe_prompt:
            probe(engine, probe_prompt)
        stop_ids = engine.stop_token_ids()
        if log_fd is not None:  # the first load is logged in full; each weight sync's reload only by its warnings
            spec.log_to(log_fd, first_load=False)
    except Exception as err:  # noqa: BLE001 - reported to the trainer, which raises it
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ok", stop_ids))
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):  # the trainer is gone (killed): do not linger
            break
        if method == "close":
            break
        try:
            if log_fd is not None:
                _enable_faulthandler(log_fd)
            crash.on(method)
            result = (take_decode_counts(engine) if method == "take_decode_counts"
                      else getattr(engine, method)(*args))
            conn.send(("ok", result))
        except Exception as err:  # noqa: BLE001 - the trainer re-raises it
            conn.send(("raise", err if _picklable(err) else EngineError(traceback.format_exc())))
    engine.close()


def probe(engine, prompt: list[int]) -> None:
    """Decode PROBE_TOKENS greedy tokens after `prompt` and score them; raise EngineError unless the log-probs are
    finite (a broken kernel shows up here, before any training)."""
    import math

    from nearpolicy.types import SamplingParams

    ids = engine.greedy([list(prompt)], PROBE_TOKENS)[0]
    logprobs = engine.score(list(prompt), ids, SamplingParams())
    if not ids or not all(math.isfinite(x) for x in logprobs):
        raise EngineError(f"the startup probe decoded {ids} with log-probs {logprobs} (expected finite values)")


def _log_to_file(path: str, spec) -> int:
    """The engine's log lines and faulthandler's stack of a crash go to `path` (unbuffered: a crash loses nothing)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, f"{LOG_MARKER} {os.getpid()} started {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    _enable_faulthandler(fd)
    spec.log_to(fd, first_load=True)
    return fd


def _enable_faulthandler(fd: int) -> None:
    """faulthandler's stack of a crash to `fd`; again before every call, since a library loaded on the way may put
    its own SIGSEGV handler in (vLLM's tvm_ffi does, on the first generate)."""
    import faulthandler

    global _FAULT_FILE
    if _FAULT_FILE is None:
        _FAULT_FILE = os.fdopen(os.dup(fd), "w")  # kept open: faulthandler writes to its descriptor at the crash
    faulthandler.disable()  # enable() alone would keep the other library's handler in place
    faulthandler.enable(file=_FAULT_FILE, all_threads=False)


_FAULT_FILE = None


def _picklable(err: BaseException) -> bool:
    """True when the trainer can unpickle `err`: a builtin or nearpolicy exception that pickles (a vLLM one would
    need vllm on the trainer's side)."""
    import pickle

    module = type(err).__module__
    if module != "builtins" and not module.startswith("nearpolicy."):
        return False
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001
        return False
    return True


class _CrashHook:
    """The test hook of the module docstring: crash for real on the N-th call of one method."""

    def __init__(self, setting: str):
        parts = setting.split(":") if setting else []
        self.method = parts[0] if parts else None
        self.nth = int(parts[1]) if len(parts) > 1 else 1
        self.signame = parts[2] if len(parts) > 2 else "SIGSEGV"
        self.calls: Counter = Counter()

    def on(self, method: str) -> None:
        self.calls[method] += 1
        if method != self.method or self.calls[method] != self.nth:
            return
        if self.signame == "raise":  # a Python-level engine failure, not a crash
            raise EngineError(f"injected engine failure in {method} (test hook {CRASH_HOOK})")
        if self.signame == "SIGSEGV":
            import ctypes

            ctypes.string_at(0)  # a real null-pointer read in native code
        elif self.signame == "SIGABRT":
            os.abort()
        os.kill(os.getpid(), getattr(signal, self.signame))
