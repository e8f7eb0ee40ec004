"""Rollout configurations to diagnose, written as one string each:

    ENGINE:PRECISION[,option=value ...]

ENGINE:PRECISION is `llamacpp:<gguf type>` (f32 f16 bf16 q8_0 q5_0 q4_0 q4_1 mxfp4, or one of llama.cpp's K-quant
mixes q4_k_m q4_k_s q5_k_m q6_k, engines/gguf/kquant.py), `hf:<dtype>` (fp32, bf16) or
`vllm:<dtype>` (fp32, bf16; vLLM in its own environment, `make vllm-env`).
Options: `kv_cache=f16|f32` and `flash_attention=true|false` (llamacpp), `temperature=`, `top_p=`, `top_k=`
(sampling, replacing the config's), `weights_only=true` (llamacpp: every weight is rounded exactly as this
candidate would store it, then run with f32 kernels: the weight-quantization error without the activation
quantization of llama.cpp's quantized dot products), and per-tensor precision overrides
`<selector>=<gguf type>` (engines/gguf/precision_map.py: embeddings, output, attention, mlp, blk.N, blk.N-M, globs).
A K-quant takes neither per-tensor overrides (llama.cpp picks each tensor's type) nor `weights_only` (its per-tensor
types exist only in the whole file llama.cpp writes, which measure.engine_state_dict does not read back); both are
refused by name, as is a K-quant named as an override's type.
Example: `llamacpp:q4_1,blk.0-2=f16,kv_cache=f32`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from nearpolicy.engines.factory import ENGINES
from nearpolicy.engines.gguf.export import TENSOR_PRECISIONS
from nearpolicy.engines.gguf.kquant import KQUANTS
from nearpolicy.engines.gguf.precision_map import describe, validate_selector
from nearpolicy.engines.llamacpp import KV_CACHE_TYPES
from nearpolicy.types import SamplingParams

_SAMPLING_KEYS = {"temperature": float, "top_p": float, "top_k": int}


@dataclass(frozen=True)
class RolloutCandidate:
    """One engine x precision x sampling configuration."""

    engine: str  # "llamacpp", "hf" or "vllm"
    precision: str  # GGUF type (llamacpp) or dtype name (hf, vllm)
    kv_cache: str = "f16"
    flash_attention: bool = False
    weights_only: bool = False
    tensor_precision: tuple[tuple[str, str], ...] = ()
    sampling: dict[str, float] = field(default_factory=dict, hash=False, compare=False)
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or self.spec()

    def spec(self) -> str:
        """The candidate written back as a parseable string."""
        parts = [f"{self.engine}:{self.precision}"]
        parts += [f"{s}={p}" for s, p in self.tensor_precision]
        if self.kv_cache != "f16":
            parts.append(f"kv_cache={self.kv_cache}")
        if self.flash_attention:
            parts.append("flash_attention=true")
        if self.weights_only:
            parts.append("weights_only=true")
        parts += [f"{k}={v}" for k, v in self.sampling.items()]
        return ",".join(parts)

    def weights_description(self) -> str:
        text = describe(self.precision, self.tensor_precision)
        return f"{text} rounded, f32 kernels" if self.weights_only else text

    def sampling_params(self, base: SamplingParams) -> SamplingParams:
        return replace(base, **self.sampling)

    def with_overrides(self, overrides: tuple[tuple[str, str], ...], label: str = "") -> "RolloutCandidate":
        return replace(self, tensor_precision=self.tensor_precision + overrides, label=label)


def parse_candidate(text: str) -> RolloutCandidate:
    """Parse one candidate string (grammar in the module docstring). Raises ValueError naming the bad part."""
    head, *options = [part.strip() for part in text.split(",")]
    engine, sep, precision = head.partition(":")
    if not sep or engine not in ENGINES:
        raise ValueError(f"candidate {text!r}: expected {', '.join(f'{k}:<precision>' for k in ENGINES)}")
    valid, honours = ENGINES[engine].precisions, ENGINES[engine].options
    if precision not in valid:
        raise ValueError(f"candidate {text!r}: unknown {engine} precision {precision!r}; valid: {', '.join(valid)}")
    fields: dict = {"engine": engine, "precision": precision}
    overrides, sampling = [], {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise ValueError(f"candidate {text!r}: option {option!r} is not key=value")
        if key in _SAMPLING_KEYS:
            sampling[key] = _number(text, key, value, _SAMPLING_KEYS[key])
        elif key == "kv_cache" and value in KV_CACHE_TYPES and key in honours:
            fields["kv_cache"] = value
        elif key in ("flash_attention", "weights_only") and value in ("true", "false") and key in honours:
            fields[key] = value == "true"
        elif value in KQUANTS and "tensor_precision" in honours:
            raise ValueError(f"candidate {text!r}: {key}={value}: a K-quant is a whole-file llama.cpp quantization, "
                             f"not a per-tensor type; per-tensor types: {', '.join(TENSOR_PRECISIONS)}")
        elif value in TENSOR_PRECISIONS and "tensor_precision" in honours:
            try:
                validate_selector(key)
            except ValueError as err:
                raise ValueError(f"candidate {text!r}: {err}") from None
            overrides.append((key, value))
        else:
            raise ValueError(f"candidate {text!r}: cannot use option {option!r} (keys: kv_cache, flash_attention, "
                             f"weights_only, {', '.join(_SAMPLING_KEYS)} or a tensor selector; GGUF types: "
                             f"{', '.join(TENSOR_PRECISIONS)})")
    if precision in KQUANTS and (overrides or fields.get("weights_only")):
        refused = ", ".join([f"{k}={v}" for k, v in overrides]
                            + ["weights_only=true"] * bool(fields.get("weights_only")))
        raise ValueError(f"candidate {text!r}: {refused} cannot apply to the K-quant {precision!r}: llama.cpp's "
                         "quantizer picks each tensor's type in the whole file (engines/gguf/kquant.py)")
    candidate = RolloutCandidate(**fields, tensor_precision=tuple(overrides), sampling=sampling)
    try:
        candidate.sampling_params(SamplingParams())  # validates the sampling values now
    except ValueError as err:
        raise ValueError(f"candidate {text!r}: {err}") from None
    return candidate


def _number(text: str, key: str, value: str, kind: type) -> float | int:
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"candidate {text!r}: {key} must be a {kind.__name__}, got {value!r}") from None
