"""The asynchronous rollout service: drives engine replicas (rollouts/pool.py) with the scheduler's segments while
the trainer updates, hands complete groups to the trainer, publishes new weights (interrupting in-flight
decoding), and restarts a replica that dies, re-issuing its segments (no sample lost or trained twice)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from collections.abc import Callable

import numpy as np

from nearpolicy.engines.base import DecodeCounts, EngineError
from nearpolicy.rollouts.scheduler import GroupState, RolloutScheduler
from nearpolicy.rollouts.types import SegmentJob
from nearpolicy.signals import exit_description
from nearpolicy.types import Rollout, SamplingParams


class RolloutService:
    def __init__(self, scheduler: RolloutScheduler, pool, prompt_of: Callable[[int], tuple[int, ...]],
                 sampling: SamplingParams, seed: int, max_parallel: int, gguf_path: str, log=print):
        self.sched, self.pool, self.prompt_of = scheduler, pool, prompt_of
        self.sampling, self.seed, self.max_parallel, self.log = sampling, seed, max_parallel, log
        self.path, self.version = gguf_path, scheduler.version
        # replica -> call id -> (its segments, its (group, sample) pairs not back yet)
        self.busy: dict[int, dict[int, tuple[list, set]]] = {w: {} for w in range(pool.replicas)}
        self.idle_since = {w: time.perf_counter() for w in range(pool.replicas)}
        self.calls = 0
        self.counters: Counter = Counter()
        self.decode_counts: DecodeCounts | None = None  # None until a replica reports some

    # -- driving the replicas --------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Hand due segments to replicas: an idle one takes up to max_parallel samples; a pool that batches
        continuously (LocalPool.streams: its replicas admit a later call's samples into slots that finished
        sequences free) also takes more for a busy replica, up to max_parallel samples in flight on it."""
        for w in sorted(self.busy, key=self._on_replica):  # idle replicas first
            calls = self.busy[w]
            if calls and not getattr(self.pool, "streams", False):
                continue
            room = self.max_parallel - self._on_replica(w)
            if room <= 0:
                continue
            segments = self.sched.next_segments(limit=room, strict=bool(calls))  # a busy replica: only what fits
            if not segments:
                if calls:
                    continue
                return
            jobs = [self._job(s) for s in segments]
            self.calls += 1
            seed = int(np.random.SeedSequence([self.seed, self.version, self.calls]).generate_state(1)[0])
            self.pool.submit(w, self.calls, jobs, self.sampling, seed)
            if not calls:
                self.counters["engine_idle_s"] += time.perf_counter() - self.idle_since[w]
            calls[self.calls] = (segments, {(s.group_id, i) for s in segments for i in s.sample_indices})

    def _on_replica(self, w: int) -> int:
        """Samples sent to replica `w` and not back yet."""
        return sum(len(outstanding) for _, outstanding in self.busy[w].values())

    def _job(self, seg) -> SegmentJob:
        samples = [self.sched.sample(seg.group_id, i) for i in seg.sample_indices]
        return SegmentJob(seg.group_id, seg.sample_indices, seg.version, seg.fresh, self.prompt_of(seg.group_id),
                          tuple(tuple(s.completion_ids) for s in samples),
                          tuple(self.sched.remaining_tokens(seg.group_id, i) for i in seg.sample_indices),
                          tuple(s.episode for s in samples))

    def _handle(self, events: list[tuple]) -> None:
        for w, kind, payload in events:
            if kind == "results":
                call_id, results, counts = payload  # a streaming replica replies a group at a time
                outstanding = self.busy[w].get(call_id, ([], set()))[1]
                for r in results:
                    self.sched.on_result(r)
                    outstanding.discard((r.group_id, r.sample_index))
                if counts is not None:
                    self.decode_counts = counts if self.decode_counts is None else self.decode_counts + counts
                self.counters["generated_tokens"] += sum(len(r.completion_ids) for r in results)
                self._free(w, call_id)
            elif kind == "died":
                self.log(f"warning: engine replica {w} died ({exit_description(payload)}); restarting it and "
                         "re-issuing its segments")
                for segments, outstanding in self.busy[w].values():  # only what had not come back
                    for seg in segments:
                        left = tuple(i for i in seg.sample_indices if (seg.group_id, i) in outstanding)
                        if left:
                            self.sched.lost(replace(seg, sample_indices=left))
                self.counters["engine_restarts"] += 1
                self.pool.restart(w, self.path, self.version)
                self.busy[w].clear()
                self.idle_since[w] = time.perf_counter()
            elif kind == "error":
                raise EngineError(f"engine replica {w} failed:\n{payload}")

    def _free(self, w: int, call_id: int) -> None:
        """Forget call `call_id` of replica `w` once all its samples are back."""
        if self.busy[w].get(call_id, ([], set()))[1]:
            return
        self.busy[w].pop(call_id, None)
        if not self.busy[w]:
            self.idle_since[w] = time.perf_counter()

    # -- what the trainer calls ------------------------------------------------------------------
    def next_batch(self, fresh_only: bool = False, timeout_s: float = 3600.0) -> list[GroupState]:
        """Block until the scheduler hands out a training batch; the time spent here is the trainer's wait."""
        t0 = time.perf_counter()
        while True:
            self._dispatch()
            batch = self.sched.take_batch(fresh_only)
            if batch is not None:
                self.counters["trainer_wait_s"] += time.perf_counter() - t0
                return batch
            if time.perf_counter() - t0 > timeout_s:
                raise EngineError(f"no training batch after {timeout_s:.0f} s (engine replicas stalled?)")
            self._handle(self.pool.poll(timeout=0.05))

    def publish(self, gguf_path: str, version: int) -> None:
        """New weights: interrupt in-flight decoding, reload every replica (they reload in parallel with the
        trainer's next phase; segments issued from now on carry `version`)."""
        self.sched.publish(version)
        self.path, self.version = gguf_path, version
        self.pool.interrupt_all()
        self.pool.load_all(gguf_path, version)

    def take_counters(self) -> dict[str, float]:
        """Per-step service metrics (reset after reading) plus the scheduler's running counts."""
        out = {f"async/{k}": float(v) for k, v in self.counters.items()}
        out |= {f"async/{k}_total": float(v) for k, v in self.sched.stats.items()}
        self.counters = Counter()
        return out

    def take_decode_metrics(self) -> dict[str, float]:
        """rollout/decode_calls, decode_batch_mean and decode_occupancy (engines/base.DecodeCounts) of every replica
        call whose results came back since the last take, all replicas together (calls summed, occupancy of their
        slots); then reset. {} while no replica has reported counts; once one has, a take with no call since the last
        gives rollout/decode_calls 0."""
        counts = self.decode_counts
        self.decode_counts = None if counts is None else DecodeCounts()
        return {} if counts is None else counts.metrics()

    def close(self) -> None:
        self.pool.close()


def groups_to_rollouts(groups: list[GroupState], prompt_of: Callable[[int], tuple[int, ...]]) -> list[Rollout]:
    """Trainer rollouts from complete scheduler groups: ids, engine log-probs and per-token versions verbatim."""
    return [Rollout(g.group_id, i, list(prompt_of(g.group_id)), list(s.completion_ids), list(s.logprobs),
                    list(s.versions), s.finish) for g in groups for i, s in enumerate(g.samples)]
