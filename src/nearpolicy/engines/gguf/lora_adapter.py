"""A LoRA adapter as a GGUF LoRA adapter file that llama.cpp loads beside its base model (llama_adapter_lora_init).

What llama.cpp's convert_lora_to_gguf.py writes (ggml-org/llama.cpp, the script vendored in llama-cpp-python
0.3.36), and what its loader (src/llama-adapter.cpp) reads:
- metadata: general.architecture = the base model's ("llama", "gemma3": engines/gguf/architectures.py; llama.cpp
  refuses any other), general.type = "adapter",
  adapter.type = "lora", adapter.lora.alpha (float32);
- per adapted base tensor "<GGUF name>" two tensors, "<GGUF name>.lora_a" = PEFT's lora_A [r, in] and
  "<GGUF name>.lora_b" = PEFT's lora_B [out, r] (numpy row-major, so ggml ne = [in, r] and [r, out]: the loader
  checks a.ne[0] == base.ne[0], b.ne[1] == base.ne[1], a.ne[1] == b.ne[0]);
- for llama's attn_q / attn_k, lora_b's rows permuted as the base's q / k rows are (the script's
  LoraTorchTensor.permute moves only B when the last axis stays; the exporter's `_permute` is the same reordering);
  gemma3 stores its projections as they are (its norm shift touches no adapted tensor).
llama.cpp adds scale * B (A x) to the base matmul with scale = alpha / r (r = b.ne[0]; `llama_adapter_lora_weight::
get_scale`, adapter scale 1.0), PEFT's scaling for use_rslora = false. Tensors are written at F32 (the script's
default --outtype), so the adapter reaches the engine unrounded."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from nearpolicy.engines.gguf.architectures import ArchSpec, arch_spec
from nearpolicy.files import atomic_path

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The llama projections an adapter may target (PEFT's and transformers' spelling; [lora] target_modules)."""


def adapter_arrays(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]],
                   config: Any) -> list[tuple[str, np.ndarray]]:
    """(GGUF tensor name, float32 array) pairs exactly as export_lora_gguf writes them: per HF base weight name
    (e.g. "model.layers.0.self_attn.q_proj.weight") with (lora_A [r, in], lora_B [out, r]), "<name>.lora_a" = A and
    "<name>.lora_b" = B, B's rows transformed as the base's (llama: permuted for q_proj by num_attention_heads and
    k_proj by num_key_value_heads; gemma3: as they are), in the canonical block order. Raises ValueError for an architecture without GGUF LoRA support, a name its map
    does not know or that is no projection, or shapes that do not chain (A's rank != B's)."""
    spec = _lora_spec(config)
    out = []
    for hf_name, (a, b) in adapters.items():
        kind, name = spec.gguf_tensor(hf_name, config.num_hidden_layers)
        if kind not in spec.lora_kinds:
            raise ValueError(f"{hf_name}: a GGUF LoRA adapter targets projections only, not {kind.name}")
        a = a.detach().to("cpu", torch.float32).numpy()
        b = b.detach().to("cpu", torch.float32).numpy()
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{hf_name}: lora_A {a.shape} and lora_B {b.shape} do not chain (rank mismatch)")
        b = spec.to_gguf(b, kind, config)  # B's rows are the base weight's: the same row transform
        out += [(name + ".lora_a", np.ascontiguousarray(a)), (name + ".lora_b", np.ascontiguousarray(b))]
    return sorted(out, key=lambda item: _block_order(item[0]))


def export_lora_gguf(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], config: Any, out_path: Path,
                     alpha: float) -> float:
    """Write `adapters` (HF base weight name -> (lora_A [r, in], lora_B [out, r]), any float dtype) as a GGUF LoRA
    adapter at `out_path` (module docstring), atomically (a temp file beside it, renamed over it: an
    engine may be reading the previous one). `alpha`: PEFT's lora_alpha (llama.cpp scales by alpha / r). Returns
    the seconds the write took. Raises ValueError as adapter_arrays; OSError from the write."""
    start = time.perf_counter()
    writer = gguf.GGUFWriter(path=None, arch=_lora_spec(config).name)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    for name, array in adapter_arrays(adapters, config):
        writer.add_tensor(name, array, raw_dtype=gguf.GGMLQuantizationType.F32)
    try:
        with atomic_path(Path(out_path)) as tmp:
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
    finally:
        writer.close()
    return time.perf_counter() - start


def _lora_spec(config: Any) -> ArchSpec:
    """The config's ArchSpec; ValueError when it has no GGUF LoRA support (or as arch_spec)."""
    spec = arch_spec(config)
    if not spec.lora_kinds:
        raise ValueError(f"GGUF LoRA adapters are not supported for the {spec.name} architecture "
                         f"(model_type {spec.model_type})")
    return spec


def _block_order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return (int(parts[1]), name) if parts[0] == "blk" else (-1, name)
