"""A GGUF LoRA adapter loaded into a llama.cpp model and set on its contexts (the llama.cpp engine's adapter sync).

Bindings (llama-cpp-python 0.3.36): `llama_adapter_lora_init(model, path)` reads the whole adapter file into its own
buffers (the file may be replaced afterwards), `llama_set_adapters_lora(ctx, adapters, n, scales)` sets the context's
adapters (the old `llama_set_adapter_lora` is a deprecated wrapper of it), `llama_adapter_lora_free` frees one (a
model frees the adapters still loaded into it when it is freed). Setting an adapter does not touch the KV cache: keys
and values computed under the previous adapter (k_proj / v_proj adapted) stay, so the engine clears every cache after
a swap (checked: tests/test_lora.py, a cached prefix would otherwise keep the old adapter's keys)."""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

from nearpolicy.engines.base import EngineError


class LlamaAdapter:
    """The adapter at `path` loaded into the llama.cpp `model` (a llama_model pointer) through `lib` (the llama_cpp
    module). `seconds`: how long the load took. Raises EngineError naming the file when llama.cpp refuses it (not a
    LoRA adapter, another architecture, shapes that do not fit the model)."""

    def __init__(self, lib, model, path: Path | str):
        start = time.perf_counter()
        self.lib, self.path = lib, Path(path)
        if not self.path.is_file():
            raise EngineError(f"LoRA adapter file not found: {self.path}")
        self.handle = lib.llama_adapter_lora_init(model, str(self.path).encode())
        if not self.handle:
            raise EngineError(f"llama.cpp could not load the LoRA adapter {self.path} (not a llama LoRA GGUF, or its "
                              "tensors do not fit the model; see the engine log)")
        self.seconds = time.perf_counter() - start

    def set_on(self, ctx) -> None:
        """Make this the one adapter of the llama.cpp context `ctx` (scale 1.0: llama.cpp applies alpha / r itself).
        Raises EngineError when llama.cpp refuses."""
        adapters = (self.lib.llama_adapter_lora_p_ctypes * 1)(self.handle)
        scales = (ctypes.c_float * 1)(1.0)
        rc = self.lib.llama_set_adapters_lora(ctx, adapters, 1, scales)
        if rc != 0:
            raise EngineError(f"llama_set_adapters_lora failed with code {rc} for {self.path}")

    def free(self) -> None:
        """Free the adapter (before its model is freed; a second call does nothing)."""
        if self.handle:
            self.lib.llama_adapter_lora_free(self.handle)
        self.handle = None
