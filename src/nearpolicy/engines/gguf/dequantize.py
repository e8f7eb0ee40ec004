"""A GGUF's tensors as the trainer's float32 weights: what the engine computes with, bit for bit.

Each tensor of the file is dequantized with gguf-py (`gguf.quants.dequantize`: the reference dequantizer, d * q
(+ m) per block in float32, the same values llama.cpp's `dequantize_row_*` give), the architecture's value
transform is undone (engines/gguf/architectures.py: llama's q / k row permutation, a pure reordering; gemma3's
norm shift, GGUF - 1 in float32, what transformers' GGUF loader computes) and the GGUF name is mapped back to the
Hugging Face name the exporter mapped it from (gguf-py's TensorNameMap). The frozen base of a LoRA run is read this
way from the engine's own GGUF (docs/lora.md), so trainer and engine hold the same numbers for every tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from nearpolicy.engines.gguf import architectures
from nearpolicy.engines.gguf.architectures import arch_spec

unpermute = architectures.unpermute  # llama's q / k unpermutation, still importable from here (tests)


def gguf_names(hf_names: list[str], config: Any) -> dict[str, str]:
    """HF tensor name -> GGUF tensor name (gguf-py's TensorNameMap for the config's architecture, as the exporter
    maps them); the tied lm_head and rotary buffers are left out. Raises ValueError for an unsupported model_type
    or a name the map does not know."""
    return {hf_name: name for hf_name, (_, name) in _gguf_tensors(hf_names, config).items()}


def _gguf_tensors(hf_names: list[str], config: Any) -> dict[str, tuple[gguf.MODEL_TENSOR, str]]:
    spec = arch_spec(config)
    out = {}
    for hf_name in hf_names:
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        if hf_name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        out[hf_name] = spec.gguf_tensor(hf_name, config.num_hidden_layers)
    return out


def read_gguf_weights(path: Path, config: Any, hf_names: list[str]) -> dict[str, torch.Tensor]:
    """HF name -> float32 tensor (HF layout, [out, in] for weights) of every name in `hf_names`, read from the GGUF
    at `path`: dequantized (gguf.quants.dequantize), the architecture's transform undone (llama: q / k rows
    unpermuted by config.num_attention_heads / num_key_value_heads; gemma3: norms minus 1), the weights
    transformers' GGUF loader gives. Raises ValueError for an unsupported model_type, or naming the file when a
    tensor is missing or has another element count than the name's HF shape allows."""
    spec = arch_spec(config)
    wanted = _gguf_tensors(hf_names, config)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    out = {}
    for hf_name, (kind, name) in wanted.items():
        if name not in tensors:
            raise ValueError(f"{path} has no tensor {name} (for {hf_name})")
        t = tensors[name]
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF ne order is reversed
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        w = spec.from_gguf(w, kind, config)
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
