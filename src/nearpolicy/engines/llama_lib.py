"""llama-cpp-python's low-level library, loaded once with its log routed to a file of our choosing, and the queries
of it that need no engine: compiled CPU features, a GGUF's end-of-generation ids."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from nearpolicy.engines.base import EngineError

_LOG_CALLBACK = None  # keeps the log callback alive
_LOG_FD: int | None = None  # where llama.cpp's log goes (None: dropped)
_LOG_MIN_LEVEL = 2  # ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continuation of the previous line
_GGML_LOG_CONT = 5


def load_lib():
    """The llama_cpp module, its backend initialised and its log routed through `set_log_file` (first call)."""
    import llama_cpp  # lazy: the dependency is heavy and optional for pure-math users

    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = llama_cpp.llama_log_callback(_log_line)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p())
        llama_cpp.llama_backend_init()
    return llama_cpp


def _log_line(level, text, user) -> None:
    if _LOG_FD is not None and text and (level >= _LOG_MIN_LEVEL or level == _GGML_LOG_CONT and _LOG_MIN_LEVEL <= 2):
        os.write(_LOG_FD, text)


def set_log_file(fd: int | None, min_level: int = 2) -> None:
    """Send llama.cpp's own log to the open file descriptor `fd` (None: drop it, the default), from ggml log level
    `min_level` up (2 info, 3 warnings, 4 errors; debug, thousands of lines per load, is never written)."""
    global _LOG_FD, _LOG_MIN_LEVEL
    _LOG_FD, _LOG_MIN_LEVEL = fd, max(min_level, 2)
    load_lib()


def system_info() -> str:
    """llama.cpp's compiled CPU features, e.g. "CPU : SSE3 = 1 | AVX2 = 1 | ... | REPACK = 1 |"."""
    return load_lib().llama_print_system_info().decode(errors="replace").strip()


def is_eog(vocab, token: int) -> bool:
    """llama_vocab_is_eog: does `token` end a response in the loaded llama.cpp `vocab`."""
    return bool(load_lib().llama_vocab_is_eog(vocab, token))


def eog_ids(vocab) -> frozenset[int]:
    """llama_vocab_is_eog over the whole vocabulary of a loaded llama.cpp vocab."""
    lib = load_lib()
    return frozenset(t for t in range(lib.llama_vocab_n_tokens(vocab)) if lib.llama_vocab_is_eog(vocab, t))


def eog_token_ids(gguf_path: Path) -> frozenset[int]:
    """Every token id llama.cpp ends a response on (llama_vocab_is_eog over the whole vocabulary) for the GGUF at
    `gguf_path`, loaded vocabulary-only (a metadata-only GGUF from engines.gguf.export.export_vocab_gguf will do). For
    SmolLM2: {0 <|endoftext|>, 2 <|im_end|>, 4 <reponame>}. Raises EngineError when llama.cpp cannot load it."""
    lib = load_lib()
    params = lib.llama_model_default_params()
    params.vocab_only = True
    model = lib.llama_model_load_from_file(str(gguf_path).encode(), params)
    if not model:
        raise EngineError(f"llama.cpp could not load the vocabulary of {gguf_path}")
    try:
        vocab = lib.llama_model_get_vocab(model)
        return eog_ids(vocab)
    finally:
        lib.llama_model_free(model)
