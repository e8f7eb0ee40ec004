"""The run folder's one owner: config.json and plan.json, metrics.jsonl (its sink, its one reader, its truncation
on resume), safetensors checkpoints (save, load, resume from the newest loadable one) and the --resume checks
(same config except RESUMABLE_KEYS, same data).

Checkpoints are written to a temporary folder, fsynced and renamed, so a kill at any moment leaves the last
complete checkpoint loadable; the newest `keep` are kept (older ones deleted only once the new one is on disk). A
weights-only checkpoint (logging.final_weights_only) has no optimizer state: it can be exported, not resumed.

metrics.jsonl: one JSON object per line, each with an integer "step" (MetricsSink). Its one reading rule
(`read_metrics`, used by the trainer's resume, `nearpolicy summary`, `report` and `compare`): blank lines are
ignored; a LAST line that is not valid JSON is a write cut short by a kill and is skipped with a warning; any
other line that is not a JSON object with an integer "step" is damage, and raises RunFolderError naming the file
and line (a kill cannot produce it, so nothing guesses past it)."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:
    from nearpolicy.config import Config

CHECKPOINT_PREFIX = "step_"
METRICS = "metrics.jsonl"


class RunExistsError(RuntimeError):
    """The run folder already holds a run and --resume was not given, or --resume was refused (changed config or
    data)."""


class RunFolderError(ValueError):
    """A run folder file that cannot be read: missing, not UTF-8 text, or not what the trainer writes there."""


class MetricsSink:
    """Appends one JSON object per step to metrics.jsonl and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool):
        self.path = run_dir / METRICS
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # lazy: pulls in tensorboard

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


EXTRA_TENSORS = "extra.safetensors"


class CheckpointError(OSError):
    """A checkpoint could not be written (disk full, permissions); the previous checkpoint is untouched."""


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict, keep: int, extra: dict[str, torch.Tensor] | None = None,
                    weights_only: bool = False) -> Path:
    """Write checkpoints/step_XXXXXX atomically (temporary folder, fsync, rename); returns its path, keeps the newest
    `keep` (>= 1). `extra`: further named tensors (e.g. the PPO-EWMA proximal weights) written to extra.safetensors,
    read by `load_extra_tensors`. `weights_only`: no optimizer or extra tensors (about 1/3 of the bytes; marked
    "weights_only" in trainer_state.json, refused by `check_resume`). Raises FloatingPointError for non-finite
    weights (nothing written) and CheckpointError when the write fails (the temporary folder is removed; the message
    names the previous checkpoint, intact)."""
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    bad = [k for k, v in weights.items() if not torch.isfinite(v).all()]
    if bad:
        raise FloatingPointError(f"refusing to checkpoint non-finite weights at step {step}: {bad[:3]}")
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{CHECKPOINT_PREFIX}{step:06d}"
    tmp = root / f".{final.name}.tmp"
    try:
        _remove_leftovers(root)
        tmp.mkdir()
        _write_checkpoint_files(tmp, weights, None if weights_only else optimizer,
                                {**state, "step": step, "weights_only": weights_only}, None if weights_only else extra)
        if final.exists():
            _discard(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except (OSError, SafetensorError) as err:  # safetensors reports a full disk as SafetensorError
        shutil.rmtree(tmp, ignore_errors=True)
        previous = [p for p in list_checkpoints(run_dir) if p != final]
        intact = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
        reason = getattr(err, "strerror", None) or str(err)
        error = CheckpointError(f"could not write checkpoint {final} ({reason}); {intact}")
        error.errno = getattr(err, "errno", None)
        raise error from err
    for old in list_checkpoints(run_dir)[:-keep]:
        _discard(old)
    return final


def _write_checkpoint_files(folder: Path, weights: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer | None,
                            state: dict, extra: dict[str, torch.Tensor] | None = None) -> None:
    """model / optimizer (unless None) / RNG safetensors and trainer_state.json in `folder`, each file and the folder
    fsynced."""
    _tie_safe_save(weights, folder / "model.safetensors")
    if optimizer is not None:
        opt_tensors, opt_meta = _flatten_optimizer(optimizer)
        save_file(opt_tensors, str(folder / "optimizer.safetensors"))
        state = {**state, "optimizer": opt_meta}
    save_file({"torch_rng": torch.get_rng_state()}, str(folder / "rng.safetensors"))
    if extra:
        save_file({k: v.detach().contiguous() for k, v in extra.items()}, str(folder / EXTRA_TENSORS))
    write_json(folder / "trainer_state.json", state)
    for f in folder.iterdir():
        with f.open("rb") as handle:
            os.fsync(handle.fileno())
    _fsync_dir(folder)


def _discard(path: Path) -> None:
    """Remove a checkpoint folder: renamed out of the step_ namespace first, so a kill mid-delete never leaves a
    half-deleted folder that looks like a checkpoint."""
    trash = path.with_name(f".{path.name}.deleting")
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_leftovers(root: Path) -> None:
    """Temporary / half-deleted folders left by a killed run."""
    for p in root.iterdir():
        if p.name.startswith(".") and p.name.endswith((".tmp", ".deleting")) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX))


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore model, optimizer and torch RNG in place; returns the trainer state dict. Every file is read before
    anything is restored, so a damaged file leaves the model untouched (a shape mismatch may still fail midway)."""
    state = json.loads((path / "trainer_state.json").read_text())
    weights = load_file(str(path / "model.safetensors"))
    optimizer_tensors = load_file(str(path / "optimizer.safetensors"))
    rng = load_file(str(path / "rng.safetensors"))["torch_rng"]
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if k not in _tied_names(model)]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    _restore_optimizer(optimizer, optimizer_tensors, state["optimizer"])
    torch.set_rng_state(rng)
    return state


def load_extra_tensors(path: Path) -> dict[str, torch.Tensor] | None:
    """The checkpoint's extra tensors, or None when it has none (checkpoints written before they existed)."""
    file = path / EXTRA_TENSORS
    return load_file(str(file)) if file.exists() else None


def _tied_names(model: torch.nn.Module) -> set[str]:
    seen, tied = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.data_ptr() in seen:
            tied.add(name)
        seen.setdefault(tensor.data_ptr(), name)
    return tied


def _tie_safe_save(weights: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors refuses shared storage: store each storage once (tied weights are re-tied on load)."""
    seen, unique = set(), {}
    for name, tensor in weights.items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        unique[name] = tensor
    save_file(unique, str(path))


def _flatten_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors = {}
    for pid, pstate in sd["state"].items():
        for key, value in pstate.items():
            tensors[f"{pid}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return tensors, {"param_groups": sd["param_groups"]}


def _restore_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


# -- reading a run folder ----------------------------------------------------------------------------------------------
@dataclass
class MetricsLog:
    """metrics.jsonl's rows in step order, and the warnings reading it raised (a cut-short last line)."""

    rows: list[dict]
    warnings: list[str] = field(default_factory=list)


def read_text(path: Path) -> str:
    """The file's text; raises RunFolderError naming it when it cannot be read or is not UTF-8."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise RunFolderError(f"cannot read {path}: {err}") from None


def read_metrics(run_dir: Path) -> MetricsLog:
    """Read run_dir/metrics.jsonl by the one rule of the module docstring. Raises RunFolderError when the file is
    missing, unreadable or damaged (naming the file and line)."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise RunFolderError(f"no {METRICS} in {run_dir}")
    lines = read_text(path).splitlines()
    rows, warnings = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            if number == len(lines):
                warnings.append(f"{path}: skipped line {number}, cut short (not valid JSON)")
                continue
            raise RunFolderError(f"{path} line {number} is not valid JSON: {err}") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or isinstance(row["step"], bool):
            raise RunFolderError(f"{path} line {number} is not a metrics object with an integer 'step'")
        rows.append(row)
    return MetricsLog(sorted(rows, key=lambda row: row["step"]), warnings)


def read_json_object(path: Path) -> dict:
    """A run folder's config.json or plan.json; {} when absent. Raises RunFolderError when it is not a JSON object."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(read_text(path))
    except ValueError as err:
        raise RunFolderError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise RunFolderError(f"{path} does not hold a JSON object")
    return data


def truncate_metrics(run_dir: Path, step: int) -> None:
    """On resume from the checkpoint of `step`: drop the rows written after it (they will be produced again) and a
    cut-short last line. Raises RunFolderError for a damaged file (read_metrics)."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return
    keep = [row for row in read_metrics(run_dir).rows if row["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in keep))
    tmp.replace(path)


# -- --resume ----------------------------------------------------------------------------------------------------------
# may change on --resume (placement, not training, settings); everything else must match
# engine.precision and engine.extra_buffers too: the way out after an engine crash (docs/reliability.md)
RESUMABLE_KEYS = ("run.steps", "run.name", "run.output_dir", "logging", "rollout.ray_address",
                  "rollout.trainer_resources", "engine.precision", "engine.extra_buffers")


def check_same_config(saved_path: Path, cfg: Config) -> None:
    """Refuse (RunExistsError) a --resume whose config differs from the run's saved config.json, except in
    RESUMABLE_KEYS. A key the saved config lacks (added to the schema since) counts as its default."""
    from nearpolicy.config import Config

    if not saved_path.exists():
        return
    saved = json.loads(saved_path.read_text())
    now, default = cfg.model_dump(mode="json"), Config().model_dump(mode="json")
    changed = [f"{section}.{key}" for section, fields in now.items() for key, value in fields.items()
               if saved.get(section, {}).get(key, default[section][key]) != value
               and section not in RESUMABLE_KEYS and f"{section}.{key}" not in RESUMABLE_KEYS]
    if changed:
        allowed = ", ".join(k + (".*" if "." not in k else "") for k in RESUMABLE_KEYS[:-1])
        raise RunExistsError(f"--resume with a config that differs from {saved_path} in: {', '.join(changed)} "
                             f"(only {allowed} and {RESUMABLE_KEYS[-1]} may change; use a new run.name)")


def check_same_data(plan_path: Path, now: dict) -> None:
    """Refuse (RunExistsError) a --resume whose data differs from the identity the run recorded in plan.json (runs
    from before the record are not checked)."""
    from nearpolicy.tasks.identity import data_changes

    saved = json.loads(plan_path.read_text()).get("data") if plan_path.exists() else None
    change = data_changes(saved, now) if saved is not None else None
    if change:
        raise RunExistsError(f"--resume on changed data: {change}; the run's order and held-out split come from "
                             "the data it started with (restore it, or use a new run.name)")


def check_not_weights_only(run_dir: Path) -> None:
    """Refuse (RunExistsError) a --resume whose newest checkpoint holds the weights only (logging.final_weights_only):
    it has no optimizer state to continue from. An unreadable trainer_state.json is left to the resume to skip."""
    checkpoints = list_checkpoints(run_dir)
    try:
        state = json.loads((checkpoints[-1] / "trainer_state.json").read_text()) if checkpoints else {}
    except (OSError, ValueError):
        return
    if isinstance(state, dict) and state.get("weights_only"):
        older = f", or delete it to resume from {checkpoints[-2].name}" if len(checkpoints) > 1 else ""
        raise RunExistsError(
            f"{checkpoints[-1]} holds the weights only (the run had logging.final_weights_only = true), no optimizer "
            f"state, so the run cannot continue from it: export it (`nearpolicy export {run_dir}`) and start a new "
            f"run with model.path set to the exported folder{older}")


def check_resume(run_dir: Path, cfg: Config, data: dict) -> None:
    """Refuse a --resume before anything loads: a changed config or data (RunExistsError), a weights-only newest
    checkpoint (RunExistsError) or a damaged metrics.jsonl (RunFolderError, which the resume would meet only after
    the minutes of loading)."""
    check_same_config(run_dir / "config.json", cfg)
    check_same_data(run_dir / "plan.json", data)
    check_not_weights_only(run_dir)
    if (run_dir / METRICS).exists():
        read_metrics(run_dir)


def resume_checkpoint(run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      restore_extra: Callable[[Path, dict[str, torch.Tensor] | None], None],
                      log=print) -> tuple[Path, dict] | None:
    """Load the newest loadable checkpoint into `model` / `optimizer` (and `restore_extra(path, its extra tensors or
    None)`, e.g. the PPO-EWMA weights); a damaged one is reported and skipped, the model reset between attempts. Returns (path, trainer
    state) after truncating metrics.jsonl to its step, or None when none loads: the earlier metrics are then kept
    as metrics.before-resume.jsonl and the run starts over."""
    checkpoints = list_checkpoints(run_dir)
    initial = {k: v.clone() for k, v in model.state_dict().items()} if checkpoints else {}
    for path in reversed(checkpoints):
        try:
            saved = load_checkpoint(path, model, optimizer)
            restore_extra(path, load_extra_tensors(path))
        except Exception as err:  # noqa: BLE001 - any damage (safetensors header, json, shapes) skips it
            log(f"warning: checkpoint {path} is not loadable ({type(err).__name__}: {err}); trying an older one")
            model.load_state_dict(initial)  # a partial load must not leak into the next attempt
            continue
        truncate_metrics(run_dir, saved["step"])
        return path, saved
    metrics = run_dir / METRICS
    if metrics.exists():
        metrics.replace(run_dir / "metrics.before-resume.jsonl")
    log(f"no loadable checkpoint in {run_dir}: starting from step 0")
    return None


def note_engine_precision(saved: dict, precision: str, log=print) -> None:
    """Say when a resume changes engine.precision (allowed: the way out after an engine crash) from the one the
    checkpoint recorded (checkpoints from before the record say nothing)."""
    before = saved.get("engine_precision")
    if before is not None and before != precision:
        log(f"engine.precision changes on resume: {before} -> {precision} (the weights are exported at {precision} "
            "from now on; expect a different engine/trainer mismatch)")
