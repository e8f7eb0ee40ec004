"""GGUF weight quantization on several cores, the same bytes as gguf-py's `gguf.quants.quantize`.

The quantizer is ggml's own (`ggml_quantize_chunk` in the libggml-base that llama-cpp-python ships, the library the
engine decodes with), called on row ranges from a thread pool: ctypes releases the GIL, so the ranges run in
parallel. Without llama-cpp-python it is gguf-py's row quantizer over chunks of rows (numpy releases the GIL inside
each chunk's array operations). For finite inputs both give gguf-py's bytes (tests; they differ only where a block
holds a NaN, and in the sign of a zero q4_0 / q5_0 scale of an all -0.0 block, which dequantizes to 0 either way).
Measured on SmolLM2-135M's weights at q8_0, 2 threads: gguf-py 1.5 s, chunked gguf-py 0.73 s, ggml 0.39-0.48 s."""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np

CHUNK_BLOCKS = 4096  # gguf-py fallback: quantization blocks per task, enough that numpy, not Python, holds a thread
_Q = gguf.GGMLQuantizationType
_UNQUANTIZED = {_Q.F32, _Q.F16}
_GGML_TYPES = {_Q.BF16, _Q.Q8_0, _Q.Q5_0, _Q.Q5_1, _Q.Q4_0, _Q.Q4_1, _Q.MXFP4}  # checked against gguf-py (tests)
_pools: dict[int, ThreadPoolExecutor] = {}
if hasattr(os, "register_at_fork"):  # a forked child inherits the pools but not their threads
    os.register_at_fork(after_in_child=_pools.clear)
_ggml_lib: list = []  # [the loaded libggml-base, or None when llama-cpp-python is missing]


def default_threads() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def ggml():
    """llama-cpp-python's libggml-base with ggml_quantize_chunk's signature set, or None without llama-cpp-python."""
    if not _ggml_lib:
        try:
            import llama_cpp

            lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
        except Exception:  # noqa: BLE001 - llama_cpp raises RuntimeError when its own library cannot load
            lib = None
        if lib is not None:
            lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
            lib.ggml_quantize_chunk.restype = ctypes.c_size_t
            lib.ggml_quantize_init.argtypes = [ctypes.c_int]
        _ggml_lib.append(lib)
    return _ggml_lib[0]


def quantize(weight: np.ndarray, qtype: gguf.GGMLQuantizationType, threads: int | None = None) -> np.ndarray:
    """The bytes `gguf.quants.quantize(weight, qtype)` gives, computed on `threads` threads (default: every core
    this process may use).

    weight: float32 [..., n]; returns float32 / float16 arrays for F32 / F16 (unchanged shape), else uint8
    [..., n / block_size * type_size]. Raises ValueError when n is not a multiple of the type's block size, or
    for a type gguf-py cannot quantize."""
    if qtype in _UNQUANTIZED:
        return gguf.quants.quantize(weight, qtype)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if weight.ndim == 0 or weight.shape[-1] % block:
        raise ValueError(f"cannot quantize a tensor of shape {weight.shape} to {qtype.name}: the last dimension "
                         f"must be a multiple of {block}")
    rows = np.ascontiguousarray(weight, dtype=np.float32).reshape(-1, weight.shape[-1])
    out = np.empty((rows.shape[0], weight.shape[-1] // block * type_size), dtype=np.uint8)
    if rows.shape[0] == 0:
        return out.reshape(*weight.shape[:-1], out.shape[-1])
    lib = ggml() if qtype in _GGML_TYPES else None
    if lib is not None:
        lib.ggml_quantize_init(int(qtype))
        _in_parallel(_ggml_rows(lib, qtype, rows, out), rows.shape[0], -(-rows.shape[0] // 8), threads)
    else:
        quantizer = getattr(gguf.quants, qtype.name, None)
        if quantizer is None or not hasattr(quantizer, "quantize_rows"):
            raise ValueError(f"gguf-py has no quantizer for {qtype.name}")

        def run(start: int, stop: int) -> None:
            out[start:stop] = quantizer.quantize_rows(rows[start:stop])

        _in_parallel(run, rows.shape[0], max(1, CHUNK_BLOCKS * block // weight.shape[-1]), threads)
    return out.reshape(*weight.shape[:-1], out.shape[-1])


def _ggml_rows(lib, qtype: gguf.GGMLQuantizationType, rows: np.ndarray, out: np.ndarray):
    def run(start: int, stop: int) -> None:  # rows [start, stop) of `rows` into the same rows of `out`
        lib.ggml_quantize_chunk(int(qtype), rows.ctypes.data, out.ctypes.data, start * rows.shape[1], stop - start,
                                rows.shape[1], None)
    return run


def _in_parallel(run, n_rows: int, step: int, threads: int | None) -> None:
    """run(start, stop) over [0, n_rows) in ranges of `step` rows, on `threads` threads."""
    ranges = [(start, min(n_rows, start + step)) for start in range(0, n_rows, step)]
    threads = threads or default_threads()
    if threads == 1 or len(ranges) == 1:
        for start, stop in ranges:
            run(start, stop)
        return
    pool = _pools.get(threads) or _pools.setdefault(threads, ThreadPoolExecutor(threads, "gguf-quantize"))
    for done in [pool.submit(run, start, stop) for start, stop in ranges]:
        done.result()
