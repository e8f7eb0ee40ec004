"""K-quant GGUFs (q4_k_m, q4_k_s, q5_k_m, q6_k) written by llama.cpp's own quantizer.

gguf-py has no K-quant quantizer, so a K-quant engine file is made in two steps: the trainer's weights are exported
at `SOURCE_PRECISION` (f32: the exact weights; engines/gguf/export.py) to a scratch file beside the target, then
`llama_model_quantize` (llama-cpp-python's binding of llama.cpp's `llama-quantize`, the library the engine runs)
turns that file into the K-quant mix. The mix is llama.cpp's choice per tensor (`llama_tensor_get_type`): Q4_K_M
stores most 2-D weights as Q4_K, some attn_v / ffn_down and the output (or the tied token_embd) as Q6_K, and a tensor
whose rows are not a multiple of 256 (the K-quant super-block) at a fallback type (Q5_0 / Q5_1 / Q8_0 ...; llama.cpp
logs "using fallback quantization"). Norms stay F32. Read the types back with `tensor_types`.

The quantizer is native code, so it runs in a child process: a crash (SIGSEGV, SIGABRT, an OOM kill) ends
the child, and the caller gets a `QuantizeError` naming the step, the files, how the child ended and the last lines
of llama.cpp's log (kept beside the target as .<name>.quantize.log). The target is written atomically: on any error
it keeps its previous contents.

Cost: each weight sync writes a fresh file (the in-place rewrite of engines/gguf/inplace.py cannot apply: the
quantizer, not nearpolicy, lays the file out); measured times in docs/models.md ("K-quants").

Test hook: NEARPOLICY_TEST_QUANTIZE_CRASH=SIGNAL (e.g. SIGSEGV) kills the quantizer child with that signal before it
quantizes, so the crash report can be tested without a real fault."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import gguf

from nearpolicy.engines.base import EngineError
from nearpolicy.files import atomic_path
from nearpolicy.signals import exit_description

KQUANTS: dict[str, str] = {  # engine precision -> llama.cpp file type (llama_cpp.LLAMA_FTYPE_*)
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "q4_k_s": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
    "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
}
SOURCE_PRECISION = "f32"  # what the quantizer reads: the trainer's weights unrounded (docs/models.md, "K-quants")
CRASH_HOOK = "NEARPOLICY_TEST_QUANTIZE_CRASH"
_LOG_LINES = 8
_FAILED = 3  # the child's exit code when llama_model_quantize returns an error
_TENSOR = "--- tensor "  # the child's log line per tensor of the file it wrote: name, GGML type id


class QuantizeError(EngineError):
    """llama.cpp's quantizer failed or its child process died; the message names the step, files and log."""


def llama_quantize(source: Path, target: Path, precision: str, threads: int | None = None,
                   timeout_s: float = 1800.0) -> dict[str, str]:
    """Quantize the GGUF at `source` (any float GGUF llama.cpp loads) to `precision` (a KQUANTS key) with llama.cpp's
    quantizer in a child process (`python -m nearpolicy.engines.gguf.kquant`: a fresh interpreter that imports only
    llama_cpp) on `threads` threads (default: every core this process may use), writing `target` atomically.
    Returns GGUF tensor name -> GGML type name of the file written (`tensor_types`). Raises ValueError for an
    unknown precision; FileNotFoundError when `target`'s folder does not exist; QuantizeError (target unchanged) when the quantizer reports failure, the child dies (its
    signal named) or runs past `timeout_s` seconds."""
    if precision not in KQUANTS:
        raise ValueError(f"unknown K-quant {precision!r}; valid: {', '.join(KQUANTS)}")
    from nearpolicy.engines.gguf.quantize import default_threads

    source, target = Path(source), Path(target)
    if not target.parent.is_dir():  # else the error would name the hidden log path beside the target
        raise FileNotFoundError(f"cannot write {target}: its folder {target.parent} does not exist")
    log = target.parent / f".{target.name}.quantize.log"
    step = f"llama.cpp's quantizer (llama_model_quantize, {precision}) on {source.name} -> {target}"
    with atomic_path(target, durable=True) as tmp, open(log, "wb") as log_file:
        command = [sys.executable, "-X", "faulthandler", "-m", __name__, str(source), str(tmp), KQUANTS[precision],
                   str(threads or default_threads())]
        root = str(Path(__file__).resolve().parents[3])  # the folder holding this nearpolicy package
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        try:
            code = child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise QuantizeError(f"{step} ran past {timeout_s:.0f} s and was killed{_log_tail(log)}") from None
        except BaseException:  # KeyboardInterrupt, a stop signal: the child goes with the caller
            child.kill()
            child.wait()
            raise
        if code != 0:
            ended = f"{'died' if code < 0 else 'failed'} ({exit_description(code)})"
            how = "reported failure" if code == _FAILED else ended
            raise QuantizeError(f"{step} {how}; {target.name} is unchanged{_disk_hint(source, target)}"
                                f"{_log_tail(log)}")
        types = _reported_types(log)
    log.unlink(missing_ok=True)
    return types


def _disk_hint(source: Path, target: Path) -> str:
    """"; the disk may be full ..." when the target's file system has less free space than the source's size (the
    quantizer's own message for a full disk is an iostream error), else ""."""
    try:
        free, needed = shutil.disk_usage(target.parent).free, source.stat().st_size
    except OSError:
        return ""
    return f"; the disk may be full ({free / 2**20:.0f} MiB free beside {target.name})" if free < needed else ""


def tensor_types(path: Path) -> dict[str, str]:
    """GGUF tensor name -> GGML type name (e.g. "Q4_K") of every tensor of the GGUF at `path`, in file order
    (gguf-py's reader: seconds on a large vocabulary; the quantizer child reports its file's types itself)."""
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def _reported_types(log: Path) -> dict[str, str]:
    """The child's `_TENSOR name type-id` log lines as GGUF tensor name -> GGML type name, in file order."""
    types = {}
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(_TENSOR):
            name, type_id = line[len(_TENSOR):].split()
            types[name] = gguf.GGMLQuantizationType(int(type_id)).name
    return types


@contextlib.contextmanager
def scratch_path(target: Path) -> Iterator[Path]:
    """A hidden temporary path beside `target` (same file system) for the quantizer's source; removed on exit."""
    fd, name = tempfile.mkstemp(dir=Path(target).parent, prefix=f".{Path(target).name}.", suffix=".source.tmp")
    os.close(fd)
    try:
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)


def _log_tail(log: Path) -> str:
    """'; llama.cpp's log <path> ends: ...' with its last lines (around faulthandler's report after a fault), or ''
    without a log."""
    from nearpolicy.engines.process import tail_lines

    lines = tail_lines(log, _LOG_LINES)
    return f"; llama.cpp's log {log} ends:\n  " + "\n  ".join(lines) if lines else ""


def _main(source: str, target: str, ftype_name: str, threads: str) -> int:
    """The child (`python -X faulthandler -m nearpolicy.engines.gguf.kquant SOURCE TARGET FTYPE THREADS`, stdout and
    stderr to the log): llama_model_quantize. Returns 0 on success, _FAILED when llama.cpp returns an error."""
    if sys.platform.startswith("linux"):  # PR_SET_PDEATHSIG: a killed caller takes its quantizer with it
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))
    print(f"--- nearpolicy quantizer: {source} -> {target} ({ftype_name}, {threads} threads)", flush=True)
    if hook := os.environ.get(CRASH_HOOK):
        os.kill(os.getpid(), signal.Signals[hook])
    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype_name)
    params.nthread = int(threads)
    start = time.perf_counter()
    code = llama_cpp.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params))
    print(f"--- llama_model_quantize returned {code} after {time.perf_counter() - start:.2f} s", flush=True)
    if code != 0:
        return _FAILED
    _print_types(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so", target)
    return 0


class _GGUFInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]  # ggml's struct gguf_init_params


def _print_types(libggml_base: Path, path: str) -> None:
    """A `_TENSOR` line per tensor of the GGUF at `path`, read by ggml's own gguf reader (header only: milliseconds,
    where gguf-py's reader parses the whole vocabulary)."""
    lib = ctypes.CDLL(str(libggml_base))
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, _GGUFInitParams]
    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_get_n_tensors.argtypes, lib.gguf_get_n_tensors.restype = [ctypes.c_void_p], ctypes.c_int64
    lib.gguf_get_tensor_name.argtypes = lib.gguf_get_tensor_type.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_get_tensor_name.restype, lib.gguf_get_tensor_type.restype = ctypes.c_char_p, ctypes.c_int
    lib.gguf_free.argtypes = [ctypes.c_void_p]
    ctx = lib.gguf_init_from_file(path.encode(), _GGUFInitParams(True, None))
    if not ctx:
        raise RuntimeError(f"ggml cannot read back {path}")
    try:
        for i in range(lib.gguf_get_n_tensors(ctx)):
            print(f"{_TENSOR}{lib.gguf_get_tensor_name(ctx, i).decode()} {lib.gguf_get_tensor_type(ctx, i)}")
    finally:
        lib.gguf_free(ctx)
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(_main(*sys.argv[1:]))
