"""LoRA on the trainer's policy through PEFT (docs/lora.md): a frozen base and a trainable low-rank adapter.

`attach_lora` wraps the policy with `peft.get_peft_model`: each targeted nn.Linear becomes a peft LoRA layer,
y = x W^T + scale * (dropout(x) A^T) B^T with W frozen, A [r, in] (Kaiming-uniform), B [out, r] (zeros: at
step 0 the adapted policy equals the base exactly), scale = alpha / r (PEFT, use_rslora = false; Hu et al. 2021,
"LoRA", arXiv:2106.09685, eq. 3). The trainer keeps running the same transformers model object (PEFT injects the
layers in place), so model/policy.py's forwards are unchanged; only the adapter's parameters train.

The frozen base is the engine's own weights: `frozen_engine_base` writes the policy as the engine's GGUF and
`load_engine_base` overwrites the policy's weights with that file's tensors dequantized (engines/gguf/dequantize.py),
before the adapter is attached. Checkpoints hold the adapter alone (`AdapterOnly`)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nearpolicy.engines.gguf.lora_adapter import LLAMA_TARGETS


@dataclass
class LoraPolicy:
    """The trainer's adapted policy. `peft_model`: the peft.PeftModel; `model`: its base transformers model (the
    object the trainer runs, the adapter layers inside); `rank`, `alpha`, `targets` as [lora]; `base_gguf`: the
    engine GGUF the frozen base was read from (None: the base is model.path's weights, engines that load a state
    dict)."""

    peft_model: Any
    model: torch.nn.Module
    rank: int
    alpha: float
    targets: tuple[str, ...]
    base_gguf: Path | None = None

    @property
    def scale(self) -> float:
        """alpha / rank: the factor of B A (PEFT's scaling; llama.cpp's adapter scale with adapter weight 1.0)."""
        return self.alpha / self.rank

    def parameters(self) -> list[torch.nn.Parameter]:
        """The adapter's parameters (every lora_A and lora_B), the only ones that train."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def lora_layers(self) -> Iterator[tuple[str, Any]]:
        """(HF base weight name, e.g. "model.layers.0.self_attn.q_proj.weight"; the peft LoRA layer) per target."""
        for name, module in self.model.named_modules():
            if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
                yield f"{name}.weight", module

    def adapter_tensors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """HF base weight name -> (lora_A [r, in], lora_B [out, r]) float32, detached copies: what a sync sends."""
        return {name: (m.lora_A["default"].weight.detach().float().clone(),
                       m.lora_B["default"].weight.detach().float().clone()) for name, m in self.lora_layers()}

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter's parameters by their name in `model` (…lora_A.default.weight), detached copies."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def base_state(self) -> dict[str, torch.Tensor]:
        """The frozen base's weights by their plain HF names (peft's ".base_layer" dropped; adapter left out)."""
        return {k.replace(".base_layer.", "."): v for k, v in self.model.state_dict().items() if ".lora_" not in k}

    def checkpoint_view(self) -> "AdapterOnly":
        """The adapter seen as a module for checkpoints (runs/folder.py saves and loads its state dict): only the
        adapter is saved and restored, the frozen base is rebuilt from model.path and the engine precision."""
        return AdapterOnly(self.model)

    @contextmanager
    def base_only(self):
        """Within it the model computes the frozen base (every adapter disabled: PeftModel.disable_adapter)."""
        with self.peft_model.disable_adapter():
            yield

    def plain_model(self, merged: bool) -> torch.nn.Module:
        """A plain transformers model (no adapter layers) with the base weights, plus scale * B A on each target when
        `merged` (float32 sum): the hf engine's base, the trainer-side eval policy, the merged export."""
        from transformers import AutoModelForCausalLM

        plain = AutoModelForCausalLM.from_config(copy.deepcopy(self.model.config), dtype=torch.float32)
        state = self.base_state()
        if merged:
            for name, (a, b) in self.adapter_tensors().items():
                state[name] = state[name].float() + self.scale * (b @ a)
        plain.load_state_dict(state, strict=False)  # a tied lm_head follows the embeddings
        plain.tie_weights()
        return plain


class AdapterOnly(torch.nn.Module):
    """`model`'s trainable parameters (the adapter's lora_A / lora_B) as a module whose state_dict holds only them,
    by their names in `model`, and whose load_state_dict loads only them (copied in place; returns the missing and
    unexpected names as torch does). What a [lora] run's checkpoint holds: about 4 bytes x the adapter's parameters,
    plus twice that of AdamW state."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.__dict__["policy"] = model  # not a submodule: the view has no state of its own

    def _params(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.policy.named_parameters() if p.requires_grad}

    def state_dict(self, *args, keep_vars: bool = False, **kwargs) -> dict[str, torch.Tensor]:
        return {n: p if keep_vars else p.detach() for n, p in self._params().items()}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        params = self._params()
        missing, unexpected = sorted(set(params) - set(state_dict)), sorted(set(state_dict) - set(params))
        if strict and (missing or unexpected):
            raise RuntimeError(f"adapter state does not match: missing {missing[:3]}, unexpected {unexpected[:3]}")
        with torch.no_grad():
            for name in set(params) & set(state_dict):
                if tuple(state_dict[name].shape) != tuple(params[name].shape):
                    raise RuntimeError(f"size mismatch for {name}: {tuple(state_dict[name].shape)} in the checkpoint, "
                                       f"{tuple(params[name].shape)} in the adapter (another lora.rank?)")
                params[name].copy_(state_dict[name])
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


def check_targets(targets: tuple[str, ...]) -> None:
    """Raise ValueError for an empty target list, a repeated one or one outside LLAMA_TARGETS."""
    if not targets:
        raise ValueError("lora.target_modules is empty")
    unknown = [t for t in targets if t not in LLAMA_TARGETS]
    if unknown or len(set(targets)) != len(targets):
        raise ValueError(f"lora.target_modules: {unknown or 'a repeated name'}; each must be one of "
                         f"{', '.join(LLAMA_TARGETS)}, at most once")


def load_engine_base(model: torch.nn.Module, gguf_path: Path) -> list[str]:
    """Overwrite `model`'s weights with the engine GGUF's tensors dequantized (engines/gguf/dequantize.py): after it,
    every tensor the engine computes with equals the trainer's (float32) bit for bit. Returns the names loaded.
    Raises ValueError when the file does not fit the model."""
    from nearpolicy.engines.gguf.dequantize import load_gguf_weights

    return load_gguf_weights(model, gguf_path)


def frozen_engine_base(model: torch.nn.Module, folder: Path, precision: str, tensor_precision: tuple,
                       template_gguf: Path | None, tokenizer: Any, rounding: str = "nearest", seed: int = 0) -> Path:
    """Write `model` as the engine's GGUF `folder`/policy-<precision>.gguf (engines/gguf/export.export_model_gguf with
    the per-tensor overrides and export rounding) and make that file's dequantized tensors the model's weights
    (load_engine_base). Returns the file's path. Deterministic: the same model.path and settings give the same base
    (a resumed run and `nearpolicy export` rebuild it). Raises what export_model_gguf / load_engine_base raise."""
    from nearpolicy.engines.gguf.export import export_model_gguf

    path = export_model_gguf(model, folder, precision, tensor_precision, template_gguf, tokenizer, rounding, seed)
    load_engine_base(model, path)
    return path


def attach_lora(model: torch.nn.Module, rank: int, alpha: float, dropout: float, targets: tuple[str, ...],
                seed: int, base_gguf: Path | None = None) -> LoraPolicy:
    """Freeze `model` and add a LoRA adapter (rank r, lora_alpha, lora_dropout, target_modules) through
    peft.get_peft_model; lora_A drawn under torch seed `seed`, lora_B zero. The model is changed in place and stays
    the object to train. Raises ValueError for unknown targets (check_targets) or a model PEFT cannot adapt."""
    from peft import LoraConfig, get_peft_model

    check_targets(targets)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets), bias="none",
                        init_lora_weights=True)
    with torch.random.fork_rng(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)  # peft 0.21.2
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    inner = peft_model.get_base_model()
    return LoraPolicy(peft_model, inner, rank, float(alpha), tuple(targets), base_gguf)
