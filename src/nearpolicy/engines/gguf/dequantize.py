"""A llama GGUF's tensors as the trainer's float32 weights: what the engine computes with, bit for bit.

Each tensor of the file is dequantized with gguf-py (`gguf.quants.dequantize`: the reference dequantizer, d * q
(+ m) per block in float32, the same values llama.cpp's `dequantize_row_*` give), llama.cpp's q / k row permutation
is undone (the inverse of engines/gguf/export._permute, a pure reordering) and the GGUF name is mapped back to the
Hugging Face name the exporter mapped it from (gguf-py's TensorNameMap). The frozen base of a LoRA run is read this
way from the engine's own GGUF (docs/lora.md), so trainer and engine hold the same numbers for every tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of export._permute: llama.cpp's q / k row order back to Hugging Face's (per head, the two rotary
    halves de-interleaved). w: [rows, cols] or [rows]; a reordering, no arithmetic."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_names(hf_names: list[str], config: Any) -> dict[str, str]:
    """HF tensor name -> llama GGUF tensor name (gguf-py's TensorNameMap, as the exporter maps them); the tied
    lm_head and rotary buffers are left out. Raises ValueError for a name the map does not know."""
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    out = {}
    for hf_name in hf_names:
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        if hf_name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"cannot map tensor {hf_name!r} to a llama GGUF tensor name")
        out[hf_name] = name
    return out


def read_gguf_weights(path: Path, config: Any, hf_names: list[str]) -> dict[str, torch.Tensor]:
    """HF name -> float32 tensor (HF layout, [out, in] for weights) of every name in `hf_names`, read from the GGUF
    at `path`: dequantized (gguf.quants.dequantize), q / k rows unpermuted (config.num_attention_heads /
    num_key_value_heads). Raises ValueError naming the file when a tensor is missing or has another element
    count than the name's HF shape allows."""
    wanted = gguf_names(hf_names, config)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    out = {}
    for hf_name, name in wanted.items():
        if name not in tensors:
            raise ValueError(f"{path} has no tensor {name} (for {hf_name})")
        t = tensors[name]
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF ne order is reversed
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        if hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            w = unpermute(w, n_head)
        elif hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            w = unpermute(w, n_kv)
        out[hf_name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # a copy: the file is mapped
    return out


def load_gguf_weights(model: torch.nn.Module, path: Path) -> list[str]:
    """Copy the GGUF at `path`'s dequantized tensors (read_gguf_weights) into `model`'s parameters of the same HF
    names, in place (float32 values; the parameters keep their dtype). Returns the names loaded. Raises ValueError
    when a tensor's shape differs from the parameter's, or as read_gguf_weights."""
    state = model.state_dict()
    weights = read_gguf_weights(path, model.config, list(state))
    with torch.no_grad():
        for name, w in weights.items():
            if tuple(w.shape) != tuple(state[name].shape):
                raise ValueError(f"{path}: tensor for {name} has shape {tuple(w.shape)}, the model's is "
                                 f"{tuple(state[name].shape)}")
            state[name].copy_(w)
    return list(weights)
