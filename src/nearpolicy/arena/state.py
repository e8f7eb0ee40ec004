"""OUT/arena-state.json: what each cell of an arena did, rewritten atomically (runs.folder.write_json: a temporary file
renamed over the old one) after every change, so a kill at any moment leaves the last complete state.

    {"format": 1, "arena": {"base": ..., "cells": {cell id: the cell's config, run.output_dir left out}},
     "seconds": total wall seconds of all attempts, "cells": {cell id: CellRecord fields}}

A cell's status: pending (never started), running (started; a kill left it so), done, diverged (the run failed
with non-finite steps or weights: a result, kept), failed (an infrastructure failure: the engine died, the run
could not start, an unexpected error; tried again on the next start), stopped (SIGINT / SIGTERM; continued on the
next start), skipped (arena.sequential's rule stopped the arena before the cell's seed: sequential.py; run again
only where the rule, recomputed on the next start, goes on to that seed, or with arena.sequential = false). done and
diverged cells are final: never run again. Cells added to the arena since (a wider grid:
another correction, source or seed) join as pending; a state whose arena differs otherwise (a cell removed or with
a different config, another base) is refused, naming what changed."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from nearpolicy.arena.spec import ArenaError, ArenaSpec
from nearpolicy.runs.folder import write_json

STATE = "arena-state.json"
FORMAT = 1
FINAL = ("done", "diverged")
STATUSES = ("pending", "running", "done", "diverged", "failed", "stopped", "skipped")


@dataclass
class CellRecord:
    """One cell's record: status (module docstring), wall seconds over all attempts, attempts, the last error's
    message, its kind ("divergence" or "infrastructure"), the last step logged."""

    status: str = "pending"
    seconds: float = 0.0
    attempts: int = 0
    error: str | None = None
    failure: str | None = None
    last_step: int | None = None


def read_record(rec: dict) -> CellRecord:
    """A CellRecord from a stored record (keys it does not know ignored, missing ones at their defaults), its fields
    type-checked: a wrong type raises ValueError, so a damaged state is refused (ArenaState.open) or not adopted
    from (adopt.read_other) before anything is run or copied."""
    record = CellRecord(**{f.name: rec[f.name] for f in fields(CellRecord) if f.name in rec})
    number = (int, float)
    if (not isinstance(record.status, str) or isinstance(record.seconds, bool)
            or not isinstance(record.seconds, number) or not math.isfinite(record.seconds) or record.seconds < 0
            or isinstance(record.attempts, bool) or not isinstance(record.attempts, int)
            or not (record.last_step is None or (isinstance(record.last_step, int)
                                                 and not isinstance(record.last_step, bool)))):
        raise ValueError(f"a cell record has fields of the wrong type: {rec}")
    return record


def fingerprint(spec: ArenaSpec) -> dict:
    """What must not change between sittings: the base file's path and every cell's full config (its output folder
    left out, so an arena folder can be moved)."""
    cells = {}
    for cell in spec.cells:
        config = cell.config.model_dump(mode="json")
        config["run"].pop("output_dir", None)
        cells[cell.id] = config
    return {"base": str(spec.base), "cells": cells}


def _flat(config: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and prefix.count(".") < 1:
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _default_config() -> dict:
    from nearpolicy.config.schema import Config

    return Config().model_dump(mode="json")


def describe_changes(old: dict, new: dict, limit: int = 6) -> list[str]:
    """What differs between two fingerprints, one line each (at most `limit` lines, then a count); cells only in
    `new` are no change (they join as pending). A key the old fingerprint lacks counts as unchanged when the new
    value is the schema's default (as a --resume treats it)."""
    lines = []
    if old.get("base") != new.get("base"):
        lines.append(f"arena.base: {old.get('base')} -> {new.get('base')}")
    before, after = old.get("cells", {}), new.get("cells", {})
    removed = [c for c in before if c not in after]
    if removed:
        lines.append(f"{len(removed)} cell(s) removed: {', '.join(removed[:4])}{' ...' if len(removed) > 4 else ''}")
    default = _flat(_default_config())
    for cell in (c for c in after if c in before):
        a, b = _flat(before[cell]), _flat(after[cell])
        for key in sorted(set(a) | set(b)):
            if key not in a and key in default and b[key] == default[key]:
                continue  # a key added to the schema since the arena started, at its default: runs as before
            if a.get(key) != b.get(key):
                lines.append(f"cell {cell}: {key} {json.dumps(a.get(key))} -> {json.dumps(b.get(key))}")
    return lines[:limit] + ([f"... and {len(lines) - limit} more"] if len(lines) > limit else [])


@dataclass
class ArenaState:
    """The state of one arena folder (module docstring); `save()` after each change."""

    path: Path
    arena: dict
    cells: dict[str, CellRecord] = field(default_factory=dict)
    seconds: float = 0.0

    @classmethod
    def open(cls, out: Path, spec: ArenaSpec) -> "ArenaState":
        """The state in `out` (a new one when there is none). Raises ArenaError when the stored arena differs from
        `spec` (naming what changed) or the file cannot be read."""
        path = Path(out) / STATE
        current = fingerprint(spec)
        if not path.exists():
            return cls(path, current, {cell.id: CellRecord() for cell in spec.cells})
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            stored = {cid: read_record(rec) for cid, rec in data["cells"].items()}
            arena, seconds = data["arena"], float(data.get("seconds", 0.0))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ArenaError(f"{path} cannot be read ({err}); move it away to start the arena over") from None
        changes = describe_changes(arena, current)
        if changes:
            raise ArenaError(f"{spec.path} is not the arena {out} was started with; changed: " + "; ".join(changes)
                             + f". Restore it, or give a new --out to run the changed arena")
        stored |= {cell.id: CellRecord() for cell in spec.cells if cell.id not in stored}  # added cells: pending
        return cls(path, current, stored, seconds)  # the new keys recorded: later changes to them are seen

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, {"format": FORMAT, "arena": self.arena, "seconds": round(self.seconds, 3),
                               "cells": {cid: asdict(rec) for cid, rec in self.cells.items()}})

    def counts(self) -> dict[str, int]:
        """How many cells have each status."""
        return {status: sum(r.status == status for r in self.cells.values()) for status in STATUSES}
