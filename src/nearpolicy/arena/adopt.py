"""`nearpolicy arena ARENA.toml --adopt DIR`: take cells another arena already ran with the identical config, instead
of running them again (e.g. a new arena's baseline cells that are exactly a dose sweep's).

A cell of this arena is adopted from DIR (another arena's folder) when, in this order: it is pending here (cells
done, diverged, failed, stopped or skipped here are left alone), its id is in DIR/arena-state.json with a final status
(state.FINAL: done or diverged), its config in DIR's fingerprint equals this arena's (state.fingerprint: the whole
validated config, run.output_dir left out; compared by state.describe_changes's rule, so a key added to the schema
since DIR's arena started counts as equal at its default), DIR/cells/<folder> exists and OUT/cells/<folder> does not
or is empty. Adopting copies DIR/cells/<folder> byte for byte (its config.json still names the folder it ran in),
appends DIR/logs/<folder>.log (if present) and a line naming DIR to OUT/logs/<folder>.log, sets this arena's
CellRecord to a copy of DIR's (status, seconds, attempts, last step, ...), adds its seconds to the arena's and saves
the state. DIR is only read."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from nearpolicy.arena.spec import ArenaError, ArenaSpec, Cell
from nearpolicy.arena.state import FINAL, FORMAT, STATE, ArenaState, CellRecord, describe_changes, read_record
from nearpolicy.arena.table import duration


@dataclass(frozen=True)
class Other:
    """Another arena's folder as read from its arena-state.json: each cell's stored config (its fingerprint) and
    record."""

    folder: Path
    configs: dict[str, dict]
    records: dict[str, CellRecord]


def read_other(folder: Path) -> Other:
    """The arena folder `folder`'s stored configs and records (only read). Raises ArenaError when it is no folder,
    holds no arena-state.json, or that file cannot be read or is not an arena state of this format."""
    folder = Path(folder)
    path = folder / STATE
    if not folder.is_dir() or not path.is_file():
        raise ArenaError(f"--adopt {folder}: not an arena folder (no {STATE} in it)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format", FORMAT) != FORMAT:
            raise ValueError(f"format {data.get('format')}, this nearpolicy reads format {FORMAT}")
        configs = {cid: dict(config) for cid, config in data["arena"]["cells"].items()}
        records = {cid: read_record(rec) for cid, rec in data["cells"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ArenaError(f"--adopt {folder}: {path} cannot be read ({err})") from None
    return Other(folder, configs, records)


def refusal(cell: Cell, config: dict, other: Other, out: Path) -> str | None:
    """Why `cell` (this arena's, with fingerprint config `config`) cannot be adopted from `other` into the arena
    folder `out`, or None when it can (module docstring: the checks, in order). A differing config names the first
    differing key (in sorted order) with DIR's value and this arena's."""
    record = other.records.get(cell.id)
    if record is None or cell.id not in other.configs:
        return f"not in {other.folder}"
    if record.status not in FINAL:
        return f"{record.status} in {other.folder}, not final (done or diverged)"
    changes = describe_changes({"cells": {cell.id: other.configs[cell.id]}}, {"cells": {cell.id: config}}, limit=1)
    if changes:
        first = changes[0].removeprefix(f"cell {cell.id}: ")
        more = f" ({changes[1].removeprefix('... ')} differing keys)" if len(changes) > 1 else ""
        return f"config differs: {first} ({other.folder}'s -> this arena's){more}"
    if not (other.folder / "cells" / cell.folder).is_dir():
        source = other.folder / "cells" / cell.folder
        return f"{source} is not a folder" if source.exists() else f"{source} is missing"
    target = out / "cells" / cell.folder
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        return f"{target} exists and is not empty"
    return None


def copy_cell(cell: Cell, other: Other, out: Path) -> None:
    """Copy `other`'s run folder and log of `cell` into `out` (module docstring). The folder is copied to a temporary
    name and renamed into place, so a kill leaves no half-copied cell folder. Raises OSError when copying fails."""
    target = out / "cells" / cell.folder
    partial = target.with_name(f".{cell.folder}.adopting")
    shutil.rmtree(partial, ignore_errors=True)  # a copy a kill interrupted: ours, in OUT
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(other.folder / "cells" / cell.folder, partial)
    partial.replace(target)  # onto a missing or empty folder only (refusal checked)
    log = other.folder / "logs" / f"{cell.folder}.log"
    (out / "logs").mkdir(parents=True, exist_ok=True)
    with (out / "logs" / f"{cell.folder}.log").open("a", encoding="utf-8") as mine:
        if log.is_file():
            mine.write(log.read_text(encoding="utf-8", errors="replace"))
        mine.write(f"arena --adopt: this cell was adopted from {other.folder} (not run here)\n")


def adopt(spec: ArenaSpec, state: ArenaState, cells: list[Cell], others: list[Other], dry_run: bool,
          say) -> list[str]:
    """Adopt into `state` (this arena's, open) every cell of `cells` pending in it that one of `others` can give
    (the first that can, in order), saying one line per adopted cell and one per refusal (with the reason); with
    `dry_run` nothing is copied or saved ("would adopt"). Returns the adopted cell ids. Raises ArenaError when a copy
    fails (the cells adopted before it are saved; the failed one stays pending)."""
    adopted = []
    for other in others:
        for cell in (c for c in cells if state.cells[c.id].status == "pending" and c.id not in adopted):
            reason = refusal(cell, state.arena["cells"][cell.id], other, spec.out)
            if reason is not None:
                say(f"arena --adopt {cell.id}: not adopted from {other.folder}: {reason}")
                continue
            record = CellRecord(**asdict(other.records[cell.id]))
            if not dry_run:
                try:
                    copy_cell(cell, other, spec.out)
                except OSError as err:
                    raise ArenaError(f"--adopt {cell.id}: copying it from {other.folder} failed ({err})") from None
                state.cells[cell.id] = record
                state.seconds += record.seconds
                state.save()
            adopted.append(cell.id)
            say(f"arena --adopt {cell.id}: {'would adopt' if dry_run else 'adopted'} from {other.folder} "
                f"({record.status}, last step {record.last_step}, {duration(record.seconds)})")
    return adopted


def adopt_into(spec: ArenaSpec, folders: list[Path], only: str | list[str] | None, dry_run: bool, say) -> list[str]:
    """`--adopt`: read every folder of `folders` first (a bad one raises ArenaError before anything is written), then
    adopt into the arena folder of `spec` the cells `only` selects (spec.select) as `adopt` does. Raises ArenaError
    for a folder that is this arena's own, a bad folder, a changed arena (ArenaState.open) or an --only matching
    nothing."""
    own = spec.out.resolve()
    if any(Path(folder).resolve() == own for folder in folders):
        raise ArenaError(f"--adopt names this arena's own folder {spec.out}")
    others = [read_other(folder) for folder in folders]
    cells = spec.select(only)
    state = ArenaState.open(spec.out, spec)
    return adopt(spec, state, cells, others, dry_run, say)
