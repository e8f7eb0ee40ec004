"""`nearpolicy export` of a [lora] run (docs/lora.md): its checkpoints hold the adapter alone (model/lora.AdapterOnly),
so the policy is rebuilt the way the run built it: model.path loaded in float32, the frozen base made the engine's
GGUF dequantized (model/lora.frozen_engine_base with the run's engine.precision, tensor_precision, export_rounding and
run.seed, for an engine kind that loads GGUF), the adapter attached (lora.rank, alpha, dropout, target_modules) and
the checkpoint's adapter loaded strictly. Written beside the merged Hugging Face folder that runs/export.py saves:

- adapter/: the PEFT folder (adapter_config.json, adapter_model.safetensors; `PeftModel.from_pretrained(base, ...)`),
- adapter.gguf: the GGUF LoRA adapter llama.cpp loads (engines/gguf/lora_adapter.py; `llama-cli -m base --lora`),
- base/policy-<precision>.gguf: the run's engine base, the file the adapter was trained on (GGUF engine kinds)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from nearpolicy.config.engine import EngineConfig
from nearpolicy.config.lora import LoraConfig
from nearpolicy.engines.factory import kind_of
from nearpolicy.engines.gguf.lora_adapter import export_lora_gguf
from nearpolicy.model.load import ResolvedModel, load_policy
from nearpolicy.model.lora import attach_lora, frozen_engine_base


def is_lora_run(config: dict) -> bool:
    """Whether the run's config.json (as a dict) trained a LoRA adapter (lora.enabled)."""
    section = config.get("lora")
    return isinstance(section, dict) and bool(section.get("enabled"))


def export_adapter(config: dict, spec: str, resolved: ResolvedModel, weights: dict[str, torch.Tensor], folder: Path,
                   log: Callable[[str], None] = print):
    """Rebuild the [lora] run of `config` (its config.json) on `spec` (model.path, resolved) with the checkpoint's
    adapter `weights`, write adapter/, adapter.gguf and base/ into `folder` (module docstring) and return (the merged
    float32 model, eval mode, no adapter layers; the tokenizer). Raises ValueError when the weights are not this
    adapter's (another rank or targets), else what load_policy and the GGUF writers raise."""
    lora_cfg = LoraConfig(**config.get("lora", {}))
    engine = EngineConfig(**config.get("engine", {}))
    seed = int((config.get("run") or {}).get("seed", 0))
    model, tokenizer = load_policy(spec)
    model.float()
    base = None
    if kind_of(engine.kind).loads == "gguf":
        template = resolved.path if resolved.kind == "gguf" else None
        base = frozen_engine_base(model, folder / "base", engine.precision, tuple(engine.tensor_precision.items()),
                                  template, tokenizer, engine.export_rounding, seed)
        log(f"rebuilt the run's frozen base {base.relative_to(folder)}")
    lora = attach_lora(model, lora_cfg.rank, lora_cfg.alpha, lora_cfg.dropout, tuple(lora_cfg.target_modules), seed,
                       base)
    try:
        lora.checkpoint_view().load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise ValueError(f"the checkpoint's adapter does not fit [lora] of the run's config.json: {err}") from None
    lora.peft_model.save_pretrained(str(folder / "adapter"))
    export_lora_gguf(lora.adapter_tensors(), lora.model.config, folder / "adapter.gguf", lora.alpha)
    log(f"wrote the adapter: adapter/ (PEFT) and adapter.gguf (llama.cpp), rank {lora.rank}, alpha {lora.alpha:g}")
    return lora.plain_model(merged=True).eval().requires_grad_(False), tokenizer
