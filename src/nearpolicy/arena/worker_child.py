"""The child side of `nearpolicy arena --workers N` (workers.py is the parent's): `python -m
nearpolicy.arena.worker_child` reads its job (one JSON line on stdin), runs the cell through the named `train`,
and writes its report, one JSON line {"code": int, "message": str} of at most REPORT_BYTES, on the result pipe."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
from importlib import import_module

REPORT_BYTES = 16384  # a child's report line at most (UTF-8): a quarter of Linux's 64 KiB pipe buffer


def resolve(name: str):
    """The object `name` ("module:qualified.name") names, imported. Raises ImportError / AttributeError."""
    module, qualname = name.split(":")
    target = import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def report_line(code: int, message: str) -> bytes:
    """A child's report: the JSON line {"code": code, "message": the longest tail of `message` that fits} in UTF-8
    (ensure_ascii off; a lone surrogate as its \\u escape), newline included, at most REPORT_BYTES long."""

    def line(keep: int) -> bytes:
        data = json.dumps({"code": code, "message": message[len(message) - keep:]}, ensure_ascii=False) + "\n"
        return data.encode("utf-8", "backslashreplace")

    low, high = 0, min(len(message), REPORT_BYTES)  # a character takes a byte at least
    while low < high:  # the longest tail that fits: the line grows with the tail
        mid = (low + high + 1) // 2
        low, high = (mid, high) if len(line(mid)) <= REPORT_BYTES else (low, mid - 1)
    return line(low)


def parse_report(data: bytes) -> tuple[int, str] | None:
    """The (exit code, message) of the report in `data` (what a child wrote on its result pipe): its last complete
    line; None when it holds no complete line (the child ended without reporting; a line cut short is none). Raises
    ValueError naming what is wrong when that line is no JSON object {"code": int (not bool), "message": str}:
    json.loads reads Infinity and 1e999 as float."""
    lines = [line for line in data.split(b"\n")[:-1] if line.strip()]
    if not lines:
        return None
    try:
        report = json.loads(lines[-1])
    except (ValueError, RecursionError) as err:
        raise ValueError(f"not JSON: {err}") from None
    if not isinstance(report, dict):
        raise ValueError(f"not a JSON object: {lines[-1][:80]!r}")
    code, message = report.get("code"), report.get("message")
    if not isinstance(code, int) or isinstance(code, bool):
        raise ValueError(f"its code {code!r:.80} is no integer")
    if not isinstance(message, str):
        raise ValueError(f"its message {message!r:.80} is no string")
    return code, message


def _stop_when_orphaned() -> None:
    """The child's watch on its stdin: at its end (the parent died) the run stops as on SIGTERM. Reads the file
    descriptor itself: a daemon thread blocked in sys.stdin's buffered reader would hold its lock at exit."""
    while os.read(0, 4096):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def child_main() -> int:
    """A worker: read the job on stdin, run the cell, report (code, message) on the result pipe (module
    docstring)."""
    from nearpolicy.config.schema import Config

    line = sys.stdin.buffer.readline()
    if not line:
        return 1  # the parent died before sending the job
    job = json.loads(line)
    os.set_inheritable(job["result_fd"], False)  # the run's own processes never hold it
    sys.path[:] = job["sys_path"]
    faulthandler.enable()
    threading.Thread(target=_stop_when_orphaned, daemon=True).start()
    with open(job["log"], "a", encoding="utf-8") as log_file:
        write = lambda msg: (log_file.write(msg + "\n"), log_file.flush())  # noqa: E731
        try:
            code, message = resolve(job["train"])(Config.model_validate(job["config"]), job["resume"], write, False)
        except Exception as err:  # noqa: BLE001 - the cell's infrastructure failure, as in process
            code, message = 1, f"error: {type(err).__name__}: {err}"
        except KeyboardInterrupt as err:  # SIGINT before the run's own handlers, or its second SIGINT
            code, message = 130, f"interrupted ({err or 'SIGINT'})"
        write(message)
    try:
        with os.fdopen(job["result_fd"], "wb") as result:
            result.write(report_line(code, message))
    except OSError:
        pass  # the parent is gone; the state says "running" and the next start resumes the cell
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
