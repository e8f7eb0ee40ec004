"""Asynchronous rollouts on real llama.cpp engines (tiny model): partial rollouts keep exact per-token log-probs
and versions across a weight update, a replica killed mid-rollout is restarted and its samples re-issued
(none lost, none trained twice), the trainer runs with staleness and resyncs on low ESS, resume keeps the
scheduler, and the Ray backend trains with 2 replicas."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nearpolicy.engines.llamacpp import EngineSpec
from nearpolicy.rollouts.scheduler import RolloutScheduler
from nearpolicy.rollouts.types import SegmentJob
from nearpolicy.rollouts.worker import EngineWorker
from nearpolicy.types import SamplingParams

SAMPLING = SamplingParams(1.0, 1.0, 0, 24)
PROMPTS = {g: tuple(int(t) for t in np.random.default_rng(g).integers(100, 40000, 5)) for g in range(64)}


def _spec(path: Path, version: int) -> EngineSpec:
    return EngineSpec(str(path), version, 256, 16, 1, "f32", False)


def _job(sched: RolloutScheduler, seg) -> SegmentJob:
    samples = [sched.sample(seg.group_id, i) for i in seg.sample_indices]
    return SegmentJob(seg.group_id, seg.sample_indices, seg.version, seg.fresh, PROMPTS[seg.group_id],
                      tuple(tuple(s.completion_ids) for s in samples),
                      tuple(sched.remaining_tokens(seg.group_id, i) for i in seg.sample_indices))


@pytest.fixture(scope="module")
def two_versions(tiny_model_dir, smollm2_gguf, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny model as version 0 and, with its weights perturbed, as version 1 (f32 GGUFs)."""
    from transformers import AutoModelForCausalLM

    from nearpolicy.engines.gguf.export import export_gguf

    folder = tmp_path_factory.mktemp("versions")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    export_gguf(model.state_dict(), model.config, folder / "v0.gguf", "f32", smollm2_gguf)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g))
    export_gguf(model.state_dict(), model.config, folder / "v1.gguf", "f32", smollm2_gguf)
    return folder / "v0.gguf", folder / "v1.gguf"


def test_interrupted_samples_continue_with_exact_per_token_logprobs_and_versions(two_versions):
    v0, v1 = two_versions
    worker = EngineWorker(_spec(v0, 0))
    sched = RolloutScheduler(2, 1, 1, SAMPLING.max_new_tokens, partial=True)
    polls = iter([False] * 6 + [True] * 10**6)  # the weight update lands after 5 decode steps
    for r in worker.run([_job(sched, s) for s in sched.next_segments()], SAMPLING, 1, lambda: next(polls)):
        sched.on_result(r)
    cut = worker.take_decode_counts()  # polled before the prefill, then before each decode call: 5 ran
    assert cut.calls == 5 and cut.slots == 5 * 16 and cut.sequences > 5
    sched.publish(1)
    worker.load(str(v1), 1)
    continued = sched.next_segments()
    resumed = [s for s in continued if not s.fresh]
    assert resumed and continued[: len(resumed)] == resumed  # interrupted samples go out first
    assert all(s.version == 1 for s in continued)
    for r in worker.run([_job(sched, s) for s in continued], SAMPLING, 2):
        sched.on_result(r)
    batch = sched.take_batch() + sched.take_batch() + sched.take_batch()
    worker.close()
    engines = {0: EngineWorker(_spec(v0, 0)).engine, 1: EngineWorker(_spec(v1, 1)).engine}
    mixed = 0
    for g in batch:
        for s in g.samples:
            assert s.versions == sorted(s.versions) and len(s.versions) == len(s.completion_ids)
            mixed += len(set(s.versions)) == 2
            for version, engine in engines.items():  # teacher-forced log-probs of each version's own tokens
                scored = engine.score(list(PROMPTS[g.group_id]), s.completion_ids, SAMPLING)
                mine = [k for k, v in enumerate(s.versions) if v == version]
                assert np.allclose([s.logprobs[k] for k in mine], [scored[k] for k in mine], rtol=0, atol=5e-5)
    assert mixed >= 1
    for engine in engines.values():
        engine.close()


def test_replica_killed_mid_rollout_is_restarted_and_nothing_is_lost_or_repeated(two_versions):
    from nearpolicy.rollouts.pool import LocalPool
    from nearpolicy.rollouts.service import RolloutService

    v0, v1 = two_versions
    sched = RolloutScheduler(2, 2, 0, SAMPLING.max_new_tokens)
    pool = LocalPool(_spec(v0, 0), 1)
    service = RolloutService(sched, pool, PROMPTS.__getitem__, SAMPLING, 0, 16, str(v0), log=lambda m: None)
    try:
        service._dispatch()
        os.kill(pool.pids()[0], signal.SIGKILL)
        trained = []
        for step in range(3):
            batch = service.next_batch(timeout_s=300)
            for g in batch:
                assert all(len(s.completion_ids) > 0 and s.versions == [step] * len(s.completion_ids) for s in g.samples)
            trained += [g.group_id for g in batch]
            service.publish(str(v1 if step % 2 == 0 else v0), step + 1)
        counters = service.take_counters()
        decode = service.take_decode_metrics()
    finally:
        service.close()
    assert sorted(trained) == list(range(6))  # every group exactly once, none lost
    assert counters["async/engine_restarts"] == 1 and counters["async/reissued_segments_total"] >= 1
    assert decode["rollout/decode_calls"] >= 1 and 0 < decode["rollout/decode_occupancy"] <= 1  # through the pool


def _train(args, cwd, timeout=900, env=None):
    return subprocess.run([sys.executable, "-m", "nearpolicy", "train", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _base(model_path: Path, out: Path, name: str, *extra: str) -> list[str]:
    sets = [f"model.path='{model_path}'", f"run.output_dir='{out}'", f"run.name={name}", "run.steps=4",
            "algorithm.prompts_per_step=2", "algorithm.group_size=2", "algorithm.micro_batch_size=2",
            "sampling.max_new_tokens=8", "task.eval_size=4", "task.train_size=50", "logging.eval_every=4",
            "logging.checkpoint_every=1", "model.max_context=256", "logging.progress=false", *extra]
    return [arg for s in sets for arg in ("--set", s)]


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]


@pytest.mark.slow
def test_async_training_bounds_staleness_resyncs_and_resumes(tiny_gguf_factory, tmp_path):
    model = tiny_gguf_factory("f32")
    extra = ("rollout.engines=1", "rollout.staleness=1", "rollout.partial=true", "rollout.overprovision=1",
             "rollout.resync_ess=1.0")  # any stale token has ESS < 1: every stale step asks for a resync
    proc = _train(_base(model, tmp_path, "async", *extra), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(tmp_path / "async")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["staleness/max"] <= 1 and r["policy/version"] == r["step"] for r in rows)
    assert any(r["staleness/resync"] == 1 for r in rows[:-1])
    for before, after in zip(rows, rows[1:]):
        if before["staleness/resync"] == 1:  # the next update waited for the newest weights
            assert after["staleness/fresh_only"] == 1 and after["staleness/off_policy_token_frac"] == 0
    state = json.loads((tmp_path / "async" / "checkpoints" / "step_000004" / "trainer_state.json").read_text())
    assert state["scheduler"]["version"] == 4 and state["scheduler"]["consumed_groups"] == 8
    from nearpolicy.runs.report import write_report

    write_report([tmp_path / "async"], tmp_path / "async.html")
    staleness = (tmp_path / "async.html").read_text().split(">Staleness<")[1].split("<h2")[0]
    assert "<img" in staleness and "synchronous run" not in staleness  # the report reads the trainer's keys
    resumed = _train(_base(model, tmp_path, "async", *extra, "run.steps=5") + ["--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in _rows(tmp_path / "async")] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_ray_backend_trains_two_steps_with_two_replicas(tiny_gguf_factory, tmp_path):
    model = tiny_gguf_factory("f32")
    temp = tmp_path / "temp"  # the actors' node-local GGUF copies land here (they inherit TMPDIR; Ray's own
    # session folder stays under /tmp: its socket paths must stay short)
    temp.mkdir()
    proc = _train(_base(model, tmp_path, "ray", "run.steps=2", "logging.eval_every=2", "rollout.backend='ray'",
                        "rollout.engines=2", "rollout.staleness=1"), tmp_path, env=os.environ | {"TMPDIR": str(temp), "RAY_TMPDIR": "/tmp"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(temp.glob("nearpolicy-*.gguf"))  # each actor deleted its copy before the pool killed it
    assert "2 ray engine replica(s)" in proc.stderr  # a line the trainer logs, relayed by the driver
    actor_pid, driver_pid = map(int, re.search(r"trainer: Ray actor pid (\d+) on .* \(driver pid (\d+)\)",
                                                proc.stderr).groups())
    assert actor_pid != driver_pid  # the trainer ran in its own Ray worker process
    rows = _rows(tmp_path / "ray")
    assert [r["step"] for r in rows] == [1, 2] and all(r["staleness/max"] <= 1 for r in rows)
    assert rows[0]["rollout/decode_calls"] >= 1 and 0 < rows[0]["rollout/decode_occupancy"] <= 1  # from 2 actors
    assert "eval/accuracy" in rows[-1]
    assert re.search(rf"checkpoints in {tmp_path / 'ray' / 'checkpoints'}; `(\S+ -m )?nearpolicy report",
                     proc.stderr.splitlines()[-1])  # the program as started (python -m here, unless on PATH)


@pytest.mark.slow
def test_ray_trainer_resources_no_node_offers_fail_at_once_naming_them(tmp_path):
    proc = _train(["--set", "rollout.backend='ray'", "--set", "rollout.engines=1", "--set",
                   "rollout.trainer_resources={gpu_trainer = 1}", "--set", f"run.output_dir='{tmp_path}'"],
                  tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "rollout.trainer_resources {'gpu_trainer': 1.0}: no node of the Ray cluster offers that much" in proc.stderr
    assert not (tmp_path / "grpo-smollm2-chain-sum").exists()  # nothing started, nothing written
    bad = _train(["--set", "rollout.backend='ray'", "--set", "rollout.engines=1", "--set", "rollout.ray_address='nonsense'",
                  "--set", f"run.output_dir='{tmp_path}'"], tmp_path, timeout=300)
    assert bad.returncode == 2 and "error: rollout.ray_address 'nonsense'" in bad.stderr, bad.stderr[-3000:]


@pytest.mark.slow
def test_ray_driver_forwards_sigterm_the_trainer_actor_checkpoints_and_the_run_resumes(tiny_gguf_factory, tmp_path):
    import time

    model = tiny_gguf_factory("f32")
    args = _base(model, tmp_path, "ray", "run.steps=400", "logging.eval_every=400", "rollout.backend='ray'",
                 "rollout.engines=1", "rollout.staleness=1")
    proc = subprocess.Popen([sys.executable, "-m", "nearpolicy", "train", *args], cwd=tmp_path, text=True,
                            stderr=subprocess.PIPE)
    metrics = tmp_path / "ray" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 143, err[-3000:]
    stopped = re.search(r"stopped by SIGTERM at step (\d+); checkpoint (\S+) \(continue: (?:\S+ -m )?nearpolicy train --resume \S+\)", err)
    assert stopped, err[-3000:]
    step = int(stopped.group(1))
    assert step >= 2 and Path(stopped.group(2)).is_dir()
    resumed = _train(_base(model, tmp_path, "ray", f"run.steps={step + 1}", "logging.eval_every=400",
                           "rollout.backend='ray'", "rollout.engines=1", "rollout.staleness=1") + ["--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {stopped.group(2)} at step {step}" in resumed.stderr
    assert [r["step"] for r in _rows(tmp_path / "ray")] == list(range(1, step + 2))


def test_replica_that_raises_stops_the_run_with_its_traceback(two_versions):
    from nearpolicy.rollouts.pool import LocalPool
    from nearpolicy.engines.base import EngineError
    from nearpolicy.rollouts.service import RolloutService

    v0, _ = two_versions
    too_long = {0: tuple(range(100, 400))}  # 300 prompt tokens + 24 new > the replica's 256-token context
    service = RolloutService(RolloutScheduler(1, 1, 0, 24), LocalPool(_spec(v0, 0), 1), too_long.__getitem__,
                             SAMPLING, 0, 16, str(v0), log=lambda m: None)
    try:
        with pytest.raises(EngineError, match="engine replica 0 failed(.|\n)*exceeds the context of 256"):
            service.next_batch(timeout_s=120)
    finally:
        service.close()


def _running(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


def test_replicas_exit_when_the_trainer_is_killed(two_versions):
    """SIGKILL of the trainer process: its engine replicas notice and exit instead of lingering."""
    import time

    script = ("import sys, time\nfrom nearpolicy.rollouts.pool import LocalPool\n"
              "from nearpolicy.engines.llamacpp import EngineSpec\n"
              "pool = LocalPool(EngineSpec(sys.argv[1], 0, 256, 16, 1, 'f32', False), 2)\n"
              "ready = 0\nwhile ready < 2:\n    ready += sum(e[1] == 'ready' for e in pool.poll(1.0))\n"
              "print(*pool.pids(), flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(two_versions[0])], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and all(_running(p) for p in pids)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 120
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_running(p) for p in pids)


def test_a_replica_admits_a_later_call_into_its_running_batch_and_replies_a_group_at_a_time(two_versions):
    """EngineWorker.serve (continuous batching across calls): a second call handed over while the first decodes is
    admitted into free slots of the same decode loop, so both take the decode calls of one (24 tokens: 23 after
    the prefill, not 46); results come back a group at a time, every (job, sample) exactly once, every log-prob the
    engine's teacher-forced one. A call with other sampling parameters is served after, and an interrupt hands
    back every sample taken, unfinished ones as "interrupted"."""
    v0, _ = two_versions
    worker = EngineWorker(_spec(v0, 0))
    sched = RolloutScheduler(2, 4, 1, SAMPLING.max_new_tokens)
    first, second, third = ([_job(sched, seg) for seg in sched.next_segments(limit=2)] for _ in range(3))
    other = SamplingParams(0.7, 1.0, 0, SAMPLING.max_new_tokens)
    handed = iter([(2, second, SAMPLING, 5), (3, third, other, 6)])
    replies = []
    worker.serve((1, first, SAMPLING, 4), lambda: next(handed, None), lambda c, r: replies.append((c, r)))
    counts = worker.take_decode_counts()
    assert counts.calls == 2 * (SAMPLING.max_new_tokens - 1)  # calls 1 and 2 together, then call 3 alone
    assert replies[-1][0] == 3 and all(len(r) == 2 for _, r in replies)  # a group of 2 per reply
    got = sorted((c, r.group_id, r.sample_index) for c, results in replies for r in results)
    assert got == sorted((c, j.group_id, i) for c, jobs in ((1, first), (2, second), (3, third))
                         for j in jobs for i in j.sample_indices)
    for call_id, results in replies:
        sampling = other if call_id == 3 else SAMPLING
        for r in results:
            assert r.finish == "length" and len(r.completion_ids) == SAMPLING.max_new_tokens
            scored = worker.engine.score(list(PROMPTS[r.group_id]), list(r.completion_ids), sampling)
            assert np.allclose(r.logprobs, scored, rtol=0, atol=5e-5)
    polls = iter([False] * 4 + [True] * 10**6)
    cut = []
    fourth, fifth = ([_job(sched, seg) for seg in sched.next_segments(limit=2)] for _ in range(2))
    handed = iter([(5, fifth, SAMPLING, 8)])
    worker.serve((4, fourth, SAMPLING, 7), lambda: next(handed, None), lambda c, r: cut.extend((c, x) for x in r),
                 lambda: next(polls))
    worker.close()
    assert sorted((c, r.group_id, r.sample_index) for c, r in cut) == sorted(
        (c, j.group_id, i) for c, jobs in ((4, fourth), (5, fifth)) for j in jobs for i in j.sample_indices)
    assert all(r.finish == "interrupted" and 0 < len(r.completion_ids) < SAMPLING.max_new_tokens for _, r in cut)
