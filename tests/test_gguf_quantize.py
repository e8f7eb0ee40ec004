"""Threaded GGUF quantization (engines/gguf/quantize.py): the same bytes as gguf-py's single-threaded quantizer for
every export precision, through ggml's quantizer and through the gguf-py fallback, whatever the chunking and thread
count."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from nearpolicy.engines.gguf import quantize as gguf_quantize
from nearpolicy.engines.gguf.export import QTYPES, TENSOR_PRECISIONS


def _weights(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    w[0] = 0.0  # an all-zero row: d = 0, id = 0
    w[1, :32] = np.float32(0.5) * np.arange(32, dtype=np.float32)  # exact halves after scaling: the rounding ties
    w[2] *= 1e4
    return w


@pytest.fixture(params=["ggml", "gguf-py"])
def route(request, monkeypatch) -> str:
    if request.param == "ggml":
        assert gguf_quantize.ggml() is not None  # llama-cpp-python is a dependency: its ggml must load
    else:
        monkeypatch.setattr(gguf_quantize, "_ggml_lib", [None])
        monkeypatch.setattr(gguf_quantize, "CHUNK_BLOCKS", 5)  # many chunks, the last one short
    return request.param


@pytest.mark.parametrize("precision", [*TENSOR_PRECISIONS, "q5_1"])  # q5_1: in gguf_quantize's ggml set, not exported
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threaded_quantization_gives_gguf_py_bytes(precision: str, threads: int, route: str) -> None:
    qtype = QTYPES[precision][0] if precision in QTYPES else gguf.GGMLQuantizationType[precision.upper()]
    w = _weights(37, 64, seed=threads)
    got = gguf_quantize.quantize(w, qtype, threads=threads)
    want = gguf.quants.quantize(w, qtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_three_dimensional_weight_keeps_leading_dimensions(route: str) -> None:
    w = np.random.default_rng(0).standard_normal((3, 5, 64)).astype(np.float32)
    got = gguf_quantize.quantize(w, gguf.GGMLQuantizationType.Q8_0, threads=2)
    assert got.shape == (3, 5, 2 * 34)
    assert np.array_equal(got, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0))


def test_row_length_not_a_multiple_of_the_block_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        gguf_quantize.quantize(np.zeros((4, 48), np.float32), gguf.GGMLQuantizationType.Q4_1)


def test_zero_rows_and_types_without_a_reference_quantizer(route: str) -> None:
    empty = gguf_quantize.quantize(np.zeros((0, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    assert empty.shape == (0, 68) and empty.dtype == np.uint8
    with pytest.raises(ValueError, match="no quantizer for I8"):  # ggml's own assert would abort the process
        gguf_quantize.quantize(np.zeros((2, 64), np.float32), gguf.GGMLQuantizationType.I8)


def test_a_forked_child_quantizes_on_its_own_threads() -> None:
    """The thread pool does not survive a fork: a child that inherited it would wait forever on threads it lacks."""
    import os
    import signal

    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    gguf_quantize.quantize(w, gguf.GGMLQuantizationType.Q8_0, threads=2)  # the pool exists in the parent
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        signal.alarm(20)
        ok = np.array_equal(gguf_quantize.quantize(w, gguf.GGMLQuantizationType.Q8_0, threads=2),
                            gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0))
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_llama_cpp_that_cannot_load_leaves_the_gguf_py_route(monkeypatch) -> None:
    import sys
    import types

    broken = types.ModuleType("llama_cpp")

    def fail(name):
        raise RuntimeError("Failed to load shared library 'libllama.so'")

    broken.__getattr__ = fail  # as llama_cpp raises when its library cannot load
    monkeypatch.setitem(sys.modules, "llama_cpp", broken)
    monkeypatch.setattr(gguf_quantize, "_ggml_lib", [])
    w = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    assert gguf_quantize.ggml() is None
    assert np.array_equal(gguf_quantize.quantize(w, gguf.GGMLQuantizationType.Q4_1),
                          gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1))
