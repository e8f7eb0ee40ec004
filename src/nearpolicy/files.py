"""Atomic file writes: the one owner of "a reader sees the old file or the new one, never half of either".

Every file nearpolicy rewrites in place (run-folder JSON and JSONL, diagnose tables, the engine's GGUF, vLLM's
weight file) goes through `atomic_path`: the caller writes a temporary file in the same folder, which is renamed
over the target only when the write finished (and, with `durable`, fsynced first, its folder after); on any error
the temporary file is removed and the target is untouched. Durability is opt-in: scratch files rewritten every
weight sync (vLLM's) would pay an fsync of every byte for nothing. Folders (checkpoints, exports, the model cache) are published the same way by their owners,
with a temporary folder renamed into place."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: Path, durable: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path` (hidden, unique) to write; on a clean exit it is renamed over `path`
    (with `durable`: fsynced before, the folder fsynced after, so the rename survives a power cut); on an exception
    it is deleted and `path` keeps its old contents. The new file gets the target's mode where it exists, else the
    mode a plain open() would give under the umask. Raises what the write or the rename raises (OSError: a full
    disk, a missing folder)."""
    path = Path(path)
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else plain_mode(folder=False)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp's file is 0600: give the mode a plain open() would (or the target's own)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_folder(path.parent)


def plain_mode(folder: bool) -> int:
    """The permission bits a plain open() (folder: mkdir()) gives under this process's umask; mkstemp and mkdtemp give
    0600 / 0700, which a file or folder published by rename would otherwise keep."""
    return (0o777 if folder else 0o666) & ~_umask()


def give_plain_modes(folder: Path) -> None:
    """chmod `folder` and everything under it to plain_mode: before a folder written by libraries that create their
    files 0600 (safetensors' save_file) is published by rename. Raises OSError as chmod does."""
    folder = Path(folder)
    os.chmod(folder, plain_mode(folder=True))
    for path in folder.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, plain_mode(folder=path.is_dir()))


def _umask() -> int:
    """The process's umask: from /proc where Linux has it (no change to process state), else set and restored."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomically(path: Path, data: str | bytes) -> None:
    """`data` (text as UTF-8, or bytes) as the whole new contents of `path` (atomic_path)."""
    with atomic_path(path) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")


def fsync_folder(path: Path) -> None:
    """fsync a folder so a rename inside it survives a power cut (a no-op where the OS cannot open folders)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
