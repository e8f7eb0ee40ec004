"""An engine worker: runs scheduler segments on a llama.cpp engine, in its own process (local backend) or as a
Ray actor (ray backend). A segment whose version is not the engine's comes back interrupted with no tokens, so
no token is ever labelled with a version whose weights did not produce it.

Tool-use episodes run their tool calls here, in the replica, through the replica's own EpisodeRunner and
ToolClient (built from an EpisodeSetup in this process), not in the trainer's: a segment is then a whole stretch of
turns with the tool calls between them, so the replicas keep sampling episodes while the trainer updates (the
trainer's rollout service only dispatches while the trainer waits for a batch: a call per turn through it would idle
the replicas for the whole update), and the replicas' tool calls run in parallel. A tool server that crashes or
hangs is the ToolClient's error observation (kind server_died / timeout) and is restarted for the next call; it
never stops the replica or the run."""

from __future__ import annotations

import copy
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from nearpolicy.engines.base import DecodeCounts, EngineError, take_decode_counts
from nearpolicy.engines.llamacpp import EngineSpec
from nearpolicy.rollouts.types import SegmentJob, SegmentResult
from nearpolicy.types import GenerationRequest, SamplingParams

if TYPE_CHECKING:  # episodes.py imports torch: a replica process without episodes must not pay for it
    from nearpolicy.rollouts.episodes import EpisodeSetup


def _interrupted(job: SegmentJob, sample_index: int) -> SegmentResult:
    return SegmentResult(job.group_id, sample_index, job.version, (), (), "interrupted")


class EngineWorker:
    """The engine of `spec`; with `episodes`, its segments are tool-use episodes (run_episodes)."""

    def __init__(self, spec: EngineSpec, episodes: EpisodeSetup | None = None):
        self.engine = spec.open()
        self.runner = None if episodes is None else episodes.runner()

    @property
    def version(self) -> int:
        return self.engine.version

    def load(self, gguf_path: str, version: int) -> None:
        self.engine.update_weights(Path(gguf_path), version)

    def run(self, jobs: list[SegmentJob], sampling: SamplingParams, seed: int,
            interrupt: Callable[[], bool] | None = None) -> list[SegmentResult]:
        """Generate every job's samples in one multi-sequence batch; one SegmentResult per (job, sample), in job
        order."""
        if self.runner is not None:
            return self.run_episodes(jobs, sampling, seed, interrupt)
        back: list[SegmentResult] = []
        self.serve((0, jobs, sampling, seed), lambda: None, lambda call_id, results: back.extend(results), interrupt)
        order = {(j.group_id, i): k for k, (j, i) in enumerate((j, i) for j in jobs for i in j.sample_indices)}
        return sorted(back, key=lambda r: order[(r.group_id, r.sample_index)])

    def serve(self, call: tuple, next_call: Callable[[], tuple | None],
              reply: Callable[[int, list[SegmentResult]], None], interrupt: Callable[[], bool] | None = None) -> None:
        """Continuous batching across calls: decode `call` = (call_id, jobs, sampling, seed) and, as finished
        sequences free slots, the jobs of the calls `next_call()` hands over (None: none waiting), in one decode
        loop (engine.stream). `reply(call_id, results)` hands back results as they finish: a group (or a continued
        sample) at a time, so the caller can send more work as soon as slots free; every (job, sample) comes back
        exactly once. A later call with other sampling parameters is served after the ones before it. A job at
        another version than the engine's comes back interrupted with no tokens; on `interrupt`, unfinished samples
        come back as they are and samples not started with no tokens. Decode passes are seeded
        SeedSequence([seed of `call`, pass]) (an asynchronous run's samples depend on timing anyway). Raises
        EngineError for a group larger than the engine's max_parallel_sequences or a sample whose prompt and token
        limit exceed its model.max_context."""
        sampling, seed = call[2], call[3]
        waiting: deque = deque()  # (call_id, job, sample indices, request), not started
        started: dict[int, tuple] = {}  # id(request) -> the same, once the engine took it
        postponed: list[tuple] = []  # calls with other sampling parameters

        def take(entry: tuple) -> None:
            stale = [_interrupted(job, i) for job in entry[1] if job.version != self.engine.version
                     for i in job.sample_indices]
            if stale:
                reply(entry[0], stale)
            for job in (j for j in entry[1] if j.version == self.engine.version):
                if job.fresh:
                    waiting.append((entry[0], job, job.sample_indices, self._request(
                        job.group_id, job.prompt_ids, len(job.sample_indices), job.remaining[0], sampling)))
                else:
                    waiting.extend((entry[0], job, (i,), self._request(job.group_id, job.prompt_ids + prefix, 1, left,
                                                                       sampling))
                                   for i, prefix, left in zip(job.sample_indices, job.prefixes, job.remaining))

        def pull(free_slots: int, cells: int) -> list[GenerationRequest]:
            nonlocal pulled
            while not postponed and sum(w[3].n for w in waiting) < free_slots and (entry := next_call()) is not None:
                (take if entry[2] == sampling else postponed.append)(entry)
            out = []
            fits = lambda r: r.n <= free_slots and r.kv_cells(sampling.max_new_tokens) <= cells  # noqa: E731
            while waiting and fits(waiting[0][3]):
                entry = waiting.popleft()
                started[id(entry[3])] = entry
                out.append(entry[3])
                free_slots -= entry[3].n
            pulled += len(out)
            return out

        def emit(request: GenerationRequest, rollouts) -> None:
            call_id, job, indices, _ = started.pop(id(request))
            reply(call_id, [SegmentResult(job.group_id, i, job.version, tuple(r.completion_ids),
                                          tuple(float(x) for x in r.rollout_logprobs), r.finish_reason)
                            for i, r in zip(indices, rollouts)])

        take(call)
        passes = pulled = 0
        while waiting:
            before = pulled
            pass_seed = int(np.random.SeedSequence([seed, passes]).generate_state(1)[0])
            need = max(w[3].kv_cells(sampling.max_new_tokens) for w in waiting)
            self.engine.stream(pull, emit, sampling, pass_seed, interrupt, need)
            passes += 1
            if interrupt and interrupt():
                break
            if pulled == before:  # nothing could start: never loop on it
                raise EngineError(f"the engine took none of {len(waiting)} waiting samples")
        for call_id, job, indices, _ in waiting:
            reply(call_id, [_interrupted(job, i) for i in indices])
        waiting.clear()
        for entry in postponed:
            self.serve(entry, lambda: None, reply, interrupt)

    def _request(self, group_id: int, prompt_ids: tuple[int, ...], n: int, limit: int,
                 sampling: SamplingParams) -> GenerationRequest:
        request = GenerationRequest(group_id, prompt_ids, n, max_new_tokens=limit)
        self.engine.check_request(request, sampling)
        return request

    def run_episodes(self, jobs: list[SegmentJob], sampling: SamplingParams, seed: int,
                     interrupt: Callable[[], bool] | None = None) -> list[SegmentResult]:
        """Continue every job sample's episode (a copy of the job's; a new one from the prompt where it has none)
        turn by turn, tool calls included, until it ends or `interrupt` returns True; every turn's generate call
        holds all of them (round r seeded SeedSequence([seed, r])). One SegmentResult per (job, sample): the ids
        the segment added (model and observation), their log-probs (None for observations), finish "stop" /
        "length" for an episode that ended, else "interrupted", and the episode itself."""
        out, episodes = [], []
        for job in jobs:
            if job.version != self.engine.version:
                out += [SegmentResult(job.group_id, i, job.version, (), (), "interrupted") for i in job.sample_indices]
                continue
            held = job.episodes or (None,) * len(job.sample_indices)
            episodes += [copy.deepcopy(e) if e is not None else self.runner.new(job.group_id, i, list(job.prompt_ids))
                         for i, e in zip(job.sample_indices, held, strict=True)]
        before = [len(e.ids) for e in episodes]
        seed_of_round = lambda r: int(np.random.SeedSequence([seed, r]).generate_state(1)[0])  # noqa: E731
        self.runner.run(self.engine, episodes, sampling, seed_of_round, interrupt=interrupt)
        for e, n in zip(episodes, before):
            finish = e.finish(self.runner.stop_ids) if e.done else "interrupted"
            out.append(SegmentResult(e.group_id, e.sample_index, self.engine.version, tuple(e.ids[n:]),
                                     tuple(e.logprobs[n:]), finish, e))
        return out

    def take_decode_counts(self) -> DecodeCounts | None:
        """The engine's decode counts of the runs since the last take (engines/base.take_decode_counts)."""
        return take_decode_counts(self.engine)

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            if self.runner is not None:
                self.runner.tools.close()


def process_main(worker_id: int, spec: EngineSpec, inbox, outbox, interrupt_event,
                 episodes: EpisodeSetup | None = None) -> None:
    """Entry point of a local worker process: serve run / load / stop messages until told to stop. Ctrl-C reaches
    the whole process group; the trainer decides how to stop (signals.py), so the replica ignores it."""
    import os
    import queue
    import signal

    os.setpgrp()  # a signal to the trainer's process group (Ctrl-C, kill -TERM -PGID) is the trainer's to handle
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    orphaned = lambda: os.getppid() != parent  # noqa: E731 - the trainer was killed (SIGKILL): stop, do not linger
    try:
        worker = EngineWorker(spec, episodes)
    except Exception:  # noqa: BLE001 - reported to the trainer, which raises it
        outbox.put((worker_id, "error", traceback.format_exc()))
        return
    outbox.put((worker_id, "ready", spec.version))
    held: deque = deque()  # messages read while serving runs, handled in order afterwards

    def next_run():
        """The next run waiting in the inbox, or None; stops at the first other message (a load or stop must come
        first: runs sent after a load are for the new weights)."""
        while not held:
            try:
                kind, payload = inbox.get_nowait()
            except queue.Empty:
                return None
            if kind == "run":
                return payload
            held.append((kind, payload))
        return None

    def reply(call_id, results) -> None:
        outbox.put((worker_id, "results", (call_id, results, worker.take_decode_counts())))

    while not orphaned():
        try:
            kind, payload = held.popleft() if held else inbox.get(timeout=1.0)
        except queue.Empty:
            continue
        try:
            if kind == "run":
                stop = lambda: interrupt_event.is_set() or orphaned()  # noqa: E731
                if worker.runner is None:  # continuous batching across runs (EngineWorker.serve)
                    worker.serve(payload, next_run, reply, stop)
                else:
                    call_id, jobs, sampling, seed = payload
                    reply(call_id, worker.run(jobs, sampling, seed, stop))
            elif kind == "load":
                worker.load(*payload)
                interrupt_event.clear()
                outbox.put((worker_id, "loaded", payload[1]))
            else:
                worker.close()
                return
        except Exception:  # noqa: BLE001
            outbox.put((worker_id, "error", traceback.format_exc()))
