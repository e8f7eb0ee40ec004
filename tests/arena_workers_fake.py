"""A fake `train` for `nearpolicy arena --workers N` (tests/test_arena_workers.py) that a worker process imports by
name: it writes a cell's known metrics.jsonl one step at a time, stops on SIGINT / SIGTERM after the step in progress
as a run does (signals.GracefulStop; a rerun continues after the last logged step), and records when it started and
ended in TIMES/<cell folder>.<pid>.json. What it does is set by the environment variable ARENA_FAKE (JSON; the
workers inherit it): times (folder), step_seconds (or {correction: seconds}), crash ({cell id: "SIGKILL" or an exit
code}), rendezvous (wait, up to 60 s, until that many cells have started: proof that they run at the same time),
message ({cell id: the closing message of a run that then fails, exit code 1}), chatter ({cell id: text written on the
worker's result pipe before the run, which then reports as usual}), report ({cell id: text written on the result pipe
in place of the worker's report, after which the worker exits 0 without one}).

Run as a script (`python arena_workers_fake.py ARENA.toml OUT WORKERS [CELL_GLOB]`) it is an arena process with this
`train`."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time
from pathlib import Path

PLAN = "ARENA_FAKE"


def final_accuracy(correction: str, source: str, seed: int) -> float:
    """The last eval's accuracy of a cell: tis beats off by 0.30 or 0.31 (a settled difference at 3 seeds)."""
    return 0.5 + 0.01 * seed + (0.30 + 0.01 * (seed % 2) if correction == "tis" else 0.0) + 0.02 * (source == "noise")


def _row(step: int, steps: int, accuracy: float) -> dict:
    if step == 0:
        return {"step": 0, "eval/accuracy": 0.5}
    return {"step": step, "reward/mean": 0.5, "mismatch/k3": 0.01, "correction/rejected_frac": 0.0,
            "correction/frac_high": 0.0, "correction/frac_low": 0.0, "time/step": 1.0,
            "eval/accuracy": accuracy if step == steps else 0.5}


def _last_step(metrics: Path) -> int:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    return rows[-1]["step"] if rows else -1


def _result_pipe() -> int:
    """The worker's result pipe (arena/workers.py): the one pipe this process holds open for writing only (stdin, the
    job's pipe, is read only; stdout and stderr are the cell's log file)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if (os.readlink(f"/proc/self/fd/{name}").startswith("pipe:")
                    and fcntl.fcntl(int(name), fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY):
                return int(name)
        except OSError:
            continue
    raise RuntimeError("no result pipe: not run in a worker process")


def train(cfg, resume, log, progress):
    from nearpolicy.signals import GracefulStop

    plan = json.loads(os.environ.get(PLAN, "{}"))
    cell = cfg.run.name.replace("__", "/")
    correction, source, seed = cell.split("/")
    run_dir = cfg.run.output_dir / cfg.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    times = Path(plan["times"]) / f"{cfg.run.name}.{os.getpid()}.json"
    times.parent.mkdir(parents=True, exist_ok=True)
    record = {"cell": cell, "resume": resume, "start": time.time(), "end": None}
    times.write_text(json.dumps(record))
    crash = plan.get("crash", {}).get(cell)
    if crash == "SIGKILL":
        os.kill(os.getpid(), signal.SIGKILL)
    elif crash is not None:
        os._exit(int(crash))
    if cell in plan.get("chatter", {}):
        os.write(_result_pipe(), plan["chatter"][cell].encode())
    if cell in plan.get("report", {}):
        os.write(_result_pipe(), plan["report"][cell].encode())
        os._exit(0)
    deadline = time.time() + 60
    while len(list(times.parent.glob("*.json"))) < plan.get("rendezvous", 0) and time.time() < deadline:
        time.sleep(0.05)
    pause = plan.get("step_seconds", 0.0)
    pause = pause.get(correction, 0.0) if isinstance(pause, dict) else pause
    metrics, steps = run_dir / "metrics.jsonl", cfg.run.steps
    accuracy = final_accuracy(correction, source, int(seed[1:]))
    code, message = 0, "done"
    with GracefulStop() as stop, metrics.open("a") as out:
        for step in range(_last_step(metrics) + 1, steps + 1):
            if step:
                time.sleep(pause)
            out.write(json.dumps(_row(step, steps, accuracy)) + "\n")
            out.flush()
            if stop.signum is not None and step < steps:
                code, message = 128 + stop.signum, f"stopped by {signal.Signals(stop.signum).name} at step {step}"
                break
    if cell in plan.get("message", {}) and code == 0:
        code, message = 1, plan["message"][cell]
    times.write_text(json.dumps(record | {"end": time.time(), "code": code}))
    return code, message


def intervals(folder: Path) -> list[dict]:
    """The (cell, resume, start, end, code) records the fake wrote into `folder`."""
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))]


if __name__ == "__main__":
    import arena_workers_fake  # noqa: PLW0406 - `train` by its module's name, as a worker imports it

    from nearpolicy.arena.runner import run_arena
    from nearpolicy.arena.spec import load_arena

    arena, out, workers, only = (sys.argv[1:] + [None])[:4]
    sys.exit(run_arena(load_arena(Path(arena), Path(out)), only, train=arena_workers_fake.train, workers=int(workers)))
