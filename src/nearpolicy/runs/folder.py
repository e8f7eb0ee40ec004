"""The run folder's one owner: config.json and plan.json, metrics.jsonl (its sink, its one reader, its truncation
on resume), safetensors checkpoints (save, load, resume from the newest loadable one). The checks before a run or a
resume starts (RESUMABLE_KEYS, same config and data, a finished run) are runs/start_checks.py's.

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
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from nearpolicy.files import fsync_folder, give_plain_modes, write_atomically

CHECKPOINT_PREFIX = "step_"
METRICS = "metrics.jsonl"


class RunExistsError(RuntimeError):
    """The run folder already holds a run and --resume was not given, or --resume was refused (changed config or
    data)."""


class RunFinished(Exception):
    """--resume of a run whose newest checkpoint is at or past run.steps: nothing is left to train."""


class RunFolderError(ValueError):
    """A run folder file that cannot be read: missing, not UTF-8 text, or not what the trainer writes there."""


class MetricsSink:
    """Appends one JSON object per step to metrics.jsonl (the record) and mirrors its finite scalars to the
    trackers (trackers.open_trackers: TensorBoard, wandb)."""

    def __init__(self, run_dir: Path, trackers=()):
        self.path = run_dir / METRICS
        self.trackers = list(trackers)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        scalars = finite_scalars(metrics)
        for tracker in self.trackers:
            tracker.log(step, scalars)

    def close(self) -> None:
        """Close every tracker once (a second call does nothing)."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()


def is_finite_number(value) -> bool:
    """A metric value that counts: an int or float (a bool does not) that is finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def finite_scalars(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics a tracker gets: the finite numbers (NaN / inf stay as null in metrics.jsonl only)."""
    return {k: float(v) for k, v in metrics.items() if is_finite_number(v)}


def finite_points(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of the metrics rows where `key` holds a finite number, in row order (summary, report, the
    closing line of a run all read a metric this way)."""
    return [(row["step"], float(row[key])) for row in rows if is_finite_number(row.get(key))]


def write_json(path: Path, data: dict) -> None:
    """`data` as indented JSON, replacing `path` atomically (files.write_atomically)."""
    write_atomically(path, json.dumps(data, indent=2, default=str) + "\n")


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
        give_plain_modes(tmp)  # safetensors writes its files 0600
        if final.exists():
            _discard(final)
        os.rename(tmp, final)
        fsync_folder(root)
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
    fsync_folder(folder)


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
    found = [p for p in root.iterdir() if p.is_dir() and re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", p.name)]
    return sorted(found, key=lambda p: (int(p.name[len(CHECKPOINT_PREFIX):]), p.name))  # step_N only, by step


def checkpoint_step(path: Path) -> int | None:
    """The step a checkpoint folder holds, read without loading it: its trainer_state.json's step when every file
    a load reads is there and whole (each safetensors file as long as its header says; a kill or a full disk cuts
    files short), else None. A None here means load_checkpoint would fail; the reverse is not promised (a file
    may hold other shapes)."""
    try:
        state = json.loads((path / "trainer_state.json").read_text())
        for name in ("model.safetensors", "optimizer.safetensors", "rng.safetensors"):
            if not _safetensors_whole(path / name):
                return None
    except (OSError, ValueError):
        return None
    step = state.get("step") if isinstance(state, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def checkpoint_kind(path: Path) -> tuple[int, bool] | None:
    """(step, weights_only) of a checkpoint folder that is whole for its kind: a full one as checkpoint_step says (a
    resume loads it), a weights-only one (trainer_state.json's "weights_only", logging.final_weights_only) with
    whole weights (an export reads it, a resume refuses it); else None (damaged)."""
    if (step := checkpoint_step(path)) is not None:
        return step, False
    try:
        state = json.loads((path / "trainer_state.json").read_text())
        step = state.get("step") if isinstance(state, dict) and state.get("weights_only") is True else None
        whole = _safetensors_whole(path / "model.safetensors")
    except (OSError, ValueError):
        return None
    return (step, True) if whole and isinstance(step, int) and not isinstance(step, bool) else None


def _safetensors_whole(file: Path) -> bool:
    """The file's length is 8 + its header's length + the end of its last tensor's data."""
    length = file.stat().st_size
    with file.open("rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        if size > length - 8:
            return False
        header = json.loads(handle.read(size))
    try:  # a header of another shape (a list, no or odd data_offsets) is damage, not a crash
        ends = [int(t["data_offsets"][1]) for name, t in header.items() if name != "__metadata__"]
    except (AttributeError, KeyError, TypeError, IndexError, ValueError):
        return False
    return length == 8 + size + max(ends, default=0)


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
    implementation = [{k: group.get(k) for k in ("fused", "foreach")} for group in optimizer.param_groups]
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    for group, chosen in zip(optimizer.param_groups, implementation):  # this run's choice, not the saved one
        group.update(chosen)


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
    last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)  # blank lines after it do not count
    rows, warnings = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            if number == last:
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
    write_atomically(path, "".join(json.dumps(row) + "\n" for row in keep))


# -- resuming from a checkpoint (the checks before it: runs/start_checks.py) ------------------------------------------------
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


def last_step(run_dir: Path) -> int | None:
    """The step of metrics.jsonl's last complete line (None without one); reads only the file's tail, so a running
    cell's progress is polled cheaply (read_metrics reads the whole file)."""
    path = Path(run_dir) / METRICS
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None
