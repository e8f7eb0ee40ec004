"""The one place where an engine kind becomes an engine.

Training (training/assemble.py), `nearpolicy diagnose` (diagnosis/measure.py), `nearpolicy doctor` and the
benchmarks under bench/ describe the engine they want as plain fields (`EngineRequest`), hand over what it runs on
(`EngineInputs`: a GGUF file, the trainer's policy, its state dict) and call `build_engine`. Nothing else in the
package branches on an engine kind: what differs between kinds (its precisions, what a weight sync hands it, which
config options and features it supports) is data in its `EngineKind` entry, read by the config checks and diagnose.

A new engine kind (SGLang, a remote server) is one new module with its adapter (engines/<name>.py, implementing
engines/base.RolloutEngine) plus one `@engine_kind(...)` builder here; tests/test_structure.py holds that no module
outside this one compares against an engine kind's name.

Every adapter is imported inside its builder: `import nearpolicy.engines.factory` loads no engine library."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nearpolicy.engines.base import LLAMA_MAX_SEQ, RolloutEngine
from nearpolicy.engines.gguf.export import PRECISIONS as GGUF_PRECISIONS
from nearpolicy.engines.gguf.precision_map import describe as describe_precision_map
from nearpolicy.engines.hf import DTYPES as HF_DTYPES
from nearpolicy.engines.vllm_child import DTYPES as VLLM_DTYPES, LORA_RANKS as VLLM_LORA_RANKS


@dataclass(frozen=True)
class EngineRequest:
    """Which engine, with which numerics, as plain fields (picklable; no config object).

    `precision` is the kind's own precision name: a GGUF type (llamacpp), an hf or vllm dtype. `isolated`: run the
    engine in its own process where the kind can (llamacpp; vllm always does), so a native crash ends that process,
    not the caller (engines/process.py). `kv_cache_gib` is vLLM's KV reservation in GiB. `lora_rank`: under [lora] the
    adapter's rank, so vllm opens with LoRA on (0: the first adapter reopens it, engines/vllm_child.py)."""

    kind: str
    precision: str
    max_context: int = 1024
    max_parallel_sequences: int = 64
    threads: int = 2
    tensor_precision: tuple[tuple[str, str], ...] = ()
    kv_cache: str = "f16"
    flash_attention: bool = False
    extra_buffers: bool = False
    adaptive_threads: bool = True
    logit_noise: float = 0.0
    seed: int = 0
    kv_cache_gib: float = 1.0
    isolated: bool = True
    version: int = 0
    lora_rank: int = 0

    @property
    def precision_label(self) -> str:
        """The precision with any per-tensor overrides, e.g. "q4_1 (blk.0=f16)"."""
        return describe_precision_map(self.precision, self.tensor_precision)

    @property
    def label(self) -> str:
        """"kind:precision" with any per-tensor overrides, e.g. "llamacpp:q4_1 (blk.0=f16)" (logs, errors)."""
        return f"{self.kind}:{self.precision_label}"


@dataclass
class EngineInputs:
    """What the engine runs on. `gguf`: the GGUF file (kinds that load GGUF); `model`: the trainer's policy (the hf
    engine copies it; vllm reads its config); `state_dict`: the weights vllm receives (default: the model's);
    `stop_ids`: the complete end-of-generation set; `workdir`: where logs and converted weights go; `probe_prompt`:
    prompt ids of the startup probe of an engine in its own process."""

    gguf: Path | None = None
    model: Any = None
    state_dict: dict | None = None
    stop_ids: set[int] = field(default_factory=set)
    workdir: Path | None = None
    probe_prompt: list[int] | None = None
    start_timeout_s: float = 300.0

    def need(self, name: str, kind: str):
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"engine kind {kind!r} needs EngineInputs.{name}")
        return value

    def log_path(self, name: str) -> Path | None:
        return None if self.workdir is None else self.workdir / name


@dataclass(frozen=True)
class EngineKind:
    """One engine kind's facts. `loads`: what a weight sync hands its `update_weights` ("gguf": a GGUF path, the
    trainer's weights exported at `precision`; "state_dict": the trainer's state dict; under [lora] see
    `lora_adapter`). `options`: the config
    options it honours (kv_cache, flash_attention, extra_buffers, tensor_precision, export_rounding,
    weights_only, lora: takes a LoraAdapter in update_weights). `replicas`: can run as rollout.engines replicas;
    `episodes`: runs tool-use episodes; `alignable`: algorithm.precision_alignment = "engine" can emulate it
    (model/aligned.py); `max_parallel`: its hard limit on sequences per batch (None: none) and `max_parallel_why` its reason; `config_precision`: the [engine] key that holds its
    precision; `lora_adapter`: under [lora], the LoraAdapter field its update_weights reads ("gguf": a GGUF LoRA
    file, "tensors": the adapter's tensors, "peft_dir": a PEFT folder); `lora_tolerances`: (precision, nats/token)
    pairs where the [lora] sync proof's default agreement tolerance for this kind differs from
    training/lora_sync.PROOF_TOLERANCE's per precision (its arithmetic measured apart, docs/lora.md); `lora_max_rank`:
    the largest lora.rank it takes (None: no limit of its own)."""

    name: str
    precisions: tuple[str, ...]
    loads: Literal["gguf", "state_dict"]
    build: Callable[[EngineRequest, EngineInputs], RolloutEngine]
    config_precision: str
    options: frozenset[str] = frozenset()
    replicas: bool = False
    episodes: bool = False
    alignable: bool = False
    max_parallel: int | None = None
    max_parallel_why: str = ""
    lora_adapter: Literal["gguf", "tensors", "peft_dir"] = "tensors"
    lora_tolerances: tuple[tuple[str, float], ...] = ()
    lora_max_rank: int | None = None


ENGINES: dict[str, EngineKind] = {}


def engine_kind(name: str, precisions, loads: str, config_precision: str, **facts):
    """Register the decorated builder as engine kind `name`; a name registered twice is refused."""

    def register(build):
        if name in ENGINES:
            raise ValueError(f"engine kind {name!r} is registered twice")
        ENGINES[name] = EngineKind(name, tuple(precisions), loads, build, config_precision, **facts)
        return build

    return register


def kind_of(name: str) -> EngineKind:
    """The registered kind `name`; raises ValueError listing the valid names."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine kind {name!r}; valid: {', '.join(ENGINES)}")
    return ENGINES[name]


def build_engine(request: EngineRequest, inputs: EngineInputs) -> RolloutEngine:
    """The engine of `request` on `inputs`. An isolated engine is probed before it is handed back. Raises
    ValueError for an unknown kind or precision or a missing input, EngineError / EngineDied when the engine does
    not start (vllm without .venv-vllm names `make vllm-env`)."""
    kind = kind_of(request.kind)
    if request.precision not in kind.precisions:
        raise ValueError(f"engine {request.kind!r}: unknown precision {request.precision!r}; "
                         f"valid: {', '.join(kind.precisions)}")
    return kind.build(request, inputs)


def llamacpp_spec(request: EngineRequest, gguf: Path, version: int | None = None):
    """The llama.cpp EngineSpec of `request` over `gguf` (picklable: what engine replicas and child processes
    open)."""
    from nearpolicy.engines.llamacpp import EngineSpec

    r = request
    return EngineSpec(str(gguf), r.version if version is None else version, r.max_context, r.max_parallel_sequences,
                      r.threads, r.kv_cache, r.flash_attention, r.extra_buffers, adaptive_threads=r.adaptive_threads,
                      logit_noise=r.logit_noise)


_LLAMACPP_OPTIONS = frozenset({"kv_cache", "flash_attention", "extra_buffers", "tensor_precision", "export_rounding",
                               "weights_only", "lora"})


@engine_kind("llamacpp", GGUF_PRECISIONS, "gguf", "precision", options=_LLAMACPP_OPTIONS, lora_adapter="gguf",
             replicas=True,
             episodes=True, alignable=True, max_parallel=LLAMA_MAX_SEQ,
             max_parallel_why=f"llama.cpp's limit of {LLAMA_MAX_SEQ} sequences per context (LLAMA_MAX_SEQ)")
def _llamacpp(request: EngineRequest, inputs: EngineInputs) -> RolloutEngine:
    gguf = inputs.need("gguf", request.kind)
    if request.isolated:
        from nearpolicy.engines.process import ProcessEngine

        return ProcessEngine(llamacpp_spec(request, gguf), request.label, log_path=inputs.log_path("llamacpp.log"),
                             probe_prompt=inputs.probe_prompt, start_timeout_s=inputs.start_timeout_s)
    return llamacpp_spec(request, gguf).open()


@engine_kind("hf", tuple(HF_DTYPES), "state_dict", "hf_dtype", options=frozenset({"lora"}), lora_adapter="tensors",
             episodes=True)
def _hf(request: EngineRequest, inputs: EngineInputs) -> RolloutEngine:
    from nearpolicy.engines.hf import HFEngine

    return HFEngine(inputs.need("model", request.kind), inputs.stop_ids, dtype=request.precision,
                    max_parallel_sequences=request.max_parallel_sequences, version=request.version,
                    logit_noise=request.logit_noise)


@engine_kind("vllm", tuple(VLLM_DTYPES), "state_dict", "vllm_dtype", options=frozenset({"lora"}),
             lora_adapter="peft_dir", lora_tolerances=(("bf16", 0.2),),  # bf16: up to 0.059 measured, docs/lora.md
             lora_max_rank=VLLM_LORA_RANKS[-1])
def _vllm(request: EngineRequest, inputs: EngineInputs) -> RolloutEngine:
    from nearpolicy.engines.vllm_engine import VLLMProcessEngine, vllm_python

    vllm_python()  # fails now, naming `make vllm-env`, when the environment is missing
    model = inputs.need("model", request.kind)
    workdir = inputs.need("workdir", request.kind)
    state = inputs.state_dict if inputs.state_dict is not None else model.state_dict()
    return VLLMProcessEngine(model.config, state, workdir / "vllm-weights", stop_ids=inputs.stop_ids,
                             max_context=request.max_context, max_parallel_sequences=request.max_parallel_sequences,
                             threads=request.threads, dtype=request.precision, kv_cache_gib=request.kv_cache_gib,
                             version=request.version, seed=request.seed, log_path=inputs.log_path("vllm.log"),
                             probe_prompt=inputs.probe_prompt, lora_rank=request.lora_rank)
