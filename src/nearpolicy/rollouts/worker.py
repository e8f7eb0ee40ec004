"""An engine worker: runs scheduler segments on a llama.cpp engine, in its own process (local backend) or as a
Ray actor (ray backend). A segment whose version is not the engine's comes back interrupted with no tokens, so
no token is ever labelled with a version whose weights did not produce it."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path

from nearpolicy.engines.llamacpp import EngineSpec
from nearpolicy.rollouts.types import SegmentJob, SegmentResult
from nearpolicy.types import GenerationRequest, SamplingParams


class EngineWorker:
    def __init__(self, spec: EngineSpec):
        self.engine = spec.open()

    @property
    def version(self) -> int:
        return self.engine.version

    def load(self, gguf_path: str, version: int) -> None:
        self.engine.update_weights(Path(gguf_path), version)

    def run(self, jobs: list[SegmentJob], sampling: SamplingParams, seed: int,
            interrupt: Callable[[], bool] | None = None) -> list[SegmentResult]:
        """Generate every job's samples in one multi-sequence batch; one SegmentResult per (job, sample)."""
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

    def close(self) -> None:
        self.engine.close()


def process_main(worker_id: int, spec: EngineSpec, inbox, outbox, interrupt_event) -> None:
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
        worker = EngineWorker(spec)
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
                outbox.put((worker_id, "results", (call_id, worker.run(jobs, sampling, seed, stop))))
            elif kind == "load":
                worker.load(*payload)
                interrupt_event.clear()
                outbox.put((worker_id, "loaded", payload[1]))
            else:
                worker.close()
                return
        except Exception:  # noqa: BLE001
            outbox.put((worker_id, "error", traceback.format_exc()))
