"""Continuous batching across calls on the asynchronous replicas (rollouts/service.py, rollouts/worker.py): the
service never sends a busy replica more than it can hold, and a group the engine can never hold is refused, not
looped on. Pure Python (a stub pool and engine, no model)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from nearpolicy.engines.base import EngineError
from nearpolicy.engines.llamacpp import LlamaCppEngine
from nearpolicy.rollouts.scheduler import RolloutScheduler
from nearpolicy.rollouts.service import RolloutService
from nearpolicy.rollouts.types import SegmentJob
from nearpolicy.rollouts.worker import EngineWorker
from nearpolicy.types import SamplingParams

SAMPLING = SamplingParams(1.0, 1.0, 0, 8)


def test_a_busy_streaming_replica_is_never_sent_more_than_max_parallel_samples():
    """max_parallel 3, groups of 2: replica 0 holds 2 samples (room 1), and a whole group would not fit: it is sent
    nothing more (next_segments strict), and the idle replica 1 gets the next group."""
    sent = []
    pool = SimpleNamespace(replicas=2, streams=True,
                           submit=lambda w, call, jobs, s, seed: sent.append((w, call, jobs)))
    sched = RolloutScheduler(2, 4, 1, SAMPLING.max_new_tokens)
    service = RolloutService(sched, pool, lambda g: (1, 2, 3), SAMPLING, 0, 3, "-")
    service._dispatch()
    service._dispatch()
    for w, calls in service.busy.items():
        in_flight = sum(len(seg.sample_indices) for segs in calls.values() for seg in segs)
        assert in_flight <= 3, f"replica {w} has {in_flight} samples in flight (max_parallel 3): {sent}"
    assert sorted(w for w, _, _ in sent) == [0, 1]  # one group each, the idle replica included


def _stub_engine(max_parallel: int) -> LlamaCppEngine:
    engine = object.__new__(LlamaCppEngine)
    engine.max_parallel, engine.max_context, engine.version = max_parallel, 256, 0
    engine._model = object()
    engine._sampling_context = lambda cells: SimpleNamespace(cells_per_seq=256)
    engine._fit_threads = lambda ctx: None
    return engine


def test_a_group_larger_than_the_engine_raises_instead_of_hanging():
    """A group of more samples than max_parallel_sequences can never start: EngineWorker.run (serve) raises
    EngineError naming it instead of waiting for slots that never free."""
    worker = object.__new__(EngineWorker)
    worker.engine, worker.runner = _stub_engine(2), None
    job = SegmentJob(0, (0, 1, 2), 0, True, (1, 2, 3), ((), (), ()), (8, 8, 8))
    outcome = []

    def go():
        try:
            outcome.append(worker.run([job], SAMPLING, 0))
        except EngineError as err:
            outcome.append(err)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "EngineWorker.run is still looping after 10 s (group of 3 > max_parallel 2)"
    assert isinstance(outcome[0], EngineError) and "exceeds engine.max_parallel_sequences" in str(outcome[0])
