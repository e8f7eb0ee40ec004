"""The [engine] section of the config schema (config/schema.py assembles the whole schema): which engine samples the
rollouts and the numerics it samples with."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, field_validator, model_validator

from nearpolicy.config.sections import Section
from nearpolicy.engines.factory import ENGINES, EngineRequest, kind_of
from nearpolicy.engines.gguf.rounding import ROUNDINGS, check_rounding
from nearpolicy.engines.gguf.export import PRECISIONS, TENSOR_PRECISIONS
from nearpolicy.engines.gguf.kquant import KQUANTS
from nearpolicy.engines.hf import DTYPES as HF_DTYPES
from nearpolicy.engines.llamacpp import KV_CACHE_TYPES
from nearpolicy.engines.vllm_child import DTYPES as VLLM_DTYPES

Precision = Literal[PRECISIONS]


class EngineConfig(Section):
    """The rollout engine: which one, and the numerics it samples with."""

    kind: Literal[tuple(ENGINES)] = "llamacpp"
    """llamacpp: llama.cpp on GGUF weights exported from the trainer at `precision` before each sync; hf: the
    transformers engine in this process (weights at `hf_dtype`); vllm: vLLM in its own environment and process
    (`make vllm-env`; weights at `vllm_dtype`, reloaded in place after each update; docs/vllm.md)."""
    precision: Precision = "q8_0"
    """llamacpp: GGUF weight type the trainer's weights are exported at before each sync. The K-quants (q4_k_m,
    q4_k_s, q5_k_m, q6_k) are llama.cpp's own per-tensor mixes, written by its quantizer from an f32 export at every
    sync (several seconds each, no in-place sync; engines/gguf/kquant.py): no tensor_precision overrides, no
    stochastic export_rounding, no precision alignment."""
    hf_dtype: Literal[tuple(HF_DTYPES)] = "fp32"
    """hf engine: dtype of the weights and KV cache."""
    vllm_dtype: Literal[tuple(VLLM_DTYPES)] = "fp32"
    """vllm: dtype of the weights, activations and KV cache (bf16 on CPU: faster, about 0.035 nats off, and not
    deterministic; docs/vllm.md)."""
    vllm_kv_cache_gib: float = Field(1.0, gt=0, le=1024)
    """vllm: KV cache vLLM reserves, GiB (it starts only with an explicit size; prefix caching shares a group's
    prompt blocks)."""
    max_parallel_sequences: int = Field(64, ge=1)
    """Sequences decoded together in one multi-sequence batch; llamacpp: at most 256 (llama.cpp's LLAMA_MAX_SEQ,
    the most sequences one context holds)."""
    kv_cache: Literal[tuple(KV_CACHE_TYPES)] = "f16"
    """llamacpp: KV-cache dtype."""
    flash_attention: StrictBool = False
    """llamacpp: use the flash-attention kernel (rounds queries to f16: adds mismatch)."""
    extra_buffers: StrictBool = False
    """llamacpp: let llama.cpp move weights into its extra buffer types at load (CPU repacking of q4_0 into
    interleaved blocks; AMX tiles when compiled in). Off: with AMX, the first q8_0 / q4_0 / q4_1 matmul faults on
    some Intel Xeon hosts (ggml-org/llama.cpp#20824); measured effect on speed: docs/results.md sec. 6."""
    adaptive_threads: StrictBool = True
    """llamacpp: run each rollout / eval call on at most the cores other processes leave idle (never more than
    run.threads or rollout.engine_threads): ggml's spin barriers make a 2-thread engine about 5x slower than a
    1-thread one when another process holds a core (engines/cpu_load.py). Results do not depend on it."""
    logit_noise: float = Field(0.0, ge=0, le=10)
    """A mismatch of chosen size (0 = off): training rollouts are sampled from the logits plus seeded N(0, std^2)
    noise per vocabulary entry and each token's log-prob is reported under that noisy distribution, so the engine
    and the trainer differ by a known amount: E KL(mu || pi) = std^2 / 2 (1 - sum p^2) for small std at T = 1
    (about std^2 / 2 on a flat distribution). Both engines; greedy eval is unaffected (docs/arena.md)."""
    tensor_precision: dict[str, Precision] = {}
    """llamacpp: per-tensor overrides of `precision`, selector -> precision, later entries win; selectors:
    embeddings, output, attention, mlp, blk.N, blk.N-M or a GGUF-name glob (e.g. {"blk.0-2" = "f16"}, the kind
    of mixed recipe `nearpolicy diagnose --admit` proposes)."""

    export_rounding: Literal[ROUNDINGS] = "nearest"
    """llamacpp: how each sync rounds the trainer's fp32 weights onto the engine's grid. nearest: gguf-py's
    quantizer; a coarse engine erases updates smaller than half a step (docs/results.md sec. 3). stochastic:
    unbiased stochastic rounding (arXiv:1502.02551), so small updates reach the engine in expectation; q8_0 and
    q4_1 tensors only, seeded by run.seed and the weights (engines/gguf/rounding.py; docs/aligned.md)."""

    def request(self, *, max_context: int, threads: int, seed: int, isolated: bool = True,
                lora_rank: int = 0) -> EngineRequest:
        """This section as the engine factory's plain fields (engines/factory.py): the kind's own precision key,
        the options the kind honours; `lora_rank` > 0 under [lora] (vllm opens with LoRA on)."""
        kind = kind_of(self.kind)
        overrides = tuple(self.tensor_precision.items()) if "tensor_precision" in kind.options else ()
        return EngineRequest(self.kind, getattr(self, kind.config_precision), max_context, self.max_parallel_sequences,
                             threads, overrides, self.kv_cache, self.flash_attention, self.extra_buffers,
                             self.adaptive_threads, self.logit_noise, seed, self.vllm_kv_cache_gib, isolated,
                             lora_rank=lora_rank)

    @model_validator(mode="after")
    def _rounding_covers_types(self) -> "EngineConfig":
        if self.export_rounding != "nearest" and "export_rounding" not in kind_of(self.kind).options:
            raise ValueError(f"engine.export_rounding = {self.export_rounding!r} rounds the llama.cpp engine's GGUF; "
                             f"engine.kind = {self.kind!r} loads no GGUF (set export_rounding = 'nearest')")
        try:
            check_rounding(self.export_rounding, {self.precision, *self.tensor_precision.values()})
        except ValueError as err:
            raise ValueError(f"engine.export_rounding: {err}") from None
        return self

    @model_validator(mode="after")
    def _kquant_is_whole_file(self) -> "EngineConfig":
        if self.precision in KQUANTS and self.tensor_precision:
            raise ValueError(f"engine.tensor_precision = {self.tensor_precision} with engine.precision = "
                             f"{self.precision!r}: a K-quant is llama.cpp's own per-tensor mix "
                             f"(engines/gguf/kquant.py) and takes no overrides; remove engine.tensor_precision or use "
                             f"one of "
                             f"{', '.join(TENSOR_PRECISIONS)}")
        for selector, precision in self.tensor_precision.items():
            if precision in KQUANTS:
                raise ValueError(f"engine.tensor_precision[{selector!r}] = {precision!r}: a K-quant is a whole-file "
                                 f"llama.cpp quantization, not a per-tensor type; per-tensor types: "
                                 f"{', '.join(TENSOR_PRECISIONS)}")
        return self

    @field_validator("tensor_precision")
    @classmethod
    def _selectors_known(cls, value: dict[str, str]) -> dict[str, str]:
        from nearpolicy.engines.gguf.precision_map import validate_selector

        for selector in value:
            validate_selector(selector)
        return value
