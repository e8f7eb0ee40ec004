"""The arena file (ARENA.toml): parse, validate and expand into cells, each an ordinary validated Config.

    [arena]
    base = "main.toml"               # the base config (TOML, or a run folder's config.json), relative to this file
    seeds = [0, 1, 2]                # run.seed of each repetition (required, distinct)
    set = ["run.steps=15"]           # --set overrides applied to every cell (the shared budget)
    out = "runs/arena"               # output folder (default runs/arena-<file stem>; `--out` replaces it)
    baseline = "off"                 # the correction every other is compared with (default: the first)
    keep_checkpoints = false         # false: a finished cell's checkpoints/ and engine/ are deleted
    step_seconds = 7.0               # estimates for --dry-run before any cell has finished (seconds)
    eval_seconds = 4.0
    start_seconds = 25.0
    vary = ["run.steps"]             # SAME_KEYS cells may differ in on purpose (default: none)
    late_steps = 3                   # N of the outcome "mean training reward of the last N steps" (int >= 1, at
                                     # most every cell's run.steps; default: max(1, run.steps // 4) per cell)
    sequential = false               # true: run seed by seed, stop once the comparisons are settled (sequential.py)
    target_mde = 0.05                # a CI containing 0 with an MDE <= this settles as a null (in (0, 1); required)
    min_seeds = 3                    # the first look after this many seeds (>= 3; the seeds listed are the most run)
    stop_on = "final"                # the outcome the rule judges (one of OUTCOME_NAMES)
    stop_for = ["tis vs off under q4_1"]   # the comparisons the rule waits for (default: all; stop_settings.py)

    [corrections]                    # the arms: a preset, --set overrides, or both
    off = { preset = "off" }
    tis_bypass = { preset = "tis", set = ["correction.mode='bypass'"] }

    [sources]                        # mismatch sources: --set overrides, an optional note (the dose)
    q4_1 = { set = ["engine.precision='q4_1'"], note = "k3 ~ 5e-2 at step 0" }

    [[override]]                     # optional per-cell overrides, by cell glob (correction/source/sSEED; must match)
    cells = "*/q4_1/*"
    set = ["run.steps=20"]

A cell's config is the base file with, in this order, arena.set, the source's set, the correction's preset and set,
the matching overrides' sets, then run.seed, run.name (the cell's folder name) and run.output_dir (OUT/cells): one
layer of --set overrides over the file (config.load_config's rules). Arena files never set run.seed, run.name or
run.output_dir themselves. Every cell's config is validated before anything runs; an error names the arena key.
Cells may not differ in a task.* key or a SAME_KEYS key outside arena.vary (the budget and the held-out eval)."""

from __future__ import annotations

import copy
import fnmatch
import json
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nearpolicy.config.schema import Config, ConfigError, config_from_data, parse_override
from nearpolicy.config.checks import read_config_file
from nearpolicy.arena.keys import (  # noqa: F401 (ArenaError, OUTCOME_NAMES re-exported)
    ARENA_KEYS, DRAW_KEYS, NAME, OUTCOME_NAMES, OWNED_KEYS, SAME_KEYS, TOP_KEYS, ArenaError)
from nearpolicy.arena.stop_settings import Sequential, parse_sequential  # noqa: F401 (Sequential re-exported)

@dataclass(frozen=True)
class Arm:
    """A correction or a mismatch source: its name, its --set overrides ("section.key=value", TOML values), a note."""

    name: str
    sets: tuple[str, ...]
    note: str = ""


@dataclass(frozen=True)
class Cell:
    """One run of the grid: correction x source x seed, with its validated config and the --set overrides that made
    it from the base file (arena.set, the source's, the correction's, the matching overrides'; not the owned keys)."""

    correction: str
    source: str
    seed: int
    config: Config
    sets: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        """'correction/source/sSEED' (what --only globs match)."""
        return f"{self.correction}/{self.source}/s{self.seed}"

    @property
    def folder(self) -> str:
        """The run folder's name under OUT/cells: 'correction__source__sSEED'."""
        return f"{self.correction}__{self.source}__s{self.seed}"

    @property
    def run_dir(self) -> Path:
        return self.config.run.output_dir / self.config.run.name


@dataclass(frozen=True)
class Estimates:
    """Seconds per training step (at the base config's samples per step), per eval and per cell start."""

    step_seconds: float = 7.0
    eval_seconds: float = 4.0
    start_seconds: float = 25.0


@dataclass(frozen=True)
class ArenaSpec:
    """A parsed, validated arena: where it came from, its arms, seeds, output folder and cells (corrections-major:
    every source and seed of the first correction first). `sequential`: the sequential stopping settings (None:
    off, every seed runs). `late_steps`: arena.late_steps, the N of the late-reward outcome (training steps; None:
    arena/outcomes.default_late_steps of each cell's run.steps)."""

    path: Path
    base: Path
    seeds: tuple[int, ...]
    corrections: tuple[Arm, ...]
    sources: tuple[Arm, ...]
    out: Path
    baseline: str
    keep_checkpoints: bool
    estimates: Estimates
    cells: tuple[Cell, ...] = field(default=())
    late_steps: int | None = None
    sequential: Sequential | None = None

    def select(self, only: str | Sequence[str] | None) -> list[Cell]:
        """The cells whose id matches the glob `only`, or any glob of a list of them (fnmatch; None or an empty list:
        all). Raises ArenaError naming a glob that matches no cell."""
        globs = [only] if isinstance(only, str) else list(only or ())
        if not globs:
            return list(self.cells)
        for glob in globs:
            if not any(fnmatch.fnmatchcase(c.id, glob) for c in self.cells):
                raise ArenaError(f"--only {glob!r} matches no cell; cells are named correction/source/sSEED, e.g. "
                                 f"{self.cells[0].id}")
        return [c for c in self.cells if any(fnmatch.fnmatchcase(c.id, glob) for glob in globs)]


def _read(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArenaError(f"arena file {path} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as err:  # a repeated arm name: a repeated key
        raise ArenaError(f"{path}: not a valid TOML file ({err})") from None


def _unknown(table: dict, allowed: tuple[str, ...], where: str) -> None:
    extra = sorted(set(table) - set(allowed))
    if extra:
        raise ArenaError(f"{where}: unknown key {extra[0]!r} (allowed: {', '.join(allowed)})")


def _sets(value: Any, where: str) -> tuple[str, ...]:
    if not (isinstance(value, list) and all(isinstance(item, str) for item in value)):
        raise ArenaError(f"{where}.set must be a list of \"section.key=value\" strings, got {value!r}")
    for item in value:
        try:
            keys, _ = parse_override(item)
        except ConfigError as err:
            raise ArenaError(f"{where}.set: {err}") from None
        if ".".join(keys) in OWNED_KEYS:
            raise ArenaError(f"{where}.set: {'.'.join(keys)} is set by the arena for each cell (seeds, folders)")
    return tuple(value)


def _arms(data: Any, kind: str, preset_allowed: bool) -> tuple[Arm, ...]:
    if not isinstance(data, dict) or not data:
        raise ArenaError(f"[{kind}] must hold at least one named table, e.g. {kind}.NAME = {{ set = [...] }}")
    arms, folded = [], {}
    allowed = ("preset", "set", "note") if preset_allowed else ("set", "note")
    for name, table in data.items():
        where = f"{kind}.{name}"
        if not NAME.match(name):
            raise ArenaError(f"{where}: a name is letters, digits, '.', '-' and single '_', starting and ending with "
                             "a letter or digit (it becomes part of a folder name)")
        if name.lower() in folded:  # case-insensitive file systems would give both the same folder
            raise ArenaError(f"{where}: the name differs from {kind}.{folded[name.lower()]} only in case")
        folded[name.lower()] = name
        if not isinstance(table, dict):
            raise ArenaError(f"{where} must be a table, e.g. {{ set = [\"engine.precision='q4_1'\"] }}")
        _unknown(table, allowed, where)
        sets = _sets(table.get("set", []), where)
        if "preset" in table:
            if not isinstance(table["preset"], str):
                raise ArenaError(f"{where}.preset must be a correction name (`nearpolicy list`)")
            sets = (f"correction.preset={json.dumps(table['preset'])}",) + sets
        if not sets:
            raise ArenaError(f"{where} changes nothing: give {' or '.join(a for a in allowed if a != 'note')}")
        arms.append(Arm(name, sets, str(table.get("note", ""))))
    return tuple(arms)


def _seeds(value: Any) -> tuple[int, ...]:
    if not (isinstance(value, list) and value and all(isinstance(s, int) and not isinstance(s, bool) for s in value)):
        raise ArenaError(f"arena.seeds must be a non-empty list of integers, got {value!r}")
    repeated = sorted({s for s in value if value.count(s) > 1})
    if repeated:
        raise ArenaError(f"arena.seeds repeats {repeated[0]}: each seed is one repetition of every cell")
    if any(not 0 <= s < 2**32 for s in value):
        raise ArenaError("arena.seeds must lie in [0, 2^32) (run.seed)")
    return tuple(value)


def _estimates(arena: dict) -> Estimates:
    values = {}
    for key in ("step_seconds", "eval_seconds", "start_seconds"):
        if key in arena:
            if not (isinstance(arena[key], (int, float)) and not isinstance(arena[key], bool) and arena[key] >= 0):
                raise ArenaError(f"arena.{key} must be a number of seconds >= 0, got {arena[key]!r}")
            values[key] = float(arena[key])
    return Estimates(**values)


def _overrides(data: Any) -> list[tuple[str, tuple[str, ...]]]:
    if not isinstance(data, list) or not all(isinstance(t, dict) for t in data):
        raise ArenaError("[[override]] must be an array of tables with `cells` (a glob) and `set`")
    out = []
    for i, table in enumerate(data):
        where = f"override[{i}]"
        _unknown(table, ("cells", "set"), where)
        if not isinstance(table.get("cells"), str):
            raise ArenaError(f"{where}.cells must be a glob over cell ids (correction/source/sSEED)")
        out.append((table["cells"], _sets(table.get("set", []), where)))
    return out


def load_arena(path: Path, out: Path | None = None) -> ArenaSpec:
    """Parse and validate the arena file `path`; `out` replaces arena.out. Every cell's config is built and
    validated here. Raises ArenaError (module docstring)."""
    path = Path(path)
    data = _read(path)
    _unknown(data, TOP_KEYS, str(path))
    arena = data.get("arena")
    if not isinstance(arena, dict):
        raise ArenaError(f"{path}: no [arena] table (it needs at least base and seeds)")
    _unknown(arena, ARENA_KEYS, "arena")
    if not isinstance(arena.get("base"), str):
        raise ArenaError("arena.base must name the base config file (relative to the arena file's folder)")
    base = (path.parent / Path(arena["base"]).expanduser()).resolve()
    if base.is_dir():
        hint = f"; name its config.json: {base / 'config.json'}" if (base / "config.json").is_file() else ""
        raise ArenaError(f"arena.base: {base} is a folder, not a config file{hint}")
    if not base.is_file():
        raise ArenaError(f"arena.base: the base config {base} does not exist (relative to {path.parent})")
    corrections = _arms(data.get("corrections"), "corrections", preset_allowed=True)
    sources = _arms(data.get("sources"), "sources", preset_allowed=False)
    baseline = arena.get("baseline", corrections[0].name)
    if baseline not in [c.name for c in corrections]:
        raise ArenaError(f"arena.baseline {baseline!r} is not one of the corrections")
    if not isinstance(arena.get("keep_checkpoints", False), bool):
        raise ArenaError("arena.keep_checkpoints must be true or false")
    out_dir = Path(out) if out is not None else Path(arena.get("out", f"runs/arena-{path.stem}"))
    spec = ArenaSpec(path, base, _seeds(arena.get("seeds")), corrections, sources, out_dir, baseline,
                     arena.get("keep_checkpoints", False), _estimates(arena))
    common = _sets(arena.get("set", []), "arena")
    try:
        base_data = _base_data(base)
    except ConfigError as err:
        raise ArenaError(f"arena.base: {err}") from None
    cells = _cells(spec, base_data, common, _overrides(data.get("override", [])))
    _same_eval(cells, _vary(arena.get("vary", [])))
    return replace(spec, cells=tuple(cells), late_steps=_late_steps(arena.get("late_steps"), cells),
                   sequential=parse_sequential(arena, len(spec.seeds), [c.name for c in spec.corrections],
                                               [s.name for s in spec.sources], spec.baseline))


def _late_steps(value: Any, cells: list[Cell]) -> int | None:
    """arena.late_steps (None when not set). Raises ArenaError unless it is an integer >= 1 and at most every
    cell's run.steps (the late reward averages that many of the cell's training steps)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ArenaError(f"arena.late_steps must be an integer >= 1 (the last training steps whose mean reward is an "
                         f"outcome), got {value!r}")
    shortest = min(cells, key=lambda c: c.config.run.steps)
    if value > shortest.config.run.steps:
        raise ArenaError(f"arena.late_steps = {value} is more than cell {shortest.id}'s run.steps = "
                         f"{shortest.config.run.steps}: the late reward averages the last late_steps training steps")
    return value


def _vary(value: Any) -> frozenset[str]:
    if not (isinstance(value, list) and all(isinstance(k, str) for k in value)):
        raise ArenaError(f"arena.vary must be a list of config keys, got {value!r}")
    for key in value:
        if key not in SAME_KEYS:
            raise ArenaError(f"arena.vary: {key!r} is not a budget key cells may differ in on purpose (one of "
                             f"{', '.join(SAME_KEYS)}; task.* keys never need it: the mixture keys may differ "
                             "without it, the others never, as every cell scores the same held-out set)")
    return frozenset(value)


def _base_data(base: Path) -> dict:
    """The base config as a dict: a TOML file, a JSON config, or a run folder's own config.json (its relative paths
    read where that run started; the cells set run.seed, run.name and run.output_dir themselves)."""
    from nearpolicy.runs.start_checks import is_run_config, run_config_data

    return run_config_data(base.parent) if is_run_config(base) else read_config_file(base)


def _config(base: dict, sets: list[str], where: str, path: Path) -> Config:
    try:
        return config_from_data(copy.deepcopy(base), list(sets), path)
    except ConfigError as err:  # an arena has no --set: its hints name the arena's set lists
        said = str(err).replace("add --set ", "add to arena.set: ").replace("--set on ", "set on ").replace(
            "--set ", "set item ")
        raise ArenaError(f"{where}: {said}") from None


def _cells(spec: ArenaSpec, base: dict, common: tuple[str, ...], overrides) -> list[Cell]:
    """Validate each layer on its own first, so an unknown key is blamed on the arm that wrote it."""
    _config(base, list(common), "arena.set (over the base config)", spec.base)
    for kind, arms in (("sources", spec.sources), ("corrections", spec.corrections)):
        for arm in arms:
            _config(base, [*common, *arm.sets], f"{kind}.{arm.name}", spec.base)
    cells, matched = [], set()
    for correction in spec.corrections:
        for source in spec.sources:
            for seed in spec.seeds:
                draft = Cell(correction.name, source.name, seed, Config())
                mine = [(i, sets) for i, (glob, sets) in enumerate(overrides) if fnmatch.fnmatchcase(draft.id, glob)]
                matched |= {i for i, _ in mine}
                extra = [s for _, sets in mine for s in sets]
                owned = [f"run.seed={seed}", f"run.name={json.dumps(draft.folder)}",
                         f"run.output_dir={json.dumps(str(spec.out / 'cells'))}"]
                sets = (*common, *source.sets, *correction.sets, *extra)
                cells.append(Cell(correction.name, source.name, seed,
                                  _config(base, [*sets, *owned], f"cell {draft.id}", spec.base), sets))
    for i, (glob, _) in enumerate(overrides):
        if i not in matched:
            raise ArenaError(f"override[{i}].cells {glob!r} matches no cell; cells are named correction/source/sSEED, "
                             f"e.g. {cells[0].id}")
    return cells


def _budget(cell: Cell, vary: frozenset[str]) -> dict[str, Any]:
    config = cell.config.model_dump(mode="json")
    keys = {f"task.{k}": v for k, v in config["task"].items() if k not in DRAW_KEYS}
    for key in SAME_KEYS:
        if key not in vary:
            section, name = key.split(".")
            keys[key] = config[section][name]
    return keys


def _same_eval(cells: list[Cell], vary: frozenset[str]) -> None:
    """Every cell trains on the same task with the same budget and is scored on the same held-out problems: no
    task.* key and no SAME_KEYS key outside `vary` may differ between cells. Raises ArenaError naming the key and
    the two cells."""
    first = _budget(cells[0], vary)
    for cell in cells[1:]:
        mine = _budget(cell, vary)
        changed = [k for k in first if first[k] != mine[k]]
        if changed:
            key = changed[0]
            hint = ("set task keys in the base or arena.set" if key.startswith("task.") else
                    f"set it in the base or arena.set, or list it in arena.vary = [\"{key}\"] to compare on purpose")
            raise ArenaError(f"cell {cell.id} has {key} = {mine[key]!r} but cell {cells[0].id} has {first[key]!r}: "
                             f"every cell must share the budget and the held-out eval ({hint})")
