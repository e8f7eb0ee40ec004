"""Precision alignment: the trainer's forward computes what the quantized llama.cpp engine computes.

`align_model(model, precision, tensor_precision, kv_cache)` patches a transformers Llama model in place,
reversibly (`Alignment.remove()`; the state dict, parameter names and optimizer state are untouched):
- every nn.Linear whose engine weight is not f32 runs on the engine's dequantized weight (the GGUF exporter's
  quantize -> dequantize, gguf-py, bit for bit what llama.cpp reads) and on activations rounded to that weight
  type's `vec_dot_type` (ops/ggml_quant.py, the AVX2 rule of the pinned build); q4_1 adds the q8_1 block-sum term;
- the embedding lookup reads the dequantized embedding table (`ggml_get_rows` dequantizes the row); the tied LM
  head multiplies with the same table at token_embd's type, as llama.cpp does when the GGUF has no output.weight;
- with an f16 KV cache, attention rounds K and V to f16 (`ggml_cpy` into the cache, llama-context / llama-graph
  `build_attn_mha`), and Q and the softmax probabilities to f16: without flash attention, `kq = mul_mat(k, q)`
  and `kqv = mul_mat(v, kq)` have an f16 first operand, so ggml converts the f32 second operand to f16 (F16's
  vec_dot_type; llamafile sgemm on AVX2 takes F16 x F16 only, ggml-cpu/llamafile/sgemm.cpp `llamafile_sgemm`).
Every rounding is a straight-through estimator: gradients reach the fp32 master weights as if unrounded.
Precision map: the same selectors as engine.tensor_precision (engines/gguf/precision_map.py via
engines.gguf.export.tensor_precision); a row length that is not a multiple of the block size is F16, as the exporter
stores it. Not emulated: float summation order (llama.cpp's block-wise sums, tinyBLAS tiles), llama.cpp's RoPE and
softmax arithmetic (both float32, equal up to rounding), flash attention (engine.flash_attention = true is refused).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from nearpolicy.engines.gguf.rounding import check_rounding, rounding_input
from nearpolicy.engines.gguf.export import QTYPES, tensor_precision as _gguf_precision
from nearpolicy.engines.gguf.quantize import quantize
from nearpolicy.engines.gguf.precision_map import PrecisionMap
from nearpolicy.ops.ggml_quant import (
    activation_format, fake_quant_activation, q8_1_sum_residual, rope_cos_sin, round_fp16, straight_through,
)

ATTENTION_NAME = "nearpolicy_engine_f16kv"
KV_CACHE_TYPES = ("f16", "f32")


@dataclass
class _EngineWeight:
    """One weight's engine form, recomputed when the master parameter changes (its in-place version counter)."""

    precision: str
    rounding: str = "nearest"
    seed: int = 0
    version: int = -1
    dequantized: torch.Tensor | None = None  # [out, in] float32
    mins: torch.Tensor | None = None  # [out, in / 32] float32: q4_1 block minima (q8_1 sum term), else None

    def refresh(self, weight: torch.Tensor) -> None:
        if self.version == weight._version and self.dequantized is not None:
            return
        self.dequantized, self.mins = engine_weight(weight.detach(), self.precision, self.rounding, self.seed)
        self.version = weight._version


def engine_weight(weight: torch.Tensor, precision: str, rounding: str = "nearest",
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The dequantized weight llama.cpp reads for a `precision` GGUF tensor (float32 [out, in], gguf-py's
    quantize then dequantize, as engines/gguf/export.py writes it under `rounding` seeded by `seed`), and for q4_1
    the block minima m [out, in / 32] (float32; the fp16 `m` of each block_q4_1), else None. Raises ValueError
    (unknown precision or rounding)."""
    if precision not in QTYPES:
        raise ValueError(f"unknown GGUF precision {precision!r}; valid: {', '.join(QTYPES)}")
    check_rounding(rounding, (precision,))
    qtype = QTYPES[precision][0]
    w = np.ascontiguousarray(weight.to("cpu", torch.float32).numpy())
    if precision == "f32":
        return weight.to(torch.float32), None
    w = rounding_input(w, precision, rounding, seed)  # the exporter's draw: same seed, same bytes
    packed = quantize(w, qtype)
    deq = torch.from_numpy(gguf.quants.dequantize(packed, qtype).reshape(w.shape).astype(np.float32))
    mins = None
    if precision == "q4_1":  # block_q4_1 = {fp16 d, fp16 m, uint8 qs[16]}: 20 bytes per 32 weights
        blocks = packed.reshape(w.shape[0], -1, 20)
        mins = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32))
    return deq, mins


def module_precisions(model: torch.nn.Module, precision: str, tensor_precision: PrecisionMap = ()) -> dict[str, str]:
    """HF module name -> the GGUF type the exporter stores its weight at, for every nn.Linear and nn.Embedding of
    `model` (a transformers llama). The tied LM head gets token_embd's type; a row length that is not a multiple
    of the type's block size gets f16 (gguf_export's fallback). Raises ValueError (a module with no GGUF name)."""
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    head = model.get_output_embeddings()
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        hf_name = f"{name}.weight"
        if tied and module is head:
            embed = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
            hf_name = f"{embed}.weight"
        chosen = _gguf_precision(hf_name, config, precision, tuple(tensor_precision))
        block = gguf.GGML_QUANT_SIZES[QTYPES[chosen][0]][0]
        out[name] = "f16" if module.weight.shape[-1] % block else chosen
    return out


@dataclass
class Alignment:
    """Handle of an aligned model: which modules run at which engine type; `remove()` restores the plain forward."""

    model: torch.nn.Module
    precisions: dict[str, str]
    kv_cache: str
    _previous_attention: str | None = None
    _patched: list[torch.nn.Module] = field(default_factory=list)

    def remove(self) -> None:
        for module in self._patched:
            del module.forward  # the instance attribute set by align_model; the class forward shows again
        self._patched.clear()
        if self._previous_attention is not None:
            self.model.config._attn_implementation = self._previous_attention
            self._previous_attention = None
        if getattr(self.model, "_nearpolicy_alignment", None) is self:
            del self.model._nearpolicy_alignment

    def __enter__(self) -> "Alignment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


ALIGNED_ARCHITECTURES = ("llama",)  # transformers model_type whose llama.cpp graph this module emulates


def align_model(model: torch.nn.Module, precision: str, tensor_precision: PrecisionMap = (),
                kv_cache: str = "f16", rounding: str = "nearest", seed: int = 0) -> Alignment:
    """Make `model` (a transformers llama, float32) compute what a llama.cpp engine on its `precision` export
    (with `tensor_precision` overrides, a `kv_cache` KV cache, "f16" or "f32", and the export's `rounding`
    seeded by `seed`, engine.export_rounding / run.seed) computes; module docstring.
    Returns the handle that undoes it. Raises ValueError (unknown precision / kv_cache / rounding, a type the rounding
    does not cover, model not float32, already aligned, a scaled RoPE). The dequantized weights are cached by each parameter's in-place version counter
    (torch's default AdamW bumps it; a fused optimizer or a .data copy would not: not supported)."""
    if kv_cache not in KV_CACHE_TYPES:
        raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHE_TYPES)}, got {kv_cache!r}")
    if model.config.model_type not in ALIGNED_ARCHITECTURES:
        raise ValueError(f"precision alignment emulates llama.cpp's {', '.join(ALIGNED_ARCHITECTURES)} graph; this "
                         f"model is {model.config.model_type}")
    if getattr(model, "_nearpolicy_alignment", None) is not None:
        raise ValueError("model is already aligned: remove() the previous Alignment first")
    rope = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"precision alignment emulates llama.cpp's plain RoPE; this model uses rope_type "
                         f"{rope.get('rope_type', rope.get('type'))!r} (scaled RoPE is not emulated)")
    if model.get_input_embeddings().weight.dtype != torch.float32:
        raise ValueError(f"precision alignment needs float32 master weights, got {model.get_input_embeddings().weight.dtype}")
    handle = Alignment(model, module_precisions(model, precision, tensor_precision), kv_cache)
    check_rounding(rounding, set(handle.precisions.values()))  # now, not at the first forward
    modules = dict(model.named_modules())
    for name, weight_type in handle.precisions.items():
        if weight_type == "f32":
            continue
        module = modules[name]
        state = _EngineWeight(weight_type, rounding, seed)
        patch = _embedding_forward if isinstance(module, torch.nn.Embedding) else _linear_forward
        module.forward = functools.partial(patch, module, state)
        handle._patched.append(module)
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is not None:
        rotary.forward = functools.partial(_rope_forward, model.config)
        handle._patched.append(rotary)
    if kv_cache == "f16":
        _register_attention()
        handle._previous_attention = model.config._attn_implementation
        model.config._attn_implementation = ATTENTION_NAME
    model._nearpolicy_alignment = handle
    return handle


def _linear_forward(module: torch.nn.Linear, state: _EngineWeight, x: torch.Tensor) -> torch.Tensor:
    """y = x_hat W_deq^T (+ bias) (+ the q8_1 block-sum term), both roundings straight-through."""
    state.refresh(module.weight)
    fmt = activation_format(state.precision)
    x_hat = straight_through(x, fake_quant_activation(x, fmt))
    y = F.linear(x_hat, straight_through(module.weight, state.dequantized), module.bias)
    if state.mins is not None:  # ggml_vec_dot_q4_1_q8_1: + sum_b m_b (s_b - fp16(d_b) sum q_b), a constant for autograd
        with torch.no_grad():
            block_sum_term = q8_1_sum_residual(x.detach()) @ state.mins.T
        y = y + block_sum_term  # outside no_grad: y keeps its graph (inside it, q4_1 layers passed no gradient)
    return y


def _rope_forward(config: Any, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, T, head_dim] as llama.cpp's RoPE computes them (ops/ggml_quant.rope_cos_sin)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    base = rope.get("rope_theta", getattr(config, "rope_theta", None))
    cos, sin = rope_cos_sin(position_ids, head_dim, float(base))
    return cos.to(x.dtype), sin.to(x.dtype)


def _embedding_forward(module: torch.nn.Embedding, state: _EngineWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows of the dequantized table (ggml_get_rows), gradient onto the fp32 table."""
    state.refresh(module.weight)
    return F.embedding(ids, straight_through(module.weight, state.dequantized), module.padding_idx)


def engine_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's attention with an f16 KV cache, without flash attention (llama-graph `build_attn_mha`):
    K, V and Q rounded to f16, scores = Q K^T * scaling + mask in float32, softmax in float32, the probabilities
    rounded to f16, times V. query [B, H, Tq, D], key / value [B, Hkv, Tk, D] (float32, after RoPE and the cache),
    attention_mask: None (causal, queries at the last Tq positions), bool [B|1, 1, Tq, Tk] (True = attend) or an
    additive float mask. Returns (output [B, Tq, H, D], probabilities [B, H, Tq, Tk]) as transformers'
    attention functions do. Dropout is refused (ValueError): the engine has none."""
    if dropout:
        raise ValueError("precision-aligned attention runs without dropout (config.attention_dropout must be 0)")
    groups = query.shape[1] // key.shape[1]
    q = straight_through(query, round_fp16(query.detach()))
    k = straight_through(key, round_fp16(key.detach())).repeat_interleave(groups, dim=1)
    v = straight_through(value, round_fp16(value.detach())).repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    if attention_mask is None:
        tq, tk = scores.shape[-2:]
        allowed = torch.ones(tq, tk, dtype=torch.bool).tril(diagonal=tk - tq)
        scores = scores.masked_fill(~allowed, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[..., : scores.shape[-1]], float("-inf"))
    else:
        scores = scores + attention_mask[..., : scores.shape[-1]]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    probs16 = straight_through(probs, round_fp16(probs.detach()))
    return torch.matmul(probs16, v).transpose(1, 2).contiguous(), probs


@functools.lru_cache(maxsize=1)
def _register_attention() -> None:
    """Register `engine_attention` (and transformers' additive eager mask for it) under ATTENTION_NAME, once."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION_NAME, engine_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)
