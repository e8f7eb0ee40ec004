"""vLLM rollout engine (config engine.kind = "vllm"), trainer side: vLLM in its own environment (.venv-vllm, built by
`make vllm-env`) and its own process, behind the same pipe boundary as the llama.cpp engine process
(engines/process.ProcessEngine: startup probe, a crash reported as EngineDied with its signal and log tail, the
engine's errors forwarded). The engine process is engines/vllm_child.py; this side writes the trainer's weights as an
HF folder (config.json + model.safetensors, float32) that the engine loads at start and reloads in place at every
weight sync; under [lora] it hands over the adapter as a PEFT folder instead (engines/base.LoraAdapter.peft_dir).
docs/vllm.md: use, numerics, what changes on a GPU; docs/lora.md: the adapter path."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch

from nearpolicy.engines.base import EngineError, LoraAdapter
from nearpolicy.engines.process import ProcessEngine
from nearpolicy.engines.vllm_child import DTYPES, VLLMSpec
from nearpolicy.files import atomic_path

VENV = ".venv-vllm"
PYTHON_ENV = "NEARPOLICY_VLLM_PYTHON"  # overrides the interpreter (default: <checkout>/.venv-vllm/bin/python)
WEIGHTS = "model.safetensors"


def vllm_python() -> Path:
    """The interpreter of the vLLM environment: $NEARPOLICY_VLLM_PYTHON, else .venv-vllm/bin/python in this checkout
    (beside src/), else in the working directory. Raises EngineError naming `make vllm-env` when it is missing."""
    if os.environ.get(PYTHON_ENV):
        candidates = [Path(os.environ[PYTHON_ENV])]
    else:
        checkout = Path(__file__).resolve().parents[3]
        candidates = [checkout / VENV / "bin" / "python", Path.cwd() / VENV / "bin" / "python"]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK) and (path.parent.parent / ".installed").is_file():
            return path
    raise EngineError(f"engine.kind = 'vllm' needs the vLLM environment {VENV} (looked for "
                      f"{', '.join(str(p) for p in candidates)}, with its .installed stamp): run `make vllm-env` in the "
                      f"checkout (about 3.7 GB, a few minutes), or set {PYTHON_ENV} to a python with vllm installed")


def write_hf_folder(state_dict: dict[str, torch.Tensor], config, folder: Path) -> Path:
    """Write `state_dict` (the trainer's weights) as an HF folder vLLM loads: config.json from the transformers
    `config` and model.safetensors in float32 (a tied lm_head.weight left out, as transformers saves it). The
    weights file is replaced atomically. Returns `folder`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    tensors = {name: value.detach().to(torch.float32).contiguous() for name, value in state_dict.items()
               if not (tied and name == "lm_head.weight")}
    settings = config.to_dict()
    settings["architectures"] = settings.get("architectures") or [_causal_lm_class(config)]
    settings["dtype"] = settings["torch_dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(settings, indent=1, default=str))
    with atomic_path(folder / WEIGHTS) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    return folder


def _causal_lm_class(config) -> str:
    """The transformers causal-LM class name of `config` (config.architectures is empty on a config built in code):
    vLLM picks its model implementation by that name. Raises ValueError for a config no causal LM class takes."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)].__name__
    except KeyError:
        raise ValueError(f"no transformers causal LM for a {type(config).__name__}") from None


class VLLMProcessEngine(ProcessEngine):
    """The vLLM engine on `state_dict` (the trainer's weights, with their transformers `config`), in the vLLM
    environment's own process; `folder` is where the HF folder of the current weights is written.

    `update_weights(source, version)` takes a state dict (written to `folder` first, about 1 s for 135M parameters),
    an HF folder, or a LoraAdapter with peft_dir (engines/vllm_child.VLLMEngine.load_adapter). `lora_rank` > 0 opens
    the engine with LoRA on for adapters up to that rank (0: the first adapter reopens it). Raises EngineError when
    .venv-vllm is missing (vllm_python), EngineDied when the engine process dies, and the engine's own errors
    (EngineError, ValueError) unchanged."""

    def __init__(self, config, state_dict: dict[str, torch.Tensor], folder: Path, *, stop_ids, max_context: int,
                 max_parallel_sequences: int, threads: int, dtype: str = "fp32", kv_cache_gib: float = 1.0,
                 version: int = 0, seed: int = 0, log_path: Path | None = None,
                 probe_prompt: list[int] | None = None, lora_rank: int = 0):
        if dtype not in DTYPES:
            raise ValueError(f"vllm dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        python = vllm_python()
        self.config, self.folder = config, Path(folder)
        write_hf_folder(state_dict, config, self.folder)
        spec = VLLMSpec(str(self.folder), version, max_context, max_parallel_sequences, threads, dtype, kv_cache_gib,
                        tuple(sorted(stop_ids)), str(python), seed, lora_rank)
        super().__init__(spec, f"vllm:{dtype}", log_path=log_path, probe_prompt=probe_prompt)

    def update_weights(self, source, version: int, *, unsafe_skip: tuple[str, ...] = ()) -> None:
        """Load new weights (a state dict, or an HF folder holding model.safetensors) or a LoRA adapter (a
        LoraAdapter with peft_dir) and set the policy version. `unsafe_skip` (tests only) leaves out weight-sync
        fixes (engines/vllm_child.SKIPPABLE). Raises TypeError for a LoraAdapter without peft_dir."""
        if isinstance(source, LoraAdapter):
            if source.peft_dir is None:
                raise TypeError("the vLLM engine takes a LoRA adapter as a PEFT folder (LoraAdapter.peft_dir)")
            self._call("update_weights", replace(source, tensors=None), version)  # the folder, not the tensors
            self.version = version
            return
        folder = write_hf_folder(source, self.config, self.folder) if isinstance(source, dict) else Path(source)
        self._call("update_weights", str(folder), version, tuple(unsafe_skip))
        self.version = version

    def loaded_adapters(self) -> set[int]:
        """The LoRA ids the engine holds (after an adapter sync: the newest one alone)."""
        return self._call("loaded_adapters")
