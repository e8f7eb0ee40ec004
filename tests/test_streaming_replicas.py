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
        in_flight = sum(len(seg.sample_indices) for segs, _ in calls.values() for seg in segs)
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


def _service(replicas: int, sent: list):
    from nearpolicy.rollouts.types import SegmentResult

    pool = SimpleNamespace(replicas=replicas, streams=True, submit=lambda w, c, jobs, s, seed: sent.append((w, c, jobs)),
                           restart=lambda w, p, v: None, interrupt_all=lambda: None, load_all=lambda p, v: None)
    sched = RolloutScheduler(2, 2, 1, 8, partial=True)
    service = RolloutService(sched, pool, lambda g: (1, 2, 3), SAMPLING, 0, 4, "-", log=lambda *a: None)
    reply = lambda g, i, finish, n=3: SegmentResult(g, i, sched.version, (5,) * n, (-1.0,) * n, finish)  # noqa: E731
    return service, sched, reply


def test_a_replica_that_dies_loses_only_what_had_not_come_back():
    """Replies come a group at a time, so a call can be partly back when its replica dies: a group that came back
    and went on to the other replica must not be issued again (it would be decoded twice and its second result
    refused as not in flight); only the dead replica's outstanding group is."""
    sent = []
    service, sched, reply = _service(2, sent)
    service._dispatch()
    (w0, c0, jobs0), (w1, c1, jobs1) = sent
    service.publish("-", 1)
    back, lost = jobs0[0].group_id, jobs0[1].group_id
    service._handle([(w0, "results", (c0, [reply(back, 0, "interrupted"), reply(back, 1, "interrupted")], None))])
    for j in jobs1:
        service._handle([(w1, "results", (c1, [reply(j.group_id, i, "interrupted") for i in j.sample_indices], None))])
    service._dispatch()
    assert any(j.group_id == back for w, _, jobs in sent[2:] if w == w1 for j in jobs)  # continued on replica 1
    service._handle([(w0, "died", 9)])
    reissued = {s.group_id for s in sched.waiting}
    assert lost in reissued and back not in reissued  # not the group replica 1 holds
    service._dispatch()
    for w in (0, 1):
        for call_id, (segments, _) in list(service.busy[w].items()):
            service._handle([(w, "results", (call_id, [reply(s.group_id, i, "length", 5) for s in segments
                                                       for i in s.sample_indices], None))])
    assert not sched.in_flight and service.busy == {0: {}, 1: {}}


def test_a_call_is_forgotten_once_all_its_groups_are_back_even_when_one_returns_to_the_same_replica():
    sent = []
    service, sched, reply = _service(1, sent)
    service._dispatch()
    service.publish("-", 1)
    service._handle([(0, "results", (1, [reply(0, 0, "interrupted"), reply(0, 1, "interrupted")], None))])
    service._dispatch()  # group 0 goes back to replica 0 while call 1 still holds group 1
    service._handle([(0, "results", (1, [reply(1, 0, "interrupted"), reply(1, 1, "interrupted")], None))])
    service._dispatch()
    for w, call_id, jobs in sent[1:]:
        service._handle([(w, "results", (call_id, [reply(j.group_id, i, "length", 5) for j in jobs
                                                   for i in j.sample_indices], None))])
    assert not sched.in_flight and service.busy == {0: {}}
