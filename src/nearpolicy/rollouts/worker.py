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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from nearpolicy.engines.base import DecodeCounts, take_decode_counts
from nearpolicy.engines.llamacpp import EngineSpec
from nearpolicy.rollouts.types import SegmentJob, SegmentResult
from nearpolicy.types import GenerationRequest, SamplingParams

if TYPE_CHECKING:  # episodes.py imports torch: a replica process without episodes must not pay for it
    from nearpolicy.rollouts.episodes import EpisodeSetup


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
        """Generate every job's samples in one multi-sequence batch; one SegmentResult per (job, sample)."""
        if self.runner is not None:
            return self.run_episodes(jobs, sampling, seed, interrupt)
        requests, owners, out = [], [], []
        for job in jobs:
            if job.version != self.engine.version:
                out += [SegmentResult(job.group_id, i, job.version, (), (), "interrupted") for i in job.sample_indices]
            elif job.fresh:
                requests.append(GenerationRequest(len(requests), job.prompt_ids, len(job.sample_indices),
                                                  max_new_tokens=job.remaining[0]))
                owners.append((job, job.sample_indices))
            else:
                for i, prefix, left in zip(job.sample_indices, job.prefixes, job.remaining):
                    requests.append(GenerationRequest(len(requests), job.prompt_ids + prefix, 1, max_new_tokens=left))
                    owners.append((job, (i,)))
        rollouts = self.engine.generate(requests, sampling, seed, interrupt=interrupt) if requests else []
        cursor = 0
        for job, indices in owners:
            for i in indices:
                r = rollouts[cursor]
                cursor += 1
                out.append(SegmentResult(job.group_id, i, job.version, tuple(r.completion_ids),
                                         tuple(float(x) for x in r.rollout_logprobs), r.finish_reason))
        return out

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
    while not orphaned():
        try:
            kind, payload = inbox.get(timeout=1.0)
        except queue.Empty:
            continue
        try:
            if kind == "run":
                call_id, jobs, sampling, seed = payload
                stop = lambda: interrupt_event.is_set() or orphaned()  # noqa: E731
                results = worker.run(jobs, sampling, seed, stop)
                outbox.put((worker_id, "results", (call_id, results, worker.take_decode_counts())))
            elif kind == "load":
                worker.load(*payload)
                interrupt_event.clear()
                outbox.put((worker_id, "loaded", payload[1]))
            else:
                worker.close()
                return
        except Exception:  # noqa: BLE001
            outbox.put((worker_id, "error", traceback.format_exc()))
