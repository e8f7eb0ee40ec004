"""What the GGUF path needs to know per model architecture, keyed by the HF config's model_type.

An `ArchSpec` names the GGUF architecture (gguf-py's MODEL_ARCH: its TensorNameMap maps the HF tensor names), the
value transform per GGUF tensor kind on the way into the file and its inverse on the way out, and how the
`{arch}.*` hyper-parameter keys are written from the HF config (refusing configs llama.cpp would compute
differently). Everything else (tokenizer, file layout, quantization) is architecture-independent.

- llama: llama.cpp's convert_hf_to_gguf.py permutes the q / k rows (per head, the two rotary halves interleaved);
  transformers undoes it on GGUF load.
- gemma3_text: Gemma's RMSNorm scales by (1 + w); the GGUF stores 1 + w for every norm (attn_norm,
  post_attention_norm, ffn_norm, post_ffw_norm, attn_q_norm, attn_k_norm, output_norm) and transformers' GGUF
  loader subtracts 1 (Gemma2TensorProcessor). Checked on gemma-3-270m: each HF weight is GGUF - 1 and GGUF is
  HF + 1, float32 bit for bit. No q / k permutation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

_T = gguf.MODEL_TENSOR
Transform = Callable[[np.ndarray, "gguf.MODEL_TENSOR", Any], np.ndarray]


@dataclass(frozen=True)
class ArchSpec:
    """One architecture of the GGUF path. `to_gguf(w, kind, config)` maps an HF-layout float32 array of tensor kind
    `kind` to what the GGUF stores, `from_gguf` is its inverse (both return float32 of w's shape; an unchanged
    kind is returned as is); `add_keys(writer, config)` writes the `{arch}.*` keys (raising NotImplementedError
    for a config llama.cpp would not compute alike); `lora_kinds`: the tensor kinds a GGUF LoRA adapter may target
    (`to_gguf` is a row reordering or the identity on them; empty: no adapter support)."""

    model_type: str
    arch: gguf.MODEL_ARCH
    to_gguf: Transform
    from_gguf: Transform
    add_keys: Callable[[gguf.GGUFWriter, Any], None]
    lora_kinds: frozenset = frozenset()

    @property
    def name(self) -> str:
        """The GGUF general.architecture string, e.g. "llama", "gemma3"."""
        return gguf.MODEL_ARCH_NAMES[self.arch]

    def gguf_tensor(self, hf_name: str, n_layers: int) -> tuple[gguf.MODEL_TENSOR, str]:
        """(tensor kind, GGUF name) of the HF tensor `hf_name`. Raises ValueError for a name the map does not know."""
        found = _name_map(self.arch, n_layers).get_type_and_name(hf_name, try_suffixes=(".weight", ".bias"))
        if found is None:
            raise ValueError(f"cannot map tensor {hf_name!r} to a {self.name} GGUF tensor name")
        return found


@functools.lru_cache(maxsize=16)
def _name_map(arch: gguf.MODEL_ARCH, n_layers: int) -> gguf.TensorNameMap:
    return gguf.get_tensor_name_map(arch, n_layers)


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, interleave the two rotary halves. w: [rows, cols] or [rows]."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute`: llama.cpp's q / k row order back to Hugging Face's (per head, the two rotary
    halves de-interleaved). w: [rows, cols] or [rows]; a reordering, no arithmetic."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _heads(kind: gguf.MODEL_TENSOR, config: Any) -> int | None:
    """The head count whose rows are permuted for `kind` (q: attention heads, k: KV heads), else None."""
    if kind == _T.ATTN_Q:
        return config.num_attention_heads
    if kind == _T.ATTN_K:
        return getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return None


def _llama_to(w: np.ndarray, kind: gguf.MODEL_TENSOR, config: Any) -> np.ndarray:
    n = _heads(kind, config)
    return w if n is None else permute(w, n)


def _llama_from(w: np.ndarray, kind: gguf.MODEL_TENSOR, config: Any) -> np.ndarray:
    n = _heads(kind, config)
    return w if n is None else unpermute(w, n)


def _llama_keys(writer: gguf.GGUFWriter, config: Any) -> None:
    rope = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise NotImplementedError(f"rope scaling {rope_type!r} is not exported to GGUF")
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("config has no rope_theta")
    n_head = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or n_head)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // n_head:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)


_GEMMA_NORMS = frozenset({_T.ATTN_NORM, _T.ATTN_POST_NORM, _T.FFN_PRE_NORM, _T.FFN_POST_NORM, _T.ATTN_Q_NORM,
                          _T.ATTN_K_NORM, _T.OUTPUT_NORM})
_ONE = np.float32(1)


def _gemma_to(w: np.ndarray, kind: gguf.MODEL_TENSOR, config: Any) -> np.ndarray:
    return (w + _ONE).astype(np.float32, copy=False) if kind in _GEMMA_NORMS else w


def _gemma_from(w: np.ndarray, kind: gguf.MODEL_TENSOR, config: Any) -> np.ndarray:
    return (w - _ONE).astype(np.float32, copy=False) if kind in _GEMMA_NORMS else w


# What llama.cpp's gemma3 loader assumes when the file has no key for it (checked by running the pinned library: a
# model off these defaults gives the transformers log-probs only with the key written).
_SWA_BASE_DEFAULT = 10000.0  # rope.freq_base_swa: the sliding layers' rope base
_SWA_PERIOD_DEFAULT = 6  # attention.sliding_window_pattern: every 6th layer full attention


def _gemma3_keys(writer: gguf.GGUFWriter, config: Any) -> None:
    """The keys (and order) of the gemma3 GGUFs llama.cpp's convert_hf_to_gguf.py writes (gemma-3-270m's), plus
    rope.freq_base_swa, attention.sliding_window_pattern and final_logit_softcapping where the config is off
    llama.cpp's defaults for them."""
    full_theta, local_theta = _gemma3_check(config)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(float(full_theta))
    writer.add_sliding_window(config.sliding_window)
    writer.add_head_count_kv(config.num_key_value_heads)
    if local_theta != _SWA_BASE_DEFAULT:
        writer.add_rope_freq_base_swa(float(local_theta))
    sliding = [t == "sliding_attention" for t in config.layer_types]
    if sliding != [(i + 1) % _SWA_PERIOD_DEFAULT != 0 for i in range(config.num_hidden_layers)]:
        writer.add_sliding_window_pattern(sliding)  # True: a sliding-window layer
    if getattr(config, "final_logit_softcapping", None) is not None:
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))


def _gemma3_check(config: Any) -> tuple[float, float]:
    """(full, sliding) attention rope bases; raises NotImplementedError for what llama.cpp's gemma3 graph computes
    differently from transformers and reads no key for."""
    rope = getattr(config, "rope_parameters", None) or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    for layer_type, params in (("full_attention", full), ("sliding_attention", local)):
        if params.get("rope_type", "default") != "default":
            raise NotImplementedError(f"rope scaling {params['rope_type']!r} ({layer_type}) is not exported to GGUF")
        if "rope_theta" not in params:
            raise ValueError(f"config has no {layer_type} rope_theta")
    unsupported = {  # feature -> whether this config uses it
        f"query_pre_attn_scalar {config.query_pre_attn_scalar} != head_dim {config.head_dim} (llama.cpp scales "
        "queries by head_dim ** -0.5)": config.query_pre_attn_scalar != config.head_dim,
        "attn_logit_softcapping": getattr(config, "attn_logit_softcapping", None) is not None,
        "use_bidirectional_attention": bool(getattr(config, "use_bidirectional_attention", False)),
        "attention_bias": bool(getattr(config, "attention_bias", False)),
        f"hidden_activation {config.hidden_activation!r}": config.hidden_activation != "gelu_pytorch_tanh",
        "sliding_window None": config.sliding_window is None,
        f"layer types {sorted(set(config.layer_types))}":
            not set(config.layer_types) <= {"sliding_attention", "full_attention"},
    }
    for feature, used in unsupported.items():
        if used:
            raise NotImplementedError(f"gemma3 GGUF export does not support {feature}: llama.cpp's gemma3 graph "
                                      "would not compute what transformers does")
    return full["rope_theta"], local["rope_theta"]


_PROJECTIONS = frozenset({_T.ATTN_Q, _T.ATTN_K, _T.ATTN_V, _T.ATTN_OUT, _T.FFN_GATE, _T.FFN_UP, _T.FFN_DOWN})
_SPECS = {
    "llama": ArchSpec("llama", gguf.MODEL_ARCH.LLAMA, _llama_to, _llama_from, _llama_keys, _PROJECTIONS),
    "gemma3_text": ArchSpec("gemma3_text", gguf.MODEL_ARCH.GEMMA3, _gemma_to, _gemma_from, _gemma3_keys, _PROJECTIONS),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_SPECS)


def arch_spec(config: Any) -> ArchSpec:
    """The ArchSpec of an HF config (by config.model_type). Raises ValueError naming the model_type and the
    supported ones."""
    model_type = getattr(config, "model_type", None)
    spec = _SPECS.get(model_type)
    if spec is None:
        raise ValueError(f"GGUF export supports {', '.join(SUPPORTED_MODEL_TYPES)}; this model is {model_type}")
    return spec
