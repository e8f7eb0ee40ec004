"""One training run from a validated config to (exit code, closing message): the steps `nearpolicy train` takes
in its own process, and that the Ray trainer actor (training/ray_actor.py) takes on its node.

Exit codes: 0 done; 1 a failed step or engine; 2 a run that could not start (existing run, bad resume, bad
input); 128 + signal number when stopped by SIGINT / SIGTERM after a completed step (130 / 143)."""

from __future__ import annotations

from collections.abc import Callable

from nearpolicy.config.schema import Config


def build_trainer(cfg: Config, resume: bool, log: Callable[[str], None]):
    """(Trainer, None), or (None, (exit code, message)) when the run does not start: 2 when it cannot, 0 for a
    --resume of a finished run (nothing to do), 130 / 143 for a SIGINT / SIGTERM during the imports or the loading
    (also one whose exception was dropped: signals.StartupInterrupt; signals.startup_stop says it)."""
    from nearpolicy.signals import StartupInterrupt, startup_stop

    busy = load_warning()
    if busy:
        log(busy)
    with StartupInterrupt() as startup:
        try:
            trainer, failed = _open_trainer(cfg, resume, log)
        except KeyboardInterrupt as err:  # while loading: a run folder the attempt created is already removed
            return None, startup_stop(err)
    if trainer is not None and startup.signum is not None:  # a signal whose exception Python dropped (in a finalizer)
        trainer.close()
        return None, startup_stop(signum=startup.signum)
    return trainer, failed


def _open_trainer(cfg: Config, resume: bool, log: Callable[[str], None]):
    """training.trainer.open_trainer, its imports (torch: seconds) included: (Trainer, None), or (None, (exit code,
    message)) for a run that cannot start or has nothing to do."""
    from nearpolicy.engines.base import EngineError
    from nearpolicy.runs.folder import RunExistsError, RunFinished
    from nearpolicy.runs.trackers import TrackerError
    from nearpolicy.tasks.scoring import ScoringError
    from nearpolicy.training.trainer import open_trainer

    try:
        return open_trainer(cfg, resume=resume, log=log), None
    except RunFinished as finished:
        return None, (0, str(finished))
    except (RunExistsError, OSError, ValueError, TrackerError, ScoringError) as err:
        return None, (2, f"error: {err}")
    except EngineError as err:
        return None, (2, f"error: {err}\n{engine_advice(cfg)}")


def load_warning(load_1min: float | None = None, cores: int | None = None, running_now: float | None = None
                 ) -> str | None:
    """A warning line when other work competes for the cores (doctor.machine_load's rule: 1-min load above half the
    cores, and so many other tasks runnable now), else None: steps then take far longer than the README's timings
    (docs/results.md sec. 10). Without arguments both are read from this machine."""
    import os

    from nearpolicy.doctor import machine_load, others_running

    if load_1min is None:
        load_1min, running_now = os.getloadavg()[0], others_running()
    check = machine_load(load_1min, cores or os.cpu_count() or 1, running_now)
    return None if check.ok else f"warning: {check.value}; each step will take far longer than on an idle machine"


def dry_run(cfg: Config, resume: bool) -> tuple[int, str, str]:
    """`nearpolicy train --dry-run`: (exit code, the effective config as TOML headed by comments saying what the
    start would do and the run plan, a closing message). Only the task is built and the model path resolved
    (seconds); nothing is written. Exit 0 when the run would start or has nothing to do; 2 when it would be refused
    or cannot start."""
    import json

    from nearpolicy.config.reference import config_toml
    from nearpolicy.runs.lock import check_not_in_use
    from nearpolicy.runs.start_checks import check_run_folder
    from nearpolicy.runs.folder import RunExistsError, RunFinished, RunFolderError
    from nearpolicy.training.assemble import dry_plan

    code, data = 0, None
    try:
        check_not_in_use(cfg.run.output_dir / cfg.run.name)
        folder = check_run_folder(cfg, resume)
        said, data = folder.said, folder.data
    except RunFinished as finished:
        said = str(finished)
    except (RunExistsError, RunFolderError) as err:
        code, said = 2, f"refused: {err}"
    except OSError as err:  # a missing task.path
        return 2, "", f"error: {err}"
    try:
        plan = dry_plan(cfg) | ({"data": data} if data else {})
    except (OSError, ValueError) as err:
        return 2, "", f"error: {err}"
    lines = ["# nearpolicy train --dry-run: the effective config (defaults < file < --set); nothing was run or written",
             f"# {said}", "# run plan (plan.json adds the parameter count and stop-token ids once the model loads):",
             *(f"#   {key} = {json.dumps(value, default=str)}" for key, value in plan.items()), "", config_toml(cfg)]
    return code, "\n".join(lines), ("error: the run would not start: " + said if code else "dry run: nothing written")


def engine_advice(cfg: Config) -> str:
    """What to try when the llama.cpp engine crashes or fails its startup probe on this machine."""
    e = cfg.engine
    tries = []
    if e.extra_buffers:
        tries.append("--set engine.extra_buffers=false (llama.cpp's AMX / repack buffers, ggml-org/llama.cpp#20824)")
    if e.precision not in ("f32", "f16", "bf16"):
        tries.append("--set engine.precision=f16 (unquantized kernels)")
    tries.append("in a new run (a new run.name), --set engine.kind=hf (the transformers engine)")
    return ("the llama.cpp engine failed on this machine; try " + ", or ".join(tries)
            + "; `nearpolicy doctor` prints what a bug report needs")


def fit(trainer, stop, progress: bool = True) -> tuple[int, str]:
    """Run `trainer` to its last step; `stop` has a `signum` attribute (signals.GracefulStop or any object set
    from elsewhere). Closes the trainer's engine replicas whatever happens."""
    from nearpolicy.engines.base import EngineError
    from nearpolicy.engines.base import EngineDied
    from nearpolicy.runs.folder import CheckpointError
    from nearpolicy.signals import StopRequested
    from nearpolicy.tasks.scoring import ScoringError

    try:
        run_dir = trainer.fit(stop, progress=progress)
    except StopRequested as stopped:
        return stopped.exit_code, str(stopped)
    except EngineDied as died:
        where = last_checkpoint_said(trainer.run_dir, trainer.state.step)
        if getattr(stop, "signum", None) is not None:  # a group signal reached the engine too: a stop, not a crash
            import signal

            name = signal.Signals(stop.signum).name
            return 128 + stop.signum, (f"stopped by {name} at step {trainer.state.step}; the signal also ended the "
                                       f"engine process ({died.signal_name} during {died.phase}), so the step in "
                                       f"progress was not completed; {where}")
        return 1, (f"error: {died}\n{where}; engine.precision and engine.extra_buffers may change on --resume\n"
                   f"{engine_advice(trainer.cfg)}")
    except CheckpointError as err:  # its message already names the checkpoint left intact
        from nearpolicy.signals import resume_command

        return 1, f"error at step {trainer.state.step}: {err} (continue: {resume_command(trainer.run_dir)})"
    except (KeyboardInterrupt, EngineError, ScoringError, ValueError, FloatingPointError, OSError) as err:
        where = last_checkpoint_said(trainer.run_dir, trainer.state.step)
        reason = "interrupted" if isinstance(err, KeyboardInterrupt) else f"error: {err}"
        if isinstance(err, ScoringError) and trainer.cfg.task.reward_function:
            reason += f" (task.reward_function {trainer.cfg.task.reward_function!r} runs there)"
        return (130 if isinstance(err, KeyboardInterrupt) else 1), f"{reason} at step {trainer.state.step}; {where}"
    finally:
        trainer.close()
    import shlex

    from nearpolicy.runs.start_checks import further_advice
    from nearpolicy.signals import program_name

    further = further_advice(run_dir, trainer.state.step, trainer.cfg.algorithm.lr_schedule,
                             trainer.cfg.logging.final_weights_only)
    return 0, (f"done: {accuracy_said(run_dir)}metrics in {run_dir / 'metrics.jsonl'}, checkpoints in "
               f"{run_dir / 'checkpoints'}; `{program_name()} report {shlex.quote(str(run_dir))}` draws them; "
               f"{further}")


def accuracy_said(run_dir) -> str:
    """'eval accuracy 0.297 (step 0) -> 0.492 (step 30), best 0.695 (step 20); ' from metrics.jsonl, or ''."""
    from nearpolicy.runs.folder import RunFolderError, finite_points, read_metrics

    try:
        evals = finite_points(read_metrics(run_dir).rows, "eval/accuracy")
    except RunFolderError:
        return ""
    if not evals:
        return ""
    (first_step, first), (last_step, last) = evals[0], evals[-1]
    best_step, best = max(evals, key=lambda point: point[1])
    return (f"eval accuracy {first:.3f} (step {first_step}) -> {last:.3f} (step {last_step}), best {best:.3f} "
            f"(step {best_step}); ")


def last_checkpoint_said(run_dir, step: int) -> str:
    """What an interrupted or failed run at `step` (completed steps) tells the user about its checkpoints."""
    from nearpolicy.runs.folder import list_checkpoints
    from nearpolicy.signals import resume_command

    saved = list_checkpoints(run_dir)
    if saved:
        return f"the last checkpoint {saved[-1]} is intact (continue: {resume_command(run_dir)})"
    if step == 0:
        return "no step was completed (run the same command again to start over)"
    return ("no checkpoint was written yet (run again with --resume, which starts over in this folder, or set "
            "a new run.name)")
