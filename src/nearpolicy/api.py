"""The Python API: build a config, train, read the metrics; the same run `nearpolicy train` makes, from a script.

    import nearpolicy

    def main():
        cfg = nearpolicy.load_config("configs/main.toml", ["run.name=mine", "task.kind=jsonl",
                                                           "task.path='data.jsonl'",
                                                           "task.reward_function='rewards.py:reward'"])
        result = nearpolicy.train(cfg)              # raises nearpolicy.TrainingError when the run fails
        print(result.run_dir, result.final["eval/accuracy"])
        rows = nearpolicy.read_metrics(result.run_dir)      # one dict per metrics.jsonl line

    if __name__ == "__main__":                      # required, see below
        main()

`Config(...)` builds a config in Python as well: each section takes a dict or its section model, e.g.
`Config(run={"steps": 5}, task={"kind": "jsonl", "path": "data.jsonl"})` (validated like a TOML file; pydantic's
ValidationError on a bad value).

The `if __name__ == "__main__":` guard: the scoring process, the llama.cpp engine process and engine replicas are
started with multiprocessing "spawn", and each imports the calling script again (as "__mp_main__"), running its
top-level code. A `train` call reached while a child process imports the script exits that child (SystemExit) with a
message naming the guard; the run then stops with the child's start-up error (a TrainingError)."""

from __future__ import annotations

import multiprocessing
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nearpolicy.config.schema import Config, ConfigError
from nearpolicy.config.schema import load_config as _load_config

__all__ = ["Config", "ConfigError", "TrainResult", "TrainingError", "load_config", "read_metrics", "read_samples",
           "run_training", "train"]

STOP_CODES = (130, 143)  # stopped by SIGINT / SIGTERM (training/run.py's exit codes)


class TrainingError(RuntimeError):
    """A run that could not start (exit code 2: an existing run folder without resume, a refused resume, bad input
    such as an unimportable task.reward_function) or failed (exit code 1: an engine crash, NaN steps); the message
    is what `nearpolicy train` prints, including where the last checkpoint is."""

    def __init__(self, message: str, exit_code: int, run_dir: Path):
        super().__init__(message)
        self.exit_code, self.run_dir = exit_code, run_dir


@dataclass
class TrainResult:
    """A finished or stopped run: its folder, exit code (0 done; 130 / 143 stopped by SIGINT / SIGTERM after a
    completed step, which was checkpointed), the closing message and metrics.jsonl's rows in step order."""

    run_dir: Path
    exit_code: int
    message: str
    metrics: list[dict] = field(default_factory=list)

    @property
    def stopped(self) -> bool:
        """Whether a signal stopped the run before its last step (continue it with train(cfg, resume=True))."""
        return self.exit_code != 0

    @property
    def final(self) -> dict:
        """The last metrics row ({} when none): the last step's metrics, with eval/* (the last step evaluates)."""
        return self.metrics[-1] if self.metrics else {}


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """The validated config of the TOML file `path` (None: the embedded defaults; configs/main.toml adds its lr
    recipe) with `overrides` ("section.key=value", the value read as TOML, like `--set`) applied on top. Raises
    ConfigError naming the offending key. See config.load_config for the layering rules."""
    return _load_config(None if path is None else Path(path), list(overrides))


def _above_the_bar(msg: str) -> None:
    """A line on stderr above the progress bar (tqdm clears the bar, writes the line and redraws it)."""
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)


def run_training(cfg: Config, resume: bool = False, log: Callable[[str], None] | None = None,
                 progress: bool = True) -> tuple[int, str]:
    """(exit code, closing message) of one run, as `nearpolicy train` makes it: in this process (with the graceful
    stop on SIGINT / SIGTERM of signals.GracefulStop) or, with rollout.backend = "ray", as a Ray actor (which prints
    its own messages: the closing message is then empty). Exit codes: training/run.py."""
    say = log or _above_the_bar
    if cfg.rollout.backend == "ray":  # the trainer runs as a Ray actor; this process relays its output and signals
        from nearpolicy.training.ray_actor import train_in_ray_actor

        return train_in_ray_actor(cfg, resume), ""
    from nearpolicy.signals import GracefulStop
    from nearpolicy.training.run import build_trainer, fit

    trainer, failed = build_trainer(cfg, resume, log=say)
    if trainer is not None:
        with GracefulStop() as stop:
            return fit(trainer, stop, progress=progress)
    return failed


def _require_main_guard() -> None:
    """TrainingError (exit code 2) before anything starts when the running script (sys.modules["__main__"], a file)
    has no top-level `if __name__ == "__main__":` block: each child process would run its training call again.
    Interactive sessions and notebooks (no script file) need no guard."""
    import ast

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not str(path).endswith(".py") or not Path(path).is_file():
        return
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return
    if not any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body):
        raise TrainingError(
            f"{path} calls nearpolicy.train without an `if __name__ == \"__main__\":` block: the scoring and engine "
            "processes start with multiprocessing 'spawn', which imports the script again and would run its "
            "training call again; put the call under the guard (README, \"From Python\")", 2, Path(path).parent)


def _refuse_in_a_spawned_child() -> None:
    """SystemExit when a multiprocessing child is importing the caller's script (no __main__ guard)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise SystemExit(
            "nearpolicy.train() was called while a child process (the scoring process or an engine) was importing "
            "your script: put the call under `if __name__ == \"__main__\":` (child processes are started with "
            "multiprocessing 'spawn', which runs the script's top-level code again)")


def train(cfg: Config, *, resume: bool = False, progress: bool = True,
          log: Callable[[str], None] | None = None) -> TrainResult:
    """Run `cfg` to run.steps in run.output_dir / run.name; the caller's script needs the `__main__` guard (module
    docstring).

    resume: continue from the run folder's last checkpoint (`--resume`; without it an existing run is refused).
    progress: draw the progress bar (also needs logging.progress). log: where the start-up and warning lines go
    (default: stderr). SIGINT / SIGTERM stop the run after the step in progress, checkpointing it (in the main thread).

    Returns a TrainResult (exit code 0, or 130 / 143 when stopped by a signal). Raises TrainingError (with the exit
    code, 1 or 2) when the run cannot start or fails (the scoring process failing to start included; a script
    without the `__main__` guard, before anything starts), TypeError when `cfg` is not a Config, SystemExit when
    called while a child process imports the script."""
    if not isinstance(cfg, Config):
        raise TypeError(f"nearpolicy.train takes a Config (nearpolicy.load_config(path) or nearpolicy.Config(...)), "
                        f"got {type(cfg).__name__} {cfg!r:.80}")
    _refuse_in_a_spawned_child()
    _require_main_guard()
    say = log or _above_the_bar
    code, message = run_training(cfg, resume, say, progress)
    run_dir = cfg.run.output_dir / cfg.run.name
    if code != 0 and code not in STOP_CODES:
        raise TrainingError(message or f"the run failed with exit code {code}; its error is above", code, run_dir)
    if message:
        say(message)
    from nearpolicy.runs.folder import METRICS

    metrics = read_metrics(run_dir) if (run_dir / METRICS).exists() else []
    return TrainResult(run_dir, code, message, metrics)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of run_dir/metrics.jsonl in step order, one dict per step ({"step": int, "reward/mean": float, ...};
    a non-finite value is None). A cut-short last line is skipped with a warnings.warn. Raises runs.folder.RunFolderError (a
    ValueError) naming the file when it is missing or damaged."""
    from nearpolicy.runs.folder import read_metrics as _read

    log = _read(Path(run_dir))
    for warning in log.warnings:
        warnings.warn(warning, stacklevel=2)
    return log.rows


def read_samples(run_dir: str | Path) -> list[dict]:
    """The eval samples of run_dir/samples.jsonl in step order (fields: runs/samples.py); [] when there are none. A line
    that cannot be read is skipped with a warnings.warn."""
    from nearpolicy.runs.samples import read_samples as _read

    rows, problems = _read(Path(run_dir))
    for warning in problems:
        warnings.warn(warning, stacklevel=2)
    return rows
