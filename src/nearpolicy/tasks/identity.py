"""The identity of a run's data, recorded in plan.json so that a --resume on changed data is refused (invariant 17).

A JSONL task is identified by its content (sha256 of the file's bytes, its size in bytes and its number of non-blank
lines); a reasoning-gym task by its spec (dataset name, options, sizes and seeds, all in config.json) plus the
installed reasoning_gym version, which generates the problems from that spec. The JSONL record also keeps where the
file was (`resolved`, absolute), so a --resume RUN_DIR from another folder reads a relative task.path from where the
run started (runs/start_checks.stored_config); where the file is, or how task.path is written, is not its identity."""

from __future__ import annotations

import hashlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

__all__ = ["data_changes", "data_identity"]


def data_identity(kind: str, path: Path | str | None = None, name: str | None = None) -> dict[str, Any]:
    """{"kind", "path" (task.path as given), "resolved" (its absolute path), "sha256", "bytes", "lines"} of a JSONL
    file, or {"kind", "name", "reasoning_gym"} (the installed version, None when it is not installed) of a
    reasoning-gym dataset. Raises FileNotFoundError naming task.path when the JSONL file is missing."""
    if kind != "jsonl":
        try:
            installed = version("reasoning_gym")
        except PackageNotFoundError:
            installed = None
        return {"kind": kind, "name": name, "reasoning_gym": installed}
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"task.path {file} does not exist")
    digest, size, lines = hashlib.sha256(), 0, 0
    with file.open("rb") as handle:
        for line in handle:
            digest.update(line)
            size += len(line)
            lines += bool(line.strip())
    return {"kind": kind, "path": str(file), "resolved": str(file.resolve()), "sha256": digest.hexdigest(),
            "bytes": size, "lines": lines}


def data_changes(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """What changed between two data identities, in words (None when nothing did), e.g. "task.path data.jsonl
    changed: 100 -> 111 lines, 6400 -> 7104 bytes, sha256 ab12cd34ef56 -> cd34ab12ef56"."""
    where = ("path", "resolved")  # the same bytes read from another folder, or through another spelling, are the same data
    if {k: v for k, v in saved.items() if k not in where} == {k: v for k, v in now.items() if k not in where}:
        return None
    if now.get("kind") == "jsonl" and saved.get("kind") == "jsonl":
        parts = [f"{saved.get(key)} -> {now.get(key)} {key}" for key in ("lines", "bytes")
                 if saved.get(key) != now.get(key)]
        parts.append(f"sha256 {str(saved.get('sha256'))[:12]} -> {str(now.get('sha256'))[:12]}")
        return f"task.path {Path(now['path']).name} changed: {', '.join(parts)}"
    if now.get("kind") == "reasoning_gym" and saved.get("kind") == "reasoning_gym":
        return (f"task reasoning-gym {now.get('name')} changed: reasoning_gym {saved.get('reasoning_gym')} -> "
                f"{now.get('reasoning_gym')} (the same spec may generate other problems)")
    return f"task data changed: {saved} -> {now}"
