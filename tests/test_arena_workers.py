"""`nearpolicy arena --workers N` (arena/workers.py): cells run N at a time, each in a worker process, with
tests/arena_workers_fake.py's `train` (imported by name in each worker; it records when it ran): never more than N at
once, the same state and page as one after another, a worker that dies fails only its cell, SIGTERM to the arena stops
the running cells resumably, and under arena.sequential no seed starts before the previous one has ended; a report
over a pipe's buffer or malformed fails its cell (no hang, no crash), stop signals are forwarded one by one as
themselves, and --dry-run warns and estimates for N workers. Each worker imports torch (the config schema), a few
seconds apiece."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import arena_workers_fake as fake
import pytest

from nearpolicy.arena.runner import run_arena
from nearpolicy.arena.spec import load_arena
from nearpolicy.arena.state import ArenaState
from nearpolicy.arena.workers import (REPORT_BYTES, Workers, check_workers, longest_first, parallel_eta, parse_report,
                                      report_line)

BASE = """
[run]
steps = 2
threads = 1
[task]
eval_size = 4
[logging]
eval_every = 1
"""

ARENA = """
[arena]
base = "base.toml"
seeds = [0, 1]
baseline = "off"

[corrections]
off = { preset = "off" }
tis = { preset = "tis" }

[sources]
q8 = { set = ["engine.precision='q8_0'"] }
"""

SEQUENTIAL = ARENA.replace("seeds = [0, 1]", "seeds = [0, 1, 2, 3]\nsequential = true\ntarget_mde = 0.05")


def _arena(tmp_path: Path, text: str = ARENA) -> Path:
    (tmp_path / "base.toml").write_text(BASE)
    path = tmp_path / "arena.toml"
    path.write_text(text)
    return path


@pytest.fixture
def plan(tmp_path, monkeypatch):
    """set_plan(**fields): the fake's plan (arena_workers_fake's docstring) in the environment the workers inherit;
    returns the folder of its time records."""

    def set_plan(times: str = "times", **fields) -> Path:
        folder = tmp_path / times
        monkeypatch.setenv(fake.PLAN, json.dumps({"times": str(folder)} | fields))
        return folder

    return set_plan


def _most_at_once(records: list[dict]) -> int:
    """The most train calls running at the same moment."""
    return max(sum(r["start"] <= s["start"] < r["end"] for r in records) for s in records)


def _statuses(spec) -> dict[str, tuple[str, int]]:
    return {cid: (r.status, r.attempts) for cid, r in ArenaState.open(spec.out, spec).cells.items()}


def _page(out: Path) -> dict:
    """arena.json without the wall times (the arena's and each cell's: they differ between sittings)."""
    data = json.loads((out / "arena.json").read_text())
    del data["machine_seconds"]
    for cell in data["cells"]:
        del cell["seconds"]
    return data


def test_two_workers_run_two_cells_at_a_time_and_write_the_same_page_as_one(tmp_path, plan):
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    times, lines = plan(rendezvous=2, step_seconds=0.2), []
    assert run_arena(spec, say=lines.append, train=fake.train, workers=2) == 0
    records = fake.intervals(times)
    assert sorted(r["cell"] for r in records) == sorted(c.id for c in spec.cells)
    assert all(r["end"] is not None and r["code"] == 0 for r in records)
    assert _most_at_once(records) == 2  # the rendezvous: the first two waited for each other
    assert _statuses(spec) == {c.id: ("done", 1) for c in spec.cells}
    assert any(" 2 running, 0 done, 0 diverged, 0 failed | ETA " in line for line in lines)
    assert (spec.out / "logs" / "tis__q8__s1.log").read_text().splitlines()[-1] == "done"

    plan(times="times1")
    one = load_arena(spec.path, out=tmp_path / "one")
    assert run_arena(one, say=lambda _: None, train=fake.train) == 0  # in this process, one after another
    assert _statuses(one) == _statuses(spec)
    assert _page(tmp_path / "one") == _page(tmp_path / "out")
    for cell in spec.cells:
        assert (spec.out / "cells" / cell.folder / "metrics.jsonl").read_text() == \
            (one.out / "cells" / cell.folder / "metrics.jsonl").read_text()


def test_a_worker_that_dies_fails_only_its_cell_and_a_rerun_tries_it_again(tmp_path, plan):
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    plan(crash={"off/q8/s1": "SIGKILL", "tis/q8/s0": 3})
    assert run_arena(spec, say=lambda _: None, train=fake.train, workers=2) == 1
    state = ArenaState.open(spec.out, spec).cells
    assert {cid: (r.status, r.failure) for cid, r in state.items()} == {
        "off/q8/s0": ("done", None), "off/q8/s1": ("failed", "infrastructure"),
        "tis/q8/s0": ("failed", "infrastructure"), "tis/q8/s1": ("done", None)}
    assert state["off/q8/s1"].error.startswith("error: the cell's worker process ended by SIGKILL without reporting")
    assert "ended by exit code 3 without reporting" in state["tis/q8/s0"].error
    times = plan(times="again")
    assert run_arena(spec, say=lambda _: None, train=fake.train) == 0  # in process: the state is the same
    assert sorted((r["cell"], r["resume"]) for r in fake.intervals(times)) == [("off/q8/s1", True),
                                                                             ("tis/q8/s0", True)]
    assert _statuses(spec) == {"off/q8/s0": ("done", 1), "off/q8/s1": ("done", 2), "tis/q8/s0": ("done", 2),
                               "tis/q8/s1": ("done", 1)}


def test_a_report_larger_than_a_pipe_buffer_fails_its_cell_without_a_hang(tmp_path, plan):
    """A closing message of 9000 emoji (~96 KB as ASCII-escaped JSON: over Linux's 64 KiB pipe buffer): the report is
    capped (report_line) and the arena empties the pipe as the worker writes, so the cell is failed at once, not
    stuck in its write. The arena runs as a process of its own: a hang ends at the timeout, not the test session."""
    path, message = _arena(tmp_path), "error: " + "\U0001F600" * 9000
    spec = load_arena(path, out=tmp_path / "out")
    plan(message={"off/q8/s0": message})
    with (tmp_path / "stderr.txt").open("w") as err:
        arena = subprocess.Popen([sys.executable, fake.__file__, str(path), str(spec.out), "2", "off/*"], stderr=err)
        try:
            assert arena.wait(timeout=60) == 1
        finally:
            arena.kill()  # only when it hung: its workers then see their stdin close and stop
    state = ArenaState.open(spec.out, spec).cells
    assert {cid: (r.status, r.failure) for cid, r in state.items()} == {
        "off/q8/s0": ("failed", "infrastructure"), "off/q8/s1": ("done", None), "tis/q8/s0": ("pending", None),
        "tis/q8/s1": ("pending", None)}
    assert state["off/q8/s0"].error == "\U0001F600" * 2000  # the last 2000 characters, as for a cell in process
    assert (spec.out / "logs" / "off__q8__s0.log").read_text(encoding="utf-8").splitlines()[-1] == message


def test_a_report_line_keeps_the_messages_tail_within_its_byte_cap():
    for message, kept in [("error: " + "\U0001F600" * 9000, 4088), ("x" * 20000, 16355), ("\x00" * 9000, 2725),
                          ("bad byte \udcff", 10), ("done", 4)]:
        line = report_line(143, message)
        assert line.endswith(b"\n") and line.count(b"\n") == 1 and len(line) <= REPORT_BYTES
        assert json.loads(line) == {"code": 143, "message": message[len(message) - kept:]}
        assert parse_report(line) == (143, message[len(message) - kept:])


def test_a_report_is_its_last_complete_line_and_a_malformed_one_is_named():
    ok = b'{"code": 0, "message": "done"}\n'
    assert parse_report(ok) == (0, "done")
    assert parse_report(b"warming up\n[1, 2\n" + ok) == (0, "done")  # what came before the report
    assert parse_report(b"") is None and parse_report(b'{"code": 0, "mess') is None  # cut short: no report
    assert parse_report(ok + b'{"code": 1') == (0, "done")
    for bad, why in [(b'{"code": Infinity, "message": "x"}', "its code inf is no integer"),
                     (b'{"code": 1e999, "message": "x"}', "its code inf is no integer"),
                     (b'{"code": "0", "message": "x"}', "its code '0' is no integer"),
                     (b'{"code": true, "message": "x"}', "its code True is no integer"),
                     (b'{"code": 1.0, "message": "x"}', "its code 1.0 is no integer"),
                     (b'{"code": 1, "message": 7}', "its message 7 is no string"),
                     (b'{"message": "x"}', "its code None is no integer"),
                     (b'[0, "done"]', "not a JSON object: b'[0, \"done\"]'"),
                     (b"\xff\xfe", "not JSON: "), (b"[" * 100000, "not JSON: ")]:
        with pytest.raises(ValueError) as err:
            parse_report(bad + b"\n")
        assert str(err.value).startswith(why)


def test_a_malformed_report_fails_its_cell_and_what_came_before_a_report_is_passed_over(tmp_path, plan):
    """Reports of a code Infinity or 1e999 (json.loads: float inf) or "0" fail their cells (infrastructure, saying
    why) and the arena goes on; a worker that wrote a line of its own before its report is read by the report."""
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    plan(report={"off/q8/s0": '{"code": Infinity, "message": "x"}\n', "off/q8/s1": '{"code": 1e999, "message": "x"}\n',
                 "tis/q8/s0": '{"code": "0", "message": "done"}\n'}, chatter={"tis/q8/s1": "warming up\n"})
    assert run_arena(spec, say=lambda _: None, train=fake.train, workers=2) == 1
    state = ArenaState.open(spec.out, spec).cells
    assert {cid: (r.status, r.failure) for cid, r in state.items()} == {
        "off/q8/s0": ("failed", "infrastructure"), "off/q8/s1": ("failed", "infrastructure"),
        "tis/q8/s0": ("failed", "infrastructure"), "tis/q8/s1": ("done", None)}
    for cid, code in [("off/q8/s0", "inf"), ("off/q8/s1", "inf"), ("tis/q8/s0", "'0'")]:
        assert state[cid].error == (f"error: the cell's worker process ended by exit code 0 with a malformed report "
                                    f"(its code {code} is no integer); its output is in logs/"
                                    f"{cid.replace('/', '__')}.log")


def test_signals_within_one_poll_are_forwarded_one_by_one_as_themselves(tmp_path, plan):
    """SIGINT, SIGINT, SIGTERM recorded before the arena's loop looks (three signals inside one poll): each is said and
    forwarded as itself, one per poll, in order. The first stops the runs after their step in progress, the second
    aborts it: with 5 s steps, no cell logs step 1."""
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    plan(step_seconds=5.0)
    state, lines = ArenaState.open(spec.out, spec), []
    state.save()
    workers = Workers(spec, state, lines.append, fake.train, 2)

    def signal_once_both_run() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and min(_metric_lines(spec)[c.id] for c in spec.cells[:2]) < 1:
            time.sleep(0.05)
        for signum in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):  # as _Stop's handler records a signal
            workers.stop.request(signum)

    thread = threading.Thread(target=signal_once_both_run, daemon=True)
    thread.start()
    assert workers.run(spec.cells, 0, 2) == 130
    thread.join()
    assert [line for line in lines if ": forwarded to the " in line] == [
        "SIGINT: forwarded to the 2 running cell(s), stopping them after their steps in progress (checkpointed); send "
        "it again to abort now; no cell starts any more",
        "SIGINT: forwarded to the 2 running cell(s), aborting their steps in progress; no cell starts any more",
        "SIGTERM: forwarded to the 2 running cell(s) again"]
    assert {cid: r.status for cid, r in state.cells.items()} == {
        "off/q8/s0": "stopped", "off/q8/s1": "stopped", "tis/q8/s0": "pending", "tis/q8/s1": "pending"}
    assert _metric_lines(spec) == {"off/q8/s0": 1, "off/q8/s1": 1, "tis/q8/s0": 0, "tis/q8/s1": 0}


def _metric_lines(spec) -> dict[str, int]:
    lines = {}
    for cell in spec.cells:
        path = cell.run_dir / "metrics.jsonl"
        lines[cell.id] = len(path.read_text().splitlines()) if path.exists() else 0
    return lines


def test_sigterm_to_the_arena_stops_the_running_cells_resumably_and_a_rerun_completes_them(tmp_path, plan):
    path = _arena(tmp_path, ARENA.replace('baseline = "off"', 'baseline = "off"\nset = ["run.steps=6"]'))
    spec = load_arena(path, out=tmp_path / "out")
    times = plan(step_seconds=0.4)
    with (tmp_path / "stderr.txt").open("w") as err:
        arena = subprocess.Popen([sys.executable, fake.__file__, str(path), str(spec.out), "2"], stderr=err)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and arena.poll() is None:
            lines = _metric_lines(spec)
            if lines["off/q8/s0"] >= 2 and lines["off/q8/s1"] >= 2:  # both first cells have logged step 1
                break
            time.sleep(0.1)
        arena.send_signal(signal.SIGTERM)
        assert arena.wait(timeout=60) == 143
    said = (tmp_path / "stderr.txt").read_text()
    assert "SIGTERM: forwarded to the 2 running cell(s), stopping them after their steps in progress" in said
    state = ArenaState.open(spec.out, spec).cells
    assert {cid: r.status for cid, r in state.items()} == {"off/q8/s0": "stopped", "off/q8/s1": "stopped",
                                                           "tis/q8/s0": "pending", "tis/q8/s1": "pending"}
    stopped = {r["cell"]: r for r in fake.intervals(times)}
    assert sorted(stopped) == ["off/q8/s0", "off/q8/s1"] and all(r["code"] == 143 for r in stopped.values())
    for cid in stopped:
        assert 1 <= state[cid].last_step < 6 and state[cid].error.startswith("stopped by SIGTERM at step")

    again = plan(times="again")
    assert run_arena(spec, only="off/*", say=lambda _: None, train=fake.train, workers=2) == 0  # the same command
    assert sorted((r["cell"], r["resume"]) for r in fake.intervals(again)) == [("off/q8/s0", True),
                                                                             ("off/q8/s1", True)]
    for cid in stopped:  # every step logged once: the stopped cells continued after their last step
        steps = [json.loads(line)["step"] for line in (tmp_path / "out" / "cells" / cid.replace("/", "__")
                                                      / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(7))
    assert _statuses(spec) == {"off/q8/s0": ("done", 2), "off/q8/s1": ("done", 2), "tis/q8/s0": ("pending", 0),
                               "tis/q8/s1": ("pending", 0)}


def test_sequential_workers_start_no_seed_before_the_previous_one_ended_and_stop_where_the_rule_says(tmp_path, plan):
    """off is slow and tis fast: without the barrier between seeds, the worker tis frees would start the next seed's
    off cell at once. The rule (K = 2 looks, after 3 and 4 seeds) settles tis vs off at the first look: seed 3 is
    skipped, as in process. The first two cells wait for each other (the fake's rendezvous): they ran together."""
    spec = load_arena(_arena(tmp_path, SEQUENTIAL), out=tmp_path / "out")
    times, lines = plan(step_seconds={"off": 0.5, "tis": 0.0}, rendezvous=2), []
    assert run_arena(spec, say=lines.append, train=fake.train, workers=2) == 0
    started = {c.id: next(i for i, line in enumerate(lines) if f" {c.id}: step " in line)
               for c in spec.cells if c.seed < 3}
    ended = {cid: next(i for i, line in enumerate(lines) if f" {cid}: done in " in line) for cid in started}
    for seed in (1, 2):  # in the order the arena said it: every cell of the seed before ended before one started
        assert min(started[c] for c in started if c.endswith(f"/s{seed}")) > \
            max(ended[c] for c in ended if c.endswith(f"/s{seed - 1}"))
    records = fake.intervals(times)
    assert sorted(r["cell"] for r in records) == sorted(started)
    assert _most_at_once(records) == 2
    plan(times="one")
    one = load_arena(spec.path, out=tmp_path / "one")
    assert run_arena(one, say=lambda _: None, train=fake.train) == 0
    assert _statuses(spec) == _statuses(one) and _statuses(spec)["off/q8/s3"] == ("skipped", 0)
    record = json.loads((spec.out / "arena-sequential.json").read_text())
    assert record == json.loads((one.out / "arena-sequential.json").read_text())
    assert record["stopped"]["after_seeds"] == [0, 1, 2]


def test_workers_below_one_and_unimportable_train_functions_are_refused_and_oversubscription_warned(
        tmp_path, monkeypatch):
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")
    with pytest.raises(ValueError, match=r"--workers must be at least 1 \(got 0\)"):
        run_arena(spec, train=fake.train, workers=0)
    with pytest.raises(ValueError, match="imports `train` by name"):
        run_arena(spec, train=lambda cfg, resume, log, progress: (0, "done"), workers=2)
    assert not (tmp_path / "out").exists()  # refused before anything was written
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert check_workers(2, fake.train, spec.cells) == []  # 2 x run.threads 1
    assert check_workers(3, fake.train, spec.cells) == [
        "--workers 3 x run.threads 1 = 3 threads on 2 CPU(s): the cells will compete for cores (each slower, the "
        "arena maybe no faster)"]


def test_the_dry_run_warns_of_oversubscription_and_divides_its_estimate_by_the_cells_at_a_time(
        tmp_path, monkeypatch, capsys):
    """A cell: 20 s start + 3 evals x 5 s + 2 steps x 10 s = 55 s; the estimate is divided by min(N, cells to run),
    under arena.sequential by min(N, the seed's cells to run) seed by seed."""
    from nearpolicy.cli import main

    timed = 'step_seconds = 10.0\neval_seconds = 5.0\nstart_seconds = 20.0\nbaseline = "off"'
    path = _arena(tmp_path, ARENA.replace('baseline = "off"', timed))
    monkeypatch.setattr("os.cpu_count", lambda: 2)

    def dry(*args: str, arena: Path = path) -> list[str]:
        assert main(["arena", str(arena), "--out", str(tmp_path / "out"), "--dry-run", *args]) == 0
        return capsys.readouterr().out.splitlines()

    warning = ("# warning: --workers 4 x run.threads 1 = 4 threads on 2 CPU(s): the cells will compete for cores (each "
               "slower, the arena maybe no faster)")
    out = dry("--workers", "4")
    assert warning in out and out[-1].endswith("estimated 55s with 4 workers (arena.step_seconds, eval_seconds, "
                                               "start_seconds)")
    out = dry("--workers", "4", "--only", "off/*")
    assert warning in out and out[-1].endswith("estimated 55s with 4 workers (at most 2 cells at a time) "
                                               "(arena.step_seconds, eval_seconds, start_seconds)")
    out = dry("--workers", "2")
    assert not any("warning" in line for line in out)
    assert out[-1].endswith("estimated 1m50s with 2 workers (arena.step_seconds, eval_seconds, start_seconds)")
    out = dry()
    assert not any("warning" in line for line in out)
    assert out[-1].endswith("estimated 3m40s (arena.step_seconds, eval_seconds, start_seconds)")
    sequential = _arena(tmp_path, SEQUENTIAL.replace('baseline = "off"', timed))
    out = dry("--workers", "4", arena=sequential)  # 4 seeds of 2 cells, seed after seed
    assert warning in out and out[-1].endswith("estimated 3m40s with 4 workers (at most 2 cells at a time) "
                                               "(arena.step_seconds, eval_seconds, start_seconds) at most (the rule "
                                               "may stop earlier)")
    assert not (tmp_path / "out").exists()


def test_the_cli_refuses_workers_below_one(tmp_path, capsys):
    from nearpolicy.cli import main

    assert main(["arena", str(_arena(tmp_path)), "--workers", "0"]) == 2
    assert "error: --workers must be at least 1 (got 0)" in capsys.readouterr().err


def test_the_eta_divides_the_work_left_by_the_workers(tmp_path):
    spec = load_arena(_arena(tmp_path), out=tmp_path / "out")  # 2 steps per cell
    state = ArenaState.open(spec.out, spec)
    a, b, c, d = spec.cells
    # no cell done: a's pace (100 s per step: 200 s a cell) for a's remainder, b (no step yet) and the waiting cells
    assert parallel_eta(spec, state, [(a, 100.0, 1, 1), (b, 50.0, 0, 2)], [c, d], 2) == (
        (100.0 + 150.0 + 2 * 200.0) / 2, True)
    state.cells[d.id].status, state.cells[d.id].seconds = "done", 300.0
    assert parallel_eta(spec, state, [(a, 100.0, 1, 1)], [c], 2) == ((100.0 + 300.0) / 2, True)
    assert parallel_eta(spec, state, [(a, 100.0, 1, 1)], [], 2) == (100.0, True)  # one cell left: no division


def test_workers_start_the_longest_cells_first_and_keep_the_given_order_among_equals(tmp_path, plan):
    text = ARENA.replace('baseline = "off"', 'baseline = "off"\nvary = ["algorithm.group_size"]').replace(
        "q8 = { set = [\"engine.precision='q8_0'\"] }", "G2 = { set = [\"algorithm.group_size=2\"] }\n"
        "G8 = { set = [\"algorithm.group_size=8\"] }")
    spec = load_arena(_arena(tmp_path, text), out=tmp_path / "out")
    seed0 = [(c, f"{i + 1}/8") for i, c in enumerate(spec.cells) if c.seed == 0]
    assert [c.id for c, _ in seed0] == ["off/G2/s0", "off/G8/s0", "tis/G2/s0", "tis/G8/s0"]
    ordered = longest_first(spec, seed0)
    assert [c.id for c, _ in ordered] == ["off/G8/s0", "tis/G8/s0", "off/G2/s0", "tis/G2/s0"]
    assert sorted(ordered, key=lambda item: item[1]) == seed0  # each cell keeps its position label
    times = plan(step_seconds=0.1)
    assert run_arena(spec, say=lambda _: None, train=fake.train, workers=2) == 0
    started = [r["cell"] for r in sorted(fake.intervals(times), key=lambda r: r["start"])]
    assert sorted(started[:4]) == ["off/G8/s0", "off/G8/s1", "tis/G8/s0", "tis/G8/s1"]  # the G = 8 cells went first


@pytest.mark.slow
def test_a_tiny_arena_through_the_cli_with_two_workers_logs_what_it_logs_in_process(tiny_model_dir, tmp_path, capsys):
    """The real training API in each worker (tests/test_arena_run.py's tiny arena, 4 cells x 2 steps): every cell
    done, and each run's logged numbers (eval accuracy, k3, rewards, losses: all but the timings and throughputs)
    the same as in process."""
    from test_arena_run import ARENA as TINY, REWARD, _base, _rows

    from nearpolicy.cli import main

    (tmp_path / "rewards.py").write_text(REWARD)
    (tmp_path / "base.toml").write_text(_base(tiny_model_dir, tmp_path))
    path = tmp_path / "arena.toml"
    path.write_text(TINY)
    assert main(["arena", str(path), "--out", str(tmp_path / "two"), "--workers", "2"]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err and " 2 running, " in err
    assert main(["arena", str(path), "--out", str(tmp_path / "one")]) == 0
    two, one = load_arena(path, tmp_path / "two"), load_arena(path, tmp_path / "one")
    assert set(_statuses(two).values()) == {("done", 1)}
    for a, b in zip(two.cells, one.cells):
        untimed = [[{k: v for k, v in row.items() if not k.startswith(("time/", "throughput/", "memory/"))}
                    for row in _rows(c.run_dir)] for c in (a, b)]
        assert untimed[0] == untimed[1]
