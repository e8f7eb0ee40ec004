"""The [lora] section of the config schema (config/schema.py assembles the whole schema): LoRA RL on the engine's
frozen base (docs/lora.md). No [lora] section (the default) is full fine-tuning, unchanged."""

from __future__ import annotations

from pydantic import Field, StrictBool, field_validator, model_validator

from nearpolicy.config.sections import Section
from nearpolicy.engines.factory import ENGINES, kind_of
from nearpolicy.engines.gguf.kquant import KQUANTS
from nearpolicy.engines.gguf.lora_adapter import LLAMA_TARGETS


class LoraConfig(Section):
    """A LoRA adapter trained through PEFT on the engine's own weights, frozen: the base is the engine GGUF
    dequantized (llamacpp) or model.path (hf, vllm), only the adapter syncs, and every sync is proven by scoring a
    fixed probe with the engine (docs/lora.md). A [lora] table in the file (even empty) or any --set lora.KEY turns
    it on; without one the run fine-tunes every weight, as before."""

    enabled: StrictBool = False
    """On as soon as the config has a [lora] table or a lora.* override (the section's presence); false in a [lora]
    table turns it off."""

    rank: int = Field(8, ge=1, le=1024)
    """r: the adapter's rank (lora_A [r, in], lora_B [out, r] per target)."""
    alpha: float = Field(16.0, gt=0)
    """lora_alpha: the adapter's output is scaled by alpha / rank (PEFT; llama.cpp's adapter.lora.alpha)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """lora_dropout on the adapter's input in the trainer's forwards. Above 0 every trainer log-prob of a step
    (old_logprobs too: the policy stays in train mode) draws its own dropout mask, so it is not the sampling
    policy's and the on-policy PPO ratio is not exactly 1 (invariant 8); the sync proof scores without dropout."""
    target_modules: tuple[str, ...] = LLAMA_TARGETS
    """The linear layers that get an adapter, spelled as PEFT spells them: any of q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj (the embeddings and the tied LM head are never adapted)."""
    lr: float = Field(1e-4, gt=0, le=1)
    """The adapter's peak learning rate, in place of algorithm.lr (AdamW over the adapter only; shaped by
    algorithm.lr_schedule, warmup_steps and min_lr_ratio as usual)."""
    proof_tolerance: float | None = Field(None, gt=0)
    """Most mean |engine - trainer| log-prob over the sync proof's probe tokens (nats/token) that still proves the
    engine holds the trainer's adapted policy; None: the engine precision's measured tolerance
    (training/lora_sync.PROOF_TOLERANCE, docs/lora.md)."""

    @model_validator(mode="before")
    @classmethod
    def _on_when_given(cls, data):
        """A [lora] table without `enabled` means LoRA on (the schema's default instance is built enabled=False)."""
        return {**data, "enabled": True} if isinstance(data, dict) and "enabled" not in data else data

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [t for t in value if t not in LLAMA_TARGETS]
        if not value or unknown or len(set(value)) != len(value):
            raise ValueError(f"{unknown or 'empty or repeated'}: each target must be one of "
                             f"{', '.join(LLAMA_TARGETS)}, at most once")
        return value


def check_lora(cfg) -> None:
    """[lora]'s rules across sections: an engine kind that takes adapters ("lora" in its options); synchronous
    single-turn rollouts (rollout.engines = 0, no episodes); no precision alignment, MIPU, R-OPD or PPO-EWMA proximal
    policy (each handles the whole model's weights: not combined with an adapter yet). Raises ValueError."""
    if not cfg.lora.enabled:
        return
    kind = kind_of(cfg.engine.kind)
    if "lora" not in kind.options:
        raise ValueError(f"[lora] needs an engine that takes LoRA adapters; engine.kind = {cfg.engine.kind!r} does not "
                         f"(use {' or '.join(repr(k.name) for k in ENGINES.values() if 'lora' in k.options)})")
    if kind.lora_max_rank is not None and cfg.lora.rank > kind.lora_max_rank:  # else it fails when the engine opens
        raise ValueError(f"lora.rank = {cfg.lora.rank}: engine.kind = {cfg.engine.kind!r} takes LoRA ranks up to "
                         f"{kind.lora_max_rank}")
    others = {"rollout.engines >= 1": cfg.rollout.engines > 0, "episode.enabled": cfg.episode.enabled,
              "algorithm.precision_alignment = 'engine'": cfg.algorithm.precision_alignment == "engine",
              "mipu.enabled": cfg.mipu.enabled, "distill.ropd": cfg.distill.ropd,
              "correction.proximal = 'ewma'": cfg.correction.proximal == "ewma",
              f"engine.precision = {cfg.engine.precision!r} (a K-quant)": cfg.engine.precision in KQUANTS}
    if on := [name for name, set_ in others.items() if set_]:
        raise ValueError(f"[lora] is not combined with {', '.join(on)} yet (docs/lora.md, 'Not done'): remove [lora] "
                         "or those settings")
