"""`nearpolicy export`: a run's checkpoint as a Hugging Face folder (model.safetensors, config.json,
generation_config.json, tokenizer files) that `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` load, and as
GGUF files that llama.cpp runs.

The policy is rebuilt the way the run built it: `model.path` from the run's config.json loaded by
model.load.load_policy (a GGUF dequantized to a plain float32 model, which transformers can save), then the checkpoint's
model.safetensors loaded over it, strictly. The HF folder holds those float32 weights exactly. Each GGUF is written
by engines/gguf/export.export_model_gguf with the run's GGUF (when model.path is one) as the metadata template, so
the tokenizer and chat template are the model's own; at the run's engine.precision the run's engine.tensor_precision
overrides and engine.export_rounding (seeded by run.seed) apply too (the file the run's engine would load).
Everything is written to a temporary folder beside the output and renamed into place, so an output folder is either
complete or absent. A [lora] run's checkpoint holds the adapter alone: runs/lora_export.py rebuilds its frozen base and
writes the adapter (PEFT folder, GGUF adapter) beside the merged model."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nearpolicy.config.schema import EngineConfig
from nearpolicy.engines.gguf.export import PRECISIONS, export_model_gguf
from nearpolicy.files import give_plain_modes
from nearpolicy.model.load import ResolvedModel, load_model_weights, load_policy, read_model_weights, resolve_model
from nearpolicy.model.templates import use_chat_template
from nearpolicy.runs.folder import CHECKPOINT_PREFIX, checkpoint_kind, list_checkpoints, read_json_object
from nearpolicy.runs.lora_export import export_adapter, is_lora_run


class ExportError(ValueError):
    """The export cannot start: no such run folder, no checkpoint, no checkpoint of the asked step, an output
    folder in the way, an unknown precision."""


@dataclass
class Exported:
    """What `export_run` wrote: the output folder (the HF model) and the GGUF files in it."""

    folder: Path
    step: int
    checkpoint: Path
    ggufs: list[Path] = field(default_factory=list)


def find_checkpoint(run_dir: Path, step: int | None = None) -> tuple[int, Path]:
    """(step, folder) of the run's checkpoint of `step`, or of its last one when None. Raises ExportError for a
    missing run folder, a run without checkpoints, or a step without one (the message lists the steps that have
    one)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"no run folder {run_dir}")
    found = {int(p.name[len(CHECKPOINT_PREFIX):]): p for p in list_checkpoints(run_dir)
             if p.name[len(CHECKPOINT_PREFIX):].isdigit()}
    if not found:
        raise ExportError(f"{run_dir} has no checkpoint ({run_dir / 'checkpoints'} holds no step_N folder)")
    if step is None:
        step = max(found)
    if step not in found:
        raise ExportError(f"{run_dir} has no checkpoint of step {step}; steps with one: "
                          f"{', '.join(map(str, sorted(found)))}")
    return step, found[step]


def read_checkpoint(run_dir: Path, step: int | None = None, tries: int = 3) -> tuple[int, Path, dict]:
    """(step, folder, its model weights in memory) of find_checkpoint(run_dir, step), the weights read at once: a run
    still training keeps only its logging.keep_checkpoints newest and deletes older ones as it saves, so a checkpoint
    listed a moment ago can be gone before a model has loaded. Without `step` a checkpoint deleted between the listing
    and the read is replaced by the newest one (up to `tries` times). Raises ExportError (find_checkpoint's; the
    checkpoint of `step` deleted while it was read; rotated `tries` times; weights that cannot be read, naming the
    newest other whole checkpoint), FileNotFoundError of read_model_weights for a checkpoint that is still listed
    but has no weights file."""
    for _ in range(tries):
        found, checkpoint = find_checkpoint(run_dir, step)
        try:
            return found, checkpoint, read_model_weights(checkpoint)
        except ValueError as err:  # cut short (a kill, a full disk): say which checkpoint can be exported
            whole = [kind[0] for path in list_checkpoints(Path(run_dir)) if path != checkpoint
                     and (kind := checkpoint_kind(path)) is not None]
            other = f"the newest whole one is step {whole[-1]} (--step {whole[-1]})" if whole else \
                "no other checkpoint is whole"
            raise ExportError(f"the weights of {checkpoint} cannot be read ({err}): the checkpoint is damaged; "
                              f"{other}") from None
        except FileNotFoundError:
            time.sleep(0.2)  # a deletion in progress: let it finish before listing again
            if checkpoint in list_checkpoints(Path(run_dir)):
                raise
            if step is not None:
                raise ExportError(f"the checkpoint of step {step} ({checkpoint}) was deleted while it was read: the "
                                  "run writing it keeps only its logging.keep_checkpoints newest; export a newer step, "
                                  "or the newest without --step") from None
    raise ExportError(f"{run_dir}: its newest checkpoint was deleted {tries} times while it was read (a run is "
                      "saving faster than it can be read); try again, or export once the run has stopped")


def check_output(out: Path, run_dir: Path, force: bool) -> None:
    """Refuse (ExportError) an output that is a file, a non-empty folder without `force`, or a folder holding the
    run's checkpoints (which `force` would replace)."""
    out, run = Path(out).resolve(), Path(run_dir).resolve()
    if run.is_relative_to(out) or out.is_relative_to(run / "checkpoints"):
        raise ExportError(f"--out {out} would hold or replace the run's checkpoints; choose another folder")
    if Path.cwd().resolve().is_relative_to(out):
        raise ExportError(f"--out {out} holds the current folder; choose a new folder")
    spec = _model_section(run).get("path")
    model = Path(str(spec)).expanduser().resolve() if spec else None
    if model is not None and model.exists() and (model.is_relative_to(out) or out.is_relative_to(model)):
        raise ExportError(f"--out {out} would hold or replace the run's model.path {model}; choose another folder")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {out} exists and is not empty; pass --force to replace it")


def export_run(run_dir: Path, step: int | None = None, out: Path | None = None, ggufs: tuple[str, ...] | None = None,
               force: bool = False, log: Callable[[str], None] = print) -> Exported:
    """Export the run's checkpoint of `step` (default: the last) to `out` (default RUN/export/step_XXXXXX): the HF
    folder, plus `policy-<precision>.gguf` for each of `ggufs` (default: the run's engine.precision; () for none).
    Raises ExportError (see read_checkpoint / check_output), FileNotFoundError / ValueError when model.path (read
    from the run's config.json) or the checkpoint cannot be loaded, OSError when writing fails (nothing is left at
    `out` then)."""
    run_dir = Path(run_dir)
    step, checkpoint, weights = read_checkpoint(run_dir, step)  # in memory first: a running run may rotate it
    out = Path(out).resolve() if out is not None else run_dir / "export" / checkpoint.name
    check_output(out, run_dir, force)
    spec, resolved, engine = _run_model(run_dir)
    ggufs = tuple(dict.fromkeys((engine.get("precision", EngineConfig().precision),) if ggufs is None else ggufs))
    unknown = [p for p in ggufs if p not in PRECISIONS]
    if unknown:
        raise ExportError(f"unknown GGUF precision {unknown[0]!r}; valid: {', '.join(PRECISIONS)}")
    log(f"loading {spec} (model.path of {run_dir}) with the weights of {checkpoint}")
    config = read_json_object(run_dir / "config.json")
    model, tokenizer = (None, None) if is_lora_run(config) else trained_policy(spec, weights)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        if model is None:  # [lora]: an adapter-only checkpoint; the HF folder and GGUFs get the merged policy
            model, tokenizer = export_adapter(config, spec, resolved, weights, tmp, log)
        use_chat_template(tokenizer, _model_section(run_dir).get("chat_template", "auto"))  # the run's prompt layout
        save_hf_folder(model, tokenizer, tmp, read_json_object(run_dir / "plan.json").get("stop_token_ids"))
        names, template = [], resolved.path if resolved.kind == "gguf" else None
        seed = int(_config_section(run_dir, "run").get("seed", 0))  # of the run's engine.export_rounding draws
        for precision in ggufs:  # at the run's engine.precision, its per-tensor overrides and export rounding too
            own = precision == engine.get("precision")
            overrides = tuple(engine.get("tensor_precision", {}).items()) if own else ()
            rounding = (engine.get("export_rounding", "nearest"), seed) if own else ()
            names.append(export_model_gguf(model, tmp, precision, overrides, template, tokenizer, *rounding).name)
        give_plain_modes(tmp)  # mkdtemp's 0700 and safetensors' 0600 would stay with the published folder
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(out, step, checkpoint, [out / name for name in names])


def _run_model(run_dir: Path) -> tuple[str, ResolvedModel, dict]:
    """(model.path, where it resolves to, the engine section) of the run's config.json. Raises ExportError when it
    names no model.path, FileNotFoundError when that path no longer exists, ValueError when it is no model."""
    spec = _model_section(run_dir).get("path")
    if not spec or not isinstance(spec, str):
        raise ExportError(f"{run_dir / 'config.json'} is missing or names no model.path")
    try:
        resolved = resolve_model(spec)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{err} (read from {run_dir / 'config.json'}; a relative path is taken from the "
                                "current folder)") from None
    return spec, resolved, _config_section(run_dir, "engine")


def _model_section(run_dir: Path) -> dict:
    """The [model] section of the run's config.json ({} when absent or not a table)."""
    return _config_section(run_dir, "model")


def _config_section(run_dir: Path, name: str) -> dict:
    """The [name] section of the run's config.json ({} when absent or not a table)."""
    section = read_json_object(Path(run_dir) / "config.json").get(name)
    return section if isinstance(section, dict) else {}


def trained_policy(spec: str, checkpoint: Path | dict):
    """(model, tokenizer): `spec` (model.path) loaded by model.load.load_policy, in eval mode, with the checkpoint's
    weights (float32; a checkpoint folder, or its weights read by read_checkpoint). Raises what load_policy and
    load_model_weights raise."""
    model, tokenizer = load_policy(spec)
    load_model_weights(checkpoint, model)
    return model.eval().requires_grad_(False), tokenizer


def save_hf_folder(model, tokenizer, folder: Path, stop_token_ids: list[int] | None = None) -> None:
    """model.safetensors + config.json + generation_config.json + tokenizer files in `folder`. With
    `stop_token_ids` (the run's end-of-generation set, plan.json), generate() stops on the same tokens the run's
    responses ended on."""
    if stop_token_ids:
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        model.generation_config.eos_token_id = eos + sorted(set(stop_token_ids) - set(eos))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` folder to `out`; an existing `out` (empty, or replaced by --force) is renamed aside
    first and deleted after."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.{os.getpid()}.replaced")
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
