"""Engine replicas running beside the trainer: local processes (`LocalPool`) or Ray actors (`RayPool`).

Both expose the same small interface to the rollout service: submit(worker, call_id, jobs, sampling, seed),
poll(timeout) -> events, interrupt_all(), load_all(path, version), restart(worker, path, version), pids(), close().
Events are (worker, kind, payload) with kind "results" ((call_id, [SegmentResult], the call's DecodeCounts or
None)), "loaded", "ready", "died"
(the replica is gone) or "error" (the engine raised: a traceback string). With an EpisodeSetup, every replica runs
tool-use episodes with its own tools (rollouts/worker.py)."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from nearpolicy.engines.llamacpp import EngineSpec
from nearpolicy.rollouts.worker import EngineWorker, process_main

if TYPE_CHECKING:  # episodes.py imports torch: a replica process without episodes must not pay for it
    from nearpolicy.rollouts.episodes import EpisodeSetup


class LocalPool:
    """N engine worker processes (spawned, daemonic) fed through queues; an Event per worker interrupts decoding.
    `streams`: a replica admits the samples of a call sent while it decodes into the slots its finished sequences
    free (rollouts/worker.EngineWorker.serve), so the service may send it more before it replies; not for tool-use
    episodes, which a replica runs one call at a time."""

    def __init__(self, spec: EngineSpec, replicas: int, episodes: EpisodeSetup | None = None):
        import multiprocessing as mp

        self._mp = mp.get_context("spawn")
        self.spec, self.episodes = spec, episodes
        self.outbox = self._mp.Queue()
        self.procs, self.inboxes, self.flags = [], [], []
        for w in range(replicas):
            self._start(w, spec)

    def _start(self, w: int, spec: EngineSpec) -> None:
        inbox, flag = self._mp.Queue(), self._mp.Event()
        proc = self._mp.Process(target=process_main, args=(w, spec, inbox, self.outbox, flag, self.episodes), daemon=True,
                                name=f"nearpolicy-engine-{w}")
        proc.start()
        if w < len(self.procs):
            self.procs[w], self.inboxes[w], self.flags[w] = proc, inbox, flag
        else:
            self.procs.append(proc), self.inboxes.append(inbox), self.flags.append(flag)

    @property
    def replicas(self) -> int:
        return len(self.procs)

    @property
    def streams(self) -> bool:
        return self.episodes is None

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def submit(self, w: int, call_id: int, jobs, sampling, seed: int) -> None:
        self.inboxes[w].put(("run", (call_id, jobs, sampling, seed)))

    def poll(self, timeout: float) -> list[tuple]:
        events = []
        try:
            events.append(self.outbox.get(timeout=timeout))
            while True:
                events.append(self.outbox.get_nowait())
        except queue.Empty:
            pass
        events += [(w, "died", p.exitcode) for w, p in enumerate(self.procs) if not p.is_alive() and p.exitcode is not None
                   and not any(e[0] == w and e[1] == "error" for e in events)]
        return events

    def interrupt_all(self) -> None:
        for flag in self.flags:
            flag.set()

    def load_all(self, path: str, version: int) -> None:
        for inbox in self.inboxes:
            inbox.put(("load", (path, version)))

    def restart(self, w: int, path: str, version: int) -> None:
        self.procs[w].join(timeout=1)
        self._start(w, replace(self.spec, gguf_path=path, version=version))

    def close(self) -> None:
        for inbox, proc in zip(self.inboxes, self.procs):
            if proc.is_alive():
                inbox.put(("stop", None))
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()


class _RayEngine:
    """Ray actor body: the same worker, with a lock so a weight load waits for the run it interrupts."""

    def __init__(self, spec: EngineSpec, gguf_bytes: bytes, episodes: EpisodeSetup | None = None):
        import os

        self.worker = EngineWorker(replace(spec, gguf_path=_local_copy(gguf_bytes)), episodes)
        self.flag, self.lock, self.pid = threading.Event(), threading.Lock(), os.getpid()

    def run(self, call_id, jobs, sampling, seed):
        with self.lock:
            results = self.worker.run(jobs, sampling, seed, self.flag.is_set)
            return call_id, results, self.worker.take_decode_counts()

    def interrupt(self) -> None:
        self.flag.set()

    def load(self, gguf_bytes: bytes, version: int) -> int:
        with self.lock:
            old = self.worker.engine.path
            self.worker.load(_local_copy(gguf_bytes), version)
            self.flag.clear()
            old.unlink(missing_ok=True)
        return version

    def getpid(self) -> int:
        return self.pid

    def release(self) -> None:
        """Delete this actor's node-local GGUF copy: RayPool.close calls it before ray.kill, which runs no cleanup
        in the actor (each copy is the whole policy GGUF, left in the node's temp folder otherwise)."""
        with self.lock:
            self.worker.engine.path.unlink(missing_ok=True)


def _local_copy(gguf_bytes: bytes) -> str:
    """Write weights received through the object store to a node-local temporary GGUF file."""
    import tempfile

    with tempfile.NamedTemporaryFile(prefix="nearpolicy-", suffix=".gguf", delete=False) as f:
        f.write(gguf_bytes)
    return f.name


class RayPool:
    """N Ray actors (each 1 CPU) on the cluster `ray.init` connects to; weights travel through the object store,
    so replicas on other nodes need no shared filesystem. An actor serves one call at a time (`streams` False: no
    continuous batching across calls)."""

    streams = False

    def __init__(self, spec: EngineSpec, replicas: int, address: str | None = None,
                 episodes: EpisodeSetup | None = None):
        import ray

        self.owns_ray = not ray.is_initialized()  # False inside the trainer actor (training/ray_actor.py)
        if self.owns_ray:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        self.ray, self.spec, self.episodes = ray, spec, episodes
        self.actor_class = ray.remote(num_cpus=1, max_concurrency=2)(_RayEngine)
        weights = self._put(spec.gguf_path)
        self.actors = [self.actor_class.remote(spec, weights, episodes) for _ in range(replicas)]
        self.pending: dict = {}  # object ref -> (worker, kind)

    @property
    def replicas(self) -> int:
        return len(self.actors)

    def pids(self) -> list[int]:
        return self.ray.get([a.getpid.remote() for a in self.actors])

    def submit(self, w: int, call_id: int, jobs, sampling, seed: int) -> None:
        self.pending[self.actors[w].run.remote(call_id, jobs, sampling, seed)] = (w, "results")

    def poll(self, timeout: float) -> list[tuple]:
        if not self.pending:
            time.sleep(timeout)  # nothing in flight: wait like LocalPool does instead of spinning
            return []
        ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=timeout)
        events = []
        for ref in ready:
            w, kind = self.pending.pop(ref)
            try:
                events.append((w, kind, self.ray.get(ref)))
            except self.ray.exceptions.RayActorError as err:
                events.append((w, "died", str(err)))
            except self.ray.exceptions.RayTaskError as err:
                events.append((w, "error", str(err)))
        return events

    def interrupt_all(self) -> None:
        for actor in self.actors:
            actor.interrupt.remote()

    def _put(self, path: str):
        with open(path, "rb") as f:
            return self.ray.put(f.read())

    def load_all(self, path: str, version: int) -> None:
        ref = self._put(path)
        for w, actor in enumerate(self.actors):
            self.pending[actor.load.remote(ref, version)] = (w, "loaded")

    def restart(self, w: int, path: str, version: int) -> None:
        self.ray.kill(self.actors[w], no_restart=True)
        spec = replace(self.spec, version=version)
        self.actors[w] = self.actor_class.remote(spec, self._put(path), self.episodes)

    def close(self) -> None:
        try:  # each live actor deletes its GGUF copy; a dead or stuck one is killed all the same
            self.ray.get([actor.release.remote() for actor in self.actors], timeout=30)
        except Exception:  # noqa: BLE001 - RayActorError, GetTimeoutError: nothing more to clean up from here
            pass
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        if self.owns_ray:
            self.ray.shutdown()
