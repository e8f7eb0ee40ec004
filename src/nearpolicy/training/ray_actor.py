"""`rollout.backend = "ray"`: the trainer runs as a Ray actor and creates its engine replicas as Ray actors; the
`nearpolicy train` process becomes the driver. It relays the trainer's log lines and progress, forwards the first
SIGINT / SIGTERM as a graceful stop (the trainer checkpoints the step in progress and the run exits 130 / 143), and
kills the actor on a second signal. Ray kills the actor, and the replicas it owns, if the driver dies.

The actor starts in the driver's working directory when its node has it (one machine, or a shared filesystem), so
relative paths in the config mean the same there; the run folder is written on the trainer's node."""

from __future__ import annotations

import os
import socket
import sys
import threading

from nearpolicy.config.schema import Config


class _StopFlag:
    """What Trainer.fit polls between steps (the `signum` of signals.GracefulStop), set from the driver."""

    signum: int | None = None


class TrainerActor:
    """One training run inside a Ray worker process (max_concurrency > 1: poll and request_stop run while fit
    does)."""

    def __init__(self, cwd: str):
        if os.path.isdir(cwd):
            os.chdir(cwd)
        self.lines: list[str] = []
        self.lock = threading.Lock()
        self.stop = _StopFlag()
        self.trainer = None

    def where(self) -> tuple[int, str]:
        return os.getpid(), socket.gethostname()

    def _log(self, message: str) -> None:
        with self.lock:
            self.lines.append(message)

    def start(self, cfg: Config, resume: bool) -> tuple[int, str] | None:
        """Build the trainer; None when it is ready, else (exit code, message)."""
        from nearpolicy.training.run import build_trainer

        self.trainer, failed = build_trainer(cfg, resume, self._log)
        return failed

    def fit(self) -> tuple[int, str]:
        from nearpolicy.training.run import fit

        return fit(self.trainer, self.stop, progress=False)

    def request_stop(self, signum: int) -> None:
        self.stop.signum = self.stop.signum or signum

    def poll(self) -> tuple[list[str], int, dict]:
        """(log lines since the last poll, steps done, the progress bar's figures)."""
        with self.lock:
            lines, self.lines = self.lines, []
        t = self.trainer
        return lines, (t.state.step if t is not None else 0), (dict(t.postfix) if t is not None else {})


def train_in_ray_actor(cfg: Config, resume: bool, poll_s: float = 0.2) -> int:
    """Run the training as a Ray actor on the cluster at rollout.ray_address (None: start or join a local
    instance); returns the exit code `nearpolicy train` exits with."""
    import ray
    from tqdm import tqdm

    from nearpolicy.signals import GracefulStop

    say = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    owns_ray = not ray.is_initialized()
    if owns_ray:
        try:
            ray.init(address=cfg.rollout.ray_address, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        except (ValueError, OSError, RuntimeError) as err:  # a bad or unreachable rollout.ray_address
            say(f"error: rollout.ray_address {cfg.rollout.ray_address!r}: {err}")
            return 2
    wanted, offered = dict(cfg.rollout.trainer_resources), ray.cluster_resources()
    missing = {k: v for k, v in wanted.items() if offered.get(k, 0.0) < v}
    if missing:  # the actor could never be placed: say so instead of waiting forever
        if owns_ray:
            ray.shutdown()
        say(f"error: rollout.trainer_resources {missing}: no node of the Ray cluster offers that much (it offers "
            f"{', '.join(sorted(offered))}); give the trainer's node the resource with "
            "`ray start --resources='{...}'` (docs/scaling.md)")
        return 2
    actor_class = ray.remote(num_cpus=0, max_concurrency=4, resources=wanted or None)
    actor = actor_class(TrainerActor).remote(os.getcwd())
    bar = None
    try:
        with GracefulStop() as stop:
            pid, node = ray.get(actor.where.remote())
            say(f"trainer: Ray actor pid {pid} on {node} (driver pid {os.getpid()})")
            forwarded = False

            def relay(ref):
                nonlocal forwarded, bar
                while True:
                    done, _ = ray.wait([ref], timeout=poll_s)
                    lines, step, postfix = ray.get(actor.poll.remote())
                    for line in lines:
                        (bar.write if bar is not None else say)(line)
                    if bar is not None:
                        bar.update(step - bar.n)
                        if postfix:
                            bar.set_postfix(postfix)
                    if stop.signum is not None and not forwarded:
                        actor.request_stop.remote(stop.signum)
                        forwarded = True
                    if done:
                        return ray.get(ref)

            failed = relay(actor.start.remote(cfg, resume))
            if failed is not None:
                code, message = failed
            else:
                _, step, _ = ray.get(actor.poll.remote())
                bar = tqdm(total=cfg.run.steps, initial=step, desc=cfg.run.name, disable=not cfg.logging.progress,
                           dynamic_ncols=True)
                code, message = relay(actor.fit.remote())
    except KeyboardInterrupt:  # the second signal: stop now, keeping the last checkpoint on disk
        from nearpolicy.training.run import last_checkpoint_said

        code = 130  # the run folder as this node sees it
        message = "interrupted; " + last_checkpoint_said(cfg.run.output_dir / cfg.run.name,
                                                        bar.n if bar is not None else 0)
    except ray.exceptions.RayActorError as err:
        code, message = 1, f"error: the trainer actor died: {err}"
    except ray.exceptions.RayTaskError as err:  # an exception the run does not map to an exit code: its traceback
        code, message = 1, f"error: the trainer actor raised:\n{err}"
    finally:
        if bar is not None:
            bar.close()
        ray.kill(actor, no_restart=True)
        if owns_ray:
            ray.shutdown()
    say(message)
    return code
