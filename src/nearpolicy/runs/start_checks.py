"""What a run folder must hold before a run starts in it, checked before anything loads: a new run needs a folder
that holds no run; a --resume needs the same config except RESUMABLE_KEYS, the same data, a readable metrics.jsonl
and steps left to run. Also the config of a run read back from its config.json (`nearpolicy train --resume
RUN_DIR`). Loading the checkpoint itself is runs.folder.resume_checkpoint's."""

from __future__ import annotations

import copy
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nearpolicy.config.checks import read_config_file
from nearpolicy.config.schema import Config, ConfigError, config_from_data, parse_override, stored_as_layer
from nearpolicy.model.load import DEFAULT_SPEC
from nearpolicy.runs.folder import (METRICS, RunExistsError, RunFinished, RunFolderError, checkpoint_kind,
                                    is_finite_number, list_checkpoints, read_json_object, read_metrics)
from nearpolicy.signals import program_name, resume_command
from nearpolicy.tasks.identity import data_changes, data_identity

# May change on --resume: none of them changes what a step computes.
#   run.steps, run.name, run.output_dir: how far the run goes and where its folder is (run.steps only with
#     algorithm.lr_schedule = "constant": it is the length of a decaying schedule, check_same_config refuses it)
#   logging.*: what is written and how often (evals, checkpoints, TensorBoard, progress bar, the mismatch metrics)
#   run.threads, rollout.engine_threads: CPU threads; the algorithm is the same, only the float rounding of
#     reductions may differ (as on another machine), so a bit-for-bit reproduction needs the same counts
#   run.max_bad_steps: when to stop after non-finite steps, not what a step does (the way on after such a stop)
#   rollout.ray_address, rollout.trainer_resources: where the trainer and replicas run
#   engine.precision, engine.extra_buffers: the way out after an engine crash (docs/reliability.md); the change is
#     logged (the mismatch changes with the precision)
RESUMABLE_KEYS = ("run.steps", "run.name", "run.output_dir", "logging", "run.threads", "rollout.engine_threads",
                  "run.max_bad_steps", "rollout.ray_address", "rollout.trainer_resources", "engine.precision",
                  "engine.extra_buffers")
RESTARTED_METRICS = "metrics.before-restart.jsonl"


def stored_config(run_dir: Path, overrides: list[str] = ()) -> Config:
    """The config of the run in `run_dir`, read back from its config.json and pointed at `run_dir` (run.output_dir,
    run.name), with `overrides` (--set) on top. Raises ConfigError when there is no readable config.json, when an
    override sets run.name or run.output_dir (RUN_DIR names the folder), or when the config no longer validates."""
    run_dir, data = _stored_data(run_dir)
    for item in overrides:
        keys, _ = parse_override(item)
        if keys[:2] in (["run", "name"], ["run", "output_dir"]):
            raise ConfigError(f"--set {item}: with --resume RUN_DIR the folder is RUN_DIR; run.name and "
                              "run.output_dir cannot be set (move the folder instead)")
    data.setdefault("run", {}).update(output_dir=str(run_dir.parent), name=run_dir.name)
    return _validated(run_dir, data, overrides)


def config_from_run(run_dir: Path, overrides: list[str] = ()) -> Config:
    """A new run's config taken from the run in `run_dir` (`nearpolicy train RUN_DIR/config.json`): its config.json
    with its relative paths read where the run started (plan.json) and run.output_dir set to the folder that holds
    `run_dir` (so the new run lands beside it, wherever the command runs), `overrides` on top (a new run.name among
    them; without one the start refuses the existing folder). Raises ConfigError as stored_config."""
    run_dir, data = _stored_data(run_dir)
    data.setdefault("run", {})["output_dir"] = str(run_dir.resolve().parent)
    return _validated(run_dir, data, overrides)


def run_config_data(run_dir: Path) -> dict:
    """The run in `run_dir`'s config.json as a dict, its relative paths replaced by those the run read at its start
    (plan.json): a base other configs can be layered on (an arena's `base`). Raises ConfigError as stored_config."""
    run_dir, data = _stored_data(run_dir)
    _paths_from_where_it_started(data, run_dir)
    return data


def is_run_config(path: Path) -> bool:
    """Whether `path` is a run folder's own config.json (a plan.json beside it: a folder nearpolicy wrote)."""
    path = Path(path)
    return path.name == "config.json" and path.is_file() and (path.parent / "plan.json").is_file()


def _stored_data(run_dir: Path) -> tuple[Path, dict]:
    """(the run folder, absolute where it was given as '.' or '..', its config.json as a dict). Raises ConfigError
    when the folder has no readable config.json."""
    run_dir = Path(run_dir)
    if run_dir.name in ("", ".", ".."):
        run_dir = run_dir.resolve()
    path = run_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{run_dir} holds no config.json, so it is not a run folder nearpolicy wrote (to resume "
                          f"by config instead: {program_name()} train CONFIG --set ... --resume)")
    return run_dir, stored_as_layer(read_config_file(path))  # read_config_file refuses a repeated key


def _validated(run_dir: Path, data: dict, overrides: list[str]) -> Config:
    """config.json's dict `data` with its relative paths read where the run started, `overrides` on top, as a
    Config. Raises ConfigError naming config.json (config_from_data: "--set on" it when the stored config alone is
    valid)."""
    _paths_from_where_it_started(data, run_dir)
    return config_from_data(copy.deepcopy(data), list(overrides), run_dir / "config.json")  # overrides edit in place


# Config keys whose value may be a path, read relative to the current folder of the start (plan.json's working_dir):
# a --resume RUN_DIR from another folder reads them from there. model.path and distill.teacher may also be the
# shipped model's name "smollm2", task.reward_function a module name ("module:function"): those are not paths.
PATH_KEYS = ("model.path", "distill.teacher", "task.path", "task.reward_function")


def _path_value(key: str, data: dict) -> tuple[str, str] | None:
    """(the path, the text after it: ":function" of a reward file) that config key `key` ("section.name") holds in
    config `data` (a config.json dict), or None when it holds no path (unset, the model name, a module name, the
    task.path of a task that is not jsonl)."""
    section, name = key.split(".")
    fields = data.get(section) if isinstance(data.get(section), dict) else {}
    value, rest = fields.get(name), ""
    if not isinstance(value, str) or (key == "task.path" and fields.get("kind") != "jsonl"):
        return None
    if key == "task.reward_function":
        module, colon, function = value.rpartition(":")
        if not module.endswith(".py"):
            return None
        value, rest = module, colon + function
    return None if value == DEFAULT_SPEC and key in ("model.path", "distill.teacher") else (value, rest)


def _is_relative(path: str) -> bool:
    return not (Path(path).is_absolute() or path.startswith("~"))


def _plan_record(run_dir: Path) -> dict:
    """The run's plan.json ({} when it is missing or unreadable)."""
    try:
        return read_json_object(run_dir / "plan.json") if (run_dir / "plan.json").exists() else {}
    except RunFolderError:
        return {}


def _started_location(key: str, path: str, plan: dict) -> Path | None:
    """Where the run read path `path` of config key `key` at its start: an absolute path (or one under ~) is itself; a
    relative task.path is plan.json's data.resolved, any other relative path lies under plan.json's working_dir;
    None when the run recorded neither."""
    if not _is_relative(path):
        return Path(path).expanduser()
    data = plan.get("data")
    resolved = data.get("resolved") if key == "task.path" and isinstance(data, dict) else None
    if isinstance(resolved, str):
        return Path(resolved)
    working_dir = plan.get("working_dir")
    return Path(working_dir) / path if isinstance(working_dir, str) else None


def _paths_from_where_it_started(data: dict, run_dir: Path) -> None:
    """In a stored config `data` (edited in place): each relative path of PATH_KEYS is replaced by the absolute path
    the run read at its start (plan.json), so it is not read from the current folder. Raises ConfigError when the
    file is in neither place."""
    plan = _plan_record(run_dir)
    for key in PATH_KEYS:
        found = _path_value(key, data)
        if found is None or not _is_relative(found[0]):
            continue
        (path, rest), (section, name) = found, key.split(".")
        started = _started_location(key, path, plan)
        if started is not None and started.exists():
            data[section][name] = str(started) + rest
        elif not Path(path).exists():
            where = (f"is neither at {started} (where the run started) nor in the current folder {Path.cwd()}"
                     if started is not None else f"is read from the current folder {Path.cwd()}, where it does not "
                     "exist (the run recorded no absolute path)")
            raise ConfigError(f"{key} {path} of {run_dir / 'config.json'} is relative and {where}: run the command "
                              "from the folder the run was started in")


def _same_location(key: str, saved: dict, now: dict, plan: dict) -> bool:
    """Whether config key `key` names, in the config `now` resumed with, the file the saved config `saved` named at
    the run's start (both config.json dicts; where the file was, plan.json recorded)."""
    then, found = _path_value(key, saved), _path_value(key, now)
    started = _started_location(key, then[0], plan) if then is not None else None
    if started is None or found is None or then[1] != found[1]:
        return False
    return Path(found[0]).expanduser().resolve() == started.resolve()


def check_same_config(saved_path: Path, cfg: Config) -> None:
    """Refuse (RunExistsError) a --resume whose config differs from the run's saved config.json, except in
    RESUMABLE_KEYS. A key the saved config lacks (added to the schema since) counts as its default. A path of
    PATH_KEYS written differently (relative, absolute, from another folder) that names the file the run started
    with (as plan.json recorded it) is the same."""
    if not saved_path.exists():
        return
    saved = json.loads(saved_path.read_text())
    now, default = cfg.model_dump(mode="json"), Config().model_dump(mode="json")
    plan = _plan_record(saved_path.parent)
    changed = [f"{section}.{key}" for section, fields in now.items() for key, value in fields.items()
               if saved.get(section, {}).get(key, default[section][key]) != value
               and section not in RESUMABLE_KEYS and f"{section}.{key}" not in RESUMABLE_KEYS
               and not (f"{section}.{key}" in PATH_KEYS and _same_location(f"{section}.{key}", saved, now, plan))]
    if changed:
        allowed = ", ".join(k + (".*" if "." not in k else "") for k in RESUMABLE_KEYS[:-1])
        raise RunExistsError(f"--resume with a config that differs from {saved_path} in: {', '.join(changed)} "
                             f"(only {allowed} and {RESUMABLE_KEYS[-1]} may change; use a new run.name)")
    steps_then = saved.get("run", {}).get("steps", default["run"]["steps"])
    if steps_then != cfg.run.steps and cfg.algorithm.lr_schedule != "constant":
        longer = cfg.run.steps > steps_then
        instead = ("train longer in a new run.name, or from this run's exported checkpoint with --set model.path=...; "
                   "algorithm.lr_schedule = 'constant' runs can be extended" if longer else
                   f"resume with run.steps = {steps_then} and stop it when you like: every checkpoint is exportable")
        raise RunExistsError(f"--resume with run.steps {steps_then} -> {cfg.run.steps}: with algorithm.lr_schedule = "
                             f"{cfg.algorithm.lr_schedule!r} run.steps is the schedule's length, so every later step's "
                             f"learning rate would change, so the run cannot be {'extended' if longer else 'shortened'} "
                             f"({instead})")


def check_same_data(plan_path: Path, now: dict) -> None:
    """Refuse (RunExistsError) a --resume whose data differs from the identity the run recorded in plan.json (runs
    from before the record are not checked)."""
    saved = json.loads(plan_path.read_text()).get("data") if plan_path.exists() else None
    change = data_changes(saved, now) if saved is not None else None
    if change:
        raise RunExistsError(f"--resume on changed data: {change}; the run's order and held-out split come from "
                             "the data it started with (restore it, or use a new run.name)")


def check_not_weights_only(run_dir: Path, checkpoints: list[Path], kinds: list[tuple[int, bool] | None]) -> None:
    """Refuse (RunExistsError) a --resume whose newest whole checkpoint (`kinds`: runs.folder.checkpoint_kind of each
    of `checkpoints`; damaged ones are skipped, as the resume skips them) holds the weights only
    (logging.final_weights_only): it has no optimizer state to continue from."""
    usable = [(path, kind) for path, kind in zip(checkpoints, kinds) if kind is not None]
    if usable and usable[-1][1][1]:
        newest = usable[-1][0]
        older = f", or delete it to resume from {usable[-2][0].name}" if len(usable) > 1 else ""
        raise RunExistsError(
            f"{newest} holds the weights only (the run had logging.final_weights_only = true), no optimizer "
            f"state, so the run cannot continue from it: export it (`{program_name()} export {_quoted(run_dir)}`) and "
            "start a new "
            f"run with model.path set to the exported folder{older}")


def check_resume(run_dir: Path, cfg: Config, data: dict, checkpoints: list[Path],
                 kinds: list[tuple[int, bool] | None]) -> None:
    """Refuse a --resume before anything loads: a changed config or data (RunExistsError), a weights-only newest
    checkpoint among `checkpoints` (their `kinds`, check_not_weights_only; RunExistsError) or a damaged metrics.jsonl
    (RunFolderError, which the resume would meet only after the minutes of loading)."""
    check_same_config(run_dir / "config.json", cfg)
    check_same_data(run_dir / "plan.json", data)
    check_not_weights_only(run_dir, checkpoints, kinds)
    if (run_dir / METRICS).exists():
        read_metrics(run_dir)


@dataclass(frozen=True)
class FolderCheck:
    """What a start in the run folder will do: `data`, the data's identity (plan.json records it); `said`, in words
    (the dry run prints it); `restart`, True when the folder holds only an interrupted start's step-0 eval, whose
    metrics.jsonl is set aside (RESTARTED_METRICS) before the run starts over."""

    data: dict
    said: str
    restart: bool = False


def check_run_folder(cfg: Config, resume: bool) -> FolderCheck:
    """Every check a start makes before anything loads; writes nothing. Raises RunExistsError (a run is there and
    --resume was not given; a refused resume), RunFinished (--resume with no step left), RunFolderError (damaged
    metrics) and FileNotFoundError (task.path missing)."""
    run_dir = cfg.run.output_dir / cfg.run.name
    data = data_identity(cfg.task.kind, cfg.task.path, cfg.task.name)
    checkpoints = list_checkpoints(run_dir)
    kinds = [checkpoint_kind(path) for path in checkpoints]  # read once: every judgement below is made from them
    if resume:
        check_resume(run_dir, cfg, data, checkpoints, kinds)
        return _resume_check(run_dir, cfg, data, checkpoints, kinds)
    if (finished := _finished_run(run_dir, kinds, cfg.run.steps)) is not None:
        raise RunExistsError(finished)
    if checkpoints:
        raise RunExistsError(f"{run_dir} already holds a run ({_resume_point(checkpoints, kinds)}); continue it "
                             f"with --resume ({resume_command(run_dir)}; for the main job `make train "
                             f"ARGS=--resume`) or set a new run.name")
    try:
        logged = _last_logged_step(run_dir)
    except RunFolderError as err:
        raise RunExistsError(f"{run_dir} holds a run whose metrics cannot be read ({err}); set a new run.name") from None
    if logged is None:
        return FolderCheck(data, f"new run in {run_dir}")
    if logged == 0:
        return FolderCheck(data, f"new run in {run_dir}, which holds only the step-0 eval of an interrupted start "
                                 f"(its metrics are kept as {RESTARTED_METRICS})", restart=True)
    raise RunExistsError(f"{run_dir} holds a run that logged steps up to {logged} but wrote no checkpoint; pass "
                         "--resume to start it over in this folder (its metrics are kept as "
                         "metrics.before-resume.jsonl) or set a new run.name")


def _resume_point(checkpoints: list[Path], kinds: list[tuple[int, bool] | None]) -> str:
    """Where --resume would start, in words: 'last checkpoint X', with the newer damaged ones named after it, or
    'no loadable checkpoint: X damaged'. `kinds`: runs.folder.checkpoint_kind of each checkpoint; a resume loads only
    a whole full one (checkpoint_step's judgement), so a weights-only one counts as not loadable here."""
    whole = [i for i, kind in enumerate(kinds) if kind is not None and not kind[1]]
    damaged = [path.name for path in checkpoints[whole[-1] + 1 if whole else 0:]]  # list_checkpoints' step order
    if not whole:
        return f"no loadable checkpoint: {', '.join(damaged)} damaged, so --resume starts from step 0"
    newer = f"; newer, damaged: {', '.join(damaged)}" if damaged else ""
    return f"last checkpoint {checkpoints[whole[-1]].name}{newer}"


def _resume_check(run_dir: Path, cfg: Config, data: dict, checkpoints: list[Path],
                  kinds: list[tuple[int, bool] | None]) -> FolderCheck:
    """What --resume will do: continue from the newest whole full checkpoint (`kinds`: runs.folder.checkpoint_kind of
    each; what checkpoint_step accepts, and the load skips damaged ones the same way), start over without one, or
    nothing (RunFinished) when no step is left."""
    found = next(((path, kind[0]) for path, kind in zip(reversed(checkpoints), reversed(kinds))
                  if kind is not None and not kind[1]), None)
    if found is None:
        none = "no checkpoint" if not checkpoints else "no loadable checkpoint"
        return FolderCheck(data, f"--resume in {run_dir}, which has {none}: starts from step 0")
    path, step = found
    if step >= cfg.run.steps:
        raise RunFinished(f"nothing to do: {run_dir} is finished (its last checkpoint {path.name} is at step {step}, "
                          f"run.steps = {cfg.run.steps}); {further_advice(run_dir, step, cfg.algorithm.lr_schedule)}")
    skipped = f" (newer, damaged: {', '.join(p.name for p in checkpoints[checkpoints.index(path) + 1:])})" \
        if path != checkpoints[-1] else ""
    return FolderCheck(data, f"resumes {run_dir} from {path.name}{skipped}: steps {step + 1} to {cfg.run.steps}")


def further_advice(run_dir: Path, step: int, lr_schedule: str, weights_only: bool = False) -> str:
    """How to train a finished run further: --resume with more steps under a constant lr, else a new run from its
    export (a decaying schedule ended at run.steps; a weights-only final checkpoint cannot be resumed)."""
    folder, program = _quoted(run_dir), program_name()
    if lr_schedule == "constant" and not weights_only:
        return (f"to train further, resume with more steps: {program} train --resume {folder} --set run.steps=N "
                f"(N > {step})")
    why = ("its last checkpoint holds the weights only, so it cannot be resumed" if weights_only else
           f"its {lr_schedule} lr schedule ended at run.steps, so it cannot be extended")
    return (f"{why}; to train further, start a new run (fresh optimizer and lr schedule) with its config from its "
            f"exported checkpoint: {program} export {folder}, then {program} train "
            f"{_quoted(Path(run_dir) / 'config.json')} --set model.path={_quoted(f'{run_dir}/export/step_{step:06d}')} "
            "--set run.name=NEW --set run.seed=S (another seed draws other training problems; the held-out set stays)")


def _quoted(path: Path | str) -> str:
    """A path as a shell word, for the commands printed to be pasted."""
    return shlex.quote(str(path))


def _finished_run(run_dir: Path, kinds: list[tuple[int, bool] | None], steps_now: int) -> str | None:
    """The refusal of a plain start on a run that finished: its newest whole checkpoint (runs.folder.checkpoint_kind,
    a weights-only one included) is at or past its own run.steps (from its config.json; `steps_now`, the new
    config's, without one), so --resume would have nothing to do. Its step count and how to go on; None when it did
    not finish (the caller then gives its ordinary advice)."""
    usable = [kind for kind in kinds if kind is not None]  # kinds: runs.folder.checkpoint_kind of each checkpoint
    try:
        config = read_json_object(run_dir / "config.json") if (run_dir / "config.json").exists() else {}
    except RunFolderError:
        config = {}
    run, algorithm = config.get("run"), config.get("algorithm")
    steps = run.get("steps") if isinstance(run, dict) else None
    steps = steps if isinstance(steps, int) and not isinstance(steps, bool) else steps_now
    if not usable or usable[-1][0] < steps:
        return None
    schedule = algorithm.get("lr_schedule") if isinstance(algorithm, dict) else None
    return (f"{run_dir} already holds a finished run (it trained all of its run.steps = {steps}); set a new run.name "
            f"(for the main job `make train ARGS=\"--set run.name=NEW\"`; its results: {program_name()} report "
            f"{_quoted(run_dir)}; its model: {program_name()} export {_quoted(run_dir)}); "
            f"{further_advice(run_dir, usable[-1][0], schedule or 'constant', usable[-1][1])}")


def _last_logged_step(run_dir: Path) -> int | None:
    """The highest step in metrics.jsonl (0: only the step-0 eval, or no row); None without the file. Raises
    RunFolderError when it is damaged."""
    if not (run_dir / METRICS).exists():
        return None
    return max((row["step"] for row in read_metrics(run_dir).rows), default=0)


def set_aside_restarted_metrics(run_dir: Path) -> None:
    """Keep an interrupted start's metrics.jsonl (only its step-0 eval) as RESTARTED_METRICS (FolderCheck.restart)."""
    (run_dir / METRICS).replace(run_dir / RESTARTED_METRICS)


def note_engine_precision(saved: dict, precision: str, log=print) -> None:
    """Say when a resume changes engine.precision (allowed: the way out after an engine crash) from the one the
    checkpoint recorded (checkpoints from before the record say nothing)."""
    before = saved.get("engine_precision")
    if before is not None and before != precision:
        log(f"engine.precision changes on resume: {before} -> {precision} (the weights are exported at {precision} "
            "from now on; expect a different engine/trainer mismatch)")


def last_eval_accuracy(run_dir: Path, step: int) -> float | None:
    """The accuracy of the last finite eval logged at or before `step` (the progress bar's `acc=` at a resume); None
    when none is logged or metrics.jsonl cannot be read (the resume checks have already said why)."""
    try:
        rows = read_metrics(run_dir).rows
    except RunFolderError:
        return None
    evals = [row["eval/accuracy"] for row in rows if row["step"] <= step and is_finite_number(row.get("eval/accuracy"))]
    return evals[-1] if evals else None
