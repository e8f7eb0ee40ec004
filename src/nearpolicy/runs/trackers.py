"""Experiment trackers that mirror metrics.jsonl: TensorBoard (on by default) and Weights & Biases (opt-in).

metrics.jsonl stays the record every nearpolicy command reads; a tracker only copies each step's finite scalars.
Trackers are imported lazily, so a run that does not ask for one never imports it."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class TrackerError(RuntimeError):
    """A tracker the config asks for that cannot start (package not installed, wandb.init failed)."""


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Scalars as TensorBoard event files in RUN/tensorboard (`tensorboard --logdir runs`)."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # lazy: pulls in tensorboard

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A Weights & Biases run in RUN/wandb. Offline mode (the default) needs no account and no network; upload it
    later with `wandb sync RUN/wandb/offline-run-*`. The wandb run id is the run folder's name, so a resumed run
    continues the same wandb run. Raises TrackerError when wandb is not installed or wandb.init fails (online mode
without `wandb login`, no network)."""

    def __init__(self, run_dir: Path, project: str, mode: str, config: dict):
        try:
            import wandb
        except ImportError:
            raise TrackerError("logging.wandb = true needs the wandb package: pip install wandb") from None
        try:
            self.run = wandb.init(project=project, name=run_dir.name, id=_wandb_id(run_dir), resume="allow",
                                  dir=str(run_dir), mode=mode, config=config,
                                  settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        except Exception as err:  # wandb raises its own error types (UsageError, CommError, ...)
            raise TrackerError(f"wandb could not start ({mode} mode): {err}") from None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def _wandb_id(run_dir: Path) -> str:
    """wandb run ids may hold letters, digits, '-' and '_' only."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in run_dir.resolve().name)


def check_trackers(logging_cfg) -> None:
    """Before anything loads (seconds, no network): the failures of open_trackers that the machine decides, so that
    they are not met only after the model and the engine are up. Raises TrackerError when logging.tensorboard needs
    the tensorboard package, logging.wandb the wandb package, or wandb_mode = "online" credentials that are not there
    (`wandb login` or WANDB_API_KEY; wandb.login(prompt=False, verify=False) looks, without the network)."""
    if logging_cfg.tensorboard:
        try:
            import tensorboard  # noqa: F401 - torch.utils.tensorboard needs it
        except ImportError:
            raise TrackerError("logging.tensorboard = true needs the tensorboard package: pip install tensorboard, "
                               "or --set logging.tensorboard=false") from None
    if not logging_cfg.wandb:
        return
    try:
        import wandb
    except ImportError:
        raise TrackerError("logging.wandb = true needs the wandb package: pip install wandb") from None
    if logging_cfg.wandb_mode == "online" and not wandb.login(prompt=False, verify=False):
        raise TrackerError("logging.wandb_mode = 'online' needs wandb credentials and none are configured: run "
                           "`wandb login` or set WANDB_API_KEY, or --set logging.wandb_mode=offline (sync later)")


def open_trackers(run_dir: Path, logging_cfg, config: dict) -> list[Tracker]:
    """The trackers `logging_cfg` (config.LoggingConfig) asks for, opened on `run_dir`."""
    trackers: list[Tracker] = []
    if logging_cfg.tensorboard:
        trackers.append(TensorBoardTracker(run_dir))
    if logging_cfg.wandb:
        trackers.append(WandbTracker(run_dir, logging_cfg.wandb_project, logging_cfg.wandb_mode, config))
    return trackers
